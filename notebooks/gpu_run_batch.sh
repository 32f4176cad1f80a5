#!/usr/bin/env bash
# GPU: `run-batch` (an OpenAI Batch API file through the server's routes in process) against `bench throughput`
# (LLM.generate-style offline loop) on the same engine settings: Llama-3.1-8B shapes with random bf16 weights
# (`--load-format dummy` over MODEL's config.json, its Llama 3 tokenizer), N prompts of IN random token ids, OUT_LEN
# tokens each (ignore_eos), SEQS slots. Then a jax.profiler trace of a few steps through LLM.start_profile /
# stop_profile, counted. Writes $OUT/run_batch_*.log, $OUT/bench_throughput.json, $OUT/profile.txt.
#
#   MODEL=.cache/llama8b N=1024 IN=128 OUT_LEN=128 SEQS=256 bash notebooks/gpu_run_batch.sh
set -u
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-.cache/llama8b}
N=${N:-1024}
IN=${IN:-128}
OUT_LEN=${OUT_LEN:-128}
SEQS=${SEQS:-256}
CACHE_DIR=${CACHE_DIR:-/tmp/atlasjax_cc}   # (not CC: that names the C compiler)
mkdir -p "$OUT"
FLAGS="--model $MODEL --load-format dummy --max-num-seqs $SEQS --max-model-len $((IN + OUT_LEN + 64))
       --max-num-batched-tokens 8192 --compilation-cache $CACHE_DIR"
python - "$N" "$IN" "$OUT_LEN" > /tmp/batch_in.jsonl <<'PY'
import json, sys
import numpy as np
n, n_in, n_out = map(int, sys.argv[1:])
rng = np.random.default_rng(0)
for i in range(n):
    body = {"prompt": rng.integers(0, 128000, n_in).tolist(), "max_tokens": n_out, "ignore_eos": True,
            "temperature": 0}
    print(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
PY
for run in ${RUNS:-256 1024 1024:--engine-process}; do
  conc=${run%%:*}; extra=""; [ "$run" != "$conc" ] && extra=${run#*:}
  t0=$SECONDS
  python -m atlasjax run-batch -i /tmp/batch_in.jsonl -o /tmp/batch_out.jsonl $FLAGS --max-concurrency "$conc" $extra \
    > "$OUT/run_batch_c$conc$extra.log" 2>&1
  echo "== run-batch, --max-concurrency $conc $extra: rc $? in $((SECONDS - t0)) s (load and compile included)"
  grep -E "run-batch|error" "$OUT/run_batch_c$conc$extra.log" | tail -1
  python - <<'PY'
import collections, json
lines = [json.loads(t) for t in open("/tmp/batch_out.jsonl")]
ok = [l for l in lines if l["error"] is None]
print(f"   {len(lines)} answer lines, {len(ok)} answered, completion tokens "
      f"{sorted({l['response']['body']['usage']['completion_tokens'] for l in ok})}")
print("  ", collections.Counter(l["error"]["message"][:120] for l in lines if l["error"]).most_common(3))
PY
done
t0=$SECONDS
python -m atlasjax.bench throughput $FLAGS --num-prompts "$N" --input-len "$IN" --output-len "$OUT_LEN" \
  --output "$OUT/bench_throughput.json" > "$OUT/bench_throughput.log" 2>&1
echo "== bench throughput: rc $? in $((SECONDS - t0)) s"
grep -iE "output tok|tok/s|throughput" "$OUT/bench_throughput.log" | head -4
python - "$MODEL" "$CACHE_DIR" > "$OUT/profile.txt" 2>&1 <<'PY'
import glob, gzip, json, os, sys, time
from atlasjax import LLM, SamplingParams
from atlasjax import compile_cache
compile_cache.enable(sys.argv[2])
llm = LLM(sys.argv[1], load_format="dummy", max_num_seqs=8, max_model_len=512, profiler_dir="/tmp/profile")
llm.generate([[1, 2, 3] * 40], SamplingParams(max_tokens=16, ignore_eos=True))   # compiled before the trace
t = time.perf_counter()
llm.start_profile()
llm.generate([[1, 2, 3] * 40] * 4, SamplingParams(max_tokens=32, ignore_eos=True))
print("stop_profile ->", llm.stop_profile(), f"({time.perf_counter() - t:.1f} s with the trace)")
run = sorted(glob.glob("/tmp/profile/plugins/profile/*"))[-1]
for f in sorted(os.listdir(run)):
    print(f, os.path.getsize(os.path.join(run, f)), "bytes")
events = json.load(gzip.open(os.path.join(run, "perfetto_trace.json.gz"), "rt"))
events = events["traceEvents"] if isinstance(events, dict) else events
from collections import Counter
process = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
spans = [(process.get(e.get("pid"), "?"), e.get("name", "")) for e in events if e.get("ph") == "X"]
print(len(spans), "complete events, by process:", Counter(p for p, _ in spans).most_common(6))
gpu = [n for p, n in spans if "GPU" in p or "gpu" in p]
print("device events, most frequent:", Counter(gpu).most_common(8))
print("host events, most frequent:", Counter(n for p, n in spans if not ("GPU" in p or "gpu" in p)).most_common(8))
PY
echo "== profile"; cat "$OUT/profile.txt" | tail -8

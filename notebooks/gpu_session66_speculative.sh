#!/bin/bash
# Session 66, n-gram speculative decoding: tests/test_speculative.py on the GPU (the verify step runs the Pallas
# ragged prefill attention; bf16 engines), then `bench latency` on Llama-3.1-8B shapes (bf16, random weights,
# random 128-token prompts, 128 out) at batch 1 (and 8 with PART=2): the default engine (async scheduling, 4 decode
# iterations per launch), one synchronous step per launch (what speculation runs on), and n-gram drafts of k
# tokens. The random model's acceptance is not a real model's: the figures to keep are the step times per k.
#   PART=1 bash notebooks/gpu_session66_speculative.sh     # on nvidia-h200 -> $OUT/spec_*.json
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PART=${PART:-1}
spec() { echo "{\"method\": \"ngram\", \"num_speculative_tokens\": $1, \"prompt_lookup_max\": 3, \"prompt_lookup_min\": 1}"; }
if [ "$PART" = 1 ]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py 2>&1 | tail -6
    runs=("bs1_default 1" "bs1_sync 1 --no-async-scheduling --num-scheduler-steps 1" "bs1_k4 1 --speculative-config $(spec 4 | tr -d ' ')")
else
    runs=("bs1_k2 1 --speculative-config $(spec 2 | tr -d ' ')" "bs1_k8 1 --speculative-config $(spec 8 | tr -d ' ')"
          "bs8_default 8" "bs8_k4 8 --speculative-config $(spec 4 | tr -d ' ')")
fi
for run in "${runs[@]}"; do
    set -- $run
    name=spec_$1; bs=$2; shift 2
    timeout 170 python3 -m atlasjax.bench latency --preset llama-3.1-8b --batch-size $bs --input-len 128 --output-len 128 \
        --num-iters 3 --num-warmup 1 "$@" --output $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^TTFT|^TPOT|host work|waiting for|drafts accepted|decode steps" $OUT/$name.log
done

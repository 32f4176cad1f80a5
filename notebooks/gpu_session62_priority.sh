#!/bin/bash
# Session 62: what --scheduling-policy priority does for the requests that carry a priority, on a GPU.
# The 8B preset (random weights, fp8 + LM head) served with 8 slots under the priority policy; 64
# requests at once (128 in / 64 out), a quarter of them (seeded) with priority -1, the rest none. The
# control is the same load with --priority 0 (both classes scheduled alike). Runs alternate:
# control, priority, control, priority.
#   bash notebooks/gpu_session62_priority.sh     # on nvidia-h200 -> $OUT/prio_*.json, $OUT/server.log
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m atlasjax.bench.preset_server --preset llama-3.1-8b --quantization fp8 --quantize-lm-head \
    --max-num-seqs 8 --max-model-len 1024 --scheduling-policy priority --port 18123 > $OUT/server.log 2>&1 &
server=$!
i=0
for rank in 0 -1 0 -1; do
    i=$((i + 1))
    timeout 200 python3 -m atlasjax.bench serve --base-url http://127.0.0.1:18123 --num-prompts 64 \
        --input-len 128 --output-len 64 --num-warmups 8 --no-warmup-buckets --wait-for-server 300 \
        --priority-fraction 0.25 --priority $rank --output $OUT/prio_${i}_${rank}.json > $OUT/prio_${i}.log 2>&1
    echo "== run $i priority $rank rc=$?"; grep -E "TTFT|E2EL|output token|completed" $OUT/prio_${i}.log
done
kill $server

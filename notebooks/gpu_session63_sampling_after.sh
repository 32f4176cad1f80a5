#!/bin/bash
# Session 63, after sampling sorts order keys and takes the top 20 in chunks: the sampling stages again
# (notebooks/gpu_sampling_cost.py), then the 8B preset (fp8 + LM head) through `bench latency` greedy at
# batch 1 (the control) and at temperature 1.0 at batch 1, 8 and 32, and 0.7 / top_p 0.9 at 32.
#   bash notebooks/gpu_session63_sampling_after.sh     # on nvidia-h200 -> $OUT/sampling_cost.json, $OUT/lat_*.json
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ROWS=1,8,32 timeout 150 python3 notebooks/gpu_sampling_cost.py
for run in "1 0.0 1.0" "1 1.0 1.0" "8 1.0 1.0" "32 1.0 1.0" "32 0.7 0.9"; do
    set -- $run
    name=lat_bs$1_t$2_p$3
    timeout 200 python3 -m atlasjax.bench latency --preset llama-3.1-8b --quantization fp8 --quantize-lm-head \
        --batch-size $1 --input-len 128 --output-len 64 --num-iters 3 --num-scheduler-steps 4 \
        --temperature $2 --top-p $3 --output $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== bs $1 temperature $2 top_p $3 rc=$?"; grep -E "iteration" $OUT/$name.log | head -3
done

#!/bin/bash
# Session 63: what sampled decoding costs against greedy on a GPU. First the sampling function alone
# by stage (notebooks/gpu_sampling_cost.py), then the 8B preset (random weights, fp8 + LM head) through
# `bench latency` greedy, at temperature 1.0, and at temperature 0.7 with top_p 0.9, batch 1 and 32.
#   bash notebooks/gpu_session63_sampling.sh     # on nvidia-h200 -> $OUT/sampling_cost.json, $OUT/lat_*.json
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 notebooks/gpu_sampling_cost.py
for bs in 1 32; do
    for sampling in "0.0 1.0" "1.0 1.0" "0.7 0.9"; do
        set -- $sampling
        name=lat_bs${bs}_t$1_p$2
        timeout 200 python3 -m atlasjax.bench latency --preset llama-3.1-8b --quantization fp8 --quantize-lm-head \
            --batch-size $bs --input-len 128 --output-len 64 --num-iters 3 --num-scheduler-steps 4 \
            --temperature $1 --top-p $2 --output $OUT/$name.json > $OUT/$name.log 2>&1
        echo "== bs $bs temperature $1 top_p $2 rc=$?"; grep -E "TPOT|TTFT" $OUT/$name.log | head -3
    done
done

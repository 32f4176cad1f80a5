#!/bin/bash
# Session 62: issue #8's bs=1 standing re-measured at the current code (the figure in docs/performance.md
# was session 19's): Llama-3.1-8B shapes, random weights, 4 steps per launch, bf16 and fp8 + LM head, at
# TP=1 and TP=2 on the same 2x H200 machine, TP=2 first (run-order drift), then TP=1, then TP=2 again.
#   bash notebooks/gpu_session62_tp.sh     # on nvidia-h200-x2 -> $OUT/tp*.json, $OUT/tp*.log
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
i=0
for tp in ${TPS:-2 1 2}; do
    i=$((i + 1))
    timeout ${LIMIT:-170} python -m atlasjax.bench latency --preset llama-3.1-8b --input-len 128 --output-len 128 \
        --num-iters 3 --batch-size ${BS:-1} --num-scheduler-steps 4 --quantize-lm-head --quantization fp8 \
        --compare-quantization none -tp $tp --output $OUT/tp${tp}_$i.json > $OUT/tp${tp}_$i.log 2>&1
    echo "== run $i TP=$tp rc=$?"; grep -A4 "weight formats" $OUT/tp${tp}_$i.log
done

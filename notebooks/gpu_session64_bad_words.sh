#!/bin/bash
# Session 64, after bad_words added two per-slot arrays to the device state and a history update to the
# sampled plans: tests/test_bad_words.py on the GPU, then the 8B preset (fp8 + LM head, 4 steps per launch,
# 128 in / 64 out) through `bench latency` greedy at batch 1 and sampled at batch 1 and 32 (against the same
# session's figures before it: 2.63 / 2.91 / 4.01 ms).
#   bash notebooks/gpu_session64_bad_words.sh     # on nvidia-h200 -> $OUT/bw_*.json
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_bad_words.py 2>&1 | tail -2
for run in "1 0.0" "1 1.0" "32 1.0"; do
    set -- $run
    timeout 150 python3 -m atlasjax.bench latency --preset llama-3.1-8b --quantization fp8 --quantize-lm-head \
        --input-len 128 --output-len 64 --num-scheduler-steps 4 --num-iters 3 --batch-size $1 --temperature $2 \
        --output $OUT/bw_bs$1_t$2.json > $OUT/bw_bs$1_t$2.log 2>&1
    echo "== bs $1 temperature $2 rc=$?"; grep -E "TPOT \(per" $OUT/bw_bs$1_t$2.log
done

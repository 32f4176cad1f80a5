#!/bin/bash
# Session 68: speculative decoding with a draft model on an H200. Part "tests": tests/test_draft_model.py (bf16,
# the GPU default) and notebooks/gpu_spec_seeded_flip.py (the n-gram seeded flip of session 67). Part "bench":
# `bench latency` of an 8B (random weights, bf16) plain and with a Llama-3.2-1B-shaped draft of random weights
# (its drafts are almost never accepted: what a verify step with draft proposals costs).
#   bash notebooks/gpu_session68_draft.sh tests|bench     # on nvidia-h200
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ "$1" = tests ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_draft_model.py 2>&1 | grep -E "passed|failed|Error|assert|^E " | tail -20
    timeout 150 python3 notebooks/gpu_spec_seeded_flip.py 2>&1 | grep -E "request|pos" | tail -12
    exit 0
fi
draft='{"model": "preset:llama-3.2-1b", "num_speculative_tokens": K}'
for run in "bs1_plain 1 0" "bs1_draft4 1 4" "bs1_draft2 1 2" "bs8_plain 8 0" "bs8_draft4 8 4"; do
    set -- $run
    name=$1; bs=$2; k=$3
    extra=()
    [ "$k" != 0 ] && extra=(--speculative-config "${draft/K/$k}")
    timeout 150 python3 -m atlasjax.bench latency --preset llama-3.1-8b --batch-size $bs --input-len 128 \
        --output-len 128 --num-iters 3 --num-warmup 1 "${extra[@]}" > /tmp/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^TPOT|host work|waiting for|drafts accepted|Error" /tmp/$name.log | head -6
done

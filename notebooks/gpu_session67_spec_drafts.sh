#!/bin/bash
# Session 67: why the pipelined n-gram speculation proposed no drafts on Llama-3.1-8B shapes (H200, session 67's
# helper run of gpu_session66_speculative.sh: 0 drafts at bs=1 with k=2/4/8). The same bench one step per launch,
# synchronously (session 66's first version ran so), then asynchronously with one and four iterations per launch;
# and the tiny preset (bf16) the same three ways, whose text repeats.
#   bash notebooks/gpu_session67_spec_drafts.sh     # on nvidia-h200 -> $OUT/drafts_*.log
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
spec='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":3,"prompt_lookup_min":1}'
modes=("sync1 --no-async-scheduling --num-scheduler-steps 1" "async1 --num-scheduler-steps 1" "async4 --num-scheduler-steps 4")
for preset in tiny llama-3.1-8b; do
    for mode in "${modes[@]}"; do
        set -- $mode
        name=drafts_${preset}_$1; shift
        timeout 120 python3 -m atlasjax.bench latency --preset $preset --batch-size 1 --input-len 128 --output-len 128 \
            --num-iters 2 --num-warmup 1 "$@" --speculative-config "$spec" > $OUT/$name.log 2>&1
        echo "== $name rc=$?"; grep -E "^TPOT|drafts accepted" $OUT/$name.log
    done
done

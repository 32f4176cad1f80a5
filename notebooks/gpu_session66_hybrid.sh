#!/bin/bash
# Session 66, after steps without drafts became plain multi-step decodes: tests/test_speculative.py on the GPU,
# `bench latency` on Llama-3.1-8B shapes (bf16, random weights: random prompts, so no draft is ever proposed)
# default vs n-gram k=4, and the step cost with every draft accepted (notebooks/gpu_spec_step_cost.py, k=4).
#   bash notebooks/gpu_session66_hybrid.sh      # on nvidia-h200 -> $OUT/*.json
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py 2>&1 | tail -4
for run in "bs1_default" "bs1_k4 --speculative-config {\"num_speculative_tokens\":4,\"prompt_lookup_max\":3,\"prompt_lookup_min\":1}"; do
    set -- $run
    name=spec_$1; shift
    timeout 120 python3 -m atlasjax.bench latency --preset llama-3.1-8b --batch-size 1 --input-len 128 --output-len 128 \
        --num-iters 3 --num-warmup 1 "$@" --output $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^TPOT|host work|waiting for|drafts accepted" $OUT/$name.log
done
KS=4 timeout 150 python3 notebooks/gpu_spec_step_cost.py 1 2>&1 | grep "^{"

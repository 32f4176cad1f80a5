#!/bin/bash
# Session 64: sampled decoding no longer computes logprobs nobody asked for (a fourth sampling plan).
# The 8B preset (fp8 + LM head, 4 steps per launch, 128 in / 64 out) through `bench latency`: greedy at
# batch 1 (the control), temperature 1.0 at batch 1, 8 and 32 without logprobs, and with --logprobs 5 at 1
# and 32 (the plan every sampled step ran before). With STAGE=compile instead: the start-up compiles with
# three plans against four (notebooks/gpu_compile_plans.py), one process each.
#   bash notebooks/gpu_session64_sampling_plan.sh               # on nvidia-h200 -> $OUT/lat_*.json
#   STAGE=compile bash notebooks/gpu_session64_sampling_plan.sh # -> $OUT/compile_plans*.log
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
COMMON="--preset llama-3.1-8b --quantization fp8 --quantize-lm-head --input-len 128 --output-len 64 --num-scheduler-steps 4"
if [ "${STAGE:-latency}" = compile ]; then
    for plans in 3 4; do
        PLANS=$plans timeout 280 python3 notebooks/gpu_compile_plans.py latency $COMMON --batch-size 1 --num-iters 1 \
            --compile-at-start -v --long-context-decode off --output $OUT/compile_plans$plans.json \
            > $OUT/compile_plans$plans.log 2>&1
        echo "== $plans plans rc=$?"; grep -E "sampling plans|compiled [0-9]+ step shapes" $OUT/compile_plans$plans.log
    done
    exit 0
fi
for run in "1 0.0 -" "1 1.0 -" "1 1.0 5" "8 1.0 -" "32 1.0 -" "32 1.0 5"; do
    set -- $run
    name=lat_bs$1_t$2_lp$3
    extra=""; [ "$3" != "-" ] && extra="--logprobs $3"
    timeout 150 python3 -m atlasjax.bench latency $COMMON --batch-size $1 --num-iters 3 --temperature $2 $extra \
        --output $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== bs $1 temperature $2 logprobs $3 rc=$?"; grep -E "TPOT \(per|iteration" $OUT/$name.log | tail -4
done

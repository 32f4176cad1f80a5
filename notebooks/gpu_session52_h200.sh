#!/bin/bash
# Session 52: issue #5's bs=1 standings on an H200 (the only kind lent this session).
#   STAGE=bench: the 8B bs=1 decode step, 4 steps per launch, LM head quantized, fp8 / int8 / int4
#     against bf16 in one process (as "Where things stand" measures them on the H100), then the
#     kernels' share of copy bandwidth at 8 rows (bench_kernels_quant --no-prefill).
#   STAGE=prefill: the 2,048-token prefill (TTFT), fp8 / int8 / int4 weights against bf16 in one process,
#     then fp8 W8A8 against bf16.
#   STAGE=xla_int4: notebooks/gpu_xla_int4_probe.py (XLA's int4 GEMM against the engine's int4 kernel).
#   STAGE=int4_sweep: notebooks/gpu_int4_group_sweep.py (the int4 kernel's tunables) on the H200.
#   STAGE=profile: where a step's time goes, per kernel, for fp8, int4 and bf16 (4 steps per launch).
#   STAGE=variants: the step's kernels per layer (gpu_profile_step.py, 4 steps per launch, QUANT, default
#     fp8) under VARIANTS, ';'-separated sets of environment assignments; PROBE=1 also prints how XLA
#     fused the residual adds and the norms (notebooks/gpu_norm_fusion_probe.py).
#   STAGE=bench bash notebooks/gpu_session52_h200.sh     # -> $OUT/*.json, $OUT/*.log
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
case ${STAGE:-bench} in
bench)
    timeout 330 python -m atlasjax.bench latency --preset llama-3.1-8b --input-len 128 --output-len 128 \
        --num-iters 3 --batch-size 1 --num-scheduler-steps 4 --quantize-lm-head --quantization fp8 \
        --compare-quantization int8,int4,none --output $OUT/bs1_h200.json > $OUT/bs1_h200.log 2>&1
    echo "== bench rc=$?"; grep -v "^W\|^I0" $OUT/bs1_h200.log | tail -25
    timeout 200 python -m atlasjax.bench_kernels_quant --no-prefill --out $OUT > $OUT/kernels_h200.log 2>&1
    echo "== kernels rc=$?"; grep -v "^W\|^I0" $OUT/kernels_h200.log | tail -40 ;;
prefill)
    # the issue's prefill target: a 2,048-token TTFT quantized (weights only, then fp8 W8A8) against bf16
    timeout 300 python -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 --output-len 8 \
        --num-iters 3 --batch-size 1 --quantization fp8 --compare-quantization int8,int4,none \
        --output $OUT/ttft_h200.json > $OUT/ttft_h200.log 2>&1
    echo "== ttft rc=$?"; grep -A7 "weight formats" $OUT/ttft_h200.log
    timeout 200 python -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 --output-len 8 \
        --num-iters 3 --batch-size 1 --quantization fp8 --activation-quantization fp8 --compare-quantization none \
        --output $OUT/ttft_h200_w8a8.json > $OUT/ttft_h200_w8a8.log 2>&1
    echo "== ttft w8a8 rc=$?"; grep -A5 "weight formats" $OUT/ttft_h200_w8a8.log ;;
xla_int4)
    # XLA's own s4 GEMM (per column, per group, with the sub-channel fusion flag) against the engine's kernel
    ROWS=${ROWS:-8,16} timeout 400 python notebooks/gpu_xla_int4_probe.py 2>&1 | grep -v "^W\|^I0" | tail -20 ;;
int4_sweep)
    # the int4 kernel's tunables (groups per step, pipeline depth, K splits) on the H200's bandwidth
    ONLY=${ONLY:-auto,u1,u2,u4,u2_d2,u2_d6,u2_d8,u4_d2,u4_d4,u2_s1,u2_s2,u2_s4,u2_s8} timeout 420 \
        python notebooks/gpu_int4_group_sweep.py 2>&1 | grep -v "^W\|^I0" | tail -70 ;;
profile)
    for q in fp8 int4 ""; do
        QUANT=$q LM_HEAD=$([ -n "$q" ] && echo 1 || echo 0) SCHED_STEPS=4 timeout 170 python notebooks/gpu_profile_step.py > $OUT/profile_${q:-bf16}.log 2>&1
        echo "== profile ${q:-bf16} rc=$?"; grep -E "^(engine_step_ms|device_inputs)" $OUT/profile_${q:-bf16}.log
    done ;;
variants)
    # VARIANTS: ';'-separated sets of environment assignments ('default' for none), e.g.
    # "default;ATLASJAX_DECODE_MATMUL=on". PROBE=1 also prints how XLA fused the residual adds and norms.
    IFS=';' read -ra sets <<< "${VARIANTS:-default}"
    i=0
    for assignments in "${sets[@]}"; do
        [ "$assignments" = default ] && assignments=""
        echo "== variant $i: $assignments"
        if [ "${PROBE:-0}" = 1 ]; then
            env $assignments QUANT=${QUANT-fp8} TAG=_v$i timeout 120 python notebooks/gpu_norm_fusion_probe.py 2>&1 \
                | grep -E "^(NORM|   <-|fusion kinds)" | cut -c1-330 | head -6
            gzip -f $OUT/decode_hlo_*_v$i.txt 2>/dev/null
        fi
        env $assignments QUANT=${QUANT-fp8} LM_HEAD=${LM_HEAD:-1} SCHED_STEPS=4 TAG=_v$i timeout 150 python notebooks/gpu_profile_step.py \
            > $OUT/profile_v$i.log 2>&1
        rc=$?; echo "profile rc=$rc"; [ $rc != 0 ] && tail -5 $OUT/profile_v$i.log; rm -f $OUT/profile_v$i.log
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); t=r['engine_trace']; print('step ms', r['engine_step_ms'], 'busy ms/launch', t['busy_ms_per_step'], 'kernels/launch', t['kernels_per_step']); print('layer', t['one_layer'])" \
            $OUT/profile_$(q=${QUANT-fp8}; echo ${q:-bf16})_bs1_tp1_v$i.json
        i=$((i+1))
    done ;;
esac

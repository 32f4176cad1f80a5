# Session 84 on one H200: STAGE=sweep (8-bit weights past 1,024 rows: the weight dequantized as stored, W.T with its
# scales multiplied in, for XLA's GEMM writing bf16 itself, against what ran before: XLA's convert-fused GEMM with an
# f32 output and the channel scale after (per channel) or the weight dequantized to [K, N] (grouped); the 8B's four
# projections at 2,048 and 8,192 rows) and/or STAGE=ratio (the 2,048-token prefill, int8 / fp8 / int4 against bf16 in
# one process) and/or STAGE=throughput (`bench throughput`, FMT=fp8 weights, 1,024 x 128 in / 128 out, 256
# sequences, 8,192-token steps: this tree, then .before/quantized_matmul.py, carried: the routing before) and/or
# STAGE=profile (where the fp8 W8A16 2,048-token prefill's time goes now, notebooks/gpu_profile_prefill.py) and/or
# STAGE=tests (the quantized-matmul tests of the XLA paths, natively: pytest needs to be installed there).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
for stage in ${STAGE:-sweep ratio}; do
case $stage in
sweep)
  timeout ${T_SWEEP:-330} python3 -m atlasjax.bench_kernels_quant --sweep-rows ${ROWS:-2048,8192} \
    --formats ${FORMATS:-fp8,int8,int8_g32} --paths ${PATHS:-engine,xla_convert,xla_kn,xla_nk,xla_nk_barrier} \
    > $OUT/sweep.log 2>&1; echo sweep rc=$?
  grep -v "^W\|^I0\|^E0" $OUT/sweep.log | tail -40 ;;
ratio)
  timeout ${T_RATIO:-300} python3 -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 --output-len 16 \
    --num-iters ${ITERS:-3} --batch-size 1 --max-num-batched-tokens 2048 --quantization int8 \
    --compare-quantization fp8,int4,gguf-q8_0,none > $OUT/prefill_ratio.log 2>&1; echo ratio rc=$?
  grep -i "ttft" $OUT/prefill_ratio.log | grep -v "^W\|^I0\|iteration" | tail -10 ;;
profile)
  CASES=${CASES:-fp8:2048x1,bf16:2048x1} timeout ${T_PROFILE:-300} python3 notebooks/gpu_profile_prefill.py \
    > $OUT/profile_prefill.log 2>&1; echo profile rc=$?
  grep -v "^W\|^I0\|^E0" $OUT/profile_prefill.log | grep -i "^fp8\|^bf16" | cut -c1-300 ;;
tests)
  timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider tests/test_quantized_matmul.py \
    -k "xla_backend or dequantize_nk or convert_fused or gpu_prefill" > $OUT/tests.log 2>&1; echo tests rc=$?
  tail -3 $OUT/tests.log ;;
throughput)
  cp pallas_kernels/quantized_matmul.py /tmp/quantized_matmul.new.py
  for v in new old; do
    [ $v = old ] && cp .before/quantized_matmul.py pallas_kernels/quantized_matmul.py
    timeout ${T:-200} python3 -m atlasjax.bench throughput --preset llama-3.1-8b --num-prompts 1024 --input-len 128 \
      --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --quantization ${FMT:-fp8} \
      --output $OUT/tp_$v.json > $OUT/tp_$v.log 2>&1
    echo $v rc=$?; grep -i "tok/s\|compiles\|elapsed" $OUT/tp_$v.log | grep -v "^W\|^I0" | tail -5
  done
  cp /tmp/quantized_matmul.new.py pallas_kernels/quantized_matmul.py ;;
esac
done

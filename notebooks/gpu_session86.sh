# Session 86 on one H200: STAGE=tests (the tests of what session 85 changed, natively: pallas_kernels/words.py, the
# K/V scatter and ragged attention's regrouping as words, the dequantized copy) and/or STAGE=sweep (8-bit weights at
# ROWS rows on SHAPES (0-3: the 8B's gate_up, down, qkv, o_proj; or KxN), the engine's path against the word-wise dequantized copy: where the copy pays below 2,048 rows)
# and/or STAGE=ratio (#5's prefill ratios at LEN tokens, int8 / fp8 / GGUF Q8_0 against bf16 in one process).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
for stage in ${STAGE:-tests sweep}; do
case $stage in
tests)
  # the interpret-mode cases are CPU's (CI runs them); natively the kernels themselves run
  JAX_PLATFORMS=cuda,cpu timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider --maxfail=5 -k "not interpret" \
    tests/test_words.py tests/test_ragged_attention.py tests/test_fp8_kv_cache.py tests/test_paged_attention.py \
    > $OUT/tests.log 2>&1
  echo tests rc=$?; grep -E "passed|failed|error" $OUT/tests.log | tail -5
  timeout ${T_TESTS2:-120} python3 -m pytest -q -p no:cacheprovider --maxfail=5 tests/test_quantized_matmul.py \
    -k "xla_backend or dequantize_nk or convert_fused or gpu_prefill" > $OUT/tests_qmm.log 2>&1
  echo tests_qmm rc=$?; grep -E "passed|failed|error" $OUT/tests_qmm.log | tail -5 ;;
sweep)
  timeout ${T_SWEEP:-280} python3 -m atlasjax.bench_kernels_quant --sweep-rows ${ROWS:-1024} \
    --shapes ${SHAPES:-0,1,2,3} --formats ${FORMATS:-fp8,int8,int8_g32} \
    --paths ${PATHS:-engine,xla_nk} --out $OUT > $OUT/sweep.log 2>&1; echo sweep rc=$?
  grep -v "^W\|^I0\|^E0" $OUT/sweep.log | tail -60 ;;
ratio)
  timeout ${T_RATIO:-400} python3 -m atlasjax.bench latency --preset llama-3.1-8b --input-len ${LEN:-1024} \
    --output-len 16 --num-iters ${ITERS:-10} --batch-size 1 --max-num-batched-tokens ${LEN:-1024} \
    --quantization int8 --compare-quantization ${CMP:-fp8,gguf-q8_0,none} > $OUT/ratio.log 2>&1; echo ratio rc=$?
  grep -i "ttft" $OUT/ratio.log | grep -v "^W\|^I0\|iteration" | tail -10 ;;
esac
done
# STAGE2=ab: STAGE's ratio stage for this tree and for the tree in OLD_TAR (.before/old.tar), one process each
for stage in ${STAGE2:-}; do
case $stage in
ab)
  rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf ${OLD_TAR:-.before/old.tar} -C /tmp/old
  for v in new old; do
    dir=$PWD; [ $v = old ] && dir=/tmp/old
    (cd $dir && PYTHONPATH=$dir:${PYTHONPATH#.:} timeout ${T_RATIO:-250} python3 -m atlasjax.bench latency \
      --preset llama-3.1-8b --input-len ${LEN:-1024} --output-len 16 --num-iters ${ITERS:-10} --batch-size 1 \
      --max-num-batched-tokens ${LEN:-1024} --quantization int8 --compare-quantization ${CMP:-gguf-q8_0,none} \
      > $OUT/ab_$v.log 2>&1); echo $v rc=$?
    grep -i "ttft" $OUT/ab_$v.log | grep -v "^W\|^I0\|iteration" | tail -6
  done ;;
esac
done

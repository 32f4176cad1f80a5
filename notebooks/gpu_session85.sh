# Session 85 on one H200: STAGE=words (the prefill's dequantizing pass two bf16 values per uint32 word against one
# per element and four codes per input word, alone and feeding the GEMM: notebooks/gpu_dequant_words.py) and/or
# STAGE=ratio (#5's 2,048-token prefill, int8 / fp8 / int4 / GGUF Q8_0 against bf16 in one process) and/or
# STAGE=profile (where the fp8 W8A16 2,048-token prefill's time goes, notebooks/gpu_profile_prefill.py) and/or
# STAGE=tests (the quantized-matmul tests of the XLA paths, natively: pytest needs to be installed there).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
for stage in ${STAGE:-words ratio}; do
case $stage in
words)
  timeout ${T_WORDS:-300} python3 notebooks/gpu_dequant_words.py > $OUT/words.log 2>&1; echo words rc=$?
  grep "^{\|^copy" $OUT/words.log | cut -c1-220 ;;
ratio)
  timeout ${T_RATIO:-300} python3 -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 --output-len 16 \
    --num-iters ${ITERS:-3} --batch-size 1 --max-num-batched-tokens 2048 --quantization int8 \
    --compare-quantization fp8,int4,gguf-q8_0,none > $OUT/prefill_ratio.log 2>&1; echo ratio rc=$?
  grep -i "ttft" $OUT/prefill_ratio.log | grep -v "^W\|^I0\|iteration" | tail -10 ;;
profile)
  CASES=${CASES:-fp8:2048x1} timeout ${T_PROFILE:-300} python3 notebooks/gpu_profile_prefill.py \
    > $OUT/profile_prefill.log 2>&1; echo profile rc=$?
  grep -v "^W\|^I0\|^E0" $OUT/profile_prefill.log | grep -i "^fp8\|^bf16" | cut -c1-300 ;;
tests)
  timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider tests/test_quantized_matmul.py \
    -k "xla_backend or dequantize_nk or convert_fused or gpu_prefill" > $OUT/tests.log 2>&1; echo tests rc=$?
  tail -3 $OUT/tests.log ;;
esac
done
# STAGE=layout: notebooks/gpu_bf16_layout.py (bf16 GEMMs on [K, N] against [N, K] weights); STAGE=sweep: per-channel
# 8-bit weights at ROWS rows, XLA's convert-fused GEMM against the word-wise dequantized copy (`convert_fused_pays`)
for stage in ${STAGE2:-}; do
case $stage in
layout)
  timeout ${T_LAYOUT:-200} python3 notebooks/gpu_bf16_layout.py > $OUT/layout.log 2>&1; echo layout rc=$?
  grep "^{" $OUT/layout.log | cut -c1-200 ;;
sweep)
  timeout ${T_SWEEP:-250} python3 -m atlasjax.bench_kernels_quant --sweep-rows ${ROWS:-512,1024,2048,4096} \
    --formats ${FORMATS:-fp8,int8} --paths ${PATHS:-engine,xla_convert,xla_nk} > $OUT/sweep.log 2>&1; echo sweep rc=$?
  grep -v "^W\|^I0\|^E0" $OUT/sweep.log | tail -45 ;;
esac
done
# STAGE3=throughput: `bench throughput` (FMTS weights, 1,024 x 128 in / 128 out, 256 sequences, 8,192-token steps) of
# this tree and of the tree in .before/old.tar (the session's start, a3f39a7), one process each, alternating
for stage in ${STAGE3:-}; do
case $stage in
throughput)
  mkdir -p /tmp/old && tar -xf .before/old.tar -C /tmp/old
  for fmt in ${FMTS:-none fp8}; do
    for v in new old; do
      dir=$PWD; [ $v = old ] && dir=/tmp/old
      q=""; [ $fmt != none ] && q="--quantization $fmt"
      (cd $dir && PYTHONPATH=$dir:${PYTHONPATH#.:} timeout ${T:-150} python3 -m atlasjax.bench throughput \
        --preset llama-3.1-8b --num-prompts 1024 --input-len 128 --output-len 128 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 $q --output $OUT/tp_${fmt}_$v.json > $OUT/tp_${fmt}_$v.log 2>&1)
      echo $fmt $v rc=$?; grep -i "output tok/s\|compiles" $OUT/tp_${fmt}_$v.log | grep -v "^W\|^I0" | tail -3
    done
  done ;;
esac
done

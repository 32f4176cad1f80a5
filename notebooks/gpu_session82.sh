# Session 82 on one H200: STAGE=prefill (where a prefill's time goes: bf16 and W8A8, one 2,048-token prompt and 64
# prompts of 128 tokens in one step, notebooks/gpu_profile_prefill.py) or STAGE=convert (the bf16 GEMMs' own bf16
# output against f32 and a convert after: the prefill profile and the bs=1 decode step, each with this tree's
# models/layers.py and with the one in .before/, carried) or STAGE=throughput (`bench throughput`, bf16, 1,024 x
# 128 in / 128 out, 256 sequences, with this tree and with .before/'s layers.py and runner.py: admission 2 requests
# per program at this max_model_len, and the f32 GEMM outputs).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
case "${STAGE:-prefill}" in
prefill)
  timeout 570 python3 notebooks/gpu_profile_prefill.py > $OUT/profile_prefill.log 2>&1; echo rc=$?
  grep -v "^W\|^I0\|^E0" $OUT/profile_prefill.log | tail -8 ;;
throughput)
  [ -n "${PREFILL_RATIO:-}" ] && { timeout 200 python3 -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 \
      --output-len 16 --num-iters 3 --batch-size 1 --max-num-batched-tokens 2048 --quantization int8 \
      --compare-quantization fp8,none > $OUT/prefill_ratio.log 2>&1; echo prefill ratio rc=$?
    grep -i "ttft" $OUT/prefill_ratio.log | grep -v "^W\|^I0\|iteration" | tail -8; }
  for v in new old; do
    [ $v = old ] && cp .before/layers.py models/layers.py && cp .before/runner.py atlasjax/runner.py
    timeout ${T:-280} python3 -m atlasjax.bench throughput --preset llama-3.1-8b --num-prompts 1024 --input-len 128 \
      --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --output $OUT/tp_$v.json > $OUT/tp_$v.log 2>&1
    echo $v rc=$?; grep -i "tok/s\|compiles\|elapsed" $OUT/tp_$v.log | grep -v "^W\|^I0" | tail -5
  done ;;
convert)
  LAT="python3 -m atlasjax.bench latency --preset llama-3.1-8b --input-len 128 --output-len 128 --num-iters 3
       --batch-size 1 --num-scheduler-steps 4"
  for v in new old; do
    [ $v = old ] && cp .before/layers.py models/layers.py
    mkdir -p $OUT/$v
    OUT=$OUT/$v CASES=${CASES:-bf16:2048x1,bf16:128x64} timeout 250 python3 notebooks/gpu_profile_prefill.py \
      > $OUT/$v/profile_prefill.log 2>&1; echo $v rc=$?
    grep "^bf16" $OUT/$v/profile_prefill.log | cut -c1-400
    timeout 150 $LAT --output $OUT/$v/latency.json > $OUT/$v/latency.log 2>&1; echo $v latency rc=$?
    grep -i "tpot\|step" $OUT/$v/latency.log | grep -v "^W\|^I0" | head -4
  done ;;
esac

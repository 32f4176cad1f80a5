# Session 80 on one H200: STAGE=bench1 (n-gram drafts on the device against the host's at bs=1, then with a 32k
# max_model_len) or STAGE=bench8 (the same at bs=8 without the 32k run, then the n-gram test files natively) or
# STAGE=mixed (two tokens biased alike: drafts accepted in part; bs=1 and 8).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
summary() {
  grep '^{' $1 | python3 -c "import json,sys; [print(r['batch'], r['label'], round(r['tpot_ms'],3), round(r['median_step_ms'],2), round(r['tokens_per_step'],2), r['spec']['num_draft_tokens'], r['spec']['num_accepted_tokens'], round(r['engine_start_s'],1)) for r in map(json.loads, sys.stdin)]"
}
case "${STAGE:-bench1}" in
bench1)
  LONG=1 timeout 560 python3 notebooks/gpu_ngram_on_device.py 1 > $OUT/ngram_on_device_1.log 2>&1; echo rc=$?
  summary $OUT/ngram_on_device_1.log ;;
bench8)
  timeout 330 python3 notebooks/gpu_ngram_on_device.py 8 > $OUT/ngram_on_device_8.log 2>&1; echo rc=$?
  summary $OUT/ngram_on_device_8.log
  timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_ngram_on_device.py > $OUT/ngram_tests.log 2>&1; echo rc=$?
  tail -8 $OUT/ngram_tests.log ;;
mixed)
  MIXED=1 timeout 500 python3 notebooks/gpu_ngram_on_device.py 1 8 > $OUT/ngram_mixed.log 2>&1; echo rc=$?
  summary $OUT/ngram_mixed.log ;;
esac

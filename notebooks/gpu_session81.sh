# Session 81 on one H200: STAGE=gate (the n-gram acceptance gate on and off, 16 / 2 / 1 tokens biased, bs=1 and 8) or
# STAGE=rejected (n-gram drafts found but hardly ever accepted: 16 tokens biased alike; bs=1
# and 8: default engine, host lookups one round per launch, device lookups read back first and pipelined) or
# STAGE=tests (the n-gram and speculative test files natively, the served test included: starlette and gguf
# travel as wheels in .whl).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
summary() {
  grep '^{' $1 | python3 -c "import json,sys; [print(r['batch'], r['label'], round(r['tpot_ms'],3), round(r['median_step_ms'],2), round(r['tokens_per_step'],2), r['spec']['num_draft_tokens'], r['spec']['num_accepted_tokens'], round(r['engine_start_s'],1)) for r in map(json.loads, sys.stdin)]"
}
case "${STAGE:-gate}" in
gate)
  timeout 570 python3 notebooks/gpu_ngram_gate.py 1 8 > $OUT/ngram_gate.log 2>&1; echo rc=$?
  summary $OUT/ngram_gate.log ;;
rejected)
  MIXED=16 timeout 570 python3 notebooks/gpu_ngram_on_device.py 1 8 > $OUT/ngram_rejected.log 2>&1; echo rc=$?
  summary $OUT/ngram_rejected.log ;;
tests)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site || exit
  timeout 560 python3 -m pytest -q -p no:cacheprovider tests/test_ngram_on_device.py tests/test_speculative.py \
    > $OUT/spec_tests.log 2>&1; echo rc=$?
  tail -15 $OUT/spec_tests.log ;;
esac

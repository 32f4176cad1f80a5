# Session 79 on one H200: STAGE=pipelined (pipelined verify launches, bs=1, then the EAGLE-3 tests natively) or
# STAGE=profile (where a 256-row bf16 decode step goes), STAGE=pipelined8 (bs=8, then the 256-row profile) or
# STAGE=rounds (pipelined, 2 / 8 rounds per launch, k=5) or STAGE=tests (the EAGLE-3 and draft-model tests, one GPU).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
case "${STAGE:-pipelined}" in
pipelined)
  timeout 420 python3 notebooks/gpu_verify_pipelined.py 1 > $OUT/pipelined_bs1.log 2>&1; echo rc=$?
  grep '^{' $OUT/pipelined_bs1.log | python3 -c "import json,sys; [print(r['label'], round(r['tpot_ms'],3), round(r['median_step_ms'],2), round(r['tokens_per_step'],2)) for r in map(json.loads, sys.stdin)]"
  timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/test_eagle3.py -k "speculators or several_verify_rounds" > $OUT/eagle_tests.log 2>&1; echo rc=$?
  tail -3 $OUT/eagle_tests.log ;;
pipelined8)
  DRAFT_MODEL=0 timeout 330 python3 notebooks/gpu_verify_pipelined.py 8 > $OUT/pipelined_bs8.log 2>&1; echo rc=$?
  grep '^{' $OUT/pipelined_bs8.log | python3 -c "import json,sys; [print(r['label'], round(r['tpot_ms'],3), round(r['median_step_ms'],2), round(r['tokens_per_step'],2)) for r in map(json.loads, sys.stdin)]"
  BS=256 SCHED_STEPS=4 timeout 240 python3 notebooks/gpu_profile_step.py > $OUT/prof_bf16.log 2>&1; echo rc=$?
  grep -v "^top\|around" $OUT/prof_bf16.log | tail -4 ;;
rounds)
  ROUNDS=1 timeout 400 python3 notebooks/gpu_verify_pipelined.py 1 > $OUT/pipelined_rounds.log 2>&1; echo rc=$?
  grep '^{' $OUT/pipelined_rounds.log | python3 -c "import json,sys; [print(r['label'], round(r['tpot_ms'],3), round(r['median_step_ms'],2), round(r['tokens_per_step'],2)) for r in map(json.loads, sys.stdin)]" ;;
tests)
  timeout 450 python3 -m pytest -q -p no:cacheprovider tests/test_eagle3.py tests/test_draft_model.py -k "not tensor" > $OUT/spec_tests.log 2>&1; echo rc=$?
  tail -5 $OUT/spec_tests.log ;;
profile)
  BS=256 SCHED_STEPS=4 timeout 560 python3 notebooks/gpu_profile_step.py > $OUT/prof_bf16.log 2>&1; echo rc=$?
  tail -3 $OUT/prof_bf16.log ;;
esac

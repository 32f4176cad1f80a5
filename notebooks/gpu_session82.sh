# Session 82 on one H200: STAGE=prefill (where a prefill's time goes: bf16 and W8A8, one 2,048-token prompt and 64
# prompts of 128 tokens in one step, notebooks/gpu_profile_prefill.py).
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)"
case "${STAGE:-prefill}" in
prefill)
  timeout 570 python3 notebooks/gpu_profile_prefill.py > $OUT/profile_prefill.log 2>&1; echo rc=$?
  grep -v "^W\|^I0\|^E0" $OUT/profile_prefill.log | tail -8 ;;
esac

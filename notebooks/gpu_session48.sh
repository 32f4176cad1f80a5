#!/usr/bin/env bash
# Session 48, first call: the fp8 KV cache's kernels natively (tests), the attention kernel bench over
# bf16 and fp8 pages, the int4 zero-point groups on the per-group path (tests, kernel timings).
# Run from the repo root on the device: bash notebooks/gpu_session48.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
echo "== native tests"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/test_fp8_kv_cache.py} \
  "tests/test_quantized_matmul.py::test_gpu_per_group_with_integer_zero_points" 2>&1 | tail -15
echo "== int4 zero-point groups, kernel"
timeout 150 python3 notebooks/gpu_int4_zero_point_groups.py 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -60
[ -n "${SKIP_ATTENTION:-}" ] && exit 0
echo "== attention kernels"
timeout 170 python3 -m atlasjax.bench_kernels_attention --json "$OUT/attention.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -30

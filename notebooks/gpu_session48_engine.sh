#!/usr/bin/env bash
# Session 48, second call: the chosen fp8 page conversion (f16, WGMMA_UPCAST_2X) natively and on the
# kernel bench; int4 zero-point groups of 32 / 64 on the per-group path in the bs=1 step; the fp8 KV
# cache in the decode step at 64 sequences of 1,024-token prompts (Llama-3.1-8B preset, int4 weights).
# Run from the repo root on the device: bash notebooks/gpu_session48_engine.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
quiet() { grep -v "^WARNING\|^I0000\|^W0000\|Deprecat\|triton_pa"; }
echo "== native tests"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_kv_cache.py \
  "tests/test_quantized_matmul.py::test_gpu_per_group_with_integer_zero_points" 2>&1 | tail -4
echo "== attention kernels over fp8 pages"
timeout 100 python3 - <<'PY' 2>&1 | quiet | tail -10
from atlasjax.bench_kernels_attention import bench_decode, bench_prefill, copy_bandwidth, matmul_rate
rows, bw = [], copy_bandwidth()
for b, ctx, ps in ((32, 4096, 16), (1, 32768, 16), (64, 1024, 16)):
    bench_decode(b, ctx, ps, bw, rows, baselines=False)
bench_prefill(4096, matmul_rate(), rows, with_reference=True)
for r in rows:
    print(f"{r['case']:32s} {r['impl']:28s} " + (f"{r['us']:8.1f} us err {r['rel_err']:.1e}" if "us" in r else r["error"][:300]))
PY
bench() {  # name, then the bench's flags
  local name=$1; shift
  echo "== $name"
  timeout 170 python3 -m atlasjax.bench latency --preset llama-3.1-8b --num-scheduler-steps 4 --quantize-lm-head \
    --quantization int4 --output "$OUT/$name.json" "$@" 2>&1 | grep -E "TPOT \(per|TTFT  |KV pool|Error|error" | head -4
}
bench int4_g32_zp_bs1 --batch-size 1 --input-len 128 --output-len 128 --num-iters 2 --quantization-group-size 32
bench int4_g64_zp_bs1 --batch-size 1 --input-len 128 --output-len 128 --num-iters 2 --quantization-group-size 64
bench kv_auto_bs64 --batch-size 64 --input-len 1024 --output-len 64 --num-iters 2
bench kv_fp8_bs64 --batch-size 64 --input-len 1024 --output-len 64 --num-iters 2 --kv-cache-dtype fp8

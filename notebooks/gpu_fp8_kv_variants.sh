#!/usr/bin/env bash
# Session 48: the fp8 page conversion's variants (compute dtype, register layout of the fp8 load), one
# process each, on the attention kernel bench's decode and prefill cases over fp8 e4m3 pages.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
for compute in bfloat16 float16; do
  for layout in "" WGMMA_UPCAST_2X WGMMA_8BIT; do
    echo "== compute=$compute layout=${layout:-default}"
    ATLASJAX_FP8_KV_COMPUTE=$compute ATLASJAX_FP8_KV_LAYOUT=$layout timeout 100 python3 - <<'PY' 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|Deprecat\|triton_pa" | tail -8
import jax, jax.numpy as jnp
from atlasjax.bench_kernels_attention import bench_decode, bench_prefill, copy_bandwidth, matmul_rate
rows = []
bw = copy_bandwidth()
for b, ctx, ps in ((32, 4096, 16), (1, 32768, 16), (64, 1024, 16)):
    bench_decode(b, ctx, ps, bw, rows, baselines=False)
bench_prefill(4096, matmul_rate(), rows)
for r in rows:
    if "error" in r:
        print(r["case"], r["impl"], "ERROR", r["error"][:300])
    else:
        print(f"{r['case']:32s} {r['impl']:28s} {r['us']:8.1f} us err {r['rel_err']:.1e}")
PY
  done
done

"""int4 groups of 128 (`quantization="int4"`) on the decode kernel's variants, per 8B projection shape.

Variants: groups per pipeline step (`group_unroll`), the asymmetric offset term in the kernel (a
ones-tile wgmma, `fold_zeros`) or in XLA, pipeline depth, K splits. `unroll 1, unfolded` is the
session 6 kernel. CUPTI time of all kernels of one call (the kernel, the split-K sum, the XLA
offset term when unfolded), median, weight copies rotated past L2, 8 activation rows.

`[ONLY=u1_unfolded,u2] PYTHONPATH=. python notebooks/gpu_int4_group_sweep.py` (writes
`$OUT/int4_sweep.json`; ONLY picks variants).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import DECODE_SHAPES, copy_bandwidth, device_ms, rotated, MIN_ROTATION_BYTES
from atlasjax.weights_summary import weight_nbytes
from atlasjax.quantization import dequantize, quantize
from pallas_kernels.quantized_matmul import QuantMatmulConfig, quantized_matmul

ROWS = int(os.environ.get("ROWS", 8))
VARIANTS = {
    "auto": QuantMatmulConfig(),   # what the engine runs for groups of 128
    "u1_unfolded": QuantMatmulConfig(group_unroll=1, fold_zeros=False),
    "u1": QuantMatmulConfig(group_unroll=1),
    "u2": QuantMatmulConfig(group_unroll=2),
    "u4": QuantMatmulConfig(group_unroll=4),
    "u2_d2": QuantMatmulConfig(group_unroll=2, max_concurrent_steps=2),
    "u2_d6": QuantMatmulConfig(group_unroll=2, max_concurrent_steps=6),
    "u2_d8": QuantMatmulConfig(group_unroll=2, max_concurrent_steps=8),   # session 52 (H200): deeper
    "u4_d4": QuantMatmulConfig(group_unroll=4, max_concurrent_steps=4),
    "u4_d2": QuantMatmulConfig(group_unroll=4, max_concurrent_steps=2),
    "u8_d2": QuantMatmulConfig(group_unroll=8, max_concurrent_steps=2),
    "u2_s1": QuantMatmulConfig(group_unroll=2, num_k_splits=1),
    "u2_s2": QuantMatmulConfig(group_unroll=2, num_k_splits=2),
    "u2_s4": QuantMatmulConfig(group_unroll=2, num_k_splits=4),
    "u2_s8": QuantMatmulConfig(group_unroll=2, num_k_splits=8),
    # the group's scale (and offset) applied to the tile in registers, one accumulator for all K
    "pre128": QuantMatmulConfig(prescale=True, prescale_tile_k=128),
    "pre256": QuantMatmulConfig(prescale=True, prescale_tile_k=256),
    "pre512": QuantMatmulConfig(prescale=True, prescale_tile_k=512),
}


def main():
    only = [v for v in os.environ.get("ONLY", "").split(",") if v]
    copy = copy_bandwidth()
    out = {"copy_GBps": copy / 1e9, "rows": ROWS, "shapes": []}
    print(f"copy {copy / 1e9:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    for k, n in DECODE_SHAPES:
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((ROWS, k), np.float32), jnp.bfloat16)
        row = {"K": k, "N": n}
        for sym in (False, True):
            qw = quantize(w, "int4", group_size=128, symmetric=sym)
            copies = max(2, -(-MIN_ROTATION_BYTES // weight_nbytes(qw)))
            qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw)))
            moved = weight_nbytes(qw) + x.nbytes + ROWS * n * 2
            for name, cfg in VARIANTS.items():
                if (only and name not in only) or (sym and name not in ("u1", "u2", "u4", "u4_d2", "pre128", "pre256", "pre512")):
                    continue
                key = f"{'sym' if sym else 'asym'}/{name}"
                try:
                    fn = lambda x, w, cfg=cfg: quantized_matmul(x, w, backend="pallas", config=cfg)  # noqa: E731
                    y = np.asarray(fn(x, qw), np.float32)
                    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    us = device_ms(rotated(fn), x, qws) / copies * 1e3
                    row[key] = {"us": us, "pct_copy": 100 * moved / (us * 1e-6) / copy, "rel_err": err}
                    print(f"K={k:6d} N={n:6d} {key:18s} {us:8.1f} us {row[key]['pct_copy']:5.1f}% of copy err {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    row[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                    print(f"K={k} N={n} {key}: {row[key]['error']}", flush=True)
        out["shapes"].append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "int4_sweep.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

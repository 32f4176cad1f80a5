"""GPU: XLA's GEMM at a decode step's few rows against the same product padded to 8 rows (session 24).

The quantized notebook (session 23) timed XLA's fp8 gate_up at 47.9 us for 1 row and 43.2 us for
8. Would padding x to 8 zero rows (and slicing the product back) make a bs=1 step's GEMMs faster?
Llama-3.1-8B's shapes, bf16 and per-channel int8 / fp8, CUPTI per call, weights rotated past the L2.
Answer (H100, session 24): XLA's GEMM is 2-9 us slower at 1 row than at 2-8 (int8 gate_up 51.5
against 43.3 us), but the engine never hands it one row: a GPU engine runs at least 8 slots
(atlasjax/engine.py), so its decode GEMMs already see 8 rows, and a bench with x padded in
models/layers.py measured the same TPOT (fp8 3.301 / 3.301 ms).

  JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_xla_rows.py     # -> $OUT/xla_rows.json
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, device_ms, rotated
from atlasjax.quantization import quantize
from pallas_kernels.quantized_matmul import quantized_matmul

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}


def product(fmt):
    if fmt == "bf16":
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return lambda x, w: quantized_matmul(x, w, out_dtype=jnp.bfloat16)


def padded(fn, rows):
    return lambda x, w: fn(jnp.pad(x, ((0, rows - x.shape[0]), (0, 0))), w)[:x.shape[0]]


def main():
    rng = np.random.default_rng(0)
    results = []
    for name in os.environ.get("SHAPES", ",".join(SHAPES)).split(","):
        k, n = SHAPES[name]
        w32 = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02)
        for fmt in os.environ.get("FORMATS", "bf16,fp8,int8").split(","):
            w = w32.astype(jnp.bfloat16) if fmt == "bf16" else quantize(w32, fmt)
            nbytes = sum(a.nbytes for a in jax.tree.leaves(w))
            copies = max(2, -(-MIN_ROTATION_BYTES // nbytes))
            ws = [jax.tree.map(jnp.copy, w) for _ in range(copies)]
            row = dict(proj=name, fmt=fmt, K=k, N=n)
            for rows in (1, 2, 4):
                x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
                row[f"m{rows}_us"] = device_ms(rotated(product(fmt)), x, ws) / copies * 1e3
                row[f"m{rows}_pad8_us"] = device_ms(rotated(padded(product(fmt), 8)), x, ws) / copies * 1e3
                y, yp = product(fmt)(x, w), padded(product(fmt), 8)(x, w)
                row[f"m{rows}_pad8_diff"] = float(jnp.abs(y.astype(jnp.float32) - yp.astype(jnp.float32)).max())
            x = jnp.asarray(rng.standard_normal((8, k), np.float32), jnp.bfloat16)
            row["m8_us"] = device_ms(rotated(product(fmt)), x, ws) / copies * 1e3
            print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
            results.append(row)
            del ws
    with open(f"{os.environ.get('OUT', '/tmp')}/xla_rows.json", "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()

"""GPU: the unquantized projections' GEMM with the weight stored [K, N] (as the engine holds it, `jnp.dot`) against
[N, K] (the checkpoint's own order, both operands' minor dims contracted), bf16 out, at prefill row counts.

Session 85's fp8 prefill profile ran cuBLAS's GEMMs on the dequantized [N, K] copies 4-9% faster than the bf16
prefill's on [K, N] weights (gate_up 589 against 645 us at 2,048 rows): is the layout the reason?

  JAX_PLATFORMS=cuda python notebooks/gpu_bf16_layout.py     # -> $OUT/bf16_layout.json
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from atlasjax.bench_kernels_quant import device_ms

OUT = os.environ.get("OUT", "/tmp")
ROWS = [int(r) for r in os.environ.get("ROWS", "64,256,1024,2048,8192").split(",")]
SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o_proj": (4096, 4096)}   # (K, N)
COPIES = 2   # weights alternate, so a small GEMM does not read its weight from the L2

PATHS = {
    "kn (engine)": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16),
    "nk": lambda x, w: lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16),
}


def main():
    rng = np.random.default_rng(0)
    rows = []
    for name, (k, n) in SHAPES.items():
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        weights = {"kn (engine)": [w + i for i in range(COPIES)], "nk": [w.T + i for i in range(COPIES)]}
        for m in ROWS:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            for path, fn in PATHS.items():
                call = jax.jit(lambda x, ws, fn=fn: [fn(x, v) for v in ws])
                us = device_ms(call, x, weights[path]) * 1e3 / COPIES
                rows.append({"shape": name, "rows": m, "path": path, "us": us, "tflops": 2 * m * k * n / us / 1e6})
                print(json.dumps(rows[-1]), flush=True)
    with open(f"{OUT}/bf16_layout.json", "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

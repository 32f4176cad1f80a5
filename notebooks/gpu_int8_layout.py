"""GPU: does XLA's convert-fused int8 / fp8 GEMM read faster with the weight stored [K, N] (N
contiguous, as the bf16 weights are) than [N, K] (K contiguous, the QuantizedWeight layout)?

Decode rows (8), Llama-3.1-8B projection shapes, per-channel scales on the f32 output; weight
copies rotated past L2; CUPTI kernel time per call. bf16 [K, N] beside them for reference.

  JAX_PLATFORMS=cuda [FORMATS=int8,bf16] [LAYOUTS=nk] python notebooks/gpu_int8_layout.py
  (writes $OUT/int8_layout.json; XLA_FLAGS apply, e.g. --xla_gpu_exhaustive_tiling_search=true)
"""
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

from atlasjax.bench_kernels_quant import DECODE_SHAPES, MIN_ROTATION_BYTES, copy_bandwidth, device_ms, rotated

OUT = os.environ.get("OUT", "/tmp")
ROWS = 8
DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "bf16": jnp.bfloat16}
FORMATS = os.environ.get("FORMATS", ",".join(DTYPES)).split(",")
LAYOUTS = os.environ.get("LAYOUTS", "kn,nk").split(",")


def nk(x, w):   # w [N, K]: contract both K (the current QuantizedWeight layout)
    return lax.dot_general(x, w[0].astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32) * w[1]


def kn(x, w):   # w [K, N]
    return jnp.dot(x, w[0].astype(jnp.bfloat16), preferred_element_type=jnp.float32) * w[1]


res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": ROWS, "copy_Bps": copy_bandwidth(),
       "xla_flags": os.environ.get("XLA_FLAGS", "")}
key = jax.random.key(0)
for k, n in DECODE_SHAPES:
    x = jax.random.normal(key, (ROWS, k), jnp.bfloat16)
    s = jnp.ones((n,), jnp.float32)
    for fmt, dt in ((f, DTYPES[f]) for f in FORMATS):
        nbytes = k * n * jnp.dtype(dt).itemsize
        copies = max(2, -(-MIN_ROTATION_BYTES // nbytes))
        for layout, fn, shape in (("kn", kn, (k, n)), ("nk", nk, (n, k))):
            if (fmt == "bf16" and layout == "nk") or layout not in LAYOUTS:
                continue
            ws = [(jax.random.randint(jax.random.fold_in(key, i), shape, -127, 127).astype(dt), s)
                  for i in range(copies)]
            ms = device_ms(rotated(fn), x, ws) / copies
            res[f"{k}x{n}_{fmt}_{layout}"] = {"us": 1e3 * ms, "TBps": nbytes / (ms * 1e-3) / 1e12}
            print(f"{k}x{n} {fmt} {layout}: {1e3 * ms:.1f} us, {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s", flush=True)
            del ws
print(json.dumps(res, indent=1))
with open(f"{OUT}/int8_layout.json", "w") as fh:
    json.dump(res, fh, indent=1)

"""GPU: does XLA merge the int4 kernel's split sum and residual add with the RMSNorm after it?

An int4 decode layer runs "sum + residual" and "norm" as two XLA kernels after o_proj and after
down (session 29's profile). This jits that tail (the int4 o_proj on the engine's format, the
residual add, the next RMSNorm behind the optimization barrier the model puts there, and a later
consumer of the residual, as the MLP's residual add is) with the split partials summed as
`sum(axis=0)` or as explicit adds (`ATLASJAX_SPLIT_SUM=adds`), and prints the kernels XLA made and
their device time.

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks python notebooks/gpu_split_sum_fusion.py   # -> $OUT/split_sum_fusion.json
"""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import device_ms
from atlasjax.quantization import quantize
from models.deferred import rms_norm
from pallas_kernels.quantized_matmul import quantized_matmul

OUT = os.environ.get("OUT", "/tmp")
rng = np.random.default_rng(0)
K = N = 4096
w = quantize(jnp.asarray(rng.standard_normal((K, N), np.float32) * 0.02), "int4")
x = jnp.asarray(rng.standard_normal((8, K), np.float32), jnp.bfloat16)
res = jnp.asarray(rng.standard_normal((8, N), np.float32), jnp.bfloat16)
later = jnp.asarray(rng.standard_normal((8, N), np.float32), jnp.bfloat16)
scale = jnp.ones((N,), jnp.bfloat16)


def tail(x, w, res, later, scale):
    x_new = res + quantized_matmul(x, w, out_dtype=jnp.bfloat16)
    normed = jax.lax.optimization_barrier(rms_norm(x_new, scale, 1e-5))
    return normed, x_new + later


results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
for mode in ("reduce", "adds"):
    os.environ["ATLASJAX_SPLIT_SUM"] = mode
    fn = jax.jit(tail)
    text = fn.lower(x, w, res, later, scale).compile().as_text()
    entry = text[text.index("ENTRY"):]
    kernels = [line.strip()[:160] for line in entry.splitlines()
               if re.search(r"= \S+ (fusion|custom-call)\(", line)]
    out = fn(x, w, res, later, scale)
    results[mode] = {"kernels": len(kernels), "kernel_lines": kernels,
                     "us": round(device_ms(fn, x, w, res, later, scale, iterations=50) * 1e3, 2),
                     "normed_sum": float(jnp.sum(out[0].astype(jnp.float32)))}
    print(mode, results[mode]["kernels"], results[mode]["us"], *kernels, sep="\n  ", flush=True)
json.dump(results, open(f"{OUT}/split_sum_fusion.json", "w"), indent=1)

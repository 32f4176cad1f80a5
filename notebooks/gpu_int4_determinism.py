"""Is the int4 matmul the same bit for bit when run again on the same input? (session 44)

Greedy fingerprints of an int4 preset differed between processes (notebooks/gpu_greedy_fingerprint.py;
bf16 did not). This runs the engine's int4 entry (`quantized_matmul`: the fused kernel up to 32 rows,
the warp-specialized rows kernel past that, XLA's split sum) REPEATS times per shape on one input in one
process and counts the distinct results; a count above 1 is a race or an order-dependent reduction.

GPU: `JAX_PLATFORMS=cuda python notebooks/gpu_int4_determinism.py` (writes $OUT/int4_determinism.json)
CPU: `SMALL=1 python notebooks/gpu_int4_determinism.py` (interpret mode, tiny shapes, the fused kernel only).
"""
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.quantization import quantize
from pallas_kernels.quantized_matmul import quantized_matmul

REPEATS = int(os.environ.get("REPEATS", "30"))
SMALL = bool(os.environ.get("SMALL"))
# Llama-3.2-1B's projections (K, N): qkv, o_proj, gate_up, down
SHAPES = [(256, 256)] if SMALL else [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]
# SMALL: the fused kernel only; the rows kernel (past 32 rows) hung here in interpret mode (tests/test_rows_matmul.py)
ROWS = [3, 32] if SMALL else [1, 4, 8, 33, 64, 100, 190, 256, 512]

results = []
rng = np.random.default_rng(0)
for k, n in SHAPES:
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.02, "int4")
    for m in ROWS:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        f = jax.jit(lambda x, qw: quantized_matmul(x, qw, out_dtype=jnp.bfloat16, interpret=SMALL))
        digests = {}
        for _ in range(REPEATS):
            y = np.asarray(f(x, qw).astype(jnp.float32))
            d = hashlib.md5(y.tobytes()).hexdigest()
            digests[d] = digests.get(d, 0) + 1
        results.append(dict(k=k, n=n, rows=m, distinct=len(digests), counts=sorted(digests.values())))
        print(json.dumps(results[-1]), flush=True)
bad = [r for r in results if r["distinct"] > 1]
print(f"{len(bad)} of {len(results)} shapes gave more than one result")
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "int4_determinism.json"), "w") as fh:
        json.dump(results, fh, indent=1)

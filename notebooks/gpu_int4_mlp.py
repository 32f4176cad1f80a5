"""GPU: the persistent int4 MLP kernel (pallas_kernels/int4_mlp.py) against the engine's path.

Llama-3.1-8B's MLP (4096 -> 2 x 14336 -> 4096) on the engine's int4 (groups of 128, zero points,
mma order), random weights. At ROWS activation rows (default 8, then 1), weights rotated past the
L2, CUPTI time summed over each call's kernels (the gaps between kernels not counted, which
favours the paths with more kernels):
  engine   the int4 kernel on gate_up, XLA's silu x up, the int4 kernel on down (its K-split sum);
  fused    the persistent kernel (one launch, a grid barrier) and XLA's sum of its 7 partials;
  split    the same two phases as two launches (what interpret mode tests);
  engine_gate_up / gate_up_phase   the first half of each: gate_up and silu x up.
Also: each path's relative error against the jnp reference, and whether 50 calls of the fused
kernel on one input all give the same bits (a barrier that let a block read h early would not).

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks [ROWS=8,1] [CONFIGS=g4d4,g3d4] python notebooks/gpu_int4_mlp.py
  (-> $OUT/int4_mlp.json; CONFIGS: the kernel's pipeline depths, gate_up and down)
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, device_ms
from atlasjax.quantization import concat_quantized, quantize
from atlasjax.weights_summary import weight_nbytes
from models.deferred import SwiGLU
from pallas_kernels import int4_mlp
from pallas_kernels.quantized_matmul import quantized_matmul

OUT = os.environ.get("OUT", "/tmp")
ROWS = [int(r) for r in os.environ.get("ROWS", "8,1").split(",")]
# pipeline depths to try, "g<gate_up>d<down>" (the module's defaults first)
CONFIGS = os.environ.get("CONFIGS", f"g{int4_mlp.GATE_UP_DEPTH}d{int4_mlp.DOWN_DEPTH}").split(",")
H, I = 4096, 14336


def engine(x, gu, down):
    gate_up = quantized_matmul(x, gu, backend="pallas", out_dtype=jnp.bfloat16)
    return quantized_matmul(SwiGLU(gate_up).materialize(), down, backend="pallas", out_dtype=jnp.float32)


def fused(x, gu, down):
    return int4_mlp.int4_mlp_partials(x, gu, down).sum(0)


def split(x, gu, down):
    return int4_mlp.int4_mlp_partials(x, gu, down, phases="split").sum(0)


def gate_up_phase(x, gu, down):   # the first phase alone (h), against the engine's gate_up + silu x up
    return int4_mlp.int4_mlp_partials(x, gu, down, phases="gate_up")


def engine_gate_up(x, gu, down):
    return SwiGLU(quantized_matmul(x, gu, backend="pallas", out_dtype=jnp.bfloat16)).materialize()


def main():
    rng = np.random.default_rng(0)

    def q(k, n):
        return quantize(jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02), "int4")
    gu, down = concat_quantized([q(H, I), q(H, I)], 1), q(I, H)
    nbytes = weight_nbytes(gu) + weight_nbytes(down)
    copies = max(2, -(-MIN_ROTATION_BYTES // nbytes))
    weights = [jax.tree.map(jnp.copy, (gu, down)) for _ in range(copies)]
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "fits": int4_mlp.fits(8, gu, down),
               "weight_mb": round(nbytes / 1e6, 1)}
    print(results, flush=True)
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, H), np.float32), jnp.bfloat16)
        want = int4_mlp.int4_mlp_reference(x, gu, down)
        row = {}
        paths = [("engine", engine), ("engine_gate_up", engine_gate_up)]
        for config in CONFIGS:
            g, d = (int(v) for v in config[1:].split("d"))
            paths += [(f"{p}_{config}", fn, g, d) for p, fn in (("fused", fused), ("split", split),
                                                                 ("gate_up_phase", gate_up_phase))]
        for name, fn, *depths in paths:
            if depths:
                int4_mlp.GATE_UP_DEPTH, int4_mlp.DOWN_DEPTH = depths
                jax.clear_caches()   # traced again with these depths
                if not int4_mlp.fits(rows, gu, down):   # blocks that cannot all be resident would hang the barrier
                    row[name] = {"skipped": "does not fit two blocks per SM"}
                    continue
            try:
                got = jax.jit(fn)(x, gu, down)
                err = (float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) if got.shape == want.shape
                       else None)
                one = jax.jit(lambda x, ws, fn=fn: [fn(x, *w) for w in ws])
                row[name] = {"us": round(device_ms(one, x, weights) / copies * 1e3, 2), "rel_err": err}
            except Exception as e:   # reported, not fatal
                row[name] = {"error": str(e).splitlines()[0][:400]}
            print(rows, name, row[name], flush=True)
        first_config = f"fused_{CONFIGS[0]}"
        if "us" in row.get(first_config, {}):
            int4_mlp.GATE_UP_DEPTH, int4_mlp.DOWN_DEPTH = (int(v) for v in CONFIGS[0][1:].split("d"))
            jax.clear_caches()
            f = jax.jit(fused)
            first = np.asarray(f(x, gu, down))
            same = all(np.array_equal(np.asarray(f(x, gu, down)), first) for _ in range(50))
            row["fused_same_bits_in_50_calls"] = same
            print(rows, "same bits:", row["fused_same_bits_in_50_calls"], flush=True)
        results[f"rows_{rows}"] = row
    json.dump(results, open(f"{OUT}/int4_mlp.json", "w"), indent=1)


if __name__ == "__main__":
    main()

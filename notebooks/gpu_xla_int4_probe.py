"""GPU: XLA's own int4 GEMM at decode rows, against the engine's int4 kernel (session 52).

On an H200 the engine's int4 decode kernel streams the 8B projections at 41-68% of copy bandwidth
(qkv 41%, gate_up 68%, down 55%: docs/performance.md, session 52), where XLA's convert-fused fp8 GEMM
reaches 62-86%. XLA also takes s4 operands (jnp.int4) and, behind an experimental flag, fuses a
per-group (sub-channel) dequantization into its GEMM. Variants, CUPTI per call, weights rotated past
the L2 (as bench_kernels_quant does):
  engine        quantized_matmul on the engine's int4 (groups of 128, zero points, mma order)
  engine_sym    the same, symmetric groups
  xla_channel   s4 [K, N] with one scale per column applied after the dot (XLA's best case: no groups)
  xla_group     s4 with a bf16 scale per group of 128 along K, multiplied in before the dot
  xla_group_sub xla_group compiled with xla_gpu_experimental_enable_subchannel_dequantisation_fusion
  bf16          the bf16 dot
Each variant's kernels in the optimized HLO (gate_up) are listed, to see what XLA fused.

  JAX_PLATFORMS=cuda PYTHONPATH=. [ROWS=1,8,16] [SHAPES=qkv,gate_up] [VARIANTS=...] \
      python notebooks/gpu_xla_int4_probe.py     # -> $OUT/xla_int4.json
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, device_ms, weight_nbytes
from atlasjax.quantization import quantize
from pallas_kernels.quantized_matmul import quantized_matmul

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
GROUP = 128
SUBCHANNEL = {"xla_gpu_experimental_enable_subchannel_dequantisation_fusion": True}


def s4_weights(w32, per_group: bool):
    """(codes int4 [K, N], scales bf16 [K / GROUP, N] or [N]): symmetric, absmax / 7."""
    k, n = w32.shape
    if per_group:
        amax = np.abs(w32.reshape(k // GROUP, GROUP, n)).max(axis=1)
        scale = np.maximum(amax, 1e-8) / 7
        codes = np.clip(np.round(w32.reshape(k // GROUP, GROUP, n) / scale[:, None]), -8, 7).reshape(k, n)
    else:
        scale = np.maximum(np.abs(w32).max(axis=0), 1e-8) / 7
        codes = np.clip(np.round(w32 / scale), -8, 7)
    return {"codes": jnp.asarray(codes.astype(np.int8)).astype(jnp.int4), "scales": jnp.asarray(scale, jnp.bfloat16)}


def xla_channel(x, w):
    y = jnp.dot(x, w["codes"].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (y * w["scales"].astype(jnp.float32)).astype(jnp.bfloat16)


def xla_group(x, w):
    k, n = w["codes"].shape
    wf = (w["codes"].astype(jnp.bfloat16).reshape(k // GROUP, GROUP, n) * w["scales"][:, None, :]).reshape(k, n)
    return jnp.dot(x, wf, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    rng = np.random.default_rng(0)
    rows_list = [int(r) for r in os.environ.get("ROWS", "8").split(",")]
    wanted = os.environ.get("VARIANTS", "engine,engine_sym,xla_channel,xla_group,xla_group_sub,bf16").split(",")
    results = []
    for name in os.environ.get("SHAPES", ",".join(SHAPES)).split(","):
        k, n = SHAPES[name]
        w32 = rng.standard_normal((k, n), np.float32) * 0.02
        weights = {
            "engine": (quantize(w32, "int4"), lambda x, w: quantized_matmul(x, w), None),
            "engine_sym": (quantize(w32, "int4", symmetric=True), lambda x, w: quantized_matmul(x, w), None),
            "xla_channel": (s4_weights(w32, False), xla_channel, None),
            "xla_group": (s4_weights(w32, True), xla_group, None),
            "xla_group_sub": (s4_weights(w32, True), xla_group, SUBCHANNEL),
            "bf16": (jnp.asarray(w32, jnp.bfloat16), lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16), None),
        }
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            ref = np.asarray(x.astype(jnp.float32) @ jnp.asarray(w32))
            row = dict(proj=name, K=k, N=n, M=rows)
            for vname in wanted:
                w, fn, options = weights[vname]
                try:
                    nbytes = weight_nbytes(w) if hasattr(w, "qweight") else sum(a.nbytes for a in jax.tree.leaves(w))
                    if vname.startswith("xla"):   # an int4 array's nbytes counts bytes of storage, 2 codes each
                        nbytes = w["codes"].size // 2 + w["scales"].nbytes
                    copies = max(2, -(-MIN_ROTATION_BYTES // nbytes))
                    ws = [jax.tree.map(jnp.copy, w) for _ in range(copies)]
                    many = jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws], compiler_options=options)
                    one = jax.jit(fn, compiler_options=options)
                    y = np.asarray(one(x, w), np.float32)
                    us = device_ms(many, x, ws) * 1e3 / copies
                    row[vname] = dict(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                                      rel_err=round(float(np.linalg.norm(y - ref) / np.linalg.norm(ref)), 5))
                    if name == "gate_up":
                        hlo = one.lower(x, w).compile().as_text()
                        row[vname]["kernels"] = sorted({line.split("=")[0].strip() for line in hlo.splitlines()
                                                         if " fusion(" in line or "custom-call(" in line})[:8]
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    row[vname] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(f"{out_dir}/xla_int4.json", "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()

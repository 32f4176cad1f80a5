"""GPU: fp8 weights on the fp8 tensor cores in the decode matmul (session 32).

The engine's fp8 decode matmul converts each weight tile to bf16 in registers and feeds it to a
bf16 wgmma; a block cannot stream faster than that conversion (session 31: ~12 us per 256 KB at any
tile count). `fp8_mma` feeds the stored e4m3 tile to an fp8 wgmma from shared memory and stages the
activations as three e5m2 parts (pallas_kernels/fp8_parts.py). This times, at 8 rows, the four
Llama-3.1-8B layer projections and the LM head with the engine's config and its prologue or
residual, against the same with fp8_mma (wgmmas in flight 0 / 1, per-step f32 promotion, with and
without the one-block-per-SM padding), against XLA's convert-fused GEMM; and the relative error of
each against the f32 reference (the fp8 tensor cores keep ~14 bits of their running sum).

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks python notebooks/gpu_fp8_mma.py   # -> $OUT/fp8_mma.json
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, device_ms, rotated
from atlasjax.quantization import quantize
from pallas_kernels import decode_matmul as dm
from pallas_kernels.decode_matmul import decode_matmul, decode_matmul_reference
from pallas_kernels.decode_matmul_rules import default_config
from pallas_kernels.quantized_matmul import quantized_matmul

OUT = os.environ.get("OUT", "/tmp")
ONLY = os.environ.get("ONLY")   # one projection's name
M = 8
rng = np.random.default_rng(0)
results = {"device": jax.devices()[0].device_kind}
# name: (K, N, prologue / residual); the engine's fp8 route for each (models/layers.py)
SHAPES = {"qkv": (4096, 6144, "rms_norm"), "o_proj": (4096, 4096, "residual"), "down": (14336, 4096, "residual"),
          "down_swiglu": (14336, 4096, "swiglu"), "gate_up": (4096, 28672, None), "lm_head": (4096, 128256, None)}


def run(name, k, n, extra):
    xk = 2 * k if extra == "swiglu" else k
    x = jnp.asarray(rng.standard_normal((M, xk)), jnp.bfloat16)
    w = quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32), "fp8")
    kw = {}
    if extra == "rms_norm":
        kw["norm_scale"] = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
    elif extra == "swiglu":
        kw["swiglu"] = True
    residual = jnp.asarray(rng.standard_normal((M, n)), jnp.bfloat16) if extra == "residual" else None
    copies = max(2, -(-MIN_ROTATION_BYTES // (k * n)))
    ws = [jax.tree.map(jnp.copy, w) for _ in range(copies)]
    ref = decode_matmul_reference(x, w, residual, out_dtype=jnp.float32, **kw)
    base = default_config(n, extra == "swiglu", jnp.float8_e4m3fn, k)
    variants = {"convert": base}
    for tile_k in sorted({base.tile_k, 128, 256, 512}):
        if k % (base.k_split * tile_k) or (extra == "rms_norm" and tile_k > 256):
            continue
        for in_flight in (0, 1):
            variants[f"mma_k{tile_k}_f{in_flight}"] = dataclasses.replace(
                base, tile_k=tile_k, wgmmas_in_flight=in_flight, fp8_mma=True)
        variants[f"mma_k{tile_k}_promote"] = dataclasses.replace(base, tile_k=tile_k, fp8_mma=True, fp8_promote=True)
    row = results[name] = {"K": k, "N": n, "extra": extra, "base": str(base)}
    for pad in (True, False):
        dm.ONE_BLOCK_PER_SM_SMEM = 120 * 1024 if pad else 0
        for vname, cfg in variants.items():
            tag = f"{vname}/{'pad' if pad else 'nopad'}"
            try:
                dm.decode_matmul.clear_cache()
                fn = lambda x, w, cfg=cfg: decode_matmul(x, w, residual, config=cfg, **kw)   # noqa: E731
                y = fn(x, w).astype(jnp.float32)
                err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                us = device_ms(rotated(fn), x, ws) / copies * 1e3
                row[tag] = {"us": round(us, 2), "TB/s": round(k * n / us / 1e6, 3), "rel_err": err}
            except Exception as e:   # noqa: BLE001 - a config the kernel refuses, recorded
                row[tag] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(name, tag, row[tag], flush=True)
    if extra in (None, "residual"):
        def xla(x, w):
            y = quantized_matmul(x, w, backend="xla")
            return y if residual is None else residual + y
        y = xla(x, w).astype(jnp.float32)
        row["xla"] = {"us": round(device_ms(rotated(xla), x, ws) / copies * 1e3, 2),
                      "rel_err": float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))}
        print(name, "xla", row["xla"], flush=True)


for name, (k, n, extra) in SHAPES.items():
    if ONLY and name not in ONLY.split(","):
        continue
    run(name, k, n, extra)
    json.dump(results, open(f"{OUT}/fp8_mma.json", "w"), indent=1)

"""GPU: how XLA runs the int8 x int8 product of W8A8 int8, and which form of it is fastest (session 51).

XLA lowers an s8 x s8 dot to a Triton GEMM fusion that writes s32; the scales then multiply it in a
fusion of their own, which reads 4 bytes per output and writes 2. Variants, CUPTI per call over the
Llama-3.1-8B projections (the activations' quantization included unless said):
  lib           pallas_kernels/w8a8.py as the engine runs it (s32 out, then scales)
  f32_out       the dot asked for f32 out (the scales may fuse into the GEMM's epilogue)
  bf16_out      the dot asked for bf16 out
  lib_cublas    lib compiled with Triton GEMMs off (cuBLAS's int8 GEMM, where XLA takes it)
  lib_barrier   lib with an optimization barrier between the GEMM and the scales
  gemm_s32      the bare s8 x s8 -> s32 GEMM on ready codes
  gemm_cublas   the same with Triton GEMMs off
  bf16          the bf16 dot, for reference
The optimized HLO of each variant at the largest row count of gate_up goes to $OUT/hlo_int8_<v>.txt.

  JAX_PLATFORMS=cuda PYTHONPATH=. [ROWS=256,2048] [SHAPES=qkv,gate_up] [VARIANTS=lib,bf16] \
      python notebooks/gpu_int8_gemm_probe.py     # -> $OUT/int8_gemm.json
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from atlasjax.bench_kernels_quant import device_ms
from atlasjax.quantization import quantize
from pallas_kernels import w8a8

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
NO_TRITON = {"xla_gpu_enable_triton_gemm": False}
DIMS = (((1,), (1,)), ((), ()))


def scaled(out):
    def fn(x, qw):
        codes, sx = w8a8.per_token_int8(x)
        y = lax.dot_general(codes, qw.qweight, DIMS, preferred_element_type=out)
        return (y.astype(jnp.float32) * sx * qw.scales[0]).astype(jnp.bfloat16)
    return fn


def lib(x, qw):
    return w8a8.w8a8_matmul(x, qw, jnp.bfloat16)


def lib_barrier(x, qw):   # the s32 product out of reach of the GEMM's fusion: one epilogue kernel after it
    codes, sx = w8a8.per_token_int8(x)
    y = lax.optimization_barrier(lax.dot_general(codes, qw.qweight, DIMS, preferred_element_type=jnp.int32))
    return (y.astype(jnp.float32) * sx * qw.scales[0]).astype(jnp.bfloat16)


def gemm(codes, qw):
    return lax.dot_general(codes, qw.qweight, DIMS, preferred_element_type=jnp.int32)


VARIANTS = {   # name -> (fn, compiler options, takes ready codes)
    "lib": (lib, None, False),
    "f32_out": (scaled(jnp.float32), None, False),
    "bf16_out": (scaled(jnp.bfloat16), None, False),
    "lib_cublas": (lib, NO_TRITON, False),
    "lib_barrier": (lib_barrier, None, False),
    "gemm_s32": (gemm, None, True),
    "gemm_cublas": (gemm, NO_TRITON, True),
    "bf16": (None, None, False),
}


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    rng = np.random.default_rng(0)
    rows_list = [int(r) for r in os.environ.get("ROWS", "256,2048").split(",")]
    results = []
    for name in os.environ.get("SHAPES", ",".join(SHAPES)).split(","):
        k, n = SHAPES[name]
        w32 = rng.standard_normal((k, n), np.float32) * 0.02
        w = jnp.asarray(w32, jnp.bfloat16)
        qw = dataclasses.replace(quantize(w32, "int8"), activations="int8")
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            codes, _ = w8a8.per_token_int8(x)
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST))
            row = dict(proj=name, K=k, N=n, M=rows, tflop=2 * rows * k * n / 1e12)
            for vname, (fn, options, ready) in VARIANTS.items():
                if os.environ.get("VARIANTS") and vname not in os.environ["VARIANTS"].split(","):
                    continue
                try:
                    if fn is None:
                        jitted, args = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                                               .astype(jnp.bfloat16)), (x, w)
                    else:
                        jitted = jax.jit(fn, compiler_options=options) if options else jax.jit(fn)
                        args = (codes if ready else x, qw)
                    y = np.asarray(jitted(*args), np.float32)
                    us = device_ms(jitted, *args) * 1e3
                    entry = dict(us=round(us, 2), tflops=round(row["tflop"] / us * 1e6, 1))
                    if not ready:
                        entry["rel_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    row[vname] = entry
                    if name == "gate_up" and rows == max(rows_list):
                        hlo = jitted.lower(*args).compile().as_text()
                        with open(f"{out_dir}/hlo_int8_{vname}.txt", "w") as f:
                            f.write(hlo[:200000])
                        row[vname]["kernels"] = sorted({line.split("=")[0].strip() for line in hlo.splitlines()
                                                         if " fusion(" in line or "custom-call(" in line})
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    row[vname] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(f"{out_dir}/int8_gemm.json", "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()

"""GPU: does XLA multiply fp8 activations by fp8 weights on the fp8 tensor cores (int8 by int8 on the
int8 ones), and how much faster than the bf16 dot at prefill's row counts (sessions 50, 51)?

W8A8 as vLLM runs fp8 checkpoints: each activation row quantized to e4m3 with its own scale
(absmax / 448), the weight per output channel, the product accumulated in f32 and both scales
applied to it. Llama-3.1-8B's projections at 512-8,192 rows, CUPTI per call (the activations'
quantization included), against the bf16 dot, XLA's convert-fused W8A16 GEMM and the engine's
prefill path (`quantized_matmul`, auto); relative error of each to the f32 product of the bf16
inputs. Also records whether the optimized HLO calls cuBLASLt's fp8 GEMM.

FORMAT=int8 (session 51) quantizes the weights to int8 per channel instead; the variant "w8a8_lib" is
the library's product (pallas_kernels/w8a8.py) for either format.

  JAX_PLATFORMS=cuda PYTHONPATH=. [FORMAT=fp8|int8] [ROWS=512,2048] [SHAPES=qkv,down] \
      [VARIANTS=bf16,w8a8_bf16] python notebooks/gpu_w8a8_probe.py     # -> $OUT/w8a8_<format>.json
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
from pallas_kernels import w8a8 as w8a8_lib
from pallas_kernels.quant_format import with_mma_order
from pallas_kernels.quantized_matmul import quantized_matmul, xla_convert_matmul

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
E4M3_MAX = 448.0


def per_token_fp8(x):
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) / E4M3_MAX
    return (xf / scale).astype(jnp.float8_e4m3fn), scale


def w8a8(out):
    def fn(x, qw):
        xq, sx = per_token_fp8(x)
        y = lax.dot_general(xq, qw.qweight, (((1,), (1,)), ((), ())), preferred_element_type=out)
        return (y.astype(jnp.float32) * sx * qw.scales[0]).astype(jnp.bfloat16)
    return fn


def w8a8_dq(x, qw):   # the dequantize-then-dot pattern XLA's GEMM rewriter matches (unit scales)
    xq, sx = per_token_fp8(x)
    y = lax.dot_general(xq.astype(jnp.bfloat16), qw.qweight.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return (y * sx * qw.scales[0]).astype(jnp.bfloat16)


VARIANTS = {
    "bf16": lambda x, w, qw: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
    "w8a16_xla": lambda x, w, qw: xla_convert_matmul(x, qw).astype(jnp.bfloat16),
    "engine_auto": lambda x, w, qw: quantized_matmul(x, qw, out_dtype=jnp.bfloat16),
    "w8a8_f32": lambda x, w, qw: w8a8(jnp.float32)(x, qw),
    "w8a8_bf16": lambda x, w, qw: w8a8(jnp.bfloat16)(x, qw),
    "w8a8_dq": lambda x, w, qw: w8a8_dq(x, qw),
    "w8a8_lib": lambda x, w, qw: w8a8_lib.w8a8_matmul(x, dataclasses.replace(qw, activations=qw.format),
                                                      jnp.bfloat16),
    # the same on the weight as the engine stores it on a GPU (int8: mma order, K permuted in blocks)
    "w8a8_mma": lambda x, w, qw: w8a8_lib.w8a8_matmul(x, dataclasses.replace(qw, activations=qw.format),
                                                      jnp.bfloat16),
}


FORMAT = os.environ.get("FORMAT", "fp8")


def main():
    rng = np.random.default_rng(0)
    results = []
    hlo_notes = {}
    rows_list = [int(r) for r in os.environ.get("ROWS", "512,2048,8192").split(",")]
    for name in os.environ.get("SHAPES", ",".join(SHAPES)).split(","):
        k, n = SHAPES[name]
        w32 = rng.standard_normal((k, n), np.float32) * 0.02
        w = jnp.asarray(w32, jnp.bfloat16)
        qw = quantize(w32, FORMAT)
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                                     precision=lax.Precision.HIGHEST))
            row = dict(proj=name, K=k, N=n, M=rows, tflop=2 * rows * k * n / 1e12)
            wanted = os.environ.get("VARIANTS")
            for vname, v in VARIANTS.items():
                if wanted and vname not in wanted.split(","):
                    continue
                try:
                    fn = jax.jit(v)
                    q = with_mma_order(qw) if vname in ("w8a8_mma", "engine_auto") else qw
                    y = np.asarray(fn(x, w, q), np.float32)
                    us = device_ms(fn, x, w, q) * 1e3
                    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    row[vname] = dict(us=round(us, 2), tflops=round(row["tflop"] / us * 1e6, 1), rel_err=err)
                    if vname.startswith("w8a8") and vname not in hlo_notes:
                        hlo = fn.lower(x, w, q).compile().as_text()
                        hlo_notes[vname] = sorted({t for t in ("f8e4m3fn", "cublas$lt$matmul$f8", "__cublas$lt$matmul",
                                                              "__cublas$gemm", "__triton_gemm", "custom_call_target",
                                                              "s8[", "s32[", "__triton", "cutlass")
                                                  if t in hlo})
                        with open(f"{os.environ.get('OUT', '/tmp')}/hlo_{vname}.txt", "w") as f:
                            f.write(hlo[:200000])
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    row[vname] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(f"{os.environ.get('OUT', '/tmp')}/w8a8_{FORMAT}.json", "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, format=FORMAT, hlo=hlo_notes,
                       results=results), f, indent=1)
    print(json.dumps(hlo_notes))


if __name__ == "__main__":
    main()

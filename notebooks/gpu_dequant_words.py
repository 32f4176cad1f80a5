"""GPU: the prefill's dequantizing pass (`dequantize_nk`, pallas_kernels/quant_format.py) computed two bf16 values per
uint32 word (the engine's path since session 85) against one value per element (the formula before) and four codes
per uint32 input word (per-channel 8-bit only), alone and feeding the GEMM at ROWS rows (`dequantized_dot`).

Per weight shape (the 8B's projections) and format: CUPTI us of each pass and of each GEMM path, the pass's rate
((bytes read + written) / time), and whether each pass equals the element-wise one bit for bit on the GPU.

  JAX_PLATFORMS=cuda python notebooks/gpu_dequant_words.py     # -> $OUT/dequant_words.json
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from atlasjax.bench_kernels_quant import copy_bandwidth, device_ms
from atlasjax.quantization import quantize
from pallas_kernels.quant_format import dequantize_nk, group_scales, group_zeros, natural_codes

OUT = os.environ.get("OUT", "/tmp")
ROWS = int(os.environ.get("ROWS", "2048"))
SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o_proj": (4096, 4096)}   # (K, N)
SHAPES = {s: SHAPES[s] for s in os.environ.get("SHAPES", ",".join(SHAPES)).split(",")}
FORMATS = (("fp8", None, True), ("int8", None, True), ("int8", 32, True), ("int4", 128, False))


def elements(qw):
    """The formula before session 85: one bf16 element per thread."""
    k_pad, n_pad = qw.padded_shape
    g = qw.group_size
    q = natural_codes(qw).astype(jnp.float32).reshape(n_pad, k_pad // g, g)
    s = group_scales(qw).T[:, :, None]
    if qw.zeros is None:
        w = q * s
    else:
        z = group_zeros(qw).T[:, :, None]
        w = (q - z) * s if qw.zero_point else (q + 8.0) * s + z
    return w.reshape(n_pad, k_pad).astype(jnp.bfloat16)


def quads(qw):
    """Per-channel 8-bit codes read as uint32 words of four, written as two uint32 words."""
    q = natural_codes(qw)
    n, k = q.shape
    u = lax.bitcast_convert_type(q.reshape(n, k // 4, 4), jnp.uint32)
    s = group_scales(qw).T   # [N, 1]
    halves = []
    for i in range(4):
        code = lax.bitcast_convert_type(((u >> (8 * i)) & 0xFF).astype(jnp.uint8), q.dtype)
        v = (code.astype(jnp.float32) * s).astype(jnp.bfloat16)
        halves.append(lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32))
    words = jnp.stack([halves[0] | (halves[1] << 16), halves[2] | (halves[3] << 16)], -1)   # [N, K/4, 2]
    return lax.bitcast_convert_type(words, jnp.bfloat16).reshape(n, k)


PASSES = {"elements": elements, "words (engine)": lambda qw: dequantize_nk(qw, jnp.bfloat16), "quads": quads}


def gemm(dequant):
    def f(x, qw):
        w = dequant(qw)
        xp = jnp.pad(x, ((0, 0), (0, w.shape[1] - x.shape[1])))
        return lax.dot_general(xp, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return jax.jit(f)


def main():
    rng = np.random.default_rng(0)
    rows = []
    copy = copy_bandwidth()
    print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
    for name, (k, n) in SHAPES.items():
        w = rng.standard_normal((k, n), np.float32)
        x = jnp.asarray(rng.standard_normal((ROWS, k)), jnp.bfloat16)
        for fmt, g, sym in FORMATS:
            qw = quantize(w, fmt, group_size=g, symmetric=sym)
            label = f"{fmt}{'' if g is None else f'_g{g}'}"
            bits = 0.5 if fmt == "int4" else 1
            ref = np.asarray(jax.jit(elements)(qw).view(jnp.uint16))
            for path, fn in PASSES.items():
                if path == "quads" and qw.group_size != qw.padded_shape[0]:
                    continue
                us = device_ms(jax.jit(fn), qw) * 1e3
                same = bool(np.array_equal(np.asarray(jax.jit(fn)(qw).view(jnp.uint16)), ref))
                dot_us = device_ms(gemm(fn), x, qw) * 1e3
                rows.append({"shape": name, "format": label, "path": path, "pass_us": us, "same_bits": same,
                             "tb_s": (bits + 2) * n * k / us / 1e6, f"dot_{ROWS}_us": dot_us})
                print(json.dumps(rows[-1]), flush=True)
    with open(f"{OUT}/dequant_words.json", "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "copy_tb_s": copy / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

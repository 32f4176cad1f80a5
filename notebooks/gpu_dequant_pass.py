"""GPU: how fast XLA writes the bf16 copy of an 8-bit weight that the prefill path dequantizes (`dequantize_nk`,
pallas_kernels/quant_format.py), against variants of the same pass and the copy rate.

Per weight shape (the 8B's gate_up, down, qkv) and 8-bit format (fp8, int8 per channel; int8 in groups of 32), CUPTI
time of: the engine's pass (f32 math, one rounding), the same in bf16 math (the scale rounded to bf16 first: a
different result), the convert alone (no scale), the engine's values stored as uint32 words, and passes over a bf16
array of the output's size (bf16 multiply, uint16 xor, uint32 xor of its words). Effective rate = (bytes read +
bytes written) / time. SHAPES=gate_up,qkv picks shapes.

  JAX_PLATFORMS=cuda python notebooks/gpu_dequant_pass.py     # -> $OUT/dequant_pass.json
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import copy_bandwidth, device_ms
from atlasjax.quantization import quantize
from pallas_kernels.quant_format import dequantize_nk, natural_codes

OUT = os.environ.get("OUT", "/tmp")
SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144)}   # (K, N)
SHAPES = {s: SHAPES[s] for s in os.environ.get("SHAPES", ",".join(SHAPES)).split(",")}
FORMATS = (("fp8", None), ("int8", None), ("int8", 32))


def _per_channel(qw) -> bool:
    return qw.group_size == qw.padded_shape[0]


PATHS = {   # each a function of the weight (a jit argument, so XLA cannot fold the pass into a constant)
    "engine (f32 math)": lambda qw: dequantize_nk(qw, jnp.bfloat16),
    "bf16 math": lambda qw: natural_codes(qw).astype(jnp.bfloat16) * qw.scales[0][:, None].astype(jnp.bfloat16),
    "convert only": lambda qw: natural_codes(qw).astype(jnp.bfloat16),
    # the engine's values written as uint32 words, two bf16 each (whether the pass is bound by XLA's 2-byte stores)
    "f32 math, u32 stores": lambda qw: _as_words(dequantize_nk(qw, jnp.bfloat16)),
}


def _as_words(w):
    n, k = w.shape
    return jax.lax.bitcast_convert_type(w.reshape(n, k // 2, 2), jnp.uint32)


def main():
    rng = np.random.default_rng(0)
    rows = []
    copy = copy_bandwidth()
    print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
    for name, (k, n) in SHAPES.items():
        w = rng.standard_normal((k, n), np.float32)
        y = jnp.ones((n, k), jnp.bfloat16)
        for path, fn in {"bf16 -> bf16": lambda a: a * 2,
                         "uint16 xor": lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) ^ 1,
                         "uint32 xor": lambda a: _as_words(a) ^ 1}.items():
            us = device_ms(jax.jit(fn), y) * 1e3
            rows.append({"shape": name, "path": path, "us": us, "tb_s": 4 * n * k / us / 1e6})
            print(json.dumps(rows[-1]), flush=True)
        for fmt, g in FORMATS:
            qw = quantize(w, fmt, group_size=g)
            for path, fn in PATHS.items():
                if path == "bf16 math" and not _per_channel(qw):
                    continue
                us = device_ms(jax.jit(fn), qw) * 1e3
                rows.append({"shape": name, "format": f"{fmt}{'' if g is None else f'_g{g}'}", "path": path,
                             "us": us, "tb_s": 3 * n * k / us / 1e6})
                print(json.dumps(rows[-1]), flush=True)
    with open(f"{OUT}/dequant_pass.json", "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "copy_tb_s": copy / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

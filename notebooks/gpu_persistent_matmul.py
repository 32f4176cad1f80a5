"""GPU: the persistent decode matmul (pallas_kernels/persistent_matmul.py, session 27) against XLA's
convert-fused GEMM (the engine's path for gate_up) and the one-block-per-tile decode matmul
(pallas_kernels/decode_matmul.py, whole and tail-split), on Llama-3.1-8B's per-channel int8 / fp8
gate_up and LM head.

For each shape, format and row count: each kernel's median CUPTI time over weight copies that
rotate past the L2, its share of copy bandwidth, and its relative-norm error against the jnp
reference (`decode_matmul_reference`).

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks [SHAPES=gate_up,lm_head] [FORMATS=fp8,int8] \
      [ROW_COUNTS=1,8] python notebooks/gpu_persistent_matmul.py      # -> $OUT/persistent_matmul.json
"""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES
from atlasjax.quantization import quantize
from gpu_bf16_smem_gemv import start, time_paths, write   # copy bandwidth, timing loop, JSON
from pallas_kernels.decode_matmul import decode_matmul, decode_matmul_reference
from pallas_kernels.decode_matmul_rules import QUANT_CONFIG
from pallas_kernels.gemm_tiling import num_sms
from pallas_kernels.persistent_matmul import PersistentConfig, persistent_matmul
from pallas_kernels.quantized_matmul import quantized_matmul

SHAPES = {"gate_up": (4096, 28672), "lm_head": (4096, 128256)}
PERSISTENT = {f"persistent_k{k}_d{d}": PersistentConfig(tile_k=k, max_concurrent_steps=d)
              for k, d in ((256, 4), (256, 6), (256, 8), (512, 3), (512, 4))}
DECODE = {"decode_whole": QUANT_CONFIG,
          "decode_tail": dataclasses.replace(QUANT_CONFIG, k_split=2, tail_split_sms=num_sms())}


def main():
    copy = start()
    rng = np.random.default_rng(0)
    results = []
    for name in os.environ.get("SHAPES", "gate_up,lm_head").split(","):
        k, n = SHAPES[name]
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.float32)
        for fmt in os.environ.get("FORMATS", "fp8,int8").split(","):
            qw = quantize(w, fmt)
            copies = max(2, -(-MIN_ROTATION_BYTES // qw.qweight.nbytes))
            qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
            for rows in map(int, os.environ.get("ROW_COUNTS", "1,8").split(",")):
                x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
                ref = np.asarray(decode_matmul_reference(x, qw), np.float32)
                row = dict(proj=name, fmt=fmt, K=k, N=n, rows=rows, bytes=qw.qweight.nbytes)
                kernels = {"xla": lambda x, w: quantized_matmul(x, w)}
                kernels |= {key: (lambda x, w, c=c: decode_matmul(x, w, config=c)) for key, c in DECODE.items()}
                kernels |= {key: (lambda x, w, c=c: persistent_matmul(x, w, config=c)) for key, c in PERSISTENT.items()}
                time_paths(f"{name} {fmt} rows {rows}", kernels, x, qw, qws, ref, row, copy)
                results.append(row)
                write("persistent_matmul.json", copy, results)


if __name__ == "__main__":
    main()

"""GPU: the int4 decode matmuls against what they replace in the engine: the cluster kernel
(pallas_kernels/int4_decode_matmul.py, session 29, "fused") and the decode matmul's prescaled int4
path (pallas_kernels/decode_matmul.py, session 30, "matmul"; CONFIGS adds variants named
k<tile_k>_d<depth>_r<wgmmas in flight>[_s2][_staged], BLOCKS_PER_SM=2 drops its one-block-per-SM
padding); against the engine's default: the int4 kernel of pallas_kernels/quantized_matmul.py, XLA's sum of its K
split partials with the residual add, and (qkv) XLA's RMSNorm before it. Llama-3.1-8B's int4 qkv,
o_proj, down and gate_up (groups of 128, integer zero points, as quantize at load makes them).

For each shape and row count: the median CUPTI time of each path over weight copies that rotate
past the L2 (all kernels of the path), its share of copy bandwidth, its relative-norm error against
the jnp reference, and the K splits. x is one array for all copies, so XLA computes a norm
outside the kernel once per call ("unfused", "fused_no_norm"): add a norm kernel's time (~1.6 us in
the step) to compare those with "fused".

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks [ROW_COUNTS=1,8] [SPLITS=2,4,8] [SHAPES=qkv,lm_head] \
      [PATHS=unfused,matmul] [CONFIGS=k256_d6_r0,k512_d4_r0,k256_d4_r1_staged] [BLOCKS_PER_SM=2] \
      python notebooks/gpu_int4_decode_matmul.py      # -> $OUT/int4_decode_matmul[_<TAG>].json
"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES
from atlasjax.quantization import quantize
from gpu_bf16_smem_gemv import start, time_paths, write   # copy bandwidth, timing loop, JSON
from models.deferred import rms_norm
from pallas_kernels import decode_matmul as dm
from pallas_kernels import decode_matmul_rules as rules
from pallas_kernels.int4_decode_matmul import int4_decode_matmul, int4_decode_matmul_reference, num_splits
from pallas_kernels.quantized_matmul import quantized_matmul

# name: (K, N, fusion) as the 8B layer runs them
SHAPES = {"qkv": (4096, 6144, "norm"), "o_proj": (4096, 4096, "residual"), "gate_up": (4096, 28672, "norm"),
          "down": (14336, 4096, "residual"), "lm_head": (4096, 128256, None)}


def matmul_config(name, n, k):
    """k256_d4_r1[_s2][_staged] -> a DecodeMatmulConfig; "default": the one the engine would use."""
    if name == "default":
        return rules.default_config(n, w_dtype=jnp.int4, k=k)
    tile_k, depth, in_flight = map(int, re.match(r"k(\d+)_d(\d+)_r(\d+)", name).groups())
    return rules.DecodeMatmulConfig(tile_k=tile_k, max_concurrent_steps=depth, wgmmas_in_flight=in_flight,
                                    k_split=2 if "_s2" in name else 1, stage_weight="_staged" in name)


def main():
    if os.environ.get("BLOCKS_PER_SM") == "2":   # no padding: as many blocks per SM as fit
        dm.ONE_BLOCK_PER_SM_SMEM = 0
    copy = start()
    shapes = os.environ.get("SHAPES", "qkv,o_proj,gate_up,down").split(",")
    paths = os.environ.get("PATHS", "unfused,fused,matmul").split(",")
    configs = [c for c in os.environ.get("CONFIGS", "").split(",") if c]
    rng = np.random.default_rng(0)
    results = []
    for name in shapes:
        k, n, fusion = SHAPES[name]
        qw = quantize(rng.standard_normal((k, n), np.float32) * 0.02, "int4", group_size=128)
        copies = max(2, -(-MIN_ROTATION_BYTES // qw.qweight.nbytes))
        qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
        nbytes = qw.qweight.size // 2 + qw.scales.nbytes + qw.zeros.nbytes   # two codes per byte, group rows
        g = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
        for rows in map(int, os.environ.get("ROW_COUNTS", "1,8").split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            r = jnp.asarray(rng.standard_normal((rows, n), np.float32), jnp.bfloat16)
            fused = {"norm_scale": g, "norm_eps": 1e-5} if fusion == "norm" else {}
            res = r if fusion == "residual" else None
            ref = np.asarray(int4_decode_matmul_reference(x, qw, res, **fused), np.float32)
            row = dict(proj=name, K=k, N=n, rows=rows, bytes=nbytes, fusion=fusion, default_splits=num_splits(qw))

            def unfused(x, w):   # the engine's path before: XLA's norm, the int4 kernel, XLA's sum (+ residual)
                a = rms_norm(x, g, 1e-5) if fusion == "norm" else x
                y = quantized_matmul(a, w)
                return y if res is None else res + y
            kernels = {"unfused": unfused, "fused": lambda x, w: int4_decode_matmul(x, w, res, **fused),
                       "matmul": lambda x, w: dm.decode_matmul(x, w, res, **fused)}
            kernels = {key: f for key, f in kernels.items() if key in paths}
            for c in configs:
                config = matmul_config(c, n, k)
                if fusion == "norm" and (config.k_split > 1 or config.tile_k > rules.NORM_MAX_TILE_K):
                    kernels[f"matmul_{c}_no_norm"] = lambda x, w, config=config: dm.decode_matmul(
                        rms_norm(x, g, 1e-5), w, config=config)
                else:
                    kernels[f"matmul_{c}"] = lambda x, w, config=config: dm.decode_matmul(x, w, res, config=config, **fused)
            for s in map(int, os.environ.get("SPLITS", "").split(",") if os.environ.get("SPLITS") else []):
                kernels[f"fused_s{s}"] = lambda x, w, s=s: int4_decode_matmul(x, w, res, splits=s, **fused)
            if fusion == "norm" and "fused" in paths:
                kernels["fused_no_norm"] = lambda x, w: int4_decode_matmul(rms_norm(x, g, 1e-5), w)
            time_paths(f"{name} rows {rows} (splits {row['default_splits']})", kernels, x, qw, qws, ref, row, copy)
            results.append(row)
            tag = os.environ.get("TAG")
            write(f"int4_decode_matmul{'_' + tag if tag else ''}.json", copy, results)


if __name__ == "__main__":
    main()

"""GPU: decode attention + o_proj + residual add as the engine runs them now (the decode attention
kernel with its K/V write and split combine, XLA's o_proj GEMM, the residual add) against the
fused kernel pallas_kernels/attention_o_proj.py (one launch, its KV-head partials summed in the add).

Llama-3.1-8B shapes (32 q heads, 8 KV heads, head_dim 128, o_proj 4096 x 4096), 8 sequence slots,
page size 16. Prints the CUPTI time of all kernels of one layer's call (weights rotated past the
L2) per active-slot count and context length, and the largest difference of the fused output and
the written pages from the unfused path.
  JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_attention_o_proj.py
  [LENS=200,1000 ACTIVE=1,8 CONFIGS="256:64:64,128:64:64" (cols:tile_k:block_kv)]
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import device_ms
from pallas_kernels.attention_o_proj import attention_o_proj_pallas, pack_decode_tile
from pallas_kernels.paged_attention import paged_decode_attention_and_write

M, HEADS, KVH, D, PS, N = 8, 32, 8, 128, 16, 4096
COPIES = 4   # weight copies per call (4 x 32 MB: past the 50 MB L2)


def unfused(q, k, v, x, ws, kp, vp, table, lens):
    outs = []
    for w in ws:
        attn, kp, vp = paged_decode_attention_and_write(q, k, v, kp, vp, table, lens)
        outs.append(x + (attn.reshape(M, -1) @ w))
    return outs, kp, vp


def fused(cfg):
    cols, tile_k, block_kv = cfg

    def f(q, k, v, x, ws, kp, vp, table, lens):
        outs = []
        for w in ws:
            part, kp, vp, _ = attention_o_proj_pallas(pack_decode_tile(q, k, v), w, kp, vp, table, lens, cols=cols,
                                                      tile_k=tile_k, block_kv=block_kv)
            outs.append(x + part.sum(0)[:M].astype(x.dtype))
        return outs, kp, vp
    return f


def main():
    rng = np.random.default_rng(0)
    lens_list = [int(s) for s in os.environ.get("LENS", "200,1000").split(",")]
    active_list = [int(s) for s in os.environ.get("ACTIVE", "1,8").split(",")]
    configs = [tuple(int(p) for p in c.split(":")) for c in os.environ.get("CONFIGS", "256:64:64,128:64:64").split(",")]
    ws = [jnp.asarray(rng.standard_normal((HEADS * D, N), np.float32) * 0.02, jnp.bfloat16) for _ in range(COPIES)]
    for ctx in lens_list:
        pps = -(-ctx // PS) + 1
        num_pages = M * pps + 1
        kp = jnp.asarray(rng.standard_normal((KVH, num_pages, PS, D)), jnp.bfloat16)
        vp = jnp.asarray(rng.standard_normal((KVH, num_pages, PS, D)), jnp.bfloat16)
        table = jnp.asarray(rng.permutation(num_pages)[:M * pps].reshape(M, pps), jnp.int32)
        q = jnp.asarray(rng.standard_normal((M, HEADS, D)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((M, KVH, D)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((M, KVH, D)), jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
        copy_us = device_ms(jax.jit(lambda a, b: (a + 1, b + 1)), kp, vp) * 1e3
        print(f"ctx={ctx} copying both pools (each call below pays it once, not per weight copy): {copy_us:.2f} us",
              flush=True)
        for active in active_list:
            lens = jnp.asarray([ctx] * active + [0] * (M - active), jnp.int32)
            args = (q, k, v, x, ws, kp, vp, table, lens)
            base = jax.jit(unfused)
            us = device_ms(base, *args) / COPIES * 1e3
            ref_out, ref_k, ref_v = base(*args)
            print(f"ctx={ctx} active={active} unfused          {us:6.2f} us", flush=True)
            for cfg in configs:
                f = jax.jit(fused(cfg))
                try:
                    us = device_ms(f, *args) / COPIES * 1e3
                    out, k2, v2 = f(*args)
                except Exception as e:   # a config the kernel or the GPU rejects
                    print(f"ctx={ctx} active={active} fused {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                err = max(float(jnp.max(jnp.abs(a[:active].astype(jnp.float32) - b[:active].astype(jnp.float32))))
                          for a, b in zip(out, ref_out))
                same_pages = bool(jnp.all(k2 == ref_k)) and bool(jnp.all(v2 == ref_v))
                print(f"ctx={ctx} active={active} fused {cfg} {us:6.2f} us  maxdiff {err:.4f}  pages equal {same_pages}",
                      flush=True)


if __name__ == "__main__":
    main()

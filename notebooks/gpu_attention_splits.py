"""GPU: a bs=1 decode step's attention at short contexts, per number of context splits.

The engine splits each sequence's context into about one wave of programs (17 on an H100 for 8 KV
heads) and merges the splits in an XLA kernel after (1.4-1.6 us per layer, docs/performance.md).
At a short context most splits are empty: would one split (no merge kernel) or a few be as fast?
8 slots with one active (as the engine runs bs=1 on a GPU), Llama-3.1-8B's heads, page table of
max_model_len 1024, CUPTI time of every kernel of one call (attention and merge). Without the
fused K/V write: undonated here, its pools would be copied whole on every call.

Answer (H100, session 24): one split is slower at every length (7.65 against 6.59 us at 140
tokens); at 1,000 tokens 8 splits beat the default 16 (10.29 against 13.22 us).
Session 57 (H200; SLOTS rows of which ACTIVE hold the context): the default is 3 splits for 8 rows,
sized as if every row were active. A lone request at 4,096 tokens takes 34 us, 16.5 with 16 splits;
8 active rows take 41.5 with 3 and 49.7 with 16. No static count serves both
(docs/performance.md, session 57).

Session 70 (H200): at long contexts (32k-128k, one active row) with more splits, larger KV blocks and
deeper pipelines (BLOCKS, STAGES: each combination with each split count).

  JAX_PLATFORMS=cuda PYTHONPATH=. [LENS=140,256,1000] [MAX_LEN=1024] [SLOTS=8] [ACTIVE=1] [SPLITS=default,1,2,4,8] \
      [BLOCKS=default] [STAGES=default] [KV_DTYPE=bfloat16|float8_e4m3fn] python notebooks/gpu_attention_splits.py
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import device_ms
from pallas_kernels.paged_attention import paged_decode_attention

KV_HEADS = int(os.environ.get("KV_HEADS", 8))   # Llama-3.1-8B's 8 KV heads of 4 query heads; Qwen2.5-7B: 4 of 7
GROUP = int(os.environ.get("GROUP", 4))
HEAD_DIM, PAGE = 128, 16
SLOTS = int(os.environ.get("SLOTS", 8))      # the decode step's rows
MAX_LEN = int(os.environ.get("MAX_LEN", 1024))
ACTIVE = int(os.environ.get("ACTIVE", 1))   # slots with the context, of SLOTS
SPLITS = [None if s == "default" else int(s) for s in os.environ.get("SPLITS", "default,1,2,4,8").split(",")]
BLOCKS = [None if s == "default" else int(s) for s in os.environ.get("BLOCKS", "default").split(",")]
STAGES = [None if s == "default" else int(s) for s in os.environ.get("STAGES", "default").split(",")]
KV_DTYPE = jnp.dtype(os.environ.get("KV_DTYPE", "bfloat16"))   # float8_e4m3fn: an fp8 KV cache's pages


def main():
    pages = SLOTS * MAX_LEN // PAGE
    keys = jax.random.split(jax.random.key(0), 3)   # on the device: long contexts' pools are GBs
    kp, vp = (jax.random.normal(k, (KV_HEADS, pages, PAGE, HEAD_DIM), jnp.bfloat16).astype(KV_DTYPE)
              for k in keys[:2])
    table = jnp.arange(pages, dtype=jnp.int32).reshape(SLOTS, -1)
    q = jax.random.normal(keys[2], (SLOTS, KV_HEADS * GROUP, HEAD_DIM), jnp.bfloat16)
    configs = [(n, b, st) for n in SPLITS for b in BLOCKS for st in STAGES]
    results = []
    for length in map(int, os.environ.get("LENS", "140,256,1000").split(",")):
        lens = jnp.zeros((SLOTS,), jnp.int32).at[:ACTIVE].set(length)
        row = dict(context=length, rows=SLOTS, active=ACTIVE)
        ref = None
        for splits, block, stages in configs:
            fn = jax.jit(lambda q, kp, vp, n=splits, b=block, st=stages: paged_decode_attention(
                q, kp, vp, table, lens, backend="pallas", num_splits=n, block_kv=b, num_stages=st))
            name = f"splits_{splits or 'default'}" + "".join(f"_{k}{v}" for k, v in (("b", block), ("s", stages)) if v)
            try:
                out = np.asarray(fn(q, kp, vp), np.float32)
            except Exception as e:   # e.g. more shared memory than an SM has
                row[f"{name}_error"] = str(e).splitlines()[0][:200]
                continue
            ref = out if ref is None else ref
            name = f"splits_{splits or 'default'}" + "".join(f"_{k}{v}" for k, v in (("b", block), ("s", stages)) if v)
            row[f"{name}_us"] = round(device_ms(fn, q, kp, vp) * 1e3, 2)
            row[f"{name}_diff"] = float(np.abs(out - ref).max())
            kv_bytes = 2 * length * KV_HEADS * HEAD_DIM * KV_DTYPE.itemsize * ACTIVE
            row[f"{name}_TBps"] = round(kv_bytes / (row[f"{name}_us"] * 1e-6) / 1e12, 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    name = f"attention_splits_{SLOTS}_{ACTIVE}_{KV_DTYPE.name}_{KV_HEADS}x{GROUP}"
    with open(f"{os.environ.get('OUT', '/tmp')}/{name}.json", "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()

"""ragged_paged_attention: the Pallas kernel (interpret mode on CPU, native on a GPU) and its
jnp reference against a naive dense causal attention over contiguous per-sequence K/V.

Natively: `JAX_PLATFORMS=cuda ATLASJAX_TEST_GPU=1 pytest -m gpu tests/test_ragged_attention.py`
(conftest defaults JAX_PLATFORMS to cpu; the full grid compiles 54 kernels, ~4 min on H100)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_attention import (ragged_paged_attention,
                                             ragged_paged_attention_reference)

ON_GPU = jax.default_backend() == "gpu"
FULL_GRID = os.environ.get("ATLASJAX_TEST_GPU") == "1" and ON_GPU


def make_case(seed, chunks, *, max_seqs=None, pad_tokens=3, num_kv_heads=2, group=4,
              head_dim=64, page_size=16, dtype=jnp.bfloat16):
  """chunks: (context_len, q_len) per sequence; q_len < context_len is a prefix-cache hit or a
  later chunk. Extra slots (max_seqs) are unused; pad_tokens rows of padding follow."""
  rng = np.random.default_rng(seed)
  max_seqs = max_seqs or len(chunks)
  lens = np.zeros(max_seqs, np.int32)
  lens[: len(chunks)] = [c for c, _ in chunks]
  q_lens = np.zeros(max_seqs, np.int32)
  q_lens[: len(chunks)] = [n for _, n in chunks]
  query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  num_tokens = int(query_start[-1]) + pad_tokens
  pages_per_seq = max(1, -(-int(lens.max()) // page_size))
  num_pages = max_seqs * pages_per_seq + 2
  table = rng.permutation(num_pages)[: max_seqs * pages_per_seq].reshape(max_seqs, -1)
  q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
  k = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
  v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(table, jnp.int32), jnp.asarray(lens), jnp.asarray(query_start),
          jnp.asarray([len(chunks)], jnp.int32))


def dense_ragged(q, k_pages, v_pages, table, lens, query_start, num_seqs):
  """Naive f64 numpy causal attention over contiguous K/V built per sequence."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  table, lens, query_start = np.asarray(table), np.asarray(lens), np.asarray(query_start)
  num_heads, head_dim = q.shape[1:]
  num_kv_heads, _, page_size, _ = k_pages.shape
  out = np.zeros_like(q)
  for s in range(int(np.asarray(num_seqs).reshape(-1)[0])):
    start, end, n = query_start[s], query_start[s + 1], int(lens[s])
    tok = np.arange(n)
    pages = table[s, tok // page_size]
    for h in range(num_heads):
      kh = h // (num_heads // num_kv_heads)
      k, v = k_pages[kh, pages, tok % page_size], v_pages[kh, pages, tok % page_size]
      sc = q[start:end, h] @ k.T / np.sqrt(head_dim)  # [q_len, n]
      q_pos = n - (end - start) + np.arange(end - start)
      sc = np.where(tok[None, :] <= q_pos[:, None], sc, -np.inf)
      p = np.exp(sc - sc.max(axis=1, keepdims=True))
      out[start:end, h] = (p / p.sum(axis=1, keepdims=True)) @ v
  return out


def rel_err(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


CHUNKS = {
    # whole prompts of awkward lengths, a prefix-cache hit mid-page and a decode-like row
    "mixed": dict(chunks=[(17, 17), (40, 23), (3, 3), (1, 1)], max_seqs=6),
    "prefix_hit": dict(chunks=[(255, 100), (33, 1)]),
    "long": dict(chunks=[(513, 130), (70, 70)], max_seqs=3),
}


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("chunks", ["mixed", "prefix_hit"])
def test_reference_matches_dense(page_size, chunks):
  case = make_case(1, **CHUNKS[chunks], page_size=page_size, dtype=jnp.float32)
  out = np.asarray(ragged_paged_attention_reference(*case))
  assert np.all(np.isfinite(out))
  assert rel_err(out, dense_ragged(*case)) < 1e-5
  assert np.all(out[int(case[5][int(case[6][0])]):] == 0)  # padding rows


def _check_kernel(chunks, interpret, **shape):
  case = make_case(hash((chunks, tuple(shape.items()))) % 1000, **CHUNKS[chunks], **shape)
  out = ragged_paged_attention(*case, backend="pallas", interpret=interpret)
  out = np.asarray(out.astype(jnp.float32))
  ref = np.asarray(ragged_paged_attention_reference(*case))
  assert np.all(np.isfinite(out))
  assert rel_err(out, ref) < 1e-2
  assert np.all(out[int(case[5][int(case[6][0])]):] == 0)  # padding rows


INTERPRET_CASES = [
    dict(chunks="mixed", group=4, head_dim=64, page_size=16),
    dict(chunks="prefix_hit", group=1, head_dim=128, page_size=64),
    dict(chunks="mixed", group=8, head_dim=256, page_size=16),
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_kernel_interpret(case):
  case = dict(case)
  _check_kernel(case.pop("chunks"), plgpu.InterpretGPUParams(), **case)


GPU_GRID = [dict(chunks=c, group=g, head_dim=d, page_size=p)
            for c in CHUNKS for g in (1, 4, 8) for d in (64, 128, 256) for p in (16, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native Mosaic GPU run needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_GRID if FULL_GRID else INTERPRET_CASES,
                         ids=lambda c: "-".join(map(str, c.values())))
def test_kernel_gpu(case):
  case = dict(case)
  _check_kernel(case.pop("chunks"), False, **case)


def test_auto_backend_on_cpu_uses_reference():
  case = make_case(2, [(9, 4)], dtype=jnp.float32)
  out = ragged_paged_attention(*case)
  if not ON_GPU:
    np.testing.assert_array_equal(out, ragged_paged_attention_reference(*case))

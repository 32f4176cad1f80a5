"""paged_decode_attention: the Pallas kernel (interpret mode on CPU, native on a GPU) and its
jnp reference against a naive dense attention over contiguous per-sequence K/V.

Natively: `JAX_PLATFORMS=cuda ATLASJAX_TEST_GPU=1 pytest -m gpu tests/test_paged_attention.py`
(conftest defaults JAX_PLATFORMS to cpu; the full grid compiles ~150 kernels, ~10 min on H100)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from models.rope import apply_rope
from pallas_kernels.paged_attention import (_plan, can_fuse_rope, paged_decode_attention,
                                            paged_decode_attention_and_write, paged_decode_attention_reference,
                                            paged_decode_attention_rope_and_write)
from pallas_kernels.rope import rope_from_tables, rope_tables

ON_GPU = jax.default_backend() == "gpu"
FULL_GRID = os.environ.get("ATLASJAX_TEST_GPU") == "1" and ON_GPU


def make_case(seed, lens, *, num_kv_heads=2, group=4, head_dim=64, page_size=16,
              dtype=jnp.bfloat16, spare_pages=3):
  """Random q/K/V with each sequence's pages scattered through the pool in random order."""
  rng = np.random.default_rng(seed)
  lens = np.asarray(lens, np.int32)
  pages_per_seq = max(1, -(-int(lens.max()) // page_size))
  num_pages = len(lens) * pages_per_seq + spare_pages
  table = rng.permutation(num_pages)[: len(lens) * pages_per_seq].reshape(len(lens), -1)
  q = rng.standard_normal((len(lens), num_kv_heads * group, head_dim))
  k = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
  v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(table, jnp.int32), jnp.asarray(lens))


def dense_decode(q, k_pages, v_pages, table, lens):
  """Naive f64 numpy attention over contiguous K/V built per sequence."""
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  num_seqs, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  out = np.zeros_like(q)
  for s in range(num_seqs):
    n = int(lens[s])
    if n == 0:
      continue
    tok = np.arange(n)
    pages = np.asarray(table)[s, tok // page_size]
    for h in range(num_heads):
      kh = h // (num_heads // num_kv_heads)
      k = k_pages[kh, pages, tok % page_size]  # [n, D]
      v = v_pages[kh, pages, tok % page_size]
      sc = k @ q[s, h] / np.sqrt(head_dim)
      p = np.exp(sc - sc.max())
      out[s, h] = (p / p.sum()) @ v
  return out


def rel_err(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


LENS = {"mixed": [17, 0, 255, 1], "short": [1, 3], "long_short": [513, 3, 0], "single_long": [513]}


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("lens", ["mixed", "long_short"])
def test_reference_matches_dense(page_size, lens):
  case = make_case(1, LENS[lens], page_size=page_size, dtype=jnp.float32)
  out = paged_decode_attention_reference(*case)
  assert np.all(np.isfinite(np.asarray(out)))
  assert rel_err(out, dense_decode(*case)) < 1e-5
  assert np.all(np.asarray(out)[np.asarray(case[4]) == 0] == 0)


def _run_case(check, case, interpret):
  """A parametrized case dict: check(lens, interpret, num_splits, **shape)."""
  case = dict(case)
  check(case.pop("lens"), interpret, case.pop("num_splits", None), **case)


def _check_kernel(lens, interpret, num_splits=None, **shape):
  case = make_case(hash((lens, tuple(shape.items()))) % 1000, LENS[lens], **shape)
  out = paged_decode_attention(*case, backend="pallas", interpret=interpret,
                               num_splits=num_splits)
  out = np.asarray(out.astype(jnp.float32))
  ref = np.asarray(paged_decode_attention_reference(*case))
  assert np.all(np.isfinite(out))
  assert rel_err(out, ref) < 1e-2
  assert np.all(out[np.asarray(case[4]) == 0] == 0)  # inactive slots


# A representative subset for CPU interpret mode (each case is seconds).
INTERPRET_CASES = [
    dict(lens="mixed", group=4, head_dim=64, page_size=16),
    dict(lens="mixed", group=4, head_dim=64, page_size=16, num_splits=3),
    dict(lens="long_short", group=1, head_dim=128, page_size=64),
    dict(lens="long_short", group=8, head_dim=64, page_size=16, num_splits=2),
    # more splits than a short sequence has blocks: the empty splits' partials are never stored
    dict(lens="long_short", group=4, head_dim=64, page_size=16, num_splits=8),
    dict(lens="short", group=8, head_dim=256, page_size=16),
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_kernel_interpret(case):
  _run_case(_check_kernel, case, plgpu.InterpretGPUParams())


GPU_GRID = [dict(lens=l, group=g, head_dim=d, page_size=p, num_splits=ns)
            for l in LENS for g in (1, 4, 8) for d in (64, 128, 256) for p in (16, 64)
            for ns in (None, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native Mosaic GPU run needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_GRID if FULL_GRID else INTERPRET_CASES,
                         ids=lambda c: "-".join(map(str, c.values())))
def test_kernel_gpu(case):
  _run_case(_check_kernel, case, False)


def test_auto_backend_on_cpu_uses_reference():
  case = make_case(2, [5, 0], dtype=jnp.float32)
  out = paged_decode_attention(*case)
  if not ON_GPU:
    np.testing.assert_array_equal(out, paged_decode_attention_reference(*case))


# ---- the decode step's entry: write the new token's K/V, then attend

def _check_write(lens, interpret, num_splits=None, seed=5, fused_write=True, **shape):
  """The kernel's pools equal the reference scatter's bit for bit, and its output matches
  attention over the written pools (the new token included)."""
  q, k_pages, v_pages, table, seq_lens = make_case(seed, LENS[lens], **shape)
  rng = np.random.default_rng(seed + 1)
  kv_shape = (q.shape[0], k_pages.shape[0], k_pages.shape[-1])
  k_new, v_new = (jnp.asarray(rng.standard_normal(kv_shape), k_pages.dtype) for _ in range(2))
  out, k_out, v_out = paged_decode_attention_and_write(q, k_new, v_new, k_pages, v_pages, table, seq_lens,
                                                       backend="pallas", interpret=interpret, num_splits=num_splits,
                                                       fused_write=fused_write)
  ref_out, k_ref, v_ref = paged_decode_attention_and_write(q, k_new, v_new, k_pages, v_pages, table, seq_lens,
                                                           backend="reference")
  np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))
  assert rel_err(out.astype(jnp.float32), ref_out) < 1e-2
  assert rel_err(ref_out, dense_decode(q, k_ref, v_ref, table, seq_lens)) < 1e-2
  lens_np = np.asarray(seq_lens)
  for s in np.flatnonzero(lens_np):   # each active sequence's new row landed at its last position
    p = lens_np[s] - 1
    page = np.asarray(table)[s, p // k_pages.shape[2]]
    np.testing.assert_array_equal(np.asarray(k_out[:, page, p % k_pages.shape[2]], np.float32),
                                  np.asarray(k_new[s], np.float32))
  changed = np.asarray(k_out != k_pages).any(axis=(0, 3))   # [num_pages, page_size]: rows written
  assert changed.sum() <= np.count_nonzero(lens_np)


WRITE_CASES = [
    dict(lens="mixed", group=4, head_dim=64, page_size=16),
    dict(lens="mixed", group=6, head_dim=64, page_size=16),   # the new K/V fill the 8-row tile exactly
    dict(lens="long_short", group=4, head_dim=128, page_size=16, num_splits=3),
    dict(lens="short", group=8, head_dim=64, page_size=64),
    dict(lens="mixed", group=4, head_dim=64, page_size=16, num_splits=8),
]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_write_kernel_interpret(case):
  _run_case(_check_write, case, plgpu.InterpretGPUParams())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native Mosaic GPU run needs a CUDA GPU")
@pytest.mark.parametrize("case", WRITE_CASES + [dict(lens="single_long", group=4, head_dim=128, page_size=16,
                                                     num_splits=4)],
                         ids=lambda c: "-".join(map(str, c.values())))
def test_write_kernel_gpu(case):
  _run_case(_check_write, case, False)


def test_write_reference_skips_inactive_slots():
  q, k_pages, v_pages, table, seq_lens = make_case(7, [0, 4], dtype=jnp.float32)
  k_new = jnp.ones((2, k_pages.shape[0], k_pages.shape[-1]))
  _, k_out, v_out = paged_decode_attention_and_write(q, k_new, k_new, k_pages, v_pages, table, seq_lens,
                                                     backend="reference")
  assert int(np.asarray(k_out != k_pages).any(axis=(0, 3)).sum()) == 1   # only sequence 1's row
  np.testing.assert_array_equal(np.asarray(k_out[:, table[1, 0], 3]), 1.0)


def test_write_with_a_full_query_tile_interpret():
  """64 query heads per KV head leave no spare tile rows: the entry scatters, then runs the kernel."""
  _check_write("short", plgpu.InterpretGPUParams(), group=64, head_dim=64, page_size=16)


def test_write_scatter_first_interpret():
  """fused_write=False: the entry scatters with XLA first, then runs the plain kernel."""
  _check_write("mixed", plgpu.InterpretGPUParams(), fused_write=False, group=4, head_dim=64, page_size=16)


def test_kernel_bench_decode_write_rows():
  """The kernel bench's decode+write case (fused vs scatter first, a donated chain of layers) runs
  both paths; they compute the same attention exactly (interpret mode here)."""
  from atlasjax.bench_kernels_attention import bench_decode_write
  rows = []
  bench_decode_write(2, 32, rows, layers=2, backend="interpret", num_kv_heads=2, reps=1)
  assert [r["impl"] for r in rows] == ["fused write (kernel)", "XLA scatter + kernel"]
  assert all("error" not in r and r["us"] > 0 for r in rows) and rows[1]["rel_err"] == 0.0


# ---- from the raw projections: RoPE in the kernel, then the write and attention

def _inv_freq(head_dim):
  return 1.0 / (500000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


@pytest.mark.parametrize("scale", [1.0, 1.1386])   # 1.1386: yarn's attention factor for factor 4
def test_rope_tables_rotate_as_apply_rope(scale):
  """The tables' rotation is the model's apply_rope, bit for bit (the CPU path of the fused entry)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 5, 128)), jnp.bfloat16)
  positions = jnp.array([0, 7, 4095])
  tables = rope_tables(positions, _inv_freq(128), scale)
  np.testing.assert_array_equal(np.asarray(rope_from_tables(x, tables), np.float32),
                                np.asarray(apply_rope(x, positions, _inv_freq(128), scale), np.float32))
  assert np.all(np.asarray(tables[:, :, 1]) == np.array([1.0, 0.0])[None, :, None])   # V rows stay as they are


def _check_rope_write(lens, interpret, num_splits=None, seed=11, **shape):
  """The fused entry's output and pools match the same step with q and k rotated first (reference
  backend): K/V rows within one bf16 rounding of the rotation, output within bf16 attention error."""
  _, k_pages, v_pages, table, seq_lens = make_case(seed, LENS[lens], **shape)
  num_kv_heads, head_dim = k_pages.shape[0], k_pages.shape[-1]
  num_heads = num_kv_heads * shape["group"]
  rng = np.random.default_rng(seed + 1)
  qkv = jnp.asarray(rng.standard_normal((len(LENS[lens]), (num_heads + 2 * num_kv_heads) * head_dim)), jnp.bfloat16)
  tables = rope_tables(jnp.maximum(seq_lens - 1, 0), _inv_freq(head_dim))
  assert can_fuse_rope(num_heads, k_pages, head_dim)
  out, k_out, v_out = paged_decode_attention_rope_and_write(qkv, tables, k_pages, v_pages, table, seq_lens,
                                                            num_heads=num_heads, backend="pallas",
                                                            interpret=interpret, num_splits=num_splits)
  ref_out, k_ref, v_ref = paged_decode_attention_rope_and_write(qkv, tables, k_pages, v_pages, table, seq_lens,
                                                                num_heads=num_heads, backend="reference")
  np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))
  k_out, k_ref = np.asarray(k_out, np.float32), np.asarray(k_ref, np.float32)
  np.testing.assert_allclose(k_out, k_ref, rtol=2 ** -7, atol=1e-2)   # f32 rotation, one bf16 rounding
  assert np.asarray(k_out != np.asarray(k_pages, np.float32)).any(axis=(0, 3)).sum() == np.count_nonzero(seq_lens)
  assert rel_err(out.astype(jnp.float32), ref_out) < 1e-2
  assert np.all(np.asarray(out)[np.asarray(seq_lens) == 0] == 0)


ROPE_CASES = [
    # 4 query heads per KV head: odd KV heads' query rows start mid-tile (rows 4..7 of theirs)
    dict(lens="mixed", group=4, num_kv_heads=4, head_dim=128, page_size=16),
    dict(lens="long_short", group=4, num_kv_heads=4, head_dim=128, page_size=16, num_splits=3),
    # 12 per KV head: 16-row tiles, odd KV heads' query rows from row 4 of theirs
    dict(lens="short", group=12, num_kv_heads=4, head_dim=128, page_size=64),
    dict(lens="short", group=4, num_kv_heads=4, head_dim=256, page_size=16),
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_rope_write_kernel_interpret(case):
  _run_case(_check_rope_write, case, plgpu.InterpretGPUParams())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native Mosaic GPU run needs a CUDA GPU")
@pytest.mark.parametrize("case", ROPE_CASES + [dict(lens="single_long", group=4, num_kv_heads=8, head_dim=128,
                                                    page_size=16, num_splits=4)],
                         ids=lambda c: "-".join(map(str, c.values())))
def test_rope_write_kernel_gpu(case):
  _run_case(_check_rope_write, case, False)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (28, 4, 128), (4, 1, 128), (12, 2, 128)])
def test_rope_fusion_declines_shapes_it_cannot_tile(num_heads, num_kv_heads, head_dim):
  """head_dim 64 (halves narrower than a tile), projection rows not a multiple of 8 (Qwen2.5-7B's
  28 + 2 x 4), a query tile past the projections, query rows from row 6 of a tile (6 per KV head):
  the entry rotates first and runs the plain kernel, with the reference's result."""
  k_pages = jnp.zeros((num_kv_heads, 4, 16, head_dim), jnp.bfloat16)
  assert not can_fuse_rope(num_heads, k_pages, head_dim)
  rng = np.random.default_rng(3)
  k_pages = jnp.asarray(rng.standard_normal(k_pages.shape), jnp.bfloat16)
  qkv = jnp.asarray(rng.standard_normal((2, (num_heads + 2 * num_kv_heads) * head_dim)), jnp.bfloat16)
  table, lens = jnp.array([[0, 1], [2, 3]], jnp.int32), jnp.array([20, 3], jnp.int32)
  tables = rope_tables(lens - 1, _inv_freq(head_dim))
  args = (qkv, tables, k_pages, k_pages, table, lens)
  out, k_out, _ = paged_decode_attention_rope_and_write(*args, num_heads=num_heads, backend="interpret")
  ref, k_ref, _ = paged_decode_attention_rope_and_write(*args, num_heads=num_heads, backend="reference")
  np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_ref, np.float32))
  assert rel_err(out.astype(jnp.float32), ref) < 1e-2


def test_rope_entry_rejects_mismatched_projections():
  k_pages = jnp.zeros((2, 4, 16, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="bad projections"):
    paged_decode_attention_rope_and_write(jnp.zeros((2, 7 * 128)), jnp.zeros((2, 2, 2, 128)), k_pages, k_pages,
                                          jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32), num_heads=4)


def test_split_rows_sizes_the_default_splits_for_the_busy_rows_interpret():
  """A lone long context among idle rows (the engine's long-context decode program passes
  split_rows=1-2): the default splits are sized for those rows, more than for every row, and the
  result is still the reference's."""
  case = make_case(8, [1500, 0, 0, 0], num_kv_heads=8, group=1, head_dim=64, page_size=16)
  every_row = _plan(*case, None, "pallas", None, None, None, None)["num_splits"]
  busy_rows = _plan(*case, None, "pallas", None, None, None, 1)["num_splits"]
  waves = _plan(*case, None, "pallas", None, None, None, 0.25)["num_splits"]   # a quarter row: more waves
  assert every_row < busy_rows < waves and isinstance(waves, int)   # 3, 17, 24 (one per block of 64 tokens)
  four_heads = make_case(8, [5000, 0, 0, 0], num_kv_heads=4, group=1, head_dim=64, page_size=16)
  # a fraction of a row: the splits of one 8-head row (17) times 4, whatever the heads
  assert _plan(*four_heads, None, "pallas", None, None, None, 0.25)["num_splits"] == 66
  out = paged_decode_attention(*case, backend="pallas", interpret=plgpu.InterpretGPUParams(), split_rows=0.25)
  out = np.asarray(out.astype(jnp.float32))
  assert rel_err(out, np.asarray(paged_decode_attention_reference(*case))) < 1e-2
  assert np.all(out[1:] == 0)

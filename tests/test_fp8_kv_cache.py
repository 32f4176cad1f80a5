"""fp8 KV pages (`--kv-cache-dtype fp8`): the attention kernels over e4m3 / e5m2 pools against their
jnp references over the same pages, the saturating write, and the engine end to end.

The kernels convert each fp8 block to f16 in shared memory, exactly, so against the reference over
the same fp8 values they are as close as over bf16 pages. Natively:
`JAX_PLATFORMS=cuda pytest -m gpu tests/test_fp8_kv_cache.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_write import as_pool_dtype, write_kv
from pallas_kernels.paged_attention import (can_fuse_rope, paged_decode_attention, paged_decode_attention_and_write,
                                            paged_decode_attention_reference, paged_decode_attention_rope_and_write)
from pallas_kernels.ragged_attention import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.rope import rope_tables
from tests import test_paged_attention as decode_cases
from tests import test_ragged_attention as ragged_cases

ON_GPU = jax.default_backend() == "gpu"
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
INTERPRET = plgpu.InterpretGPUParams()


def as_fp8(case, kv_dtype, kv_index=(1, 2)):
  """A bf16 case tuple with its K/V pools stored in `kv_dtype`."""
  return tuple(as_pool_dtype(x, kv_dtype) if i in kv_index else x for i, x in enumerate(case))


def rel_err(out, ref):
  return decode_cases.rel_err(np.asarray(jnp.asarray(out, jnp.float32)), ref)


def test_write_saturates_instead_of_nan():
  """A value past fp8's range lands as its largest finite value (e4m3fn has no infinity: a plain
  cast would store NaN and poison every later score of the sequence)."""
  x = jnp.array([1e6, -1e6, 3.3, 0.0], jnp.float32)
  e4 = np.asarray(as_pool_dtype(x, E4M3), np.float32)
  assert e4.tolist() == [448.0, -448.0, 3.25, 0.0]
  assert np.asarray(as_pool_dtype(x, E5M2), np.float32)[:2].tolist() == [57344.0, -57344.0]
  pools = jnp.zeros((1, 2, 4, 2), E4M3)
  k_pages, _ = write_kv(pools, pools, jnp.full((1, 1, 2), 1e5), jnp.ones((1, 1, 2)), jnp.array([5]))
  assert np.asarray(k_pages, np.float32)[0, 1, 1].tolist() == [448.0, 448.0]


DECODE_CASES = [
    dict(lens="mixed", group=4, head_dim=64, page_size=16, kv_dtype=E4M3),
    dict(lens="long_short", group=4, head_dim=128, page_size=16, num_splits=3, kv_dtype=E4M3),
    dict(lens="short", group=8, head_dim=128, page_size=64, kv_dtype=E5M2),
]


def _check_decode(case, interpret):
  case = dict(case)
  lens, kv_dtype, num_splits = case.pop("lens"), case.pop("kv_dtype"), case.pop("num_splits", None)
  q, k_pages, v_pages, table, seq_lens = as_fp8(decode_cases.make_case(3, decode_cases.LENS[lens], **case), kv_dtype)
  assert k_pages.dtype == kv_dtype
  out = paged_decode_attention(q, k_pages, v_pages, table, seq_lens, backend="pallas", interpret=interpret,
                               num_splits=num_splits)
  ref = paged_decode_attention_reference(q, k_pages, v_pages, table, seq_lens)
  assert out.dtype == q.dtype and np.all(np.isfinite(np.asarray(out, np.float32)))
  assert rel_err(out, np.asarray(ref, np.float32)) < 1e-2
  assert np.all(np.asarray(out, np.float32)[np.asarray(seq_lens) == 0] == 0)


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_decode_kernel_over_fp8_pages_interpret(case):
  _check_decode(case, INTERPRET)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native Mosaic GPU run needs a CUDA GPU")
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_decode_kernel_over_fp8_pages_gpu(case):
  _check_decode(case, False)


def _check_decode_step_entries(interpret):
  """The decode step's entries over an fp8 pool, against the reference's pools bit for bit and its
  output within attention error: write + attend (the prepared tile's rows are 16-bit, so XLA's
  saturating scatter writes them), and from the raw projections (the kernel rotates the new K and
  writes the fp8 rows itself)."""
  q, k_pages, v_pages, table, seq_lens = as_fp8(
      decode_cases.make_case(9, decode_cases.LENS["mixed"], num_kv_heads=4, group=4, head_dim=128), E4M3)
  rng = np.random.default_rng(1)
  new = [jnp.asarray(rng.standard_normal((q.shape[0], 4, 128)), jnp.bfloat16) for _ in range(2)]
  got = paged_decode_attention_and_write(q, *new, k_pages, v_pages, table, seq_lens, backend="pallas",
                                         interpret=interpret)
  want = paged_decode_attention_and_write(q, *new, k_pages, v_pages, table, seq_lens, backend="reference")
  for a, b in zip(got[1:], want[1:]):
    assert a.dtype == E4M3
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert rel_err(got[0], np.asarray(want[0], np.float32)) < 1e-2

  assert can_fuse_rope(16, k_pages, 128)   # the kernel rotates the new K and writes fp8 rows itself
  qkv = jnp.asarray(rng.standard_normal((q.shape[0], 24 * 128)), jnp.bfloat16)
  qkv = qkv.at[0, 16 * 128].set(1e4)   # past e4m3's range: saturates at 448 (a plain cast would be NaN)
  tables = rope_tables(jnp.maximum(seq_lens - 1, 0), 1.0 / (500000.0 ** (jnp.arange(0, 128, 2) / 128)))
  got = paged_decode_attention_rope_and_write(qkv, tables, k_pages, v_pages, table, seq_lens, num_heads=16,
                                              backend="pallas", interpret=interpret)
  want = paged_decode_attention_rope_and_write(qkv, tables, k_pages, v_pages, table, seq_lens, num_heads=16,
                                               backend="reference")
  # V exactly; K rotated in f32 as XLA rotates it, up to one rounding: the same fp8 value, or (where
  # the rotations' last bits differ, as the GPU's fused multiply-adds make them) its neighbour
  np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))
  k_got, k_want = np.asarray(got[1], np.float32), np.asarray(want[1], np.float32)
  np.testing.assert_allclose(k_got, k_want, rtol=2 ** -3, atol=2 ** -9)
  assert np.count_nonzero(k_got != k_want) <= np.count_nonzero(seq_lens) * 4 * 128 // 8
  assert np.isfinite(np.asarray(got[1], np.float32)).all() and np.abs(np.asarray(got[1], np.float32)).max() == 448.0
  assert rel_err(got[0], np.asarray(want[0], np.float32)) < 1e-2


def test_decode_step_entries_over_fp8_pages_interpret():
  _check_decode_step_entries(INTERPRET)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native Mosaic GPU run needs a CUDA GPU")
def test_decode_step_entries_over_fp8_pages_gpu():
  _check_decode_step_entries(False)


RAGGED_CASES = [
    dict(chunks="mixed", group=4, head_dim=64, page_size=16, kv_dtype=E4M3),
    dict(chunks="prefix_hit", group=8, head_dim=128, page_size=16, kv_dtype=E5M2),
]


def _check_ragged(case, interpret):
  case = dict(case)
  chunks, kv_dtype = ragged_cases.CHUNKS[case.pop("chunks")], case.pop("kv_dtype")
  args = as_fp8(ragged_cases.make_case(5, **chunks, **case), kv_dtype)
  out = ragged_paged_attention(*args, backend="pallas", interpret=interpret)
  ref = ragged_paged_attention_reference(*args)
  valid = int(np.asarray(args[5])[int(np.asarray(args[6])[0])])
  assert out.dtype == args[0].dtype
  assert rel_err(out[:valid], np.asarray(ref[:valid], np.float32)) < 1e-2
  assert np.all(np.asarray(out, np.float32)[valid:] == 0)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_ragged_kernel_over_fp8_pages_interpret(case):
  _check_ragged(case, INTERPRET)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native Mosaic GPU run needs a CUDA GPU")
@pytest.mark.parametrize("case", RAGGED_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_ragged_kernel_over_fp8_pages_gpu(case):
  _check_ragged(case, False)


# ---- the engine over an fp8 pool (the jnp reference path on CPU) ------------------------------------

# Mean nats per token between the embedded SmolLM2's next-token distributions over an fp8 pool and over
# its float32 one, same weights, on test_quantized_models.PROMPTS (measured on this CPU: see
# docs/serving.md, "fp8 KV cache").
KV_KL_BOUNDS = {"fp8": 0.01, "fp8_e5m2": 0.03}   # measured 0.0066 and 0.0190


@pytest.fixture(scope="module")
def smollm2_f32(default_model_path):
    from atlasjax import LLM  # noqa: PLC0415
    return LLM(default_model_path, max_num_seqs=2, max_model_len=256)


@pytest.mark.parametrize("name", sorted(KV_KL_BOUNDS))
def test_mean_kl_of_an_fp8_pool(smollm2_f32, name):
    from atlasjax.engine_config import resolve_kv_cache_dtype  # noqa: PLC0415
    from tests.test_quantized_models import PROMPTS, _full_logprobs  # noqa: PLC0415
    engine = smollm2_f32.engine
    kv_dtype = resolve_kv_cache_dtype(name, jnp.float32)
    kls = []
    for prompt in PROMPTS:
        ids = smollm2_f32.tokenizer.encode(prompt)
        ref, got = (_full_logprobs(engine, ids, d) for d in (jnp.float32, kv_dtype))
        kls.append(np.sum(np.exp(ref) * (ref - got), axis=-1).mean())
    kl = float(np.mean(kls))
    print(f"KV {name}: mean KL {kl:.5f} nats/token")
    assert 0 < kl <= KV_KL_BOUNDS[name], kl


def test_engine_on_an_fp8_pool_answers_and_frees_its_pages(default_model_path):
    from atlasjax import LLM, SamplingParams  # noqa: PLC0415
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, kv_cache_dtype="fp8")
    pools = jax.tree.leaves(llm.engine.runner.state.kv)
    assert {x.dtype for x in pools} == {jnp.dtype(E4M3)}
    pool = llm.engine.pool
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text
    assert pool.num_free_pages == pool.num_pages and not llm.engine.has_unfinished()


def test_fp8_pool_pages_take_half_the_bytes():
    """What sizes the pool: an fp8 page holds the same tokens in half a bf16 page's bytes, so the same
    memory holds twice the pages."""
    from atlasjax.config import ModelConfig  # noqa: PLC0415
    from atlasjax.kv_budget import kv_bytes_per_page, kv_pool_pages  # noqa: PLC0415
    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
    bf16, fp8 = (kv_bytes_per_page(cfg, 16, d, 8) for d in (jnp.bfloat16, E4M3))
    assert bf16 == 2 * 32 * 8 * 16 * 128 * 2 and fp8 * 2 == bf16
    stats = {"bytes_limit": 80 << 30, "bytes_in_use": 20 << 30}
    assert kv_pool_pages(stats, fp8, 0, 0.9) == 2 * kv_pool_pages(stats, bf16, 0, 0.9)


def test_kv_cache_dtype_setting_and_flag():
    from atlasjax.__main__ import add_engine_args, engine_kwargs  # noqa: PLC0415
    from atlasjax.engine_config import EngineConfig, resolve_kv_cache_dtype  # noqa: PLC0415
    from atlasjax.errors import EngineConfigError  # noqa: PLC0415
    import argparse  # noqa: PLC0415
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--kv-cache-dtype", "fp8"])
    assert EngineConfig(**engine_kwargs(args)).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])
    with pytest.raises(EngineConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    assert resolve_kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert resolve_kv_cache_dtype("fp8", jnp.float32) == resolve_kv_cache_dtype("fp8_e4m3", jnp.bfloat16) == E4M3
    assert resolve_kv_cache_dtype("fp8_e5m2", jnp.bfloat16) == E5M2

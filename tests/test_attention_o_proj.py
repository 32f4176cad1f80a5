"""The experimental decode attention + o_proj kernel (pallas_kernels/attention_o_proj.py) against
its jnp reference, in Mosaic GPU interpret mode (small shapes; the kernel is not used by the model)."""
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention_o_proj import attention_o_proj_pallas, attention_o_proj_reference, pack_decode_tile


def _case(lens, heads=8, kv_heads=2, head_dim=64, page_size=16, n_out=512, seed=0):
    rng = np.random.default_rng(seed)
    m = len(lens)
    pages_per_seq = max(-(-max(lens) // page_size), 1)
    num_pages = m * pages_per_seq + 2
    table = rng.permutation(num_pages)[:m * pages_per_seq].reshape(m, pages_per_seq).astype(np.int32)
    pool = lambda: jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), jnp.bfloat16)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((heads * head_dim, n_out)) * 0.05, jnp.bfloat16)
    return (rand(m, heads, head_dim), rand(m, kv_heads, head_dim), rand(m, kv_heads, head_dim), w, pool(), pool(),
            jnp.asarray(table), jnp.asarray(lens, jnp.int32))


@pytest.mark.parametrize("lens", [[37, 0, 5], [1, 64]])
def test_kernel_matches_reference_interpret(lens):
    q, k, v, w, kp, vp, table, seq_lens = _case(lens)
    part, k2, v2, attn = attention_o_proj_pallas(pack_decode_tile(q, k, v), w, kp, vp, table, seq_lens,
                                                 interpret=plgpu.InterpretGPUParams())
    want, want_k, want_v = attention_o_proj_reference(q, k, v, w, kp, vp, table, seq_lens)
    got = part.sum(0)[:len(lens)]
    # bf16 attention rows feed the product on both sides: agreement within a few bf16 ulps
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)
    assert bool(jnp.all(k2 == want_k)) and bool(jnp.all(v2 == want_v))   # the new K/V landed, nothing else moved
    inactive = np.asarray(lens) == 0
    assert not np.any(np.asarray(got)[inactive])                         # an inactive slot yields zeros
    assert attn.shape == (8, q.shape[1] * q.shape[2])


def test_rejects_groups_wider_than_the_tile():
    q, k, v, w, kp, vp, table, seq_lens = _case([5], heads=18, kv_heads=2)
    with pytest.raises(ValueError, match="unsupported"):
        attention_o_proj_pallas(pack_decode_tile(q, k, v), w, kp, vp, table, seq_lens,
                                interpret=plgpu.InterpretGPUParams())

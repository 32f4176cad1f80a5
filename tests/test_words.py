"""pallas_kernels/words.py: 1- and 2-byte arrays viewed as uint32 words and back, bit for bit."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.words import as_words, from_words, packs, to_words


def _bits(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype,words", [(jnp.bfloat16, 4), (jnp.float16, 4), (jnp.float8_e4m3fn, 2), (jnp.int8, 2)])
def test_words_round_trip_every_bit(dtype, words):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 8)) * 3, dtype)
    w = to_words(x)
    assert w.dtype == jnp.uint32 and w.shape == (2, 5, words)
    back = from_words(w, dtype)
    assert back.dtype == jnp.dtype(dtype) and back.shape == x.shape
    np.testing.assert_array_equal(_bits(back), _bits(x))


def test_as_words_moves_rows_like_the_op_itself():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((7, 4, 8)), jnp.bfloat16)
    idx = jnp.array([6, 0, 3, 3])

    def fn(a):   # gather rows, swap the outer axes, zero one row: the minor axis stays whole
        return jnp.where(jnp.arange(4)[:, None, None] == 2, 0, a[idx].swapaxes(0, 1).swapaxes(0, 1))
    np.testing.assert_array_equal(_bits(as_words(fn, x)), _bits(fn(x)))


def test_what_does_not_pack_runs_as_it_is():
    assert not packs(jnp.zeros((3, 5), jnp.bfloat16))   # odd minor axis
    assert not packs(jnp.zeros((3, 4), jnp.float32))    # already words
    assert not packs(jnp.zeros((3, 6), jnp.int8))       # 6 bytes: not whole words
    x = jnp.arange(15, dtype=jnp.float32).reshape(3, 5)
    np.testing.assert_array_equal(as_words(lambda a: a[::-1], x), x[::-1])

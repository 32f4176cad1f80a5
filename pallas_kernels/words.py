"""1- and 2-byte arrays moved as uint32 words.

XLA's elementwise, gather, scatter and transpose kernels run one element per thread; on an H200 a
pass over bf16 elements writes ~3.3 TB/s against ~4.2 for the same bytes as 4-byte elements
(docs/performance.md, sessions 84-85). An op that leaves the minor axis whole (a gather or scatter of
rows, a transpose of the outer axes) can run on the array viewed as words, with half (bf16) or a
quarter (fp8) of the elements, and be viewed back after: the same bits.
"""
import jax
import jax.numpy as jnp
from jax import lax


def _per_word(dtype) -> int:
    return 4 // jnp.dtype(dtype).itemsize


def packs(x: jax.Array) -> bool:
    """Whether x's minor axis can be viewed as uint32 words (1- or 2-byte elements filling whole words)."""
    size = jnp.dtype(x.dtype).itemsize
    return size in (1, 2) and x.ndim > 0 and x.shape[-1] % (4 // size) == 0


def to_words(x: jax.Array) -> jax.Array:
    """[..., D] of a 1- or 2-byte dtype -> [..., D * itemsize / 4] uint32 (`packs(x)` must hold)."""
    per = _per_word(x.dtype)
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // per, per), jnp.uint32)


def from_words(w: jax.Array, dtype) -> jax.Array:
    """Inverse of `to_words`: [..., W] uint32 -> [..., W * 4 / itemsize] of `dtype`."""
    per = _per_word(dtype)
    return lax.bitcast_convert_type(w, dtype).reshape(*w.shape[:-1], w.shape[-1] * per)


def as_words(fn, x: jax.Array) -> jax.Array:
    """fn(x) computed on x viewed as words, where fn keeps the minor axis whole (it moves or selects
    rows, or zeroes them); fn(x) itself where x cannot be viewed so."""
    return from_words(fn(to_words(x)), x.dtype) if packs(x) else fn(x)

"""The warp-specialized int4 kernel for many rows (pallas_kernels/int4_rows_matmul.py) against the
jnp reference: in GPU interpret mode on small shapes here, natively (`gpu`) at Llama-3.1-8B's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.gguf_blocks import like_gguf
from atlasjax.quantization import quantize
from pallas_kernels import int4_rows_matmul as rows
from pallas_kernels.quant_format import dequantize

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")


def _error(m, k, n, *, symmetric=False, group_size=128, m_tile=64, seed=0, interpret=True, out_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32), "int4", group_size=group_size, symmetric=symmetric)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = rows.int4_rows_matmul(x, qw, m_tile=m_tile, interpret=interpret, out_dtype=out_dtype)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw), precision=jax.lax.Precision.HIGHEST))
    assert y.shape == (m, n) and y.dtype == out_dtype
    return float(np.linalg.norm(np.asarray(y, np.float32) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m,m_tile", [(3, 16), (130, 64)])
def test_interpret_matches_the_reference(symmetric, m, m_tile):
    # 130 rows: three M tiles, the last mostly padding; K = 384 (three groups); N = 200 pads to 256
    assert _error(m, 384, 200, symmetric=symmetric, m_tile=m_tile) < 4e-3   # the bf16 rounding of (q - z) s


def test_interpret_groups_of_256_and_bf16_output():
    assert _error(24, 512, 128, group_size=256, m_tile=24, out_dtype=jnp.bfloat16) < 6e-3


def test_what_it_does_not_take_is_refused():
    w = np.ones((256, 128), np.float32)
    assert not rows.fits(like_gguf(w, "Q4_K"))                               # two-level groups
    assert not rows.fits(quantize(w, "int4", group_size=64, symmetric=True))    # groups under a step
    assert not rows.fits(quantize(w, "int8"))
    assert rows.fits(quantize(w, "int4", group_size=128, symmetric=False))
    with pytest.raises(ValueError, match="does not take"):
        rows.int4_rows_matmul(jnp.zeros((4, 256), jnp.bfloat16), quantize(w, "int8"), interpret=True)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096)])
@pytest.mark.parametrize("m,m_tile", [(129, 128), (512, 128), (700, 256)])
def test_native_llama_8b_shapes(k, n, m, m_tile):
    assert _error(m, k, n, m_tile=m_tile, interpret=False, seed=m) < 4e-3

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


def test_tiles_of_256_rows_where_they_take_fewer_waves_and_fit():
    # the tile the H100 measured faster at the 8B's shapes (session 37), on 132 SMs
    picks = {(256, 28672): 256, (256, 4096): 128, (512, 4096): 128, (512, 6144): 256, (1024, 6144): 128,
             (1024, 4096): 256, (2048, 14336 // 2): 256}
    if rows.num_sms() == 132:
        assert {key: rows.m_tile_for(*key) for key in picks} == picks
    assert rows.m_tile_for(2048, 28672, jnp.float32) == 128   # f32 tiles of 256 rows do not fit beside the ring
    qw = quantize(np.ones((256, 128), np.float32), "int4", group_size=128, symmetric=True)
    assert rows.fits(qw, 256) and not rows.fits(qw, 256, jnp.float32) and rows.fits(qw, 128, jnp.float32)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096)])
@pytest.mark.parametrize("m,m_tile,out_dtype", [(129, 128, jnp.float32), (512, 128, jnp.bfloat16),
                                                (700, 256, jnp.bfloat16)])
def test_native_llama_8b_shapes(k, n, m, m_tile, out_dtype):
    assert _error(m, k, n, m_tile=m_tile, interpret=False, seed=m, out_dtype=out_dtype) < 6e-3

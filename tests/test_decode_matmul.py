"""The bf16 decode matmul kernel against jnp, and where the model routes its matmuls to it.

On CPU the Mosaic GPU kernel runs in GPU interpret mode; the `gpu` test runs the native kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers
from pallas_kernels import decode_matmul as dm
from pallas_kernels.decode_matmul import DecodeMatmulConfig, decode_matmul, decode_matmul_reference

ON_GPU = jax.default_backend() == "gpu"


def _operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    return x, w


def _assert_within_bf16_rounding(y, ref, *operands):
    """Equal up to two bf16 rounding steps of the largest value involved: the f32 sums of the kernel
    and of XLA's dot may round the product to neighbouring bf16 values (a different summation order
    on a GPU), and the residual's sum rounds once more; nothing more."""
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    big = np.maximum(np.abs(y), np.abs(ref))
    for a in operands:
        big = np.maximum(big, np.abs(np.asarray(a, np.float32)))
    big = np.maximum(big, np.finfo(np.float32).tiny)
    assert np.all(np.abs(y - ref) <= 2.0 ** (np.floor(np.log2(big)) - 6))


def _rel_err(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("config", [DecodeMatmulConfig(tile_k=64), DecodeMatmulConfig(tile_k=128, wgmmas_in_flight=1)],
                         ids=["k64", "k128_inflight1"])
def test_interpret_matches_reference(m, config):
    x, w = _operands(m, 256, 128, seed=m)
    y = decode_matmul(x, w, out_dtype=jnp.float32, config=config, interpret=True)
    assert y.shape == (m, 128) and y.dtype == jnp.float32
    assert _rel_err(y, decode_matmul_reference(x, w, out_dtype=jnp.float32)) < 1e-5   # both accumulate in f32


def test_interpret_bf16_output_and_default_tile():
    x, w = _operands(8, 512, 192)
    y = decode_matmul(x, w, interpret=True)   # out_dtype: x's (bf16); tile_k 256: two steps of K
    assert y.dtype == jnp.bfloat16
    assert _rel_err(y, decode_matmul_reference(x, w, out_dtype=jnp.float32)) < 4e-3   # one bf16 rounding


@pytest.mark.parametrize("m,k,n", [(8, 256, 100), (8, 200, 128), (33, 256, 128), (0, 256, 128)])
def test_rejects_shapes_it_cannot_stream(m, k, n):
    x, w = _operands(max(m, 1), k, n)
    with pytest.raises(ValueError, match="decode_matmul needs"):
        decode_matmul(x[:m], w, interpret=True)


@pytest.mark.parametrize("m", [3, 8])
def test_interpret_adds_the_residual_as_the_unfused_model_does(m):
    x, w = _operands(m, 512, 128, seed=m)
    r = jnp.asarray(np.random.default_rng(9).standard_normal((m, 128)), jnp.bfloat16)
    y = decode_matmul(x, w, r, config=DecodeMatmulConfig(tile_k=128, wgmmas_in_flight=1), interpret=True)
    # the product rounded to bf16, then the sum rounded, as `r + x @ w` rounds
    _assert_within_bf16_rounding(y, decode_matmul_reference(x, w, r), r, decode_matmul_reference(x, w))
    with pytest.raises(ValueError, match="residual"):
        decode_matmul(x, w, r[:, :64], interpret=True)


def test_pays_on_the_narrow_projections_only(monkeypatch):
    bf16 = jnp.bfloat16
    assert dm.pays(8, 4096, 6144, bf16, bf16)        # qkv
    assert dm.pays(8, 4096, 4096, bf16, bf16)        # o_proj
    assert dm.pays(8, 14336, 4096, bf16, bf16)       # down
    assert not dm.pays(8, 4096, 28672, bf16, bf16)   # gate_up: XLA streams it faster
    assert not dm.pays(8, 4096, 128256, bf16, bf16)  # LM head
    assert dm.pays(32, 4096, 4096, bf16, bf16)       # bs=32
    assert not dm.pays(8, 2048, 2048, bf16, bf16)    # Llama-3.2-1B's o_proj (32 tiles): no faster step
    assert not dm.pays(64, 4096, 4096, bf16, bf16)   # bs=64: a slower step
    assert not dm.pays(128, 4096, 4096, bf16, bf16)  # a prefill chunk
    assert not dm.pays(8, 4096, 4096, jnp.float32, jnp.float32)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")
    assert not dm.pays(8, 4096, 4096, bf16, bf16)


def test_model_matmul_routes_decode_rows_to_the_kernel(monkeypatch):
    """On a GPU, `models.layers.matmul` sends a bf16 decode matmul the rule accepts to the kernel
    (here in interpret mode, with the tile floor lowered to fit a small weight), and nothing else."""
    calls = []
    real = dm.decode_matmul

    def spy(x, w, residual=None, **kw):
        calls.append(x.shape)
        return real(x, w, residual, interpret=True, **kw)
    monkeypatch.setattr(layers, "_on_gpu", lambda: True)
    monkeypatch.setattr(dm, "MIN_TILES", 2)
    monkeypatch.setattr(dm, "decode_matmul", spy)
    x, w = _operands(8, 256, 128)
    r = jnp.ones((8, 128), jnp.bfloat16)
    y = layers.matmul(x, w, jnp.float32)
    assert calls == [(8, 256)]
    assert _rel_err(y, decode_matmul_reference(x, w, out_dtype=jnp.float32)) < 1e-5
    _assert_within_bf16_rounding(layers.matmul(x, w, residual=r), decode_matmul_reference(x, w, r), r,
                                decode_matmul_reference(x, w))
    layers.matmul(x.astype(jnp.float32), w.astype(jnp.float32))   # f32: XLA's dot
    layers.matmul(jnp.concatenate([x] * 5), w)                    # 40 rows: XLA's dot
    layers.matmul(x, w, decode_kernel=False)                      # a tensor-parallel partial sum
    assert calls == [(8, 256), (8, 256)]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("k,n", [(4096, 4096), (14336, 4096), (2048, 6144)])
def test_gpu_matches_reference(m, k, n):
    x, w = _operands(m, k, n)
    y = decode_matmul(x, w, out_dtype=jnp.float32)
    # f32 sums of up to 14336 products in another order than XLA's (tensor-core accumulation)
    assert _rel_err(y, decode_matmul_reference(x, w, out_dtype=jnp.float32)) < 1e-4

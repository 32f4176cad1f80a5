"""Fused dequantize-matmul kernels against the plain-jnp reference.

On CPU the Mosaic GPU kernel runs in GPU interpret mode (its wgmma reads the dequantized tile from
shared memory there); the `gpu` tests run the native kernel (register operand) on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.quantization import quantize
from pallas_kernels.quantized_matmul import QuantMatmulConfig, quantized_matmul, quantized_matmul_reference

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")

CASES = [  # (format, group_size, symmetric)
    ("int8", None, True),
    ("fp8", None, True),
    ("int4", 128, True),
    ("int4", 64, False),
    ("int8", 32, True),  # GGUF Q8_0 grouping
]


def _check(fmt, group_size, symmetric, m, k, n, seed=0, out_dtype=jnp.float32, **kwargs):
    kwargs.setdefault("prefill", "pallas")
    rng = np.random.default_rng(seed)
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32), fmt, group_size=group_size,
                  symmetric=symmetric)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = quantized_matmul(x, qw, backend="pallas", out_dtype=out_dtype, **kwargs)
    ref = np.asarray(quantized_matmul_reference(x, qw))
    assert y.shape == (m, n) and y.dtype == out_dtype
    y = np.asarray(y, np.float32)
    assert np.all(np.isfinite(y))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    # bf16 rounding of the weight tile at most (and of y when y is bf16)
    assert err < (4e-3 if out_dtype == jnp.float32 else 8e-3), (fmt, group_size, m, k, n, err)


def _ops_after_kernel(m, k, n, **kwargs):
    """Top-level ops of the jitted decode call (the kernel is one custom_vmap_call)."""
    qw = quantize(np.ones((k, n), np.float32), "int8")
    x = jnp.ones((m, k), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: quantized_matmul(x, w, backend="pallas", **kwargs))(x, qw)
    return [e.primitive.name for e in jaxpr.eqns[0].params["jaxpr"].eqns]


@pytest.mark.parametrize("fmt,group_size,symmetric", CASES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_interpret_matches_reference(fmt, group_size, symmetric, m):
    _check(fmt, group_size, symmetric, m, k=200, n=70, seed=m, interpret=True)


def test_interpret_k_splits_and_m_tiles():
    # K = 512 gives 4 steps of 128, split 2 ways; M = 64 with tile_m 16 gives 4 M tiles; N = 130
    # needs 3 tiles of 64 after padding.
    cfg = QuantMatmulConfig(num_k_splits=2, tile_m=16)
    _check("int8", None, True, 64, 512, 130, config=cfg, interpret=True, prefill="pallas")
    _check("int4", 128, False, 64, 512, 130, config=cfg, interpret=True, prefill="pallas")


@pytest.mark.parametrize("fmt,group_size,symmetric", CASES[:4])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_interpret_decode_y_from_kernel(fmt, group_size, symmetric, splits, m):
    # K = 300 pads to 512: 4 steps of 128 (8 of 64 for g64), one split or reduce-added from 4;
    # N = 70 pads to 128. bf16 y: written by the kernel (1 split) or cast from the f32 sum.
    _check(fmt, group_size, symmetric, m, k=300, n=70, seed=m + splits, out_dtype=jnp.bfloat16,
           config=QuantMatmulConfig(num_k_splits=splits), interpret=True)


def test_interpret_k_splits_f32_y_and_offset():
    # f32 y reduce-added from 2 splits; int4 asym starts from its offset term with and without splits.
    for splits in (1, 2):
        cfg = QuantMatmulConfig(num_k_splits=splits)
        _check("int8", None, True, 5, 512, 200, config=cfg, interpret=True)
        _check("int4", 64, False, 5, 512, 200, config=cfg, interpret=True)


def test_decode_has_no_epilogue():
    # Aligned decode (M = 8, K = K_pad, N = N_pad): no pad of x and nothing after the kernel, split or
    # not (tracing only: the GPU kernel is not compiled here).
    for splits in (1, 4):
        assert _ops_after_kernel(8, 1024, 128, config=QuantMatmulConfig(num_k_splits=splits)) == [
            "custom_vmap_call"]
    # Interpret mode has no clusters: its splits reduce-add into zeros, then y is cast.
    assert _ops_after_kernel(8, 256, 128, config=QuantMatmulConfig(num_k_splits=2), interpret=True) == [
        "broadcast_in_dim", "new_ref", "custom_vmap_call", "freeze", "convert_element_type"]
    ops = _ops_after_kernel(3, 200, 70, config=QuantMatmulConfig(num_k_splits=1))
    assert ops == ["jit", "custom_vmap_call", "slice"], ops  # the jit is jnp.pad


def test_interpret_prefill_xla_path():
    _check("int4", 128, True, 33, 256, 64, interpret=True, prefill="xla")
    _check("int4", 32, True, 3, 256, 64, interpret=True)  # int4 g32: no kernel layout, XLA path


def test_reference_backend_and_dtypes():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    qw = quantize(w, "int8")
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    y = quantized_matmul(x, qw, backend="reference")
    assert y.dtype == jnp.float32 and y.shape == (5, 40)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ w, rtol=0, atol=0.05 * np.abs(np.asarray(x) @ w).max())
    assert quantized_matmul(x.astype(jnp.bfloat16), qw, backend="reference").dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="K="):
        quantized_matmul(x[:, :64], qw)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt,group_size,symmetric", CASES)
@pytest.mark.parametrize("m,k,n", [(1, 200, 70), (3, 4096, 1000), (17, 1000, 4100), (64, 512, 256)])
def test_gpu_matches_reference(fmt, group_size, symmetric, m, k, n):
    _check(fmt, group_size, symmetric, m, k, n, seed=k + m)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt,group_size,symmetric", CASES)
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_decode_y_from_kernel(fmt, group_size, symmetric, splits, m):
    _check(fmt, group_size, symmetric, m, 1000, 300, seed=m, out_dtype=jnp.bfloat16,
           config=QuantMatmulConfig(num_k_splits=splits))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gpu_prefill(fmt):
    _check(fmt, 128 if fmt == "int4" else None, True, 300, 1024, 384, config=QuantMatmulConfig(tile_m=128),
           prefill="pallas")
    # M tiles over 16 rows: the K splits reduce-add (TMA) into a zeroed f32 y instead of a cluster.
    _check(fmt, 128 if fmt == "int4" else None, True, 40, 1024, 200, prefill="pallas",
           config=QuantMatmulConfig(tile_m=32, num_k_splits=2), out_dtype=jnp.bfloat16)

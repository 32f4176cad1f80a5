"""The int4 decode matmul (K split summed in the kernel, RMSNorm prologue, residual epilogue) against
jnp. On CPU the Mosaic GPU kernel runs in GPU interpret mode; the `gpu` test runs it natively."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.quantization import quantize
from models.deferred import rms_norm
from pallas_kernels import int4_decode_matmul as idm
from pallas_kernels.int4_decode_matmul import int4_decode_matmul, int4_decode_matmul_reference
from pallas_kernels.quantized_matmul import quantized_matmul_reference

ON_GPU = jax.default_backend() == "gpu"


def _operands(m, k, n, *, symmetric=False, seed=0):
    rng = np.random.default_rng(seed)
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.05, "int4", group_size=128, symmetric=symmetric)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    g = jnp.asarray(1.0 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
    return x, qw, r, g


def _rel_err(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("fused", ["plain", "residual", "norm_residual"])
def test_interpret_matches_reference(m, splits, fused):
    """The cluster's K splits summed in its first block, with each fusion, at awkward row counts."""
    x, qw, r, g = _operands(m, 1024, 128, seed=m + splits)
    kw = {"norm_scale": g, "norm_eps": 1e-5} if fused == "norm_residual" else {}
    res = r if fused != "plain" else None
    y = int4_decode_matmul(x, qw, res, out_dtype=jnp.float32, splits=splits, interpret=True, **kw)
    ref = int4_decode_matmul_reference(x, qw, res, out_dtype=jnp.float32, **kw)
    assert y.shape == (m, 128)
    assert _rel_err(y, ref) < 4e-3, _rel_err(y, ref)   # the sums of squares come from bf16 x * x


def test_interpret_symmetric_bf16_output_and_padded_n():
    """Symmetric groups, N not a multiple of 64 (padded columns cut off), bf16 out with the residual
    added after rounding, as `residual + x @ w` rounds."""
    x, qw, r, _ = _operands(5, 512, 100, symmetric=True, seed=3)
    y = int4_decode_matmul(x, qw, r, splits=2, interpret=True)
    assert y.shape == (5, 100) and y.dtype == jnp.bfloat16
    ref = int4_decode_matmul_reference(x, qw, r)
    assert _rel_err(y, ref) < 1e-2


def test_the_reference_is_the_unfused_model():
    """What the kernel computes is what the model computed before it: rms_norm, the int4 matmul, the add."""
    x, qw, r, g = _operands(3, 512, 64, seed=5)
    ref = int4_decode_matmul_reference(x, qw, r, norm_scale=g, norm_eps=1e-5, out_dtype=jnp.float32)
    unfused = r.astype(jnp.float32) + quantized_matmul_reference(rms_norm(x, g, 1e-5), qw)
    assert _rel_err(ref, unfused) < 1e-2


def test_default_splits_follow_the_int4_kernel():
    """~2 blocks per SM, each split at least 8 groups, at most a portable cluster."""
    qkv = quantize(np.zeros((4096, 6144), np.float32), "int4", group_size=128)
    gate_up = quantize(np.zeros((4096, 28672), np.float32), "int4", group_size=128)
    down = quantize(np.zeros((14336, 4096), np.float32), "int4", group_size=128)
    assert idm.num_splits(qkv) == 4 and idm.num_splits(down) == 4 and idm.num_splits(gate_up) == 1
    assert idm.num_splits(down, 16) <= idm.MAX_SPLITS


def test_takes_only_the_engine_int4_format():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 64)).astype(np.float32)
    assert idm.takes(8, quantize(w, "int4", group_size=128))
    assert not idm.takes(8, quantize(w, "int4", group_size=64))
    assert not idm.takes(8, quantize(w, "int8"))
    assert not idm.takes(idm.MAX_ROWS + 1, quantize(w, "int4", group_size=128))
    with pytest.raises(ValueError, match="int4 weight in mma order"):
        int4_decode_matmul(jnp.zeros((2, 512), jnp.bfloat16), quantize(w, "int4", group_size=64), interpret=True)
    x, qw, r, g = _operands(2, 512, 64)
    with pytest.raises(ValueError, match="residual"):
        int4_decode_matmul(x, qw, r[:, :32], interpret=True)
    with pytest.raises(ValueError, match="norm_scale"):
        int4_decode_matmul(x, qw, norm_scale=g[:256], interpret=True)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native kernel, distributed shared memory)")
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (4096, 28672)])
def test_gpu_matches_reference(m, k, n):
    x, qw, r, g = _operands(m, k, n, seed=m)
    for kw in ({}, {"norm_scale": g, "norm_eps": 1e-5}):
        y = int4_decode_matmul(x, qw, r, out_dtype=jnp.float32, **kw)
        ref = int4_decode_matmul_reference(x, qw, r, out_dtype=jnp.float32, **kw)
        assert _rel_err(y, ref) < 4e-3, (m, k, n, kw.keys(), _rel_err(y, ref))

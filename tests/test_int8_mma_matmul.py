"""The experimental int8 tensor-core matmul (pallas_kernels/int8_mma_matmul.py) against the
plain-jnp reference: interpret mode on CPU, the native kernel on a GPU (`JAX_PLATFORMS=cuda pytest ...`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.quantization import quantize
from pallas_kernels.int8_mma_matmul import LO_SCALE, Int8MmaConfig, int8_mma_matmul, split_activations, supports
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference

ON_GPU = jax.default_backend() == "gpu"


def _weight_and_x(m, k, n, seed=0, outlier=False):
    rng = np.random.default_rng(seed)
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.05, "int8")
    x = rng.standard_normal((m, k)).astype(np.float32)
    if outlier:  # an activation row with one channel 300x the rest, as LLM residual streams have
        x[0, 7] = 300.0
    return qw, jnp.asarray(x, jnp.bfloat16)


def test_activation_split_holds_more_than_bf16():
    _, x = _weight_and_x(5, 300, 64, outlier=True)
    parts, r = split_activations(x, 384)
    assert parts.dtype == jnp.int8 and parts.shape == (16, 384)
    assert int(jnp.abs(parts.astype(jnp.int32)).max()) <= 127
    back = (parts[:5].astype(jnp.float32) + parts[5:10].astype(jnp.float32) / LO_SCALE) * r[:, None]
    err = jnp.abs(back[:, :300] - x.astype(jnp.float32))
    assert float(jnp.max(err / r[:, None])) <= 0.5 / LO_SCALE + 2e-5  # half a lo step (plus f32 rounding of x / r)
    assert not np.any(np.asarray(parts[10:])) and not np.any(np.asarray(parts[:, 300:]))  # padding stays 0


@pytest.mark.parametrize("m,k,n,cfg", [
    (1, 256, 128, Int8MmaConfig(tile_k=128, max_concurrent_steps=2)),
    (3, 300, 70, Int8MmaConfig(tile_k=128)),                      # K and N padded by quantize
    (5, 512, 64, Int8MmaConfig(tile_k=256, num_k_splits=2)),      # split K, summed by XLA
])
def test_interpret_matches_reference(m, k, n, cfg):
    qw, x = _weight_and_x(m, k, n, seed=m, outlier=m == 3)
    y = np.asarray(int8_mma_matmul(x, qw, interpret=not ON_GPU, config=cfg, out_dtype=jnp.float32))
    ref = np.asarray(quantized_matmul_reference(x, qw))
    assert y.shape == (m, n)
    # the split activations carry ~15 bits per row: far inside bf16 rounding (4e-3)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-4


def test_backend_entry_and_what_it_refuses():
    qw, x = _weight_and_x(2, 256, 64)
    y = quantized_matmul(x, qw, backend="int8_mma", interpret=not ON_GPU, out_dtype=jnp.float32)
    ref = np.asarray(quantized_matmul_reference(x, qw))
    assert np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref) < 2e-4
    assert not supports(quantize(np.ones((256, 64), np.float32), "fp8"), 2)
    assert not supports(qw, 129)
    with pytest.raises(ValueError, match="per-channel int8"):
        int8_mma_matmul(jnp.ones((2, 256), jnp.bfloat16), quantize(np.ones((256, 64), np.float32), "int4"))

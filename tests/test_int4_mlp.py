"""The persistent int4 MLP kernel (pallas_kernels/int4_mlp.py) against the jnp reference.

On CPU its two phases run in GPU interpret mode as two calls (interpret mode has no grid barrier);
the `gpu` tests run the one-kernel form natively, barrier included, at Llama-3.1-8B's shapes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.quantization import concat_quantized, quantize
from pallas_kernels import int4_mlp

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel and its grid barrier)")


def _weights(hidden, inter, out, seed=0, symmetric=None):
    rng = np.random.default_rng(seed)

    def q(k, n):
        return quantize(jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.05), "int4", symmetric=symmetric)
    return concat_quantized([q(hidden, inter), q(hidden, inter)], 1), q(inter, out)


def _rel_err(got, want):
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


# (hidden, intermediate, out, down splits): as many gate_up pairs as down units, more pairs, more units
SHAPES = [(256, 512, 256, 2), (256, 1024, 256, 2), (256, 512, 512, 2)]


@pytest.mark.parametrize("hidden,inter,out,splits", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_interpreted_phases_match_reference(hidden, inter, out, splits, rows):
    gate_up, down = _weights(hidden, inter, out, seed=rows)
    assert int4_mlp.fits(rows, gate_up, down, splits)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, hidden)), jnp.bfloat16)
    partials = int4_mlp.int4_mlp_partials(x, gate_up, down, interpret=True, phases="split", splits=splits)
    assert partials.shape == (splits, rows, out) and partials.dtype == jnp.float32
    # the reference rounds gate_up and h to bf16 where the kernel does: agreement to f32 sums, or a
    # rare h element rounded the other way
    assert _rel_err(partials.sum(0), int4_mlp.int4_mlp_reference(x, gate_up, down)) < 1e-3


def test_fits_only_the_engine_int4_layout():
    gate_up, down = _weights(256, 1024, 256)
    assert int4_mlp.fits(8, gate_up, down)
    assert not int4_mlp.fits(17, gate_up, down)                                 # past decode rows
    assert not int4_mlp.fits(8, *_weights(256, 1024, 256, symmetric=True))      # no zero points
    assert not int4_mlp.fits(8, gate_up, quantize(jnp.ones((1024, 256)), "int8"))
    assert not int4_mlp.fits(8, gate_up, down, splits=3)                        # K steps not split evenly
    assert not int4_mlp.fits(8, *_weights(256, 512, 256))                       # 2 K steps, 4 splits
    assert int4_mlp.smem_bytes(8, 14336, int4_mlp.SPLITS) <= int4_mlp.SMEM_PER_BLOCK   # Llama-3.1-8B, 8 rows
    assert int4_mlp.smem_bytes(16, 14336, int4_mlp.SPLITS) > int4_mlp.SMEM_PER_BLOCK   # its h slice doubles
    assert int4_mlp.grid_size(14336, 4096, int4_mlp.SPLITS) == 256


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("hidden,inter,out,rows", [(4096, 14336, 4096, 8), (4096, 14336, 4096, 1),
                                                   (2048, 8192, 2048, 5), (256, 1024, 256, 8)])
def test_gpu_one_kernel_matches_reference_and_repeats_bit_for_bit(hidden, inter, out, rows):
    gate_up, down = _weights(hidden, inter, out, seed=rows)
    assert int4_mlp.fits(rows, gate_up, down)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, hidden)), jnp.bfloat16)
    fused = jax.jit(lambda x: int4_mlp.int4_mlp_partials(x, gate_up, down).sum(0))
    got = np.asarray(fused(x))
    assert _rel_err(got, int4_mlp.int4_mlp_reference(x, gate_up, down)) < 1e-3
    split = int4_mlp.int4_mlp_partials(x, gate_up, down, phases="split").sum(0)
    np.testing.assert_array_equal(got, np.asarray(split))   # the barrier let no block read h early
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(fused(x)), got)

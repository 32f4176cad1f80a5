"""The decode matmul kernel (bf16 weights and per-channel int8 / fp8 ones) against jnp, and its
input checks. Where the model routes its matmuls to it: tests/test_decode_routing.py.

On CPU the Mosaic GPU kernel runs in GPU interpret mode; the `gpu` test runs the native kernel.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.quantization import quantize
from models.deferred import SwiGLU, rms_norm
from pallas_kernels import decode_matmul as dm
from pallas_kernels import decode_matmul_rules as rules
from pallas_kernels.decode_matmul import decode_matmul, decode_matmul_reference
from pallas_kernels.decode_matmul_rules import DecodeMatmulConfig
from pallas_kernels.quant_format import with_mma_order
from pallas_kernels.quantized_matmul import quantized_matmul

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


def _prologue_operands(m, k, n, seed=0):
    """x [m, k] (a residual stream, larger than unit scale), gate | up [m, 2k], a norm scale near 1."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * 4, jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((m, 2 * k)) * 2, jnp.bfloat16)
    scale = jnp.asarray(1 + 0.2 * rng.standard_normal(k), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    return x, gate_up, scale, w


@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("config", [DecodeMatmulConfig(tile_k=128), DecodeMatmulConfig(tile_k=64, wgmmas_in_flight=1)],
                         ids=["k128", "k64_inflight1"])
def test_interpret_prologues_match_reference(m, config):
    """The RMSNorm and SwiGLU prologues (with a residual) against jnp rounded where the kernel rounds."""
    x, gate_up, scale, w = _prologue_operands(m, 256, 128, seed=m)
    r = jnp.asarray(np.random.default_rng(9).standard_normal((m, 128)), jnp.bfloat16)
    for a, kw in ((x, dict(norm_scale=scale, norm_eps=1e-5)), (gate_up, dict(swiglu=True))):
        y = decode_matmul(a, w, r, out_dtype=jnp.float32, config=config, interpret=True, **kw)
        assert y.shape == (m, 128)
        assert _rel_err(y, decode_matmul_reference(a, w, r, jnp.float32, **kw)) < 1e-5


def test_interpret_prologues_agree_with_the_unfused_model():
    """What a user would see: the fused RMSNorm and SwiGLU give the unfused model's product up to
    bf16 rounding. The kernel rounds x * scale and scales the f32 product by 1 / rms; the model
    rounds x / rms, then its product with scale, then the matmul: a few bf16 roundings apart."""
    x, gate_up, scale, w = _prologue_operands(8, 512, 128)
    y = decode_matmul(x, w, norm_scale=scale, norm_eps=1e-5, out_dtype=jnp.float32, interpret=True)
    unfused = decode_matmul_reference(rms_norm(x, scale, 1e-5), w, out_dtype=jnp.float32)
    assert _rel_err(y, unfused) < 6e-3
    y = decode_matmul(gate_up, w, swiglu=True, out_dtype=jnp.float32, interpret=True)
    unfused = decode_matmul_reference(SwiGLU(gate_up).materialize(), w, out_dtype=jnp.float32)
    assert _rel_err(y, unfused) < 6e-3


def test_prologue_argument_errors():
    x, gate_up, scale, w = _prologue_operands(8, 256, 128)
    with pytest.raises(ValueError, match="one prologue"):
        decode_matmul(gate_up, w, norm_scale=scale, swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="norm_scale"):
        decode_matmul(x, w, norm_scale=scale[:128], interpret=True)
    with pytest.raises(ValueError, match="gate | up"):
        decode_matmul(x, w, swiglu=True, interpret=True)


def _quantized(w, fmt):
    """fmt "int8mma": int8 stored in mma order (pallas_kernels/int8_mma_order.py)."""
    if fmt == "int8mma":
        return with_mma_order(quantize(w.astype(jnp.float32), "int8"))
    return quantize(w.astype(jnp.float32), fmt)


def _engine_product(act, qw):
    """What the engine's other decode path computes for act @ qw, in f32."""
    return quantized_matmul(act, qw, out_dtype=jnp.float32, backend="xla")


@pytest.mark.parametrize("fmt", ["int8", "int8mma", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 17])
@pytest.mark.parametrize("prologue", [None, "norm", "swiglu"])
def test_interpret_quantized_weights_match_reference(fmt, m, prologue):
    """Per-channel int8 / fp8 weights (converted to bf16 in the kernel, the channel scale on the f32
    product), with each prologue and the residual: as jnp computes it, and as the engine's other
    path (the convert fused into XLA's GEMM, then the scale) computes it, up to bf16 rounding."""
    x, gate_up, scale, w = _prologue_operands(m, 256, 128, seed=m)
    qw = _quantized(w, fmt)
    r = jnp.asarray(np.random.default_rng(9).standard_normal((m, 128)), jnp.bfloat16)
    a, kw, act = {None: (x, {}, x), "norm": (x, dict(norm_scale=scale, norm_eps=1e-5), rms_norm(x, scale, 1e-5)),
                  "swiglu": (gate_up, dict(swiglu=True), SwiGLU(gate_up).materialize())}[prologue]
    config = DecodeMatmulConfig(tile_k=128, wgmmas_in_flight=1)
    y = decode_matmul(a, qw, r, out_dtype=jnp.float32, config=config, interpret=True, **kw)
    assert y.shape == (m, 128) and y.dtype == jnp.float32
    assert _rel_err(y, decode_matmul_reference(a, qw, r, jnp.float32, **kw)) < 1e-5
    engine = r.astype(jnp.float32) + _engine_product(act, qw)
    bound = 6e-3 if prologue is not None else 1e-5   # the prologues round elsewhere
    assert _rel_err(y, engine) < bound


@pytest.mark.parametrize("fmt", ["bf16", "int8mma", "fp8"])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("prologue", [None, "swiglu"])
def test_interpret_k_split_matches_reference(fmt, m, prologue):
    """k_split 2: a cluster of two blocks per column tile, each over half of K, the first adding the
    second's product before the residual (interpret mode hands it over through HBM, the GPU through
    distributed shared memory: pallas_kernels/cluster_sum.py)."""
    x, gate_up, _, w = _prologue_operands(m, 512, 128, seed=m)
    w = w if fmt == "bf16" else _quantized(w, fmt)
    r = jnp.asarray(np.random.default_rng(9).standard_normal((m, 128)), jnp.bfloat16)
    a, kw = (gate_up, dict(swiglu=True)) if prologue else (x, {})
    config = DecodeMatmulConfig(tile_k=128, wgmmas_in_flight=1, k_split=2)
    y = decode_matmul(a, w, r, out_dtype=jnp.float32, config=config, interpret=True, **kw)
    unsplit = decode_matmul(a, w, r, out_dtype=jnp.float32, config=DecodeMatmulConfig(tile_k=128), interpret=True, **kw)
    assert y.shape == (m, 128)
    assert _rel_err(y, decode_matmul_reference(a, w, r, jnp.float32, **kw)) < 1e-5
    assert _rel_err(y, unsplit) < 1e-5


def test_k_split_needs_whole_steps_and_no_norm():
    x, w = _operands(8, 384, 128)
    with pytest.raises(ValueError, match="K % 256 == 0"):   # 384 rows: three steps of 128 do not halve
        decode_matmul(x, w, config=DecodeMatmulConfig(tile_k=128, k_split=2), interpret=True)
    with pytest.raises(ValueError, match="all of K in one block"):
        decode_matmul(x[:, :256], w[:256], norm_scale=jnp.ones((256,), jnp.bfloat16),
                      config=DecodeMatmulConfig(tile_k=128, k_split=2), interpret=True)
    with pytest.raises(ValueError, match="k_split must be 1 or 2"):
        DecodeMatmulConfig(k_split=4)
    with pytest.raises(ValueError, match="tail_split_sms needs k_split 2"):
        DecodeMatmulConfig(tail_split_sms=132)
    with pytest.raises(ValueError, match="norm scale in steps of at most 256"):
        decode_matmul(x[:, :256].repeat(2, axis=1), w[:256].repeat(2, axis=0), norm_scale=jnp.ones((512,), jnp.bfloat16),
                      config=DecodeMatmulConfig(tile_k=512), interpret=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 8])
def test_interpret_wide_config_matches_reference(fmt, m):
    """The LM head's config (`QUANT_WIDE_CONFIG`: 512-row steps, one wgmma in flight) on a small
    weight of two steps, with f32 logits as the engine asks for them."""
    x, w = _operands(m, 1024, 128, seed=m)
    qw = _quantized(w, fmt)
    y = decode_matmul(x, qw, out_dtype=jnp.float32, config=rules.QUANT_WIDE_CONFIG, interpret=True)
    assert y.shape == (m, 128) and y.dtype == jnp.float32
    assert _rel_err(y, decode_matmul_reference(x, qw, out_dtype=jnp.float32)) < 1e-5


def test_quantized_weights_it_cannot_take():
    """Grouped weights (int8 in groups, int4 in any form) and padded quantized weights are refused
    (the model keeps them on their own kernels); so is a weight whose K does not match x."""
    x, w = _operands(8, 256, 128)
    w = w.astype(jnp.float32)
    for qw in (quantize(w, "int8", group_size=128), quantize(w, "int4"), with_mma_order(quantize(w, "int4"), False),
               quantize(w[:, :100], "int8"), quantize(w, "int4", group_size=64)):
        assert rules.weight_dtype(qw) is None
        with pytest.raises(ValueError, match="per-channel int8 / fp8"):
            decode_matmul(x[:, :qw.shape[0]], qw, interpret=True)
    assert rules.weight_dtype(quantize(w, "fp8")) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="does not match"):
        decode_matmul(x[:, :128], quantize(w, "int8"), interpret=True)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("k,n", [(4096, 4096), (14336, 4096), (2048, 6144)])
def test_gpu_matches_reference(m, k, n):
    x, w = _operands(m, k, n)
    y = decode_matmul(x, w, out_dtype=jnp.float32)
    # f32 sums of up to 14336 products in another order than XLA's (tensor-core accumulation)
    assert _rel_err(y, decode_matmul_reference(x, w, out_dtype=jnp.float32)) < 1e-4


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("prologue,k,n", [("norm", 4096, 6144), ("swiglu", 14336, 4096)])
def test_gpu_prologues_match_reference(m, prologue, k, n):
    x, gate_up, scale, w = _prologue_operands(m, k, n)
    r = jnp.asarray(np.random.default_rng(9).standard_normal((m, n)), jnp.bfloat16)
    a, kw = (x, dict(norm_scale=scale, norm_eps=1e-5)) if prologue == "norm" else (gate_up, dict(swiglu=True))
    y = decode_matmul(a, w, r, out_dtype=jnp.float32, **kw)
    assert _rel_err(y, decode_matmul_reference(a, w, r, jnp.float32, **kw)) < 1e-4


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", ["int8", "int8mma", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("stage_weight", [False, True], ids=["registers", "staged"])
@pytest.mark.parametrize("prologue,k,n", [(None, 4096, 4096), ("norm", 4096, 6144), ("swiglu", 14336, 4096)])
def test_gpu_quantized_weights_match_reference(fmt, m, stage_weight, prologue, k, n):
    x, gate_up, scale, w = _prologue_operands(m, k, n)
    qw = _quantized(w, fmt)
    r = jnp.asarray(np.random.default_rng(9).standard_normal((m, n)), jnp.bfloat16)
    a, kw = {None: (x, {}), "norm": (x, dict(norm_scale=scale, norm_eps=1e-5)),
             "swiglu": (gate_up, dict(swiglu=True))}[prologue]
    config = rules.default_config(n, prologue == "swiglu", qw.qweight.dtype)
    config = DecodeMatmulConfig(config.tile_k, config.max_concurrent_steps, config.wgmmas_in_flight, stage_weight)
    y = decode_matmul(a, qw, r, out_dtype=jnp.float32, config=config, **kw)
    assert _rel_err(y, decode_matmul_reference(a, qw, r, jnp.float32, **kw)) < 1e-4


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int8mma", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("prologue,k", [(None, 4096), ("swiglu", 14336)])
@pytest.mark.parametrize("tile_k,in_flight", [(256, 1), (512, 0)])
def test_gpu_k_split_matches_reference(fmt, m, prologue, k, tile_k, in_flight):
    """o_proj and down (64 column tiles) as 2-block clusters over the halves of K, with the residual."""
    x, gate_up, _, w = _prologue_operands(m, k, 4096)
    w = w if fmt == "bf16" else _quantized(w, fmt)
    r = jnp.asarray(np.random.default_rng(9).standard_normal((m, 4096)), jnp.bfloat16)
    a, kw = (gate_up, dict(swiglu=True)) if prologue else (x, {})
    # a quantized tile feeds the wgmma from registers: waiting for each one (REGISTER_A_IN_FLIGHT)
    config = DecodeMatmulConfig(tile_k=tile_k, wgmmas_in_flight=in_flight if fmt == "bf16" else 0, k_split=2)
    y = decode_matmul(a, w, r, out_dtype=jnp.float32, config=config, **kw)
    assert _rel_err(y, decode_matmul_reference(a, w, r, jnp.float32, **kw)) < 1e-4


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int8mma", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_wide_weights_match_reference(fmt, m):
    """More column tiles than SMs (gate_up's N = 28672: 448 blocks). Quantized weights came out
    wrong here with two blocks per SM (session 21): the kernel now holds one SM per block."""
    x, w = _operands(m, 4096, 28672)
    w = w if fmt == "bf16" else _quantized(w, fmt)
    y = decode_matmul(x, w, out_dtype=jnp.float32)
    assert _rel_err(y, decode_matmul_reference(x, w, out_dtype=jnp.float32)) < 1e-4


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 32])
def test_gpu_lm_head_matches_reference(fmt, m):
    """The LM head's shape (2004 column tiles) in its default config (512-row steps), f32 logits."""
    x, w = _operands(m, 4096, 128256)
    qw = _quantized(w, fmt)
    y = decode_matmul(x, qw, out_dtype=jnp.float32)
    assert _rel_err(y, decode_matmul_reference(x, qw, out_dtype=jnp.float32)) < 1e-4


def test_register_operands_wait_for_each_wgmma():
    """A quantized tile converted in registers may not feed a wgmma left in flight (the next step's
    conversion would overwrite what it reads: wrong products on the H100, session 30): natively such
    a config is refused; a staged tile may stay in flight; every default config waits."""
    x, w = _operands(8, 512, 128)
    qw = _quantized(w, "fp8")
    with pytest.raises(ValueError, match="wgmmas_in_flight 0, or stage_weight"):
        decode_matmul(x, qw, config=DecodeMatmulConfig(tile_k=256, wgmmas_in_flight=1))
    for n, k in ((6144, 4096), (4096, 14336), (28672, 4096), (128256, 4096)):
        for w_dtype in (jnp.int8, jnp.float8_e4m3fn):
            assert rules.default_config(n, w_dtype=w_dtype, k=k).wgmmas_in_flight == rules.REGISTER_A_IN_FLIGHT == 0
    staged = DecodeMatmulConfig(tile_k=256, wgmmas_in_flight=1, stage_weight=True)
    y = decode_matmul(x, qw, out_dtype=jnp.float32, config=staged, interpret=True)
    assert _rel_err(y, decode_matmul_reference(x, qw, out_dtype=jnp.float32)) < 1e-5


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("n", [28672, 128256])
def test_gpu_quantized_weights_right_with_two_blocks_per_sm(monkeypatch, fmt, n):
    """Without the one-block-per-SM padding, two blocks share each SM's tensor cores: with register
    operands left in flight gate_up's and the LM head's products came out wrong (int8 in session 21,
    int4 in session 30); with a wait per wgmma they are right. (A pipeline one step shallower than
    the default gives this call its own compile, so the padding of earlier compiles does not carry
    over.)"""
    monkeypatch.setattr(dm, "ONE_BLOCK_PER_SM_SMEM", 0)
    x, w = _operands(8, 4096, n)
    qw = _quantized(w, fmt)
    config = dataclasses.replace(rules.default_config(n, w_dtype=rules.weight_dtype(qw), k=4096), max_concurrent_steps=3)
    y = decode_matmul(x, qw, out_dtype=jnp.float32, config=config)
    ref = decode_matmul_reference(x, qw, out_dtype=jnp.float32)
    assert _rel_err(y, ref) < 1e-4


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("sms,tiles", [(4, 10), (6, 10), (2, 4)])
@pytest.mark.parametrize("prologue", [None, "swiglu"])
def test_interpret_tail_split_matches_reference(fmt, sms, tiles, prologue):
    """tail_split_sms: the tiles of the full waves of `sms` blocks run whole (two blocks per cluster,
    each its own tile), the tail splits K over a cluster. 10 tiles on 4 SMs: 8 whole, 2 split; on 6:
    6 whole, 4 split; 4 tiles on 2: none split. Every column must come out right."""
    n = 64 * tiles
    x, gate_up, _, w = _prologue_operands(3, 512, n, seed=tiles)
    w = w if fmt == "bf16" else _quantized(w, fmt)
    r = jnp.asarray(np.random.default_rng(sms).standard_normal((3, n)), jnp.bfloat16)
    a, kw = (gate_up, dict(swiglu=True)) if prologue else (x, {})
    config = DecodeMatmulConfig(tile_k=128, wgmmas_in_flight=1, k_split=2, tail_split_sms=sms)
    y = decode_matmul(a, w, r, out_dtype=jnp.float32, config=config, interpret=True, **kw)
    assert y.shape == (3, n)
    assert _rel_err(y, decode_matmul_reference(a, w, r, jnp.float32, **kw)) < 1e-5
    per_column = jnp.linalg.norm(y - decode_matmul_reference(a, w, r, jnp.float32, **kw), axis=0)
    assert float(per_column.max()) < 1e-3 * float(jnp.linalg.norm(y, axis=0).min()) + 1e-3


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")
@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("sms", [132, 100])
def test_gpu_tail_split_matches_reference(fmt, m, sms):
    """gate_up's shape (448 tiles) with the tail past the full waves split over K: on 132 SMs 396
    tiles whole and 52 split, on 100 SMs 400 and 48 (either way, every column must come out right)."""
    x, w = _operands(m, 4096, 28672)
    w = w if fmt == "bf16" else _quantized(w, fmt)
    config = DecodeMatmulConfig(tile_k=512, wgmmas_in_flight=int(fmt == "bf16"), k_split=2, tail_split_sms=sms)
    y = decode_matmul(x, w, out_dtype=jnp.float32, config=config)
    ref = decode_matmul_reference(x, w, out_dtype=jnp.float32)
    assert _rel_err(y, ref) < 1e-4
    assert float(jnp.abs(y - ref).max()) < 1e-2 * float(jnp.abs(ref).max())   # no tile left out

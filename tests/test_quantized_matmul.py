"""Fused dequantize-matmul kernels against the plain-jnp reference.

On CPU the Mosaic GPU kernel runs in GPU interpret mode (its wgmma reads the dequantized tile from
shared memory there); the `gpu` tests run the native kernel (register operand) on a GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.gguf_blocks import like_gguf
from atlasjax.quantization import quantize
from pallas_kernels.quant_format import with_float_offsets, with_mma_order
from pallas_kernels.quantized_matmul import DECODE_ROWS, QuantMatmulConfig, quantized_matmul, quantized_matmul_reference
from pallas_kernels.rows_matmul import MIN_ROWS

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")

# zeros: "sym" (none), "zp" (asymmetric, integer zero points: what quantize makes) or "offsets"
# (asymmetric with float offsets, GGUF Q4_1's form: the same weight through `with_float_offsets`),
# or "two_level" (GGUF Q4_K's float offsets: uint8 rows under float16 rows per 256, `like_gguf`).
CASES = [  # (format, group_size, zeros)
    ("int8", None, "sym"),
    ("fp8", None, "sym"),
    ("int4", 128, "sym"),
    ("int4", 64, "zp"),
    ("int4", 64, "offsets"),
    ("int8", 32, "sym"),  # GGUF Q8_0 grouping
    ("fp8", 128, "sym"),  # FP8 checkpoints with 128 x 128 block scales (atlasjax/prequantized.py)
]


def _check(fmt, group_size, zeros, m, k, n, seed=0, natural_order=False, **kwargs):
    kwargs.setdefault("prefill", "pallas")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if zeros == "two_level":   # GGUF Q4_K's layout: uint8 group rows under float16 rows per 256
        qw = like_gguf(w, "Q4_K")
        assert qw.two_level and (fmt, group_size) == ("int4", 32)
    else:
        qw = quantize(w, fmt, group_size=group_size, symmetric=zeros == "sym")
        assert qw.zero_point == (zeros != "sym")
    if zeros == "offsets":
        qw = with_float_offsets(qw)
    assert qw.mma_order == (fmt == "int4")   # int4 is stored in mma order (test_int4_mma_order.py)
    if natural_order:   # as checkpoints saved before it load
        qw = with_mma_order(qw, False)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    kwargs.setdefault("backend", "pallas")
    y = quantized_matmul(x, qw, out_dtype=jnp.float32, **kwargs)
    ref = np.asarray(quantized_matmul_reference(x, qw))
    assert y.shape == (m, n)
    assert np.all(np.isfinite(np.asarray(y)))
    err = np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref)
    assert err < 4e-3, (fmt, group_size, m, k, n, err)  # bf16 rounding of the weight tile at most


@pytest.mark.parametrize("fmt,group_size,zeros", CASES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_interpret_matches_reference(fmt, group_size, zeros, m):
    _check(fmt, group_size, zeros, m, k=200, n=70, seed=m, interpret=True)


@pytest.mark.parametrize("fmt,group_size,zeros", [("int4", 32, "offsets"), ("int8", 32, "sym"), ("int4", 64, "zp")])
def test_interpret_prescaled_in_f32_too(fmt, group_size, zeros):
    # the prescaled tile's arithmetic: bf16 by default (faster on the H100), f32 kept as an option
    _check(fmt, group_size, zeros, 3, k=512, n=70, interpret=True, config=QuantMatmulConfig(prescale_bf16=False))


@pytest.mark.parametrize("fmt,zeros", [("int8", "sym"), ("int4", "offsets")])
def test_interpret_default_configs_of_groups_of_32(fmt, zeros):
    # `default_config`: int8 wider than 4096 columns in 512-row steps, 2 in flight; int4 with offsets 3 in flight
    _check(fmt, 32, zeros, 3, k=1024, n=4160, interpret=True)


@pytest.mark.parametrize("zeros", ["sym", "offsets", "two_level"])
@pytest.mark.parametrize("m", [1, 16, 17])
def test_interpret_default_configs_of_int4_groups_of_32(zeros, m):
    # `default_config` at up to 16 rows: the per-group path, 8 groups of 32 per step (x's group sums
    # for the offsets of narrow weights); from 17 rows the prescaled path
    from pallas_kernels.quantized_matmul import default_config
    qw = like_gguf(np.zeros((512, 256), np.float32), {"sym": "Q4_0", "offsets": "Q4_1", "two_level": "Q4_K"}[zeros])
    assert default_config(qw, m).prescale is (None if m > 16 else False)
    _check("int4", 32, zeros, m, k=512, n=200, seed=m, interpret=True, config=None)


@pytest.mark.parametrize("zeros", ["sym", "offsets", "two_level"])
@pytest.mark.parametrize("unroll,k", [(8, 512), (2, 512), (4, 1024)])
def test_interpret_per_group_groups_of_32(zeros, unroll, k):
    # in mma order a step's groups of 32 load as one tile; offsets from a ones-tile wgmma or x's sums
    for x_sums in (False, True):
        _check("int4", 32, zeros, 3, k=k, n=70, seed=unroll, interpret=True,
               config=QuantMatmulConfig(prescale=False, group_unroll=unroll, x_sums=x_sums))


def test_interpret_k_splits_and_m_tiles():
    # K = 512 gives 4 steps of 128, split 2 ways; M past DECODE_ROWS with tile_m 48 gives several
    # M tiles; N = 130 needs 3 tiles of 64 after padding.
    cfg = QuantMatmulConfig(num_k_splits=2, tile_m=48)
    m = DECODE_ROWS + 16
    _check("int8", None, "sym", m, 512, 130, config=cfg, interpret=True, prefill="pallas")
    _check("int4", 128, "zp", m, 512, 130, config=cfg, interpret=True, prefill="pallas")


def _kernels_traced(qw, m, k=256):
    """The Mosaic GPU kernels of quantized_matmul at m rows, by name (traced only: interpret mode at
    hundreds of rows would take minutes)."""
    import re
    x = jnp.zeros((m, k), jnp.bfloat16)
    text = str(jax.make_jaxpr(lambda x: quantized_matmul(x, qw, interpret=True))(x))
    return text.count("mpmd_map["), set(re.findall(r"(rows_matmul_\w+|quantized_matmul_\w+)", text))


@pytest.mark.parametrize("fmt,group_size,zeros", [("int4", 32, "two_level"), ("int8", 32, "sym"), ("int4", 64, "zp")])
def test_grouped_formats_take_the_rows_kernel_past_32_rows(fmt, group_size, zeros):
    # GGUF Q4_K, Q8_0 and int4 groups of 64 (sessions 37 and 39, pallas_kernels/rows_matmul.py `pays`):
    # int4 at every row count past 32, 8-bit codes up to 1,024 rows, then dequantize + dot (faster there)
    w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    qw = like_gguf(w, "Q4_K") if zeros == "two_level" else quantize(w, fmt, group_size=group_size, symmetric=zeros == "sym")
    assert _kernels_traced(qw, MIN_ROWS) == (1, {f"quantized_matmul_{fmt}"})   # few rows: the fused kernel
    for m in (MIN_ROWS + 1, DECODE_ROWS, DECODE_ROWS + 1, 1024):
        assert _kernels_traced(qw, m) == (1, {f"rows_matmul_{fmt}"}), m
    assert _kernels_traced(qw, 1025) == ((1, {"rows_matmul_int4"}) if fmt == "int4" else (0, set()))


def test_weights_the_rows_kernel_does_not_take_run_the_fused_kernel_up_to_fused_max_rows():
    # int4 in natural order (not the rows kernel's): this module's kernel in M tiles of 128 while that
    # measured faster than dequantizing the weight for XLA's dot, the dot above
    from pallas_kernels.quantized_matmul_rules import fused_max_rows
    qw = with_mma_order(quantize(np.ones((256, 128), np.float32), "int4", group_size=32, symmetric=False), False)
    limit = fused_max_rows(qw)
    assert limit > DECODE_ROWS
    for m in (DECODE_ROWS + 1, limit):
        assert _kernels_traced(qw, m) == (1, {"quantized_matmul_int4"}), m
    assert _kernels_traced(qw, limit + 1) == (0, set())


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_groups_of_128_take_the_rows_kernel_at_any_row_count_past_32(symmetric):
    # 0.6-1.2x the bf16 dot at 256-2,048 rows on the H100, and 0.67-0.82x the fused kernel at 64-128
    # (pallas_kernels/rows_matmul.py `pays`)
    qw = quantize(np.ones((256, 128), np.float32), "int4", group_size=128, symmetric=symmetric)
    assert "rows_matmul_int4" not in _kernels_traced(qw, MIN_ROWS)[1]   # a small decode batch: the fused kernel
    for m in (MIN_ROWS + 1, DECODE_ROWS, DECODE_ROWS + 1, 2048, 8192):
        assert _kernels_traced(qw, m) == (1, {"rows_matmul_int4"}), m


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_per_channel_8_bit_takes_the_rows_kernel_from_33_to_1024_rows(fmt):
    # 0-24% faster than XLA's convert-fused GEMM at 129-1,024 rows on the H100, not at 2,048 (session
    # 37); at 64-128 rows as fast (fp8 gate_up) to 1.6x faster (int8 down, session 39)
    qw = quantize(np.ones((256, 128), np.float32), fmt)
    assert not any(n.startswith("rows_") for n in _kernels_traced(qw, MIN_ROWS)[1])
    for m in (MIN_ROWS + 1, DECODE_ROWS, DECODE_ROWS + 1, 1024):
        assert _kernels_traced(qw, m) == (1, {f"rows_matmul_{fmt}"}), m
    assert not any(n.startswith("rows_") for n in _kernels_traced(qw, 1025)[1])


def test_interpret_auto_rows_past_a_decode_batch():
    # DECODE_ROWS + 8 rows on the default path: the rows kernel (two M tiles, the second mostly
    # padding; N = 64 padded to a block of 128)
    _check("int4", 128, "zp", DECODE_ROWS + 8, 256, 128, interpret=True, prefill="auto")
    _check("int4", 128, "zp", DECODE_ROWS + 8, 256, 64, interpret=True, prefill="auto")
    _check("fp8", None, "sym", DECODE_ROWS + 8, 256, 128, interpret=True, prefill="auto")


@pytest.mark.parametrize("fmt,group_size,zeros,k,tile_k", [
    ("int4", 128, "sym", 512, 128), ("int4", 128, "offsets", 512, 256), ("int4", 32, "sym", 576, 128),
    ("int4", 32, "offsets", 160, 128), ("int8", 32, "sym", 200, 64),
])
@pytest.mark.parametrize("m", [1, 17])
def test_interpret_prescaled_groups(fmt, group_size, zeros, k, tile_k, m):
    # Group scales folded into the dequantized tile, one accumulator; steps of several groups
    # (int4 groups of 32, GGUF Q4_0/Q4_1), K not a multiple of the requested step (576, 160, 200).
    # Float offsets here take the XLA offset term (fold_zeros=False); the folded path is below.
    cfg = QuantMatmulConfig(prescale=True, prescale_tile_k=tile_k, fold_zeros=False)
    _check(fmt, group_size, zeros, m, k, 70, seed=k + m, config=cfg, interpret=True)


@pytest.mark.parametrize("zeros", ["offsets", "zp"])
@pytest.mark.parametrize("group_size,k,tile_k", [(32, 576, 256), (32, 160, 128), (128, 512, 256)])
@pytest.mark.parametrize("m", [1, 17])
def test_interpret_prescaled_asymmetric(zeros, group_size, k, tile_k, m):
    # Asymmetric groups applied in the prescaled tile, no XLA offset term: float offsets added
    # (8 s + zeros), or integer zero points subtracted before the scale.
    cfg = QuantMatmulConfig(prescale=True, prescale_tile_k=tile_k, fold_zeros=True)
    _check("int4", group_size, zeros, m, k, 70, seed=k + m, config=cfg, interpret=True)


@pytest.mark.parametrize("zeros,fold_zeros", [("sym", True), ("zp", True), ("offsets", True), ("offsets", False)])
@pytest.mark.parametrize("group_size,k,unroll", [(128, 1024, 1), (128, 1024, 2), (128, 1024, 4),
                                                 (64, 384, 3), (256, 512, 2)])
def test_interpret_per_group_unroll(zeros, fold_zeros, group_size, k, unroll):
    # Groups of >= 128 (and 64) keep the scale on each group's f32 partial; `unroll` groups per
    # pipeline step share one wgmma wait. Integer zero points are subtracted from the tile; float
    # offsets come from a ones-tile wgmma in the kernel (fold_zeros) or from the XLA offset term.
    # Group 256 with 128-element tiles spans two steps per group (no unroll there); 3 groups per
    # step must divide 6 groups of 64.
    cfg = QuantMatmulConfig(group_unroll=unroll, fold_zeros=fold_zeros, num_k_splits=2)
    for m in (1, 17):
        _check("int4", group_size, zeros, m, k, 70, seed=k + m + unroll, config=cfg, interpret=True)


@pytest.mark.parametrize("zeros", ["sym", "zp", "offsets"])
def test_interpret_single_group(zeros):
    # K = 200 with groups of 256: one group, which the per-channel path must not take when the
    # weight has zeros (it has no zero-point or offset term).
    _check("int4", 256, zeros, 3, 200, 70, seed=11, interpret=True)


def test_group_scales_are_compact():
    # Group scales (and zero points) are stored in float16; per-channel scales stay f32.
    w = np.random.default_rng(2).standard_normal((512, 64)).astype(np.float32)
    qw = quantize(w, "int4")
    assert qw.scales.dtype == jnp.float16 and qw.zeros.dtype == jnp.float16
    exact = (w.reshape(4, 128, 64).max(1) - np.minimum(w.reshape(4, 128, 64).min(1), 0)) / 15
    np.testing.assert_allclose(np.asarray(qw.scales, np.float32)[:, :64], exact, rtol=2 ** -11)
    assert quantize(w, "int8").scales.dtype == jnp.float32


def test_per_group_unroll_divides_the_groups():
    from pallas_kernels.quantized_matmul import _tile_k, _unroll
    cfg = QuantMatmulConfig(group_unroll=4)
    for k, groups, unroll in [(1280, 10, 2), (768, 6, 3), (1024, 8, 4)]:   # K pads to a multiple of 256
        qw = quantize(np.zeros((k, 64), np.float32), "int4", group_size=128)
        assert qw.num_groups == groups and _unroll(qw, cfg, _tile_k(qw, cfg)) == unroll


@pytest.mark.parametrize("zeros", ["zp", "offsets"])
def test_interpret_constant_groups_stay_finite(zeros):
    # Constant groups: 0.25 is 15 steps with zero points (the range widened to hold 0); an all-zero
    # group has scale 0. Float offsets of a constant group carry the value with scale 0 (as GGUF
    # Q4_1 can), so the in-kernel offset term must not divide by the scale.
    rng = np.random.default_rng(5)
    w = rng.standard_normal((512, 64)).astype(np.float32)
    w[128:256, :10] = 0.25    # one whole group of ten channels is constant
    w[256:384, 10:20] = 0.0   # and one is zero
    qw = quantize(w, "int4", group_size=128, symmetric=False)
    assert float(np.asarray(qw.scales)[2, 10:20].max()) == 0.0
    np.testing.assert_allclose(np.asarray(quantized_matmul_reference(jnp.eye(512), qw))[128:256, :10], 0.25,
                               rtol=2 ** -11)   # 15 steps of the f16-rounded scale
    if zeros == "offsets":
        qw = with_float_offsets(qw)
        qw = dataclasses.replace(qw, scales=qw.scales.at[1, :10].set(0.0), zeros=qw.zeros.at[1, :10].set(0.25))
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    y = np.asarray(quantized_matmul(x, qw, backend="pallas", interpret=True, out_dtype=jnp.float32))
    ref = np.asarray(quantized_matmul_reference(x, qw))
    assert np.all(np.isfinite(y))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 4e-3


def test_prescaled_int4_g32_takes_the_kernel():
    from atlasjax.quantization import quantize as q
    from pallas_kernels.quantized_matmul import _can_use_pallas
    qw = q(np.ones((576, 64), np.float32), "int4", group_size=32, symmetric=True)
    one_group = QuantMatmulConfig(prescale=False, group_unroll=1)
    assert not _can_use_pallas(qw, one_group)   # one group a step: 16-byte rows, no swizzle
    assert not _can_use_pallas(with_mma_order(qw, False), QuantMatmulConfig(prescale=False))   # natural order: one tile a group
    assert _can_use_pallas(qw, QuantMatmulConfig(prescale=False))   # in mma order 2 groups load as a 32-byte row
    assert _can_use_pallas(qw, QuantMatmulConfig(prescale=True))


def test_interpret_batched_decode_rows():
    # A decode batch of 17..MIN_ROWS rows takes the fused kernel as one M tile, MIN_ROWS + 1 to
    # DECODE_ROWS the rows kernel as one M tile (K split in four here), not dequantize + dot.
    qw = quantize(np.ones((512, 64), np.float32), "int4", group_size=128, symmetric=True)
    assert _kernels_traced(qw, 24, k=512) == (1, {"quantized_matmul_int4"})
    assert _kernels_traced(qw, 40, k=512) == (1, {"rows_matmul_int4"})
    _check("int4", 128, "sym", 24, 256, 64, interpret=True, prefill="auto")
    _check("int4", 128, "sym", 40, 512, 64, interpret=True, prefill="auto")


def test_interpret_prefill_xla_path():
    _check("int4", 128, True, DECODE_ROWS + 1, 256, 64, interpret=True, prefill="xla")
    _check("int4", 32, True, 3, 256, 64, interpret=True, config=QuantMatmulConfig(prescale=False))  # no kernel: XLA


@pytest.mark.parametrize("fmt,group_size,zeros", CASES)
@pytest.mark.parametrize("m", [1, 3, 17, 64, 2050])
def test_xla_backend_matches_reference(fmt, group_size, zeros, m):
    # Per-channel int8/fp8: convert fused into XLA's dot, scale on the output (the GPU default for
    # them) up to 2,048 rows for a weight this small; grouped formats given backend="xla", and per
    # channel past that, the weight dequantized as stored for XLA's dot. K, N off every tile size.
    _check(fmt, group_size, zeros, m, k=200, n=70, seed=m, backend="xla")


@pytest.mark.parametrize("m", [5, 2050])
def test_xla_backend_of_int8_in_mma_order(m):
    # int8 stored in mma order (K permuted in blocks of 32, for the decode matmul): x is permuted alike before
    # XLA's convert-fused GEMM (few rows) or the dequantized copy (past 2,048 rows)
    rng = np.random.default_rng(m)
    qw = with_mma_order(quantize(rng.standard_normal((200, 70)).astype(np.float32), "int8"), True)
    assert qw.mma_order
    x = jnp.asarray(rng.standard_normal((m, 200)), jnp.bfloat16)
    y = np.asarray(quantized_matmul(x, qw, backend="xla", out_dtype=jnp.float32))
    ref = np.asarray(quantized_matmul_reference(x, qw))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 4e-3


@pytest.mark.parametrize("fmt,group_size,zeros", CASES + [("int4", 32, "two_level")])
def test_dequantize_nk_is_the_padded_transposed_weight(fmt, group_size, zeros):
    # dequantize (W [K, N]) is read from it; its values are checked against the float weights and gguf's own
    # dequantization in tests/test_quantization.py: this checks the layout and the padding
    from pallas_kernels.quant_format import dequantize, dequantize_nk
    w = np.random.default_rng(5).standard_normal((256, 70)).astype(np.float32)
    qw = like_gguf(w, "Q4_K") if zeros == "two_level" else quantize(w, fmt, group_size=group_size,
                                                                      symmetric=zeros == "sym")
    if zeros == "offsets":
        qw = with_float_offsets(qw)
    nk = np.asarray(dequantize_nk(qw, jnp.float32))
    assert nk.shape == qw.padded_shape[::-1]
    np.testing.assert_allclose(nk[:70, :256], np.asarray(dequantize(qw, jnp.float32)).T, rtol=1e-6, atol=1e-6)
    assert not nk[70:, :].any() and not nk[:, 256:].any()   # padding contributes nothing
    bf16 = dequantize_nk(qw)   # computed two values per 32-bit word: the f32 values rounded once, bit for bit
    assert bf16.dtype == jnp.bfloat16
    rounded = np.asarray(jnp.asarray(nk, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(bf16).view(np.uint16), rounded.view(np.uint16))


def test_convert_fused_gemm_runs_per_channel_weights_by_rows_and_size(monkeypatch):
    import pallas_kernels.quantized_matmul_rules as qm
    small, large = (quantize(np.ones((256, n), np.float32), "fp8") for n in (128, 256))
    monkeypatch.setattr(qm, "CONVERT_FUSED_MAX_ELEMS", 256 * 128)
    assert all(qm.convert_fused_pays(qw, 1024) for qw in (small, large))
    assert qm.convert_fused_pays(small, 2048) and not qm.convert_fused_pays(large, 2048)
    assert not qm.convert_fused_pays(small, 2049)
    assert not qm.convert_fused_pays(quantize(np.ones((256, 128), np.float32), "int8", group_size=32), 8)


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
@pytest.mark.parametrize("fmt,group_size,zeros", CASES)
@pytest.mark.parametrize("m,k,n", [(1, 200, 70), (3, 4096, 1000), (17, 1000, 4100), (64, 512, 256)])
def test_gpu_matches_reference(fmt, group_size, zeros, m, k, n):
    _check(fmt, group_size, zeros, m, k, n, seed=k + m)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt,group_size,zeros,tile_k", [
    ("int4", 128, "sym", 128), ("int4", 128, "offsets", 256), ("int4", 32, "sym", 128), ("int4", 32, "offsets", 64),
    ("int8", 32, "sym", 128)])
@pytest.mark.parametrize("m,k,n", [(1, 576, 70), (8, 4096, 1000), (40, 1024, 4100)])
def test_gpu_prescaled_groups(fmt, group_size, zeros, tile_k, m, k, n):
    _check(fmt, group_size, zeros, m, k, n, seed=k + m,
           config=QuantMatmulConfig(prescale=True, prescale_tile_k=tile_k, fold_zeros=False))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("zeros", ["offsets", "zp"])
@pytest.mark.parametrize("group_size,tile_k", [(32, 256), (32, 128), (128, 256)])
@pytest.mark.parametrize("m,k,n", [(1, 576, 70), (8, 4096, 1000), (40, 1024, 4100)])
def test_gpu_prescaled_asymmetric(zeros, group_size, tile_k, m, k, n):
    _check("int4", group_size, zeros, m, k, n, seed=k + m,
           config=QuantMatmulConfig(prescale=True, prescale_tile_k=tile_k, fold_zeros=True))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("zeros,fold_zeros", [("sym", True), ("zp", True), ("offsets", True), ("offsets", False)])
@pytest.mark.parametrize("unroll", [1, 2, 4])
@pytest.mark.parametrize("m,k,n", [(1, 1024, 70), (8, 4096, 1000), (40, 2048, 4100)])
def test_gpu_per_group_unroll(zeros, fold_zeros, unroll, m, k, n):
    _check("int4", 128, zeros, m, k, n, seed=k + m + unroll,
           config=QuantMatmulConfig(group_unroll=unroll, fold_zeros=fold_zeros))


@pytest.mark.parametrize("group_size,symmetric,unroll", [(32, False, 8), (64, False, 4), (64, True, 4)])
def test_default_config_of_int4_groups_of_32_and_64_at_load(group_size, symmetric, unroll):
    # what `--quantization int4 --quantization-group-size 32|64` makes: the per-group path up to 16 rows
    from pallas_kernels.quantized_matmul import default_config
    qw = quantize(np.zeros((512, 256), np.float32), "int4", group_size=group_size, symmetric=symmetric)
    assert (default_config(qw, 8).prescale, default_config(qw, 8).group_unroll) == (False, unroll)
    assert default_config(qw, 17).prescale is None


@pytest.mark.parametrize("group_size,unroll", [(32, 8), (64, 4), (64, 2)])
def test_interpret_per_group_with_integer_zero_points(group_size, unroll):
    # groups of 32 / 64 with integer zero points (`--quantization-group-size`) on the per-group path:
    # a step's groups load as one tile, each group's zero point in its part of the conversion
    _check("int4", group_size, "zp", 3, k=512, n=70, seed=unroll, interpret=True,
           config=QuantMatmulConfig(prescale=False, group_unroll=unroll))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("group_size,unroll", [(32, 8), (64, 4), (64, 2)])
@pytest.mark.parametrize("m,k,n", [(1, 1024, 70), (8, 4096, 1000), (16, 2048, 4100)])
def test_gpu_per_group_with_integer_zero_points(group_size, unroll, m, k, n):
    _check("int4", group_size, "zp", m, k, n, seed=k + m + unroll,
           config=QuantMatmulConfig(prescale=False, group_unroll=unroll))


# Two-level group rows (GGUF Q4_K): steps of one super-group (the default), of half of one, and of
# two; the offset term folded into the tile or added by XLA.
TWO_LEVEL_CONFIGS = {"default": None, "half_super": QuantMatmulConfig(prescale_tile_k=128),
                     "two_supers": QuantMatmulConfig(prescale_tile_k=512),
                     "xla_offsets": QuantMatmulConfig(fold_zeros=False)}


@pytest.mark.parametrize("config", TWO_LEVEL_CONFIGS, ids=str)
@pytest.mark.parametrize("m", [1, 17])
def test_interpret_two_level_rows(config, m):
    _check("int4", 32, "two_level", m, k=512, n=70, seed=m, interpret=True, config=TWO_LEVEL_CONFIGS[config])


def test_two_level_rows_take_the_kernel_and_xla_dequantizes_them():
    from pallas_kernels.quantized_matmul import _can_use_pallas, default_config
    qw = like_gguf(np.random.default_rng(0).standard_normal((512, 128)).astype(np.float32), "Q4_K")
    assert _can_use_pallas(qw, default_config(qw))
    assert _can_use_pallas(qw, QuantMatmulConfig(prescale=False, group_unroll=8))
    assert not _can_use_pallas(qw, QuantMatmulConfig(prescale=False, group_unroll=1))   # 16-byte rows
    _check("int4", 32, "two_level", 3, k=512, n=70, backend="xla")
    _check("int4", 32, "two_level", 130, k=256, n=70, interpret=True, prefill="xla")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("config", TWO_LEVEL_CONFIGS, ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 512, 70), (8, 4096, 1000), (40, 1024, 4100)])
def test_gpu_two_level_rows(config, m, k, n):
    _check("int4", 32, "two_level", m, k, n, seed=k + m, config=TWO_LEVEL_CONFIGS[config])


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("zeros", ["sym", "offsets", "two_level"])
@pytest.mark.parametrize("config", ["default", "per_group_4", "ones_mma"])
@pytest.mark.parametrize("m,k,n", [(1, 512, 70), (8, 4096, 1000), (16, 1024, 4100), (40, 1024, 4100)])
def test_gpu_per_group_groups_of_32(zeros, config, m, k, n):
    configs = {"default": None, "per_group_4": QuantMatmulConfig(prescale=False, group_unroll=4, x_sums=True),
               "ones_mma": QuantMatmulConfig(prescale=False, group_unroll=8)}
    _check("int4", 32, zeros, m, k, n, seed=k + m, config=configs[config])


@pytest.mark.parametrize("zeros,group_size", [("sym", 128), ("zp", 128), ("offsets", 32)])
def test_interpret_natural_order(zeros, group_size):
    _check("int4", group_size, zeros, 3, 256, 70, seed=4, natural_order=True, interpret=True)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("zeros,group_size", [("sym", 128), ("zp", 128), ("offsets", 128), ("sym", 32), ("offsets", 32)])
@pytest.mark.parametrize("m,k,n", [(1, 576, 70), (8, 4096, 1000)])
def test_gpu_natural_order(zeros, group_size, m, k, n):
    _check("int4", group_size, zeros, m, k, n, seed=k + m, natural_order=True)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt,group_size", [("int4", 32), ("int8", 32), ("int4", 128)])
def test_gpu_full_decode_tile_fits_shared_memory(fmt, group_size):
    # DECODE_ROWS rows in one M tile with 256-element prescaled steps: the pipeline depth shrinks
    # to fit shared memory (it overflowed at 4 steps in flight, found on the H100).
    _check(fmt, group_size, "sym", DECODE_ROWS, 2048, 512, seed=3)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gpu_prefill(fmt):
    _check(fmt, 128 if fmt == "int4" else None, "zp" if fmt == "int4" else "sym", 300, 1024, 384, config=QuantMatmulConfig(tile_m=128),
           prefill="pallas")

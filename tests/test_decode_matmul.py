"""The decode matmul kernel (bf16 weights, and per-channel int8 / fp8 ones) against jnp, and where
the model routes its matmuls to it.

On CPU the Mosaic GPU kernel runs in GPU interpret mode; the `gpu` test runs the native kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.config import ModelConfig
from atlasjax.loader import random_params
from atlasjax.quantization import quantize, quantize_params
from models import layers
from models.attention import AttentionMetadata
from models.deferred import RMSNormed, SwiGLU, rms_norm
from models.fused import fuse_projections
from models.transformer import Transformer, init_kv_cache
from pallas_kernels import decode_matmul as dm
from pallas_kernels import decode_switches
from pallas_kernels.decode_matmul import DecodeMatmulConfig, decode_matmul, decode_matmul_reference
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
    engine = r.astype(jnp.float32) + quantized_matmul(act, qw, out_dtype=jnp.float32, backend="xla")
    assert _rel_err(y, engine) < (1e-5 if prologue is None else 6e-3)   # the prologues round elsewhere


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
    y = decode_matmul(x, qw, out_dtype=jnp.float32, config=dm.QUANT_WIDE_CONFIG, interpret=True)
    assert y.shape == (m, 128) and y.dtype == jnp.float32
    assert _rel_err(y, decode_matmul_reference(x, qw, out_dtype=jnp.float32)) < 1e-5


def test_quantized_weights_it_cannot_take():
    """Grouped, int4 or padded quantized weights are refused (the model keeps them on their own
    kernels); so is a weight whose K does not match x."""
    x, w = _operands(8, 256, 128)
    w = w.astype(jnp.float32)
    for qw in (quantize(w, "int8", group_size=128), quantize(w, "int4"), quantize(w[:, :100], "int8")):
        assert dm.weight_dtype(qw) is None
        with pytest.raises(ValueError, match="per-channel int8 / fp8"):
            decode_matmul(x[:, :qw.shape[0]], qw, interpret=True)
    assert dm.weight_dtype(quantize(w, "fp8")) == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match="does not match"):
        decode_matmul(x[:, :128], quantize(w, "int8"), interpret=True)


def test_pays_on_the_narrow_projections_only(monkeypatch):
    bf16 = jnp.bfloat16
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
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
    fp8 = jnp.float8_e4m3fn   # per channel: qkv, o_proj, down (session 22)
    for k, n in ((4096, 6144), (4096, 4096), (14336, 4096)):
        assert dm.pays(8, k, n, bf16, fp8)
        assert not dm.pays(8, k, n, bf16, jnp.int8)   # int8: a step no faster than with XLA's GEMM
    assert not dm.pays(8, 4096, 28672, bf16, fp8)   # gate_up: XLA's GEMM
    assert not dm.pays(64, 4096, 4096, bf16, fp8)
    for m in (1, 8, 32):   # the LM head (2004 tiles, many waves) in 512-row steps (session 23)
        assert dm.pays(m, 4096, 128256, bf16, fp8)
    assert dm.default_config(128256, w_dtype=fp8, k=4096) == dm.QUANT_WIDE_CONFIG
    assert dm.pays(8, 4096, 128256, bf16, jnp.int8)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "off")   # the A/B switch: the session-22 rule
    assert not dm.pays(8, 4096, 128256, bf16, fp8) and dm.pays(8, 4096, 4096, bf16, fp8)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "on")    # every width, gate_up too
    assert dm.pays(8, 4096, 28672, bf16, fp8) and not dm.pays(8, 4096, 28672, bf16, bf16)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "tail")  # gate_up with its tail split over K
    assert dm.pays(8, 4096, 28672, bf16, jnp.int8)
    tail = dm.default_config(28672, w_dtype=fp8, k=4096)
    assert (tail.k_split, tail.tail_split_sms, tail.tile_k) == (2, dm.num_sms(), 512)
    assert dm.default_config(128256, w_dtype=fp8, k=4096) == dm.QUANT_WIDE_CONFIG   # the LM head: unsplit
    monkeypatch.delenv("ATLASJAX_DECODE_MATMUL_WIDE")
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "on")
    assert dm.pays(8, 14336, 4096, bf16, jnp.int8)
    assert dm.default_config(4096, w_dtype=jnp.int8, k=14336).k_split == 2   # o_proj, down: 64 tiles
    assert dm.default_config(6144, w_dtype=jnp.int8, k=4096).k_split == 1    # qkv: 96 tiles
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")
    assert not dm.pays(8, 4096, 4096, bf16, bf16)
    assert not dm.pays(8, 4096, 4096, bf16, fp8)


def test_runs_only_on_the_gpus_where_it_measured_faster(monkeypatch):
    bf16 = jnp.bfloat16
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H200")   # no faster there (session 19)
    assert not dm.pays(8, 4096, 4096, bf16, bf16)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "on")
    assert dm.pays(8, 4096, 4096, bf16, bf16)


def test_prologue_pays_where_it_measured_faster(monkeypatch):
    assert dm.prologue_pays("rms_norm", 1) and dm.prologue_pays("rms_norm", 32)
    assert dm.prologue_pays("swiglu", 8)
    assert not dm.prologue_pays("swiglu", 16)   # slower than XLA's silu * up kernel + the kernel
    assert dm.prologue_pays("rms_norm", 8, jnp.int8) and not dm.prologue_pays("swiglu", 8, jnp.int8)
    # given the weight's shape: not where the config splits K or steps past one norm-scale box
    fp8 = jnp.float8_e4m3fn
    assert dm.prologue_pays("rms_norm", 8, fp8, 6144, 4096)          # qkv: 96 tiles, all of K per block
    assert not dm.prologue_pays("rms_norm", 8, fp8, 4096, 4096)      # 64 tiles: a 2-block K split
    assert not dm.prologue_pays("rms_norm", 8, fp8, 128256, 4096)    # the LM head's 512-row steps
    assert dm.prologue_pays("rms_norm", 8, jnp.bfloat16, 4096, 4096)  # bf16 does not split
    monkeypatch.setenv("ATLASJAX_DECODE_PROLOGUE", "off")
    assert not dm.prologue_pays("rms_norm", 8) and not dm.prologue_pays("swiglu", 8)


def _route_to_interpreted_kernel(monkeypatch, record, min_tiles):
    """Make `models.layers.matmul` see an H100 and send what the rule accepts to the kernel in
    interpret mode, with the tile floor lowered to fit small weights; record(x, kwargs) per call."""
    real = dm.decode_matmul

    def spy(x, w, residual=None, **kw):
        record(x, kw)
        return real(x, w, residual, interpret=True, **kw)
    monkeypatch.setattr(layers, "_on_gpu", lambda: True)
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(dm, "MIN_TILES", min_tiles)
    monkeypatch.setattr(dm, "decode_matmul", spy)


def test_model_matmul_routes_decode_rows_to_the_kernel(monkeypatch):
    """On a GPU, `models.layers.matmul` sends a bf16 decode matmul the rule accepts to the kernel
    (here in interpret mode, with the tile floor lowered to fit a small weight), and nothing else."""
    calls = []
    _route_to_interpreted_kernel(monkeypatch, lambda x, kw: calls.append(x.shape), min_tiles=2)
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


def test_model_matmul_routes_per_channel_quantized_weights(monkeypatch):
    """On an H100, fp8 per-channel weights take the kernel like bf16 ones (int8 ones when forced), with
    the RMSNorm prologue but SwiGLU computed by XLA first (it measured slower in the quantized
    kernel); grouped int4 weights stay on their own kernel; `ATLASJAX_DECODE_MATMUL=off` keeps XLA's
    GEMM."""
    calls = []
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "on")   # for int8
    _route_to_interpreted_kernel(monkeypatch, lambda x, kw: calls.append((x.shape, sorted(kw))), min_tiles=2)
    x, gate_up, scale, w = _prologue_operands(8, 256, 128)
    for fmt in ("int8", "fp8"):
        qw = quantize(w.astype(jnp.float32), fmt)
        y = layers.matmul(RMSNormed(x, scale, 1e-5), qw, jnp.float32)
        assert calls.pop() == ((8, 256), ["norm_eps", "norm_scale", "out_dtype"])
        assert _rel_err(y, quantized_matmul(rms_norm(x, scale, 1e-5), qw, out_dtype=jnp.float32, backend="xla")) < 6e-3
        layers.matmul(SwiGLU(gate_up), qw)
        assert calls.pop() == ((8, 256), ["out_dtype"])
    monkeypatch.setattr(layers, "_on_gpu", lambda: False)   # int4's own kernel needs a GPU: keep it off
    layers.matmul(x, quantize(w.astype(jnp.float32), "int4"))
    assert not calls
    monkeypatch.setattr(layers, "_on_gpu", lambda: True)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")
    y = layers.matmul(x, qw, jnp.float32)   # the quantized path (XLA's convert-fused GEMM on a GPU)
    assert not calls
    np.testing.assert_array_equal(y, quantized_matmul(x, qw, out_dtype=jnp.float32))


def test_decode_rows_reach_xla_quantized_gemm_behind_a_barrier(monkeypatch):
    """On a GPU, the activations of a decode step (at most MAX_ROWS rows) reach XLA's quantized GEMM
    through an optimization barrier, so XLA cannot fuse the RMSNorm's scale into the GEMM (its tile
    then streams slower, docs/performance.md session 28); prefill rows and the CPU path have none,
    and the product is the same either way."""
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")   # int8 / fp8 stay on XLA's GEMM
    x, _, scale, w = _prologue_operands(8, 256, 128)
    qw = quantize(w.astype(jnp.float32), "int8")

    def barriers(rows, on_gpu):
        monkeypatch.setattr(layers, "_on_gpu", lambda: on_gpu)
        f = lambda x: layers.matmul(RMSNormed(x, scale, 1e-5), qw, jnp.float32)  # noqa: E731
        xs = jnp.concatenate([x] * (rows // 8))
        return str(jax.make_jaxpr(f)(xs)).count("optimization_barrier"), f(xs)
    n_decode, y_decode = barriers(8, True)
    n_prefill, _ = barriers(8 * (dm.MAX_ROWS // 8 + 1), True)
    n_cpu, y_cpu = barriers(8, False)
    assert (n_decode, n_prefill, n_cpu) == (1, 0, 0)
    np.testing.assert_array_equal(y_decode, y_cpu)


def test_model_matmul_fuses_deferred_activations(monkeypatch):
    """A deferred RMSNorm / SwiGLU goes into the kernel's prologue on a GPU (interpret mode here);
    `ATLASJAX_DECODE_PROLOGUE=off` hands the kernel the computed activations; elsewhere the matmul
    computes exactly what the unfused model computes."""
    calls = []
    x, gate_up, scale, w = _prologue_operands(8, 256, 128)
    normed, act = RMSNormed(x, scale, 1e-5), SwiGLU(gate_up)
    # CPU: materialized, as the model computed it before deferral existed
    np.testing.assert_array_equal(layers.matmul(normed, w), layers.matmul(rms_norm(x, scale, 1e-5), w))
    np.testing.assert_array_equal(layers.matmul(act, w), layers.matmul(act.materialize(), w))
    _route_to_interpreted_kernel(
        monkeypatch, lambda x, kw: calls.append((x.shape, sorted(k for k in kw if k in ("norm_scale", "swiglu")))),
        min_tiles=2)
    for deferred in (normed, act):
        y = layers.matmul(deferred, w, jnp.float32)
        assert _rel_err(y, layers.matmul(deferred.materialize(), w, jnp.float32)) < 6e-3
    assert calls == [((8, 256), ["norm_scale"]), ((8, 256), []), ((8, 512), ["swiglu"]), ((8, 256), [])]
    calls.clear()
    layers.matmul(SwiGLU(jnp.concatenate([gate_up] * 2)), w)   # 16 rows: SwiGLU by XLA, then the kernel
    layers.matmul(RMSNormed(jnp.concatenate([x] * 4), scale, 1e-5), w)   # 32 rows: the norm still fused
    assert calls == [((16, 256), []), ((32, 256), ["norm_scale"])]
    calls.clear()
    monkeypatch.setenv("ATLASJAX_DECODE_PROLOGUE", "off")
    layers.matmul(normed, w)
    layers.matmul(act, w)
    assert calls == [((8, 256), []), ((8, 256), [])]


# shapes every projection of which the kernel takes once the tile floor is lowered (K % 256 == 0)
_KERNEL_CFG = ModelConfig(family="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512)


def _tiny_decode_step(params):
    """run() -> the tiny model's logits for one decode step of two sequences. Each call traces the
    step anew (jax's jit cache keys on the function), so it sees the routing in force then."""
    cfg = _KERNEL_CFG
    model = Transformer(cfg, attn_backend="reference", dtype=jnp.bfloat16)
    kv = init_kv_cache(cfg, 4, 16, jnp.bfloat16)
    meta = AttentionMetadata(slot_mapping=jnp.array([0, 16]), page_table=jnp.array([[0, 1], [2, 3]], jnp.int32),
                             seq_lens=jnp.array([1, 1]))
    tokens, positions = jnp.array([7, 42]), jnp.array([0, 0])

    def run():
        def step(tokens, positions, kv):
            hidden, _ = model.apply({"params": params}, tokens, positions, kv, meta)
            return model.apply({"params": params}, hidden, method=Transformer.logits)
        return np.asarray(jax.block_until_ready(jax.jit(step)(tokens, positions, kv)), np.float32)
    return run


def test_decode_step_through_the_fused_kernel_matches_the_model(monkeypatch):
    """A tiny bf16 Llama's decode step with every projection on the kernel (interpret mode; the norms,
    SwiGLU and residual adds fused) against the same step on XLA's dots: the logits agree to bf16
    rounding and the greedy token is the same."""
    run_step = _tiny_decode_step(fuse_projections(random_params(_KERNEL_CFG, jnp.bfloat16, seed=5)))
    reference = run_step()
    prologues = []
    _route_to_interpreted_kernel(
        monkeypatch, lambda x, kw: prologues.append("norm" if "norm_scale" in kw else "swiglu" if kw.get("swiglu") else "plain"),
        min_tiles=1)
    fused = run_step()
    # per layer: qkv and gate_up with the norm, o_proj plain, down with SwiGLU; then the LM head
    assert prologues == ["norm", "plain", "norm", "swiglu"] * _KERNEL_CFG.num_layers + ["plain"]
    assert _rel_err(fused, reference) < 2e-2
    np.testing.assert_array_equal(fused.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("lm_head", [False, True], ids=["bf16_head", "quantized_head"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_decode_step_through_the_kernel(monkeypatch, fmt, lm_head):
    """As the engine holds them (quantized per projection at load, then fused), per-channel weights
    of the widths the kernel takes go to it on an H100 (fp8 by default, int8 forced): here qkv,
    o_proj and down, with the tile range narrowed to exclude gate_up; down (K = 512) as a 2-block K
    split. The logits agree with XLA's path to quantized bf16 rounding (greedy tokens are not
    compared: this random model has near-ties). A quantized LM head's f32 logits come from the
    kernel too."""
    params = fuse_projections(quantize_params(random_params(_KERNEL_CFG, jnp.bfloat16, seed=5), fmt,
                                              quantize_lm_head=lm_head))
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")
    reference = _tiny_decode_step(params)()
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "on" if fmt == "int8" else "auto")
    calls = []
    _route_to_interpreted_kernel(monkeypatch, lambda x, kw: calls.append((x.shape, kw.get("out_dtype"))), min_tiles=1)
    monkeypatch.setattr(dm, "MAX_TILES", 8)    # qkv 8 tiles, o_proj and down 4; gate_up 16
    fused = _tiny_decode_step(params)()
    # per layer qkv (normed), o_proj, down (SwiGLU by XLA first); then the LM head (4 tiles), f32
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert calls == [((2, 256), bf16), ((2, 256), bf16), ((2, 512), bf16)] * _KERNEL_CFG.num_layers + [((2, 256), f32)]
    assert dm.weight_dtype(params["lm_head"]["kernel"]) == (params["lm_head"]["kernel"].qweight.dtype if lm_head else bf16)
    assert dm.default_config(256, w_dtype=params["layers_0"]["mlp"]["down_proj"]["kernel"].qweight.dtype,
                             k=512).k_split == 2   # down's config
    assert _rel_err(fused, reference) < 2e-2


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
    config = dm.default_config(n, prologue == "swiglu", qw.qweight.dtype)
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
    config = DecodeMatmulConfig(tile_k=tile_k, wgmmas_in_flight=in_flight, k_split=2)
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
    config = DecodeMatmulConfig(tile_k=512, wgmmas_in_flight=1, k_split=2, tail_split_sms=sms)
    y = decode_matmul(x, w, out_dtype=jnp.float32, config=config)
    ref = decode_matmul_reference(x, w, out_dtype=jnp.float32)
    assert _rel_err(y, ref) < 1e-4
    assert float(jnp.abs(y - ref).max()) < 1e-2 * float(jnp.abs(ref).max())   # no tile left out

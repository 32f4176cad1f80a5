"""Where the model routes its matmuls: to the decode matmul (bf16 and per-channel int8 / fp8
weights, with prologues and residual epilogues), or to XLA's GEMM, and on which GPUs.

The kernel runs in GPU interpret mode here, behind `models.layers.matmul` as a GPU step would call it.
"""

import dataclasses

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
from models.transformer import Transformer, init_kv_cache, layer_calls
from pallas_kernels import decode_matmul as dm
from pallas_kernels import decode_matmul_rules as rules
from pallas_kernels import decode_switches
from pallas_kernels.decode_matmul import decode_matmul_reference
from pallas_kernels.quantized_matmul import quantized_matmul
from tests.test_decode_matmul import _assert_within_bf16_rounding, _operands, _prologue_operands, _rel_err


def test_pays_on_the_narrow_projections_only(monkeypatch):
    bf16 = jnp.bfloat16
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert rules.pays(8, 4096, 6144, bf16, bf16)        # qkv
    assert rules.pays(8, 4096, 4096, bf16, bf16)        # o_proj
    assert rules.pays(8, 14336, 4096, bf16, bf16)       # down
    assert not rules.pays(8, 4096, 28672, bf16, bf16)   # gate_up: XLA streams it faster
    assert not rules.pays(8, 4096, 128256, bf16, bf16)  # LM head
    assert rules.pays(32, 4096, 4096, bf16, bf16)       # bs=32
    assert not rules.pays(8, 2048, 2048, bf16, bf16)    # Llama-3.2-1B's o_proj (32 tiles): no faster step
    assert not rules.pays(64, 4096, 4096, bf16, bf16)   # bs=64: a slower step
    assert not rules.pays(128, 4096, 4096, bf16, bf16)  # a prefill chunk
    assert not rules.pays(8, 4096, 4096, jnp.float32, jnp.float32)
    fp8 = jnp.float8_e4m3fn   # per channel: qkv, o_proj, down (session 22)
    for k, n in ((4096, 6144), (4096, 4096), (14336, 4096)):
        assert rules.pays(8, k, n, bf16, fp8)
        assert not rules.pays(8, k, n, bf16, jnp.int8)   # int8: a step no faster than with XLA's GEMM
    assert not rules.pays(8, 4096, 28672, bf16, fp8)   # gate_up: XLA's GEMM
    assert not rules.pays(64, 4096, 4096, bf16, fp8)
    for m in (1, 8, 32):   # the LM head (2004 tiles, many waves) in 512-row steps (session 23)
        assert rules.pays(m, 4096, 128256, bf16, fp8)
    assert rules.default_config(128256, w_dtype=fp8, k=4096) == rules.QUANT_WIDE_CONFIG
    assert rules.pays(8, 4096, 128256, bf16, jnp.int8)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "off")   # the A/B switch: the session-22 rule
    assert not rules.pays(8, 4096, 128256, bf16, fp8) and rules.pays(8, 4096, 4096, bf16, fp8)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "on")    # every width, gate_up too
    assert rules.pays(8, 4096, 28672, bf16, fp8) and not rules.pays(8, 4096, 28672, bf16, bf16)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "tail")  # gate_up with its tail split over K
    assert rules.pays(8, 4096, 28672, bf16, jnp.int8)
    tail = rules.default_config(28672, w_dtype=fp8, k=4096)
    assert (tail.k_split, tail.tail_split_sms, tail.tile_k) == (2, rules.num_sms(), 512)
    assert rules.default_config(128256, w_dtype=fp8, k=4096) == rules.QUANT_WIDE_CONFIG   # the LM head: unsplit
    monkeypatch.delenv("ATLASJAX_DECODE_MATMUL_WIDE")
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "on")
    assert rules.pays(8, 14336, 4096, bf16, jnp.int8)
    assert rules.default_config(4096, w_dtype=jnp.int8, k=14336).k_split == 2   # o_proj, down: 64 tiles
    assert rules.default_config(6144, w_dtype=jnp.int8, k=4096).k_split == 1    # qkv: 96 tiles
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")
    assert not rules.pays(8, 4096, 4096, bf16, bf16)
    assert not rules.pays(8, 4096, 4096, bf16, fp8)
    monkeypatch.delenv("ATLASJAX_DECODE_MATMUL")


def test_runs_only_on_the_gpus_where_it_measured_faster(monkeypatch):
    bf16 = jnp.bfloat16
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H200")   # no faster there (session 19)
    assert not rules.pays(8, 4096, 4096, bf16, bf16)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "on")
    assert rules.pays(8, 4096, 4096, bf16, bf16)


def test_prologue_pays_where_it_measured_faster(monkeypatch):
    assert rules.prologue_pays("rms_norm", 1) and rules.prologue_pays("rms_norm", 32)
    assert rules.prologue_pays("swiglu", 8)
    assert not rules.prologue_pays("swiglu", 16)   # slower than XLA's silu * up kernel + the kernel
    assert rules.prologue_pays("rms_norm", 8, jnp.int8) and not rules.prologue_pays("swiglu", 8, jnp.int8)
    # given the weight's shape: not where the config splits K or steps past one norm-scale box
    fp8 = jnp.float8_e4m3fn
    assert rules.prologue_pays("rms_norm", 8, fp8, 6144, 4096)          # qkv: 96 tiles, all of K per block
    assert not rules.prologue_pays("rms_norm", 8, fp8, 4096, 4096)      # 64 tiles: a 2-block K split
    assert not rules.prologue_pays("rms_norm", 8, fp8, 128256, 4096)    # the LM head's 512-row steps
    assert rules.prologue_pays("rms_norm", 8, jnp.bfloat16, 4096, 4096)  # bf16 does not split
    monkeypatch.setenv("ATLASJAX_DECODE_PROLOGUE", "off")
    assert not rules.prologue_pays("rms_norm", 8) and not rules.prologue_pays("swiglu", 8)


def _route_to_interpreted_kernel(monkeypatch, record, min_tiles):
    """Make `models.layers.matmul` see an H100 and send what the rule accepts to the kernel in
    interpret mode, with the tile floor lowered to fit small weights; record(x, kwargs) per call."""
    real = dm.decode_matmul

    def spy(x, w, residual=None, **kw):
        record(x, kw)
        return real(x, w, residual, interpret=True, **kw)
    monkeypatch.setattr(layers, "_on_gpu", lambda: True)
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(rules, "MIN_TILES", min_tiles)
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


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_decode_rows_reach_xla_gemm_behind_a_barrier(monkeypatch, fmt):
    """On a GPU, the activations of a decode step (at most MAX_ROWS rows) reach XLA's GEMM through an
    optimization barrier, so XLA cannot fuse the RMSNorm's scale into the GEMM (its tile then
    streams slower, docs/performance.md session 28); prefill rows and the CPU path have none, and
    the product is the same either way."""
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "off")   # every weight stays on XLA's GEMM
    x, _, scale, w = _prologue_operands(8, 256, 128)
    w = w if fmt == "bf16" else quantize(w.astype(jnp.float32), fmt)

    def barriers(rows, on_gpu):
        monkeypatch.setattr(layers, "_on_gpu", lambda: on_gpu)
        f = lambda x: layers.matmul(RMSNormed(x, scale, 1e-5), w, jnp.float32)  # noqa: E731
        xs = jnp.concatenate([x] * (rows // 8))
        return str(jax.make_jaxpr(f)(xs)).count("optimization_barrier"), f(xs)
    n_decode, y_decode = barriers(8, True)
    n_prefill, _ = barriers(8 * (rules.MAX_ROWS // 8 + 1), True)
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


def _tiny_decode_step(params, cfg=_KERNEL_CFG):
    """run() -> the tiny model's logits for one decode step of two sequences. Each call traces the
    step anew (jax's jit cache keys on the function), so it sees the routing in force then."""
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


def _traced_layers(cfg=_KERNEL_CFG) -> int:
    """Layers a step traces (what trace-time routing records see): one when the layers share one jitted
    call (models/transformer.py), else each."""
    return 1 if layer_calls() else cfg.num_layers


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
    assert prologues == ["norm", "plain", "norm", "swiglu"] * _traced_layers() + ["plain"]
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
    monkeypatch.setattr(rules, "MAX_TILES", 8)    # qkv 8 tiles, o_proj and down 4; gate_up 16
    fused = _tiny_decode_step(params)()
    # per layer qkv (normed), o_proj, down (SwiGLU by XLA first); then the LM head (4 tiles), f32
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert calls == [((2, 256), bf16), ((2, 256), bf16), ((2, 512), bf16)] * _traced_layers() + [((2, 256), f32)]
    assert rules.weight_dtype(params["lm_head"]["kernel"]) == (params["lm_head"]["kernel"].qweight.dtype if lm_head else bf16)
    assert rules.default_config(256, w_dtype=params["layers_0"]["mlp"]["down_proj"]["kernel"].qweight.dtype,
                             k=512).k_split == 2   # down's config
    assert _rel_err(fused, reference) < 2e-2


def test_int4_decode_step_stays_on_its_own_kernel(monkeypatch):
    """Grouped int4 weights (groups of 128 with zero points, as quantize at load makes them) at
    decode rows on an H100 never take the decode matmul: they run pallas_kernels/quantized_matmul.py
    (here its CPU reference), whose K split XLA sums. (The decode matmul's int4 path and the int4
    cluster kernel were slower, 3.35 and 2.76 against 2.36 ms per 8B step, and were removed in
    session 32.) The logits agree with the CPU path's, which rounds its bf16 intermediates elsewhere."""
    params = fuse_projections(quantize_params(random_params(_KERNEL_CFG, jnp.bfloat16, seed=5), "int4",
                                              quantize_lm_head=True))
    reference = _tiny_decode_step(params)()   # CPU: dequantize + dot
    calls = []
    _route_to_interpreted_kernel(monkeypatch, lambda x, kw: calls.append(x.shape), min_tiles=1)
    routed = _tiny_decode_step(params)()
    assert not calls
    assert _rel_err(routed, reference) < 2e-2


def test_int4_decode_mlp_runs_as_one_persistent_kernel(monkeypatch):
    """With `ATLASJAX_INT4_MLP=on`, a decode step's MLP on the engine's int4 weights (groups of 128,
    zero points, mma order, gate_up fused) runs pallas_kernels/int4_mlp.py on a GPU: gate_up, silu x
    up and down in one kernel. Here its two phases run as two interpreted calls (interpret mode has
    no grid barrier), and the logits agree with the CPU path's. Unset (the default), the separate
    kernels run."""
    from pallas_kernels import int4_mlp
    cfg = dataclasses.replace(_KERNEL_CFG, intermediate_size=1024)   # 4 down splits of whole steps
    params = fuse_projections(quantize_params(random_params(cfg, jnp.bfloat16, seed=5), "int4"))
    mlp = params["layers_0"]["mlp"]
    assert int4_mlp.fits(2, mlp["gate_up_proj"]["kernel"], mlp["down_proj"]["kernel"])
    reference = _tiny_decode_step(params, cfg)()   # CPU: dequantize + dot
    calls = []
    real = int4_mlp.int4_mlp_partials

    def interpreted(x, gate_up, down, **kw):
        calls.append(x.shape)
        return real(x, gate_up, down, interpret=True, phases="split")
    _route_to_interpreted_kernel(monkeypatch, lambda x, kw: None, min_tiles=1)
    monkeypatch.setattr(int4_mlp, "int4_mlp_partials", interpreted)
    _tiny_decode_step(params, cfg)()
    assert not calls
    monkeypatch.setenv("ATLASJAX_INT4_MLP", "on")
    routed = _tiny_decode_step(params, cfg)()
    assert calls == [(2, cfg.hidden_size)] * _traced_layers(cfg)
    assert _rel_err(routed, reference) < 2e-2

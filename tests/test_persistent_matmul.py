"""The persistent decode matmul (per-channel int8 / fp8 weights, one block per SM) against jnp, its
schedule, its input checks, and where the model routes to it (opt-in).

On CPU the Mosaic GPU kernel runs in GPU interpret mode, with a few blocks standing in for the SMs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.quantization import quantize
from models import layers
from pallas_kernels import decode_matmul as dm
from pallas_kernels import decode_matmul_rules as rules
from pallas_kernels import decode_switches
from pallas_kernels import persistent_matmul as pm
from pallas_kernels.decode_matmul import decode_matmul_reference
from pallas_kernels.persistent_matmul import PersistentConfig, Schedule, persistent_matmul
from tests.test_decode_matmul import _assert_within_bf16_rounding, _rel_err


def _operands(m, k, n, fmt, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32), fmt)
    return x, w


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("tiles,blocks,m", [(6, 4, 1), (4, 4, 3), (10, 4, 8), (8, 6, 2)],
                         ids=["whole+tail", "whole_only", "two_whole+tail", "idle_cluster"])
def test_interpret_matches_reference(fmt, tiles, blocks, m):
    """Every schedule shape: one whole tile per block and a split tail, no tail, two whole tiles
    per block (an epilogue mid-pipeline, then the accumulator restarts), and a cluster with no tail
    tile. f32 out: the channel-scaled f32 sums, as the reference computes them."""
    x, w = _operands(m, 256, tiles * 64, fmt, seed=tiles + m)
    y = persistent_matmul(x, w, out_dtype=jnp.float32, config=PersistentConfig(tile_k=64, blocks=blocks),
                          interpret=True)
    assert y.shape == (m, tiles * 64) and y.dtype == jnp.float32
    assert _rel_err(y, decode_matmul_reference(x, w, out_dtype=jnp.float32)) < 1e-5


def test_interpret_bf16_out_rounds_as_the_reference():
    x, w = _operands(3, 256, 384, "fp8", seed=1)
    y = persistent_matmul(x, w, config=PersistentConfig(tile_k=64, blocks=4), interpret=True)
    assert y.dtype == jnp.bfloat16
    _assert_within_bf16_rounding(y, decode_matmul_reference(x, w))


def test_schedule_spreads_tiles_over_blocks():
    gate_up = Schedule(tiles=448, blocks=132)   # Llama-3.1-8B, H100
    assert (gate_up.whole, gate_up.tail) == (3, 52) and gate_up.runs()
    lm_head = Schedule(tiles=2004, blocks=132)
    assert (lm_head.whole, lm_head.tail) == (15, 24) and lm_head.runs()
    assert not Schedule(tiles=96, blocks=132).runs()    # qkv: fewer tiles than blocks
    assert not Schedule(tiles=200, blocks=132).runs()   # 68 tail tiles for 66 clusters
    assert Schedule(tiles=264, blocks=132).runs() and Schedule(264, 132).tail == 0


def test_rejects_what_it_cannot_take():
    x, w = _operands(8, 256, 384, "int8")
    config = PersistentConfig(tile_k=64, blocks=4)
    assert pm.fits(8, 256, w, config)
    with pytest.raises(ValueError, match="per-channel int8 / fp8"):
        persistent_matmul(x, jnp.zeros((256, 384), jnp.bfloat16), config=config, interpret=True)
    with pytest.raises(ValueError, match="per-channel int8 / fp8"):   # grouped int4
        persistent_matmul(x, quantize(jnp.zeros((256, 384), jnp.float32), "int4"), config=config, interpret=True)
    with pytest.raises(ValueError, match="M=33"):
        persistent_matmul(jnp.zeros((33, 256), jnp.bfloat16), w, config=config, interpret=True)
    with pytest.raises(ValueError, match="K % 512"):
        persistent_matmul(x, w, config=PersistentConfig(tile_k=256, blocks=4), interpret=True)
    with pytest.raises(ValueError, match="8 blocks"):   # 6 tiles on 8 blocks: none whole
        persistent_matmul(x, w, config=PersistentConfig(tile_k=64, blocks=8), interpret=True)
    with pytest.raises(ValueError, match="even"):
        PersistentConfig(blocks=5)


def _gate_up(fmt="fp8"):   # the 8B gate_up's quantized weight, as shapes only
    return jax.eval_shape(lambda: quantize(jnp.zeros((4096, 28672), jnp.float32), fmt))


def test_pays_only_when_asked_for(monkeypatch):
    """Opt-in (`ATLASJAX_DECODE_MATMUL_WIDE=persistent`): the 8B bs=1 bench step on the H100 was
    slower with it, fp8 and int8 (session 27). Never the LM head."""
    monkeypatch.setattr(pm, "num_sms", lambda: 132)
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    bf16 = jnp.bfloat16
    assert not pm.pays(1, 4096, bf16, _gate_up())
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "persistent")
    assert pm.pays(1, 4096, bf16, _gate_up()) and pm.pays(8, 4096, bf16, _gate_up("int8"))
    lm_head = jax.eval_shape(lambda: quantize(jnp.zeros((4096, 128256), jnp.float32), "fp8"))
    assert not pm.pays(1, 4096, bf16, lm_head)
    assert not pm.pays(1, 4096, jnp.float32, _gate_up())
    assert not pm.pays(64, 4096, bf16, _gate_up())
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H200")   # the decode kernels' GPUs only
    assert not pm.pays(1, 4096, bf16, _gate_up())
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL", "on")
    assert pm.pays(1, 4096, bf16, _gate_up())


def test_model_matmul_routes_to_it_when_asked_for(monkeypatch):
    """With the switch on, `models.layers.matmul` sends a decode matmul the kernel takes to it (here
    in interpret mode on 4 blocks), with the residual added after."""
    calls = []
    real = pm.persistent_matmul

    def spy(x, w, **kw):
        calls.append(x.shape)
        return real(x, w, interpret=True, **kw)
    monkeypatch.setenv("ATLASJAX_DECODE_MATMUL_WIDE", "persistent")
    monkeypatch.setattr(layers, "_on_gpu", lambda: True)
    monkeypatch.setattr(decode_switches, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(pm, "num_sms", lambda: 4)
    monkeypatch.setattr(pm, "persistent_matmul", spy)
    x, w = _operands(2, 1024, 384, "fp8")   # K: two of the default config's 512-row steps
    r = jnp.ones((2, 384), jnp.bfloat16)
    y = layers.matmul(x, w, residual=r)
    assert calls == [(2, 1024)]
    _assert_within_bf16_rounding(y, decode_matmul_reference(x, w, r), r, decode_matmul_reference(x, w))
    monkeypatch.delenv("ATLASJAX_DECODE_MATMUL_WIDE")
    monkeypatch.setattr(rules, "MIN_TILES", 2)   # so that the default route (decode_matmul) is what runs
    monkeypatch.setattr(dm, "decode_matmul", lambda x, w, residual=None, **kw: dm.decode_matmul_reference(x, w, residual))
    layers.matmul(x, w)
    assert calls == [(2, 1024)]

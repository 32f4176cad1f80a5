"""The warp-specialized kernel for many rows (pallas_kernels/rows_matmul.py: int4 groups of 128,
per-channel int8 / fp8) against the jnp reference: in GPU interpret mode on small shapes here,
natively (`gpu`) at Llama-3.1-8B's.

Mind the shapes of new interpret tests: on jax 0.11.2 GPU interpret mode hung for int4 at K = N = 256
with m_tile 16 and 40 (no return in 200 s and 10 min, two warpgroup threads waiting at a barrier), and
8, 24, 56 and 72 did not return within 40 s, where 32 and 48 took ~4 s (session 44). The native
kernel runs those tiles (m = 33 takes m_tile 40)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax.bench_kernels_quant import quantized_as
from atlasjax.gguf_blocks import like_gguf
from atlasjax.quantization import quantize
from pallas_kernels import rows_matmul as rows
from pallas_kernels.quant_format import dequantize, permuted_like_mma_order, with_mma_order

ON_GPU = jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the native Mosaic GPU kernel)")


def _error(m, k, n, *, fmt="int4", zeros="zp", group_size=128, m_tile=64, seed=0, interpret=True,
           out_dtype=jnp.float32, k_splits=1):
    rng = np.random.default_rng(seed)
    qw = quantized_as(rng.standard_normal((k, n)).astype(np.float32), fmt, group_size, zeros)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw), precision=jax.lax.Precision.HIGHEST))
    if qw.mma_order and fmt == "int8":   # as quantized_matmul runs it: x permuted like the weight's K
        x, qw = permuted_like_mma_order(x, qw)
    y = rows.rows_matmul(x, qw, m_tile=m_tile, interpret=interpret, out_dtype=out_dtype, k_splits=k_splits)
    assert y.shape == (m, n) and y.dtype == out_dtype
    return float(np.linalg.norm(np.asarray(y, np.float32) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m,m_tile", [(3, 16), (130, 64)])
def test_interpret_matches_the_reference(symmetric, m, m_tile):
    # 130 rows: three M tiles, the last mostly padding; K = 384 (three groups); N = 200 pads to 256
    assert _error(m, 384, 200, zeros="sym" if symmetric else "zp", m_tile=m_tile) < 4e-3   # the bf16 rounding of (q - z) s


def test_interpret_groups_of_256_and_bf16_output():
    assert _error(24, 512, 128, group_size=256, m_tile=24, out_dtype=jnp.bfloat16) < 6e-3


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_interpret_per_channel_8_bit(fmt):
    # exact codes in the wgmma, the channel scale on the f32 result: the decode kernels' error
    assert _error(130, 256, 256, fmt=fmt, zeros="sym", group_size=None, m_tile=64) < 2.5e-3


@pytest.mark.parametrize("fmt,group_size,zeros", [
    ("int4", 32, "sym"), ("int4", 32, "offsets"), ("int4", 32, "two_level"),   # GGUF Q4_0, Q4_1, Q4_K
    ("int4", 64, "zp"), ("int8", 32, "sym"), ("fp8", 128, "sym")])             # GPTQ g64, Q8_0, block FP8
def test_interpret_grouped_formats(fmt, group_size, zeros):
    # each group's scale (and offset) rounded to bf16 into the tile, as dequantize-then-dot rounds
    assert _error(40, 512, 128, fmt=fmt, group_size=group_size, zeros=zeros, m_tile=40) < 5e-3


@pytest.mark.parametrize("fmt,group_size,zeros,k,k_splits", [
    ("int4", 128, "zp", 512, 2), ("int4", 128, "zp", 512, 4), ("int4", 256, "zp", 1024, 2),
    ("int4", 32, "two_level", 512, 2), ("fp8", None, "sym", 512, 2), ("int8", 32, "sym", 512, 4)])
def test_interpret_k_split(fmt, group_size, zeros, k, k_splits):
    # each part of K from its own weight columns and group rows, the f32 partials summed after
    assert _error(20, k, 256, fmt=fmt, group_size=group_size, zeros=zeros, m_tile=24, out_dtype=jnp.bfloat16,
                  k_splits=k_splits) < 6e-3


def test_what_it_does_not_take_is_refused():
    w = np.ones((256, 128), np.float32)
    assert not rows.fits(with_mma_order(quantize(w, "int4", group_size=32, symmetric=True), False))   # int4: mma order
    assert not rows.fits(quantize(w, "int4", group_size=128, symmetric=True), m_tile=12)   # tiles of whole 8-row blocks
    in_mma_order = with_mma_order(quantize(w, "int8"))   # as the decode matmul wants int8
    assert in_mma_order.mma_order and not rows.fits(in_mma_order)   # quantized_matmul permutes x first:
    assert rows.fits(permuted_like_mma_order(jnp.zeros((1, 256)), in_mma_order)[1])
    assert rows.fits(quantize(w, "int8")) and rows.fits(quantize(w, "fp8"))
    assert rows.fits(quantize(w, "int4", group_size=128, symmetric=False))
    assert not rows.fits(quantize(w, "int4", group_size=128), k_splits=3)   # K splits of whole steps
    assert not rows.fits(quantize(w, "int4", group_size=256), k_splits=2)   # and whole groups
    assert not rows.fits(like_gguf(np.ones((256, 128), np.float32), "Q4_K"), k_splits=2)   # and super-groups
    with pytest.raises(ValueError, match="does not take"):
        rows.rows_matmul(jnp.zeros((4, 256), jnp.bfloat16), quantize(w, "int4", group_size=128, symmetric=True),
                         m_tile=12, interpret=True)


def _int4(k, n):
    return quantize(np.ones((k, n), np.float32), "int4", group_size=128, symmetric=True)


@pytest.fixture(scope="module")
def llama_8b():
    return {"gate_up": _int4(4096, 28672), "down": _int4(14336, 4096), "qkv": _int4(4096, 6144),
            "o_proj": _int4(4096, 4096)}


def test_tiles_of_256_rows_where_they_take_fewer_waves_and_fit(llama_8b, monkeypatch):
    # the tile the H100 measured faster at the 8B's shapes (session 37, where the two differed by
    # over 1%), on 132 SMs, where K is not split
    monkeypatch.setattr(rows, "num_sms", lambda: 132)
    picks = {("gate_up", 256): 256, ("gate_up", 1024): 256, ("gate_up", 2048): 256, ("down", 512): 128,
             ("down", 1024): 256, ("down", 2048): 256, ("qkv", 256): 128, ("qkv", 512): 256, ("qkv", 1024): 128,
             ("qkv", 2048): 256, ("o_proj", 512): 128, ("o_proj", 1024): 256, ("o_proj", 2048): 256}
    assert {(w, m): rows.plan_for(m, llama_8b[w]) for w, m in picks} == {key: (tile, 1) for key, tile in picks.items()}
    assert rows.plan_for(2048, llama_8b["gate_up"], jnp.float32)[0] == 128   # f32 tiles of 256 rows do not fit beside the ring
    assert rows.plan_for(2048, quantize(np.ones((128, 28672), np.float32), "fp8"))[0] == 128   # nor 8-bit weights'
    qw = _int4(128, 128)
    assert rows.fits(qw, 256) and not rows.fits(qw, 256, jnp.float32) and rows.fits(qw, 128, jnp.float32)


def test_k_split_where_the_n_blocks_leave_sms_idle(llama_8b, monkeypatch):
    # down and o_proj (N = 4096: 32 blocks of 128) at 129-256 rows run 64 blocks on 132 SMs; qkv's 96
    # and gate_up's 448 do not gain enough to pay for the f32 partials, nor do the 8B's weights at 512
    # rows. Narrower weights split further (the fastest split measured in each case, session 38).
    monkeypatch.setattr(rows, "num_sms", lambda: 132)
    assert [rows.plan_for(m, llama_8b["down"]) for m in (129, 256, 512)] == [(128, 2), (128, 2), (128, 1)]
    assert rows.plan_for(200, llama_8b["o_proj"]) == (128, 2)
    assert rows.plan_for(256, llama_8b["qkv"]) == (128, 1) and rows.plan_for(256, llama_8b["gate_up"]) == (256, 1)
    assert rows.plan_for(256, _int4(4096, 1024)) == (128, 4)   # a GGUF layout's own k or v: 16 blocks unsplit
    small = _int4(2048, 2048)                                  # Llama-3.2-1B's o_proj
    assert rows.plan_for(256, small) == (128, 4) and rows.plan_for(512, small) == (128, 2)


def test_a_decode_batch_is_one_m_tile_with_k_split_where_blocks_are_few(llama_8b, monkeypatch):
    # 33-128 rows (session 39, the fastest measured on the H100 at 32-128 rows): one M tile of
    # every row (padded to 8); down and o_proj (32 blocks) in four parts of K; gate_up's 224 blocks
    # are two waves already
    monkeypatch.setattr(rows, "num_sms", lambda: 132)
    for m in (33, 64, 96, 128):
        tile = -(-m // 8) * 8
        assert rows.plan_for(m, llama_8b["down"]) == (tile, 4), m
        assert rows.plan_for(m, llama_8b["o_proj"]) == (tile, 4), m
        assert rows.plan_for(m, llama_8b["gate_up"]) == (tile, 1), m
    assert not rows.pays(llama_8b["down"], rows.MIN_ROWS) and rows.pays(llama_8b["down"], rows.MIN_ROWS + 1)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096)])
@pytest.mark.parametrize("m,m_tile,out_dtype", [(129, 128, jnp.float32), (512, 128, jnp.bfloat16),
                                                (700, 256, jnp.bfloat16)])
def test_native_llama_8b_shapes(k, n, m, m_tile, out_dtype):
    assert _error(m, k, n, m_tile=m_tile, interpret=False, seed=m, out_dtype=out_dtype) < 6e-3


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt,group_size,zeros", [("int4", 128, "zp"), ("int4", 32, "two_level"), ("fp8", None, "sym")])
@pytest.mark.parametrize("k_splits", [2, 4])
def test_native_k_split(fmt, group_size, zeros, k_splits):
    assert _error(256, 14336, 4096, fmt=fmt, group_size=group_size, zeros=zeros, m_tile=128, interpret=False,
                  out_dtype=jnp.bfloat16, k_splits=k_splits) < 7e-3


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt,group_size,zeros", [("int4", 128, "zp"), ("int4", 32, "two_level"), ("fp8", None, "sym"),
                                                  ("int8", None, "sym")])
@pytest.mark.parametrize("m,k_splits", [(33, 4), (64, 2), (100, 1)])
def test_native_decode_batch_as_one_m_tile(fmt, group_size, zeros, m, k_splits):
    # a decode batch of 33-128 rows: one M tile of every row padded to 8 (session 39)
    assert _error(m, 14336, 4096, fmt=fmt, group_size=group_size, zeros=zeros, m_tile=-(-m // 8) * 8,
                  interpret=False, seed=m, out_dtype=jnp.bfloat16, k_splits=k_splits) < 7e-3


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("k,n,m", [(4096, 6144, 129), (14336, 4096, 600)])
def test_native_per_channel_8_bit(fmt, k, n, m):
    assert _error(m, k, n, fmt=fmt, zeros="sym", group_size=None, m_tile=128, interpret=False, seed=m, out_dtype=jnp.bfloat16) < 6e-3


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt,group_size,zeros", [
    ("int4", 32, "sym"), ("int4", 32, "offsets"), ("int4", 32, "two_level"), ("int4", 64, "zp"), ("int8", 32, "sym"),
    ("fp8", 128, "sym")])
def test_native_grouped_formats(fmt, group_size, zeros):
    assert _error(300, 14336, 4096, fmt=fmt, group_size=group_size, zeros=zeros, m_tile=128, interpret=False,
                  out_dtype=jnp.bfloat16) < 7e-3


def test_wide_8bit_weights_leave_the_kernel_from_1024_rows(monkeypatch):
    # H200, 1,024 rows (session 86): weights of 16,384+ columns ran 4-20% faster as the dequantized copy
    # through XLA's GEMM, narrower ones on this kernel; below 1,024 rows (H100, session 88) the kernel was
    # as fast or faster; int4 stays on the kernel at any count
    import pallas_kernels.quantized_matmul_rules as qm
    monkeypatch.setattr(rows, "WIDE_8BIT_N", 256)
    monkeypatch.setattr(qm, "CONVERT_FUSED_MAX_ELEMS", 256 * 128)   # the wide weight is past the o_proj-sized exception
    for fmt, group_size in (("fp8", None), ("int8", None), ("int8", 32)):
        narrow, wide = (quantize(np.ones((256, n), np.float32), fmt, group_size=group_size) for n in (128, 256))
        assert rows.pays(narrow, 512) and rows.pays(narrow, rows.MAX_8BIT_ROWS), fmt
        assert rows.pays(wide, 768) and rows.pays(wide, 1023) and not rows.pays(wide, 1024), fmt
        assert not rows.pays(narrow, rows.MAX_8BIT_ROWS + 1), fmt
        if group_size is None:   # nor XLA's convert-fused GEMM: the copy runs them
            assert qm.convert_fused_pays(wide, 512) and not qm.convert_fused_pays(wide, 1024)
            assert qm.convert_fused_pays(narrow, 1024)
    assert rows.pays(_int4(256, 256), 4096)


def test_deep_int8_weights_leave_the_kernel_from_1024_rows(monkeypatch):
    # H200, 1,024 rows (sessions 86-87): the 8B / Qwen3-8B / 70B downs ran 2-9% faster as the copy in int8
    # (per channel or Q8_0's groups), faster on this kernel in fp8; shallower weights stay on it
    monkeypatch.setattr(rows, "DEEP_INT8_K", 512)
    for fmt, group_size in (("fp8", None), ("int8", None), ("int8", 32)):
        shallow, deep = (quantize(np.ones((k, 128), np.float32), fmt, group_size=group_size) for k in (256, 512))
        assert rows.pays(shallow, rows.MAX_8BIT_ROWS), fmt
        assert rows.pays(deep, 768) and rows.pays(deep, 1023), fmt
        assert rows.pays(deep, 1024) == (fmt == "fp8"), fmt
    assert rows.pays(_int4(512, 128), 4096)

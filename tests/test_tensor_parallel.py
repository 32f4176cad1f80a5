"""Tensor parallelism on 8 CPU devices (XLA_FLAGS in conftest): TP 2/4/8 equals the single-device engine.

Cases: llama with 8 heads / 2 KV heads (KV heads replicated at TP 4 and 8), qwen3 with 1 KV head,
q/k norm, tied embeddings and a 500-token vocab (padded to split over 8), qwen2 with qkv bias.
"""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import atlasjax.loader as loader
from atlasjax import LLM, SamplingParams
from atlasjax.errors import EngineConfigError
from models.layers import is_quantized
from pallas_kernels.quant_format import dequantize
from tests.gguf_writer_util import Q, write_gguf_from_hf

ENGINE = dict(max_num_seqs=4, max_model_len=96, page_size=16, max_num_batched_tokens=32)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1)
PROMPT_LENS = (3, 19, 45)   # 45 > the 32-token budget: chunked prefill


def _prompts(vocab: int, seed: int = 0):
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(0, vocab, size=n)] for n in PROMPT_LENS]


def _run(llm, prompts):
    outs = llm.generate(prompts, PARAMS)
    tokens = [o.outputs[0].token_ids for o in outs]
    gen_lp = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    prompt_lp = [[d[p].logprob for d, p in zip(o.prompt_logprobs[1:], prompt[1:])] for o, prompt in zip(outs, prompts)]
    return tokens, gen_lp, prompt_lp


def _assert_same(got, want, label):
    tokens, gen_lp, prompt_lp = got
    assert tokens == want[0], f"{label}: greedy tokens differ from the single-device engine"
    for a, b in zip(gen_lp + prompt_lp, want[1] + want[2]):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=label)


@pytest.fixture(scope="module", params=["llama_gqa4", "qwen3_tp", "qwen2_tp"])
def case(request, hf_model_factory):
    _, path = hf_model_factory(request.param)
    vocab = 512 if request.param == "llama_gqa4" else 500
    prompts = _prompts(vocab)
    return request.param, path, prompts, _run(LLM(path, **ENGINE), prompts)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_equals_single_device(case, tp):
    name, path, prompts, reference = case
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
    _assert_same(_run(llm, prompts), reference, f"{name} TP={tp}")
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages   # every page returned


def _spec_dims(array) -> list[int]:
    """Which dims of a placed array are split over the `model` mesh axis."""
    assert isinstance(array.sharding, NamedSharding)
    return [i for i, axis in enumerate(array.sharding.spec) if axis == "model"]


def test_every_big_matrix_and_the_kv_pool_are_sharded(hf_model_factory):
    _, path = hf_model_factory("llama_gqa4")
    tp = 4
    engine = LLM(path, tensor_parallel_size=tp, **ENGINE).engine
    params = engine.runner.params
    expect = {("embed_tokens", "embedding"): 0, ("lm_head", "kernel"): 1}
    for i in range(2):
        for proj, dim in (("qkv_proj", 1), ("o_proj", 0)):   # the runner executes fused q/k/v and gate/up
            expect[(f"layers_{i}", "self_attn", proj, "kernel")] = dim
        for proj, dim in (("gate_up_proj", 1), ("down_proj", 0)):
            expect[(f"layers_{i}", "mlp", proj, "kernel")] = dim
    flat = dict(loader._flatten(params))
    for path_, leaf in flat.items():
        if path_ in expect:
            dim = expect[path_]
            assert _spec_dims(leaf) == [dim], path_
            shard = leaf.addressable_shards[0].data.shape
            assert shard[dim] * tp == leaf.shape[dim], f"{path_}: each device must hold 1/{tp}, got {shard}"
        else:   # norms: small vectors, replicated
            assert leaf.ndim == 1 and leaf.sharding.is_fully_replicated, path_
    assert set(expect) <= set(flat)
    # 2 KV heads over 4 devices: each head replicated twice, one per device.
    for k_pages, v_pages in engine.runner.state.kv:
        for pool in (k_pages, v_pages):
            assert _spec_dims(pool) == [0] and pool.shape[0] == tp
            assert pool.addressable_shards[0].data.shape[0] == 1


def test_safetensors_are_read_in_slices(hf_model_factory, monkeypatch):
    """No sharded tensor is read whole: each device's slice comes straight from the file."""
    _, path = hf_model_factory("qwen2_tp")
    whole_reads = []
    original = loader.TensorReader.__call__

    def spy(self):
        whole_reads.append(self.shape)
        return original(self)
    monkeypatch.setattr(loader.TensorReader, "__call__", spy)
    LLM(path, tensor_parallel_size=2, **ENGINE)
    assert whole_reads and all(len(shape) == 1 for shape in whole_reads), whole_reads   # only norm vectors


def test_int8_quantized_model_splits_per_device(hf_model_factory):
    name, prompts = "llama_gqa4", _prompts(512, seed=3)
    _, path = hf_model_factory(name)
    one = _run(LLM(path, quantization="int8", **ENGINE), prompts)
    llm = LLM(path, quantization="int8", tensor_parallel_size=2, **ENGINE)
    q = llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert is_quantized(q) and q.qweight.shape[0] == 2 and _spec_dims(q.qweight) == [0]
    _assert_same(_run(llm, prompts), one, "int8 TP=2")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=["Q8_0", "Q4_0"])   # Q4_0: int4 in mma order, split along K
def test_gguf_blocks_stay_quantized_and_split(hf_model_factory, tmp_path, qtype):
    hf, path = hf_model_factory("llama_gqa4")
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf_from_hf(path, hf.config, gguf_path, qtype=qtype)
    prompts = _prompts(256, seed=4)   # the writer's byte vocabulary is not used: token ids go in directly
    one = _run(LLM(str(gguf_path), keep_gguf_quantized=True, **ENGINE), prompts)
    llm = LLM(str(gguf_path), keep_gguf_quantized=True, tensor_parallel_size=2, **ENGINE)   # K/2 keeps whole 32-blocks
    assert is_quantized(llm.engine.runner.params["layers_1"]["self_attn"]["qkv_proj"]["kernel"])
    down = llm.engine.runner.params["layers_1"]["mlp"]["down_proj"]["kernel"]   # row-parallel: split along K
    assert is_quantized(down) and down.mma_order == (qtype == Q.Q4_0)
    head = llm.engine.runner.params["lm_head"]["kernel"]   # untied output.weight: kept, split over the vocab
    assert is_quantized(head) and head.qweight.shape[0] == 2
    _assert_same(_run(llm, prompts), one, f"GGUF {qtype.name} TP=2")


def test_gguf_q4_k_two_level_rows_split(tmp_path):
    # Q4_K's two-level rows (uint8 under float16 rows per 256) split along N as they are and along K
    # in whole super-blocks (down: K 512 into 256s); a cut inside one (o_proj: K 256 into 128s)
    # multiplies that weight's rows out. Either way TP=2 computes what one device does.
    from tests.test_gguf_blocks import _write_k_quant_llama
    path = _write_k_quant_llama(tmp_path / "q4_k.gguf", more_bits=False)
    prompts = _prompts(256, seed=6)
    one = _run(LLM(path, keep_gguf_quantized=True, **ENGINE), prompts)
    llm = LLM(path, keep_gguf_quantized=True, tensor_parallel_size=2, **ENGINE)
    layer = llm.engine.runner.params["layers_0"]
    assert layer["mlp"]["gate_up_proj"]["kernel"].two_level and layer["mlp"]["down_proj"]["kernel"].two_level
    assert layer["mlp"]["down_proj"]["kernel"].super_scales.shape[:2] == (2, 1)   # per device: K 256 = one super row
    assert not layer["self_attn"]["o_proj"]["kernel"].two_level
    _assert_same(_run(llm, prompts), one, "GGUF Q4_K TP=2")


# int4 with zero points and int8 groups split along K (o_proj's K of 64 halves into whole groups of 32)
@pytest.mark.parametrize("fmt", ["awq-g32", "gptq-8bit", "fp8-channel"])
def test_prequantized_checkpoint_stays_quantized_and_splits(hf_model_factory, tmp_path, fmt):
    import transformers

    from tests.prequantized_writers import write_prequantized
    _, path = hf_model_factory("llama_gqa4")
    write_prequantized(transformers.AutoModelForCausalLM.from_pretrained(path), str(tmp_path), fmt)
    prompts = _prompts(512, seed=5)
    one = _run(LLM(str(tmp_path), **ENGINE), prompts)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)
    down = llm.engine.runner.params["layers_1"]["mlp"]["down_proj"]["kernel"]   # row-parallel: split along K
    assert is_quantized(down) and down.qweight.shape[0] == 2 and _spec_dims(down.qweight) == [0]
    _assert_same(_run(llm, prompts), one, f"{fmt} TP=2")


def _same_tree(a, b):
    fa, fb = dict(loader._flatten(a)), dict(loader._flatten(b))
    assert fa.keys() == fb.keys()
    for key, x in fa.items():
        y = fb[key]
        if is_quantized(x):
            assert (x.shape, x.format, x.group_size) == (y.shape, y.format, y.group_size), key
            x, y = dequantize(x), dequantize(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(key))


@pytest.mark.parametrize("name, tp, quant", [("llama_gqa4", 4, None), ("qwen3_tp", 8, None), ("qwen2_tp", 2, "int8")],
                         ids=["kv_replicated", "padded_vocab", "int8"])
def test_checkpoint_params_under_tp_equal_the_single_device_ones(hf_model_factory, name, tp, quant):
    """What LLM.save writes: the checkpoint layout whole, KV replicas taken once, vocab padding dropped,
    per-device quantized weights joined."""
    _, path = hf_model_factory(name)
    one = LLM(path, quantization=quant, **ENGINE).engine.runner.checkpoint_params()
    sharded = LLM(path, quantization=quant, tensor_parallel_size=tp, **ENGINE).engine.runner.checkpoint_params()
    _same_tree(sharded, one)


@pytest.mark.parametrize("name, tp, quant", [("llama_gqa4", 4, None), ("qwen3_tp", 8, "int8"), ("qwen2_tp", 8, "fp8")],
                         ids=["kv_replicated", "padded_vocab_int8", "fp8_head_padded_vocab"])
def test_gather_onto_one_device_and_back_stays_on_the_devices(hf_model_factory, name, tp, quant):
    """The calibrations at start (atlasjax/model_source.py) gather a TP tree onto the first device and
    place it on the mesh again. Neither move may pass through the host (jax's transfer guard refuses
    any device <-> host copy here); the gathered tree is the host gather's, and placing it gives back
    the same shards."""
    from atlasjax.sharding import logical_axes  # noqa: PLC0415
    _, path = hf_model_factory(name)
    runner = LLM(path, quantization=quant, quantize_lm_head=quant is not None, tensor_parallel_size=tp,
                 **ENGINE).engine.runner
    plan, logical, first = runner.plan, logical_axes(runner.cfg, runner.dtype), jax.devices()[0]
    sharded = runner.per_projection_params()
    with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
        gathered = plan.gather(sharded, logical, device=first)
        placed = plan.shard_params(gathered, logical)
    assert all(leaf.devices() == {first} for leaf in jax.tree.leaves(gathered))
    _same_tree(gathered, plan.gather(sharded, logical))
    got, want = jax.tree.leaves(placed), jax.tree.leaves(sharded)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_model_saved_under_tp_loads_on_one_device(hf_model_factory, tmp_path):
    _, path = hf_model_factory("llama_gqa4")
    prompts = _prompts(512, seed=5)
    LLM(path, tensor_parallel_size=4, **ENGINE).save(str(tmp_path / "saved"))
    _assert_same(_run(LLM(str(tmp_path / "saved"), **ENGINE), prompts), _run(LLM(path, **ENGINE), prompts),
                 "saved at TP=4, loaded on one device")


@pytest.mark.parametrize("tp, message", [(3, "num_heads=8 is not divisible"), (16, "only 8 device")])
def test_impossible_tensor_parallel_size_is_a_clear_error(hf_model_factory, tp, message):
    _, path = hf_model_factory("llama_gqa4")
    with pytest.raises(EngineConfigError, match=message):
        LLM(path, tensor_parallel_size=tp, **ENGINE)
    assert len(jax.devices()) == 8


def test_multi_step_decoding_under_tp_equals_single_device(case):
    name, path, prompts, reference = case
    llm = LLM(path, tensor_parallel_size=2, num_scheduler_steps=4, **ENGINE)
    _assert_same(_run(llm, prompts), reference, f"{name} TP=2, 4 steps per launch")
    assert any(k[0] == "decode" and len(k) == 4 for k in llm.engine.runner._compiled)
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


def test_decode_buckets_under_tp_equal_single_device(case):
    """Smaller decode buckets (rows gathered from their slots) on a mesh: the long prompt's chunked
    prefill leaves the other two decoding in a 2-row step first."""
    name, path, prompts, reference = case
    llm = LLM(path, tensor_parallel_size=2, decode_batch_sizes=(1, 2), **ENGINE)
    _assert_same(_run(llm, prompts), reference, f"{name} TP=2, decode buckets (1, 2, 4)")
    rows = {k[1] for k in llm.engine.runner._compiled if k[0] == "decode"}
    assert rows & {1, 2}, f"no small decode bucket ran: {rows}"
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


def test_compile_at_start_under_tp_equal_single_device(case):
    """Steps compiled against the sharded pool's shapes before it exists, as a TP server starts."""
    name, path, prompts, reference = case
    llm = LLM(path, tensor_parallel_size=2, decode_batch_sizes=(2,), compile_at_start=True, **ENGINE)
    before = set(llm.engine.runner._compiled)
    _assert_same(_run(llm, prompts), reference, f"{name} TP=2, compiled at start")
    assert set(llm.engine.runner._compiled) == before     # nothing more compiles, prompt logprobs included


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_8bit_activations_split_per_device(hf_model_factory, fmt, tmp_path):
    """W8A8 under TP=2: a row-parallel shard rounds its own slice of each token to e4m3 / int8 (its
    own scale), so the logprobs are not bit-equal to one device's; they must stay as close to the float
    model as one device's W8A8, with the same greedy tokens. Both load one saved quantized checkpoint
    (int8 weights quantized at load are smoothed first: the next test)."""
    _, path = hf_model_factory("llama_gqa4")
    engine = dict(max_num_seqs=2, max_model_len=320, page_size=16, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    prompt = [int(t) for t in np.random.RandomState(5).randint(0, 512, size=300)]   # one 256-token chunk + rest

    def run(llm):
        out = llm.generate([prompt], params)[0]
        lps = np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        return lps, out.outputs[0].token_ids
    ref, _ = run(LLM(path, **engine))
    LLM(path, quantization=fmt, max_num_seqs=2, max_model_len=128).save(str(tmp_path / fmt))
    one, one_tokens = run(LLM(str(tmp_path / fmt), activation_quantization=fmt, **engine))
    llm = LLM(str(tmp_path / fmt), activation_quantization=fmt, tensor_parallel_size=2, **engine)
    assert f"{fmt} activations" in llm.engine.weights_summary
    q = llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert q.activations == fmt and _spec_dims(q.qweight) == [0]
    two, two_tokens = run(llm)
    assert two_tokens == one_tokens
    assert np.abs(two - ref).mean() <= 1.25 * np.abs(one - ref).mean()
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


def test_int8_activations_smoothed_under_tensor_parallelism(hf_model_factory):
    """int8 weights quantized at load for int8 activations are smoothed under TP=2 as on one device
    (atlasjax/smoothing.py; the float model gathered, smoothed and quantized, then placed again):
    every shard holds one device's smoothed int8 weights, and the greedy tokens and logprobs match it."""
    _, path = hf_model_factory("llama_gqa4")
    engine = dict(max_num_seqs=2, max_model_len=320, page_size=16, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    prompt = [int(t) for t in np.random.RandomState(6).randint(0, 512, size=300)]

    def run(llm):
        out = llm.generate([prompt], params)[0]
        lps = np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        return lps, out.outputs[0].token_ids
    w8a8 = dict(quantization="int8", activation_quantization="int8", **engine)
    float_llm = LLM(path, **engine)
    ref, _ = run(float_llm)
    one_llm = LLM(path, **w8a8)
    one, one_tokens = run(one_llm)
    llm = LLM(path, tensor_parallel_size=2, **w8a8)
    two, two_tokens = run(llm)
    assert two_tokens == one_tokens
    assert np.abs(two - ref).mean() <= 1.25 * np.abs(one - ref).mean()
    float_layer = float_llm.engine.runner.checkpoint_params()["layers_0"]
    one_layer = one_llm.engine.runner.checkpoint_params()["layers_0"]
    two_layer = llm.engine.runner.checkpoint_params()["layers_0"]
    # smoothed: the input norm's scale moved, as one device moved it, and the int8 codes are one device's
    norm = [np.asarray(layer["input_layernorm"]["scale"], np.float32) for layer in (float_layer, one_layer, two_layer)]
    assert not np.allclose(norm[1], norm[0])
    np.testing.assert_array_equal(norm[2], norm[1])
    for block, name in (("self_attn", "q_proj"), ("mlp", "down_proj")):
        got, want = (np.asarray(dequantize(layer[block][name]["kernel"])) for layer in (two_layer, one_layer))
        np.testing.assert_array_equal(got, want)
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages

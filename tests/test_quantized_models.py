"""Quantized models: KL divergence to the unquantized model, and the Paris check on 4-bit and int8;
a Q4_K_M rewrite of the default kept quantized, against the same file dequantized.

The reference is the embedded SmolLM2 with its GGUF weights dequantized to float32. Bounds are
measured on this model (docs/quantization.md): int8 and fp8 are near-lossless; int4 (group 128,
re-quantizing already 4-bit weights) is documented, not near-lossless.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from models.attention import AttentionMetadata
from models.transformer import Transformer, init_kv_cache

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "In 1969, astronauts first",
           "Water boils at a temperature of"]
KL_BOUNDS = {"int8": 0.01, "fp8": 0.035, "int4": 0.55, "gguf-q4_1": 0.0}   # mean nats per token


def _full_logprobs(engine, ids, kv_dtype=jnp.float32):
    """log-softmax over the vocabulary at every prompt position, one sequence, no cache reuse; the
    prompt's K/V written to a pool of `kv_dtype` and read back by its own attention."""
    cfg, ps = engine.model_config, 16
    n = len(ids)
    num_pages = -(-n // ps)
    model = Transformer(cfg, attn_backend="reference", dtype=jnp.float32)
    kv = init_kv_cache(cfg, num_pages, ps, kv_dtype)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n), page_table=jnp.arange(num_pages)[None],
                             seq_lens=jnp.array([n]), query_start=jnp.array([0, n]), num_seqs=jnp.array(1))
    params = {"params": engine.runner.checkpoint_params()}
    hidden, _ = model.apply(params, jnp.array(ids), jnp.arange(n), kv, meta)
    return np.asarray(jax.nn.log_softmax(model.apply(params, hidden, method=Transformer.logits), axis=-1))


@pytest.fixture(scope="module")
def reference(default_model_path):
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, keep_gguf_quantized=False)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    return ids, [_full_logprobs(llm.engine, i) for i in ids]


@pytest.mark.parametrize("mode", ["gguf-q4_1", "int8", "fp8", "int4"])
def test_mean_kl_to_the_unquantized_model(default_model_path, reference, mode):
    kwargs = dict(keep_gguf_quantized=True) if mode == "gguf-q4_1" else dict(quantization=mode)
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, **kwargs)
    ids, ref = reference
    kls = []
    for i, r in zip(ids, ref):
        q = _full_logprobs(llm.engine, i)
        kls.append(np.sum(np.exp(r) * (r - q), axis=-1).mean())
    kl = float(np.mean(kls))
    print(f"{mode}: mean KL {kl:.5f} nats/token")
    assert kl <= KL_BOUNDS[mode] + 1e-4, f"{mode} KL {kl}"


@pytest.mark.parametrize("kwargs", [dict(keep_gguf_quantized=True), dict(quantization="int8")], ids=["own-4bit", "int8"])
def test_quantized_default_still_answers_paris(default_model_path, kwargs):
    llm = LLM(default_model_path, max_num_seqs=2, max_model_len=256, **kwargs)
    leaf = llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert hasattr(leaf, "qweight"), "projections must stay quantized on device"
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text


# -- a Q4_K_M file ---------------------------------------------------------------------------------
# llama.cpp's Q4_K_M: Q4_K everywhere but attn_v and ffn_down of some layers (Q6_K); rows whose length
# is not a multiple of 256 fall back to Q5_0 (for Q4_K) and Q8_0 (for Q6_K). On SmolLM2 (hidden 576)
# that makes every projection but ffn_down Q5_0 / Q8_0, and ffn_down Q4_K / Q6_K.
# Mean nats per token, kept blocks against the same file dequantized (measured 0.00063). No Paris check
# here: this file re-quantizes SmolLM2's Q4_1 weights into Q4_K by plain rounding, which already costs
# the answer with the weights dequantized.
Q4_K_M_KL_BOUND = 0.001


def _q4_k_m_type(name: str, array: np.ndarray, num_layers: int):
    from gguf import GGMLQuantizationType as Q
    from atlasjax.bench.gguf_layouts import use_more_bits
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    more_bits = use_more_bits(layer, num_layers)
    wide = name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits or name == "token_embd.weight"
    if array.shape[1] % 256:
        return Q.Q8_0 if wide else Q.Q5_0
    return Q.Q6_K if wide else Q.Q4_K


@pytest.fixture(scope="module")
def q4_k_m_path(default_model_path, tmp_path_factory):
    """The embedded SmolLM2's weights written again as a Q4_K_M GGUF, with its own tokenizer and template."""
    import gguf

    from atlasjax.gguf_loader import _parse_header, load_gguf
    from tests.gguf_kquant_encoders import encode_q4_k, encode_q6_k
    from tests.gguf_writer_util import write_gguf_from_hf
    source = load_gguf(default_model_path)
    meta, _ = _parse_header(default_model_path)
    layers = source.config["num_hidden_layers"]
    encoders = {gguf.GGMLQuantizationType.Q4_K: encode_q4_k, gguf.GGMLQuantizationType.Q6_K: encode_q6_k}

    def encode(name, array):
        if array.ndim == 1:
            return array, gguf.GGMLQuantizationType.F32
        qtype = _q4_k_m_type(name, array, layers)
        return encoders.get(qtype, lambda a: gguf.quants.quantize(a, qtype))(array), qtype

    path = tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    state = {name: t.dequantize() for name, t in source.tensors.items()}
    tokenizer = {k.removeprefix("tokenizer.ggml."): v.tolist() if hasattr(v, "tolist") else v
                 for k, v in meta.items() if k.startswith("tokenizer.")}
    written = write_gguf_from_hf(state, source.config, path, tokenizer=tokenizer, encode=encode)
    assert {t for _, t in written.values()} >= {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K}
    return str(path)


def test_q4_k_m_file_kept_quantized_matches_it_dequantized(q4_k_m_path):
    ref = LLM(q4_k_m_path, max_num_seqs=2, max_model_len=256, keep_gguf_quantized=False)
    kept = LLM(q4_k_m_path, max_num_seqs=2, max_model_len=256, keep_gguf_quantized=True)
    formats = {(name, getattr(layer["mlp"]["down_proj"]["kernel"], "format", None))
               for name, layer in kept.engine.runner.params.items() if name.startswith("layers_")}
    assert {f for _, f in formats} == {"int4", "int8"}   # Q4_K and Q6_K down projections, kept
    attn = kept.engine.runner.params["layers_0"]["self_attn"]
    q = (attn["qkv_proj"] if "qkv_proj" in attn else attn["q_proj"])["kernel"]
    assert q.format == "int8" and q.group_size == 32   # Q5_0, kept exactly
    kls = []
    for prompt in PROMPTS:
        ids = ref.tokenizer.encode(prompt)
        r, q = _full_logprobs(ref.engine, ids), _full_logprobs(kept.engine, ids)
        kls.append(np.sum(np.exp(r) * (r - q), axis=-1).mean())
    kl = float(np.mean(kls))
    print(f"Q4_K_M kept: mean KL {kl:.6f} nats/token")
    assert kl <= Q4_K_M_KL_BOUND, kl

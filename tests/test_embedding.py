"""Embeddings (`LLM.embed`, `LLM.score`): the pooled final hidden states must equal Hugging Face's on the
same weights, whatever the batch they are computed in; the model's sentence-transformers config must
choose the pooling; dimensions, normalize and truncate_prompt_tokens must do what vLLM's do; a base-model
checkpoint (unprefixed names, no LM head: how embedding models ship) must load; bad input must get a
clear error and leave the engine serving."""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch

from atlasjax import LLM, PoolingParams, SamplingParams
from atlasjax.embedding import MAX_SEQS, batch_tokens, plan_batches
from atlasjax.errors import EngineConfigError, InvalidRequestError, UnsupportedModelError
from atlasjax.pooling import read_pooler_config

# A GPU runs float32 matmuls in TF32 (about 1e-3 relative) and its kernels differ by batch shape.
ON_GPU = jax.default_backend() == "gpu"
UNIT_TOL = 2e-3 if ON_GPU else 2e-5      # normalized vectors against Hugging Face
RAW_TOL = 1e-2 if ON_GPU else 1e-4       # un-normalized ones (values up to ~2)
SAME_TOL = 1e-4 if ON_GPU else 1e-6      # the engine against itself in another batch
KW = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, dtype="float32")   # float32 on a GPU too
PROMPTS = [list(range(3, 20)), list(range(40, 45)), list(range(100, 170)), [7]]


@pytest.fixture(scope="module")
def qwen3(hf_model_factory):
    model, d = hf_model_factory("qwen3")
    return model, d, LLM(d, **KW)


def _hf_hidden(model, ids) -> np.ndarray:
    """Hugging Face's final-norm hidden states [len, hidden] for one sequence, float64."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def _unit(v):
    return v / np.linalg.norm(v)


def _vectors(outputs) -> list[np.ndarray]:
    return [np.array(o.outputs.embedding) for o in outputs]


def test_last_token_pooling_matches_hugging_face_in_any_batch(qwen3):
    model, _, llm = qwen3
    together = _vectors(llm.embed(PROMPTS))
    for ids, got in zip(PROMPTS, together):
        np.testing.assert_allclose(got, _unit(_hf_hidden(model, ids)[-1]), atol=UNIT_TOL)
        np.testing.assert_allclose(got, _vectors(llm.embed([ids]))[0], atol=SAME_TOL)   # alone = in a batch
    out = llm.embed("w1 w2" if llm.tokenizer else PROMPTS[0])[0]
    assert out.finished and out.prompt_token_ids and len(out.outputs.embedding) == llm.engine.model_config.hidden_size


def test_dimensions_normalize_and_truncation(qwen3):
    model, _, llm = qwen3
    ids = PROMPTS[2]
    raw = _hf_hidden(model, ids)[-1]
    plain = _vectors(llm.embed([ids], PoolingParams(normalize=False)))[0]
    np.testing.assert_allclose(plain, raw, rtol=RAW_TOL, atol=RAW_TOL)
    short = _vectors(llm.embed([ids], PoolingParams(dimensions=16)))[0]
    np.testing.assert_allclose(short, _unit(raw[:16]), atol=UNIT_TOL)          # cut first, then normalized
    cut = llm.embed([ids], truncate_prompt_tokens=10)[0]
    assert cut.prompt_token_ids == ids[-10:]
    np.testing.assert_allclose(cut.outputs.embedding, _unit(_hf_hidden(model, ids[-10:])[-1]), atol=UNIT_TOL)


def test_score_is_the_cosine_of_the_embeddings(qwen3):
    _, _, llm = qwen3
    a, b, c = (_vectors(llm.embed([p]))[0] for p in PROMPTS[:3])
    one_to_many = llm.score(PROMPTS[0], PROMPTS[1:3])
    assert [s.outputs.score for s in one_to_many] == pytest.approx([a @ b, a @ c], abs=SAME_TOL)
    pairwise = llm.score(PROMPTS[:2], [PROMPTS[0], PROMPTS[2]])
    assert pairwise[0].outputs.score == pytest.approx(1.0, abs=SAME_TOL)
    assert pairwise[1].outputs.score == pytest.approx(b @ c, abs=SAME_TOL)
    with pytest.raises(InvalidRequestError, match="one text with many"):
        llm.score(PROMPTS[:2], PROMPTS[:3])


def test_bad_inputs_are_refused_and_the_engine_still_serves(qwen3):
    _, _, llm = qwen3
    too_long = list(range(1, 130))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.embed([PROMPTS[0], too_long])
    with pytest.raises(InvalidRequestError, match="exceeds the model's embedding size"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=10_000))
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.embed([[1, 10**6]])
    with pytest.raises(InvalidRequestError, match="at least one input"):
        llm.embed([])
    with pytest.raises(InvalidRequestError, match="dimensions"):
        PoolingParams(dimensions=0)
    assert len(llm.embed([too_long], truncate_prompt_tokens=-1)[0].prompt_token_ids) == KW["max_model_len"]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3 and llm.engine.pool.num_used_pages == 0


def _with_sentence_transformers(src: str, dst: str, pooling: dict, normalize: bool, extra_module: str | None = None):
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    if extra_module:
        modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": extra_module})
    with open(os.path.join(dst, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(dst, "1_Pooling"))
    with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **pooling}, f)
    return dst


def test_sentence_transformers_config_chooses_the_pooling(qwen3, tmp_path):
    model, d, _ = qwen3
    mean_dir = _with_sentence_transformers(d, str(tmp_path / "mean"), {"pooling_mode_mean_tokens": True}, False)
    llm = LLM(mean_dir, **KW)
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("mean", False)
    for ids, got in zip(PROMPTS[:2], _vectors(llm.embed(PROMPTS[:2]))):
        np.testing.assert_allclose(got, _hf_hidden(model, ids).mean(axis=0), rtol=RAW_TOL, atol=RAW_TOL)
    # the engine's pooling_type overrides the model's; cls is the first position's state
    cls = LLM(mean_dir, pooling_type="cls", **KW)
    np.testing.assert_allclose(_vectors(cls.embed([PROMPTS[0]]))[0], _hf_hidden(model, PROMPTS[0])[0],
                               rtol=RAW_TOL, atol=RAW_TOL)
    maxed = read_pooler_config(mean_dir, "max")
    assert maxed.pooling_type == "max" and maxed.unsupported is None


def test_a_pipeline_the_engine_cannot_run_refuses_embeddings_only(qwen3, tmp_path):
    _, d, _ = qwen3
    dense = _with_sentence_transformers(d, str(tmp_path / "dense"), {"pooling_mode_lasttoken": True}, True,
                                        "sentence_transformers.models.Dense")
    llm = LLM(dense, **KW)
    with pytest.raises(UnsupportedModelError, match="Dense"):
        llm.embed([PROMPTS[0]])
    assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    odd = read_pooler_config(_with_sentence_transformers(d, str(tmp_path / "odd"),
                                                         {"pooling_mode_weightedmean_tokens": True}, True))
    assert odd.pooling_type is None and "weightedmean" in odd.unsupported
    assert read_pooler_config(str(tmp_path / "odd"), "mean").unsupported is None
    with pytest.raises(EngineConfigError, match="pooling_type"):
        LLM(d, pooling_type="median", **KW)


@pytest.mark.parametrize("name", ["qwen3", "llama_gqa4"])
def test_a_base_model_checkpoint_embeds_as_the_causal_lm(hf_model_factory, tmp_path, name):
    """Qwen3Model / LlamaModel saved alone: names without `model.`, no LM head (llama_gqa4's is untied)."""
    model, d = hf_model_factory(name)
    base = str(tmp_path / "base")
    model.model.save_pretrained(base, safe_serialization=True)
    from safetensors import safe_open
    with safe_open(os.path.join(base, "model.safetensors"), "np") as f:
        assert not any(k.startswith(("model.", "lm_head")) for k in f.keys())
    embedder = LLM(base, **KW)
    assert embedder.engine.pooling_only            # runner auto: no LM head, so a pooling runner
    got = _vectors(embedder.embed(PROMPTS[:2]))
    for ids, v in zip(PROMPTS[:2], got):
        np.testing.assert_allclose(v, _unit(_hf_hidden(model, ids)[-1]), atol=UNIT_TOL)
    forced = LLM(base, runner="generate", **KW)     # it may still be asked to generate
    assert len(forced.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    embedder.save(str(tmp_path / "saved"))          # saved and loaded back: still a model for pooling
    again = LLM(str(tmp_path / "saved"), **KW)
    assert again.engine.pooling_only
    np.testing.assert_allclose(_vectors(again.embed(PROMPTS[:1]))[0], got[0], atol=SAME_TOL)


def test_batches_cover_every_input_within_the_budget():
    lengths = [5, 300, 17, 16, 1, 64, 65, 2000, 33] + [3] * 100
    batches = plan_batches(lengths, token_budget=256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        total = sum(lengths[i] for i in b)
        assert (total <= 256 or len(b) == 1) and len(b) <= MAX_SEQS
        size = batch_tokens(total, 256)
        assert total <= size and size & (size - 1) == 0 and (size <= 256 or len(b) == 1)
    assert [batch_tokens(n, 256) for n in (1, 16, 17, 200, 256, 2000)] == [16, 16, 32, 256, 256, 2048]   # a lone long input: a power of two too


def test_concurrent_requests_share_batches_and_a_bad_one_fails_alone(qwen3):
    """The engine thread (or process) runs the embed commands it finds waiting together."""
    from atlasjax.async_llm import Embeddings, apply_commands
    _, _, llm = qwen3
    engine = llm.engine
    want = _vectors(llm.embed([PROMPTS[0]]))[0]
    before = engine.embedder.num_batches
    delivered = []
    apply_commands(engine, [("embed", "a", [PROMPTS[0]], None), ("embed", "bad", [[]], None),
                            ("embed", "b", [PROMPTS[1]], PoolingParams(dimensions=8))], delivered.append)
    out = dict(item for items in delivered for item in items)
    assert engine.embedder.num_batches == before + 1
    assert isinstance(out["bad"], InvalidRequestError)
    assert isinstance(out["a"], Embeddings) and out["a"].results[0][0] == PROMPTS[0]
    np.testing.assert_allclose(out["a"].results[0][1], want, atol=SAME_TOL)
    raw = _vectors(llm.embed([PROMPTS[1]], PoolingParams(normalize=False)))[0]
    np.testing.assert_allclose(out["b"].results[0][1], _unit(raw[:8]), atol=SAME_TOL)


def test_each_request_is_answered_as_soon_as_its_last_batch_lands(qwen3):
    """Requests are batched in order, the next batch dispatched before the last is read back: the first
    request's answer goes out while the later ones still run."""
    _, _, llm = qwen3
    engine = llm.engine
    long_input = list(range(1, 61))                      # 60 tokens: one batch each at a 64-token budget
    order = []
    engine.embed_requests([([long_input], None), ([long_input[:50]], None), ([long_input[:40]], None)],
                          on_done=lambda i, result: order.append((i, engine.embedder.num_batches)))
    assert [i for i, _ in order] == [0, 1, 2]
    assert order[0][1] < order[2][1]                       # request 0 was out before the last batch ran


def test_the_pooling_runner_embeds_alone(qwen3):
    """runner='pooling' (vLLM's --runner pooling): the embedding batch sizes compile at start instead of the
    generation steps, the KV pool holds one sequence, the vectors are the generate runner's, and a
    generation request is refused."""
    _, d, llm = qwen3
    pooling = LLM(d, runner="pooling", compile_at_start=True, **KW)
    embedder = pooling.engine.embedder
    assert embedder.num_programs == len(embedder.batch_sizes()) and pooling.engine.runner.num_compiles == 0
    assert pooling.engine.pool.num_pages == KW["max_model_len"] // 16
    for got, want in zip(_vectors(pooling.embed(PROMPTS)), _vectors(llm.embed(PROMPTS))):
        np.testing.assert_allclose(got, want, atol=SAME_TOL)
    assert embedder.num_programs == len(embedder.batch_sizes())      # nothing compiled while serving
    with pytest.raises(InvalidRequestError, match="embeddings only"):
        pooling.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    assert not pooling.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, tol", [(dict(tensor_parallel_size=2), SAME_TOL), (dict(quantization="int8"), None)])
def test_sharded_and_quantized_engines_embed_as_the_plain_one(qwen3, kwargs, tol):
    """Tensor parallelism (2 devices) gives the same vectors; int8 weights nearly the same (cosine)."""
    _, d, llm = qwen3
    other = LLM(d, **KW, **kwargs)
    for got, want in zip(_vectors(other.embed(PROMPTS)), _vectors(llm.embed(PROMPTS))):
        if tol is not None:
            np.testing.assert_allclose(got, want, atol=tol)
        else:
            assert got @ want > 0.995


def test_a_failing_batch_answers_every_waiting_request_and_the_engine_serves_on(qwen3, monkeypatch):
    from atlasjax.async_llm import apply_commands
    _, _, llm = qwen3
    engine = llm.engine

    def broken(*args, **kwargs):
        raise ValueError("device trouble")
    monkeypatch.setattr(engine.embedder, "embed", broken)
    delivered = []
    apply_commands(engine, [("embed", "a", [PROMPTS[0]], None), ("embed", "b", [PROMPTS[1]], None)],
                   delivered.append)
    out = dict(item for items in delivered for item in items)
    assert set(out) == {"a", "b"} and all(isinstance(e, RuntimeError) and "device trouble" in str(e)
                                          for e in out.values())
    monkeypatch.undo()
    assert len(llm.embed([PROMPTS[0]])[0].outputs.embedding) == engine.model_config.hidden_size

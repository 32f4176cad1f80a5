"""Sequence classifiers and reward models (`*ForSequenceClassification` checkpoints: the model plus a `score`
head over the last token's state): `LLM.classify` must give Hugging Face's logits and probabilities on the
same weights, in any batch; POST /classify must answer as `LLM.classify` with the config's labels; a model
without a head must refuse classification with a clear error."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from atlasjax import LLM
from atlasjax.errors import UnsupportedModelError
from tests.hf_models import BASE

KW = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, dtype="float32")
PROMPTS = [list(range(3, 20)), list(range(40, 45)), list(range(100, 170))]
ON_GPU = jax.default_backend() == "gpu"
TOL = 2e-3                               # against transformers (a GPU's float32 matmuls run in TF32)
SAME = 1e-3 if ON_GPU else 1e-5          # the engine against itself in another batch


def _classifier(out_dir: str, cls, config_cls, num_labels: int, **overrides):
    torch.manual_seed(0)
    config = config_cls(**{**BASE, **overrides}, num_labels=num_labels, pad_token_id=0,
                        id2label={i: f"class_{i}" for i in range(num_labels)})
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


_built: dict = {}


def _case(name: str, tmp_path_factory):
    if name not in _built:
        d = str(tmp_path_factory.mktemp(name))
        if name == "qwen3_3_labels":
            hf = _classifier(d, transformers.Qwen3ForSequenceClassification, transformers.Qwen3Config, 3,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
        else:   # a reward model: one label, untied embeddings (the checkpoint has no LM head)
            hf = _classifier(d, transformers.LlamaForSequenceClassification, transformers.LlamaConfig, 1,
                             num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
        _built[name] = hf, LLM(d, **KW)
    return _built[name]


@pytest.fixture(scope="module", params=["qwen3_3_labels", "llama_reward"])
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


def test_classify_matches_hugging_face(case):
    hf, llm = case
    outs = llm.classify(PROMPTS)
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].double().numpy()
        np.testing.assert_allclose(out.outputs.logits, want, atol=TOL)
        probs = torch.softmax(torch.tensor(want), -1) if len(want) > 1 else torch.sigmoid(torch.tensor(want))
        np.testing.assert_allclose(out.outputs.probs, probs.numpy(), atol=TOL)
        assert out.prompt_token_ids == ids and out.outputs.num_classes == hf.config.num_labels
    alone = llm.classify(PROMPTS[1])[0]                    # alone = in a batch
    np.testing.assert_allclose(alone.outputs.logits, outs[1].outputs.logits, atol=SAME)
    assert llm.engine.classifier_labels == tuple(f"class_{i}" for i in range(hf.config.num_labels))
    assert llm.engine.pooling_only                  # runner auto: a classifier does not generate


def test_a_model_without_a_head_refuses_to_classify(hf_model_factory):
    _, d = hf_model_factory("qwen3")
    with pytest.raises(UnsupportedModelError, match="classification head"):
        LLM(d, **KW).classify(PROMPTS[0])


def test_the_classify_route_answers_as_llm_classify(tmp_path_factory, tmp_path):
    """`serve --runner pooling` on the 3-label classifier: POST /classify (vLLM's) with token-id inputs."""
    import httpx

    from tests.server_util import ServerProcess
    hf, llm = _case("qwen3_3_labels", tmp_path_factory)
    server = ServerProcess(llm.engine.loaded.source, str(tmp_path / "server.log"), "--runner", "pooling",
                           engine_kwargs={k: v for k, v in KW.items() if k != "dtype"})
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            body = http.post("/classify", json={"input": PROMPTS}).json()
            for d, want in zip(body["data"], llm.classify(PROMPTS)):
                np.testing.assert_allclose(d["probs"], want.outputs.probs, atol=SAME)
                assert d["label"] == llm.engine.classifier_labels[int(np.argmax(want.outputs.probs))]
                assert d["num_classes"] == hf.config.num_labels
            assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
            bad = http.post("/classify", json={"input": [[1, 10**6]]})
            assert bad.status_code == 400
            wrong = http.post("/v1/embeddings", json={"input": PROMPTS[0], "dimensions": 10_000})
            assert wrong.status_code == 400
    finally:
        server.stop()


def test_a_saved_classifier_keeps_its_head(tmp_path_factory, tmp_path):
    _, llm = _case("qwen3_3_labels", tmp_path_factory)
    llm.save(str(tmp_path / "saved"))
    again = LLM(str(tmp_path / "saved"), **KW)
    assert again.engine.classifier_labels == llm.engine.classifier_labels
    for got, want in zip(again.classify(PROMPTS), llm.classify(PROMPTS)):
        np.testing.assert_allclose(got.outputs.logits, want.outputs.logits, atol=SAME)

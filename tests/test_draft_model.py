"""Speculative decoding with a draft model (atlasjax/draft_model.py): a smaller model proposes each request's next
tokens on the device and the target verifies them. The output must be the target's alone (greedy and seeded),
the draft's KV cache must follow every step the target runs (chunked prefill, plain and multi-step decodes, the
prefix cache, preemption), and a bad draft is refused with the reason."""
import json
import os
import shutil

import jax
import numpy as np
import pytest
import tokenizers

from atlasjax import LLM, SamplingParams
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import EngineConfigError
from atlasjax.speculative import SpeculativeConfig
from tests.test_engine import _alone, _assert_idle, _run_staggered, _workload

# float32 everywhere: on a GPU in bf16 (its default) a verify's rows round unlike a decode's, and this random model's
# near-equal tokens then flip (an H200 found greedy ties between two tokens that did; session 68)
# num_pages: a full-length sequence per slot (a CPU's default), so that on a GPU the many engines alive in one
# module do not each take most of the free memory (the last got one page on an H200)
ENGINE = dict(max_num_seqs=8, max_model_len=160, page_size=8, max_num_batched_tokens=64, dtype="float32",
              num_pages=160)
GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
# short, repeating and long prompts; the long one (97 tokens) prefills in two chunks of the 64-token budget
PROMPTS = [[7, 8, 9, 10, 7, 8], list(range(3, 40)), list(range(3, 100))]


@pytest.fixture(scope="module")
def target(hf_model_factory):
    return hf_model_factory("llama_gqa4")[1]


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, **ENGINE)


@pytest.fixture(scope="module")
def self_draft(target):
    """The target drafting for itself: in float32 its greedy drafts are the target's own tokens, all accepted
    exactly when the draft's cache holds what the target's holds."""
    return LLM(target, speculative_config={"model": target, "num_speculative_tokens": 3}, **ENGINE)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _ran_verify_rounds(llm, rounds: int) -> bool:
    """Whether the engine ran (the offline engine compiles as it goes) a launch of that many verify rounds."""
    return ("verify", rounds) in {(k[0], k[-1]) for k in llm.engine.runner._compiled if len(k) == 4}


def test_a_draft_of_the_target_itself_is_accepted_whole(plain, self_draft):
    engine = self_draft.engine
    steps = engine.stats.num_steps
    assert _tokens(self_draft, PROMPTS, GREEDY) == _tokens(plain, PROMPTS, GREEDY)
    spec = engine.stats.spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.mean_acceptance_length == pytest.approx(4.0, abs=0.35)   # k + 1 tokens a step (less at max_tokens)
    assert engine.stats.num_steps - steps < 3 * 24 / 2                    # far fewer steps than tokens
    _assert_idle(engine)


def test_another_draft_model_leaves_greedy_and_seeded_outputs_exact(target, hf_model_factory, plain):
    """A draft of other heads (4 of 16 against 8 query and 2 KV heads of 8): its own KV pool on the same pages.
    Its random drafts are mostly rejected; the tokens and logprobs stay the target's."""
    llm = LLM(target, speculative_config={"model": hf_model_factory("llama_tied_mha")[1],
                                          "num_speculative_tokens": 4}, **ENGINE)
    assert llm.engine.runner.state.draft_kv[0][0].shape[-1] == 16
    assert _tokens(llm, PROMPTS, GREEDY) == _tokens(plain, PROMPTS, GREEDY)
    seeded = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=0.5, min_p=0.05, seed=4, max_tokens=12, min_tokens=6, logprobs=1),
              SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, logit_bias={3: 4.0})]
    for a, b in zip(plain.generate(PROMPTS, seeded), llm.generate(PROMPTS, seeded)):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        for da, db in zip(a.logprobs or [], b.logprobs or []):
            assert da.keys() == db.keys()
            np.testing.assert_allclose([v.logprob for v in da.values()], [v.logprob for v in db.values()],
                                       atol=5e-3 if jax.default_backend() == "gpu" else 1e-4)   # GPU: TF32 matmuls
    assert llm.engine.stats.spec.num_draft_tokens > 0
    _assert_idle(llm.engine)


def test_the_draft_cache_follows_decodes_multi_step_launches_and_the_prefix_cache(target, plain):
    """A penalized request runs plain decodes (4 per launch) beside a greedy one, which drafts once the penalized one
    has finished: every draft still accepted means the draft's cache took the tokens those decodes wrote. A prompt
    served again from the prefix cache drafts as well as the first time (the draft's K/V lives on the same pages)."""
    llm = LLM(target, speculative_config={"model": target, "num_speculative_tokens": 3}, num_scheduler_steps=4,
              **ENGINE)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=9, ignore_eos=True), GREEDY]
    prompts = PROMPTS[:2]
    assert _tokens(llm, prompts, params) == _tokens(plain, prompts, params)
    assert any(k[0] == "decode" and len(k) == 4 for k in llm.engine.runner._compiled)   # a multi-step launch
    assert _ran_verify_rounds(llm, 4)
    spec = llm.engine.stats.spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    hits, drafted = llm.engine.pool.num_hit_pages, spec.num_draft_tokens
    assert _tokens(llm, [PROMPTS[2]], GREEDY) == _tokens(llm, [PROMPTS[2]], GREEDY) == _tokens(plain, [PROMPTS[2]],
                                                                                                GREEDY)
    assert llm.engine.pool.num_hit_pages > hits
    assert spec.num_draft_tokens > drafted and spec.num_accepted_tokens == spec.num_draft_tokens
    _assert_idle(llm.engine)


@pytest.mark.parametrize("rounds", [1, 3])
def test_staggered_requests_and_preemption_equal_plain_decoding(target, hf_model_factory, rounds):
    """One verify round per launch, or three with launches pipelined (verify_rounds.py)."""
    work = _workload(n=16, seed=3)
    want = _alone(LLM(target, enable_prefix_caching=False, **ENGINE).engine, work)
    engine = LLM(target, speculative_config={"model": hf_model_factory("qwen3")[1], "num_speculative_tokens": 2},
                 enable_prefix_caching=False, num_scheduler_steps=rounds, **{**ENGINE, "num_pages": 24}).engine
    assert _run_staggered(engine, work) == want
    assert engine.scheduler.num_preemptions > 0 and engine.stats.spec.num_draft_tokens > 0
    assert (engine.launcher.num_pipelined_verifies > 0) == (rounds > 1)
    _assert_idle(engine)


def test_a_draft_under_tensor_parallelism_is_split_as_the_target(hf_model_factory):
    """TP=2: the draft (Qwen3, one KV head: replicated on both devices) runs inside shard_map beside the target
    (Qwen2, two KV heads), its KV pool split over the devices; the tokens are one device's plain decoding's."""
    target, draft = hf_model_factory("qwen2_tp")[1], hf_model_factory("qwen3_tp")[1]
    prompts = [[7, 8, 9, 10, 7, 8], list(range(3, 90))]
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=12, ignore_eos=True)
    want = [_tokens(LLM(target, **ENGINE), prompts, p) for p in (GREEDY, seeded)]
    llm = LLM(target, tensor_parallel_size=2, speculative_config={"model": draft, "num_speculative_tokens": 3},
              **ENGINE)
    pool = llm.engine.runner.state.draft_kv[0][0]
    assert pool.shape[0] == 2 and len(pool.sharding.device_set) == 2     # one (replicated) KV head per device
    assert [_tokens(llm, prompts, p) for p in (GREEDY, seeded)] == want
    assert llm.engine.stats.spec.num_draft_tokens > 0
    _assert_idle(llm.engine)
    self_drafting = LLM(target, tensor_parallel_size=2, speculative_config={"model": target,
                                                                           "num_speculative_tokens": 3},
                        num_scheduler_steps=3, **ENGINE)   # three verify rounds a launch
    assert _tokens(self_drafting, prompts, GREEDY) == want[0]
    assert _ran_verify_rounds(self_drafting, 3) and self_drafting.engine.launcher.num_pipelined_verifies > 0
    spec = self_drafting.engine.stats.spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens


def _with_tokenizer(src: str, dst: str, words: str) -> str:
    shutil.copytree(src, dst)
    vocab = {f"{words}{i}": i for i in range(512)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=f"{words}0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(dst, "tokenizer.json"))
    return dst


def test_bad_draft_configs_are_refused_with_the_reason(target, tmp_path):
    def refused(match, **kw):
        with pytest.raises(EngineConfigError, match=match):
            EngineConfig(model=target, **kw)
    refused("needs model", speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    refused("model is for method 'draft_model'", speculative_config={"method": "ngram", "model": target,
                                                                      "num_speculative_tokens": 2})
    refused("not supported.*'draft_model'", speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    refused("draft_tensor_parallel_size=2 must equal tensor_parallel_size=1", speculative_config={
        "model": target, "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2})
    refused("quantization of the draft", speculative_config={"model": target, "num_speculative_tokens": 2,
                                                             "quantization": "fp8"})
    assert SpeculativeConfig.parse('{"model": "d", "num_speculative_tokens": 2}').uses_draft_model
    corrupt = shutil.copytree(target, tmp_path / "corrupt")
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    gemma = shutil.copytree(target, tmp_path / "gemma")
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps(dict(config, architectures=["GemmaForCausalLM"], model_type="gemma")))
    for draft, reason in ((tmp_path / "missing", "does not exist"), (corrupt, "truncated or corrupt"),
                          (gemma, "unsupported model architecture")):
        with pytest.raises(EngineConfigError, match=f"draft model .* cannot be loaded: .*{reason}"):
            LLM(target, speculative_config={"model": str(draft), "num_speculative_tokens": 2}, **ENGINE)
    words = _with_tokenizer(target, str(tmp_path / "w"), "w")
    other = _with_tokenizer(target, str(tmp_path / "x"), "x")
    with pytest.raises(EngineConfigError, match="another tokenizer"):
        LLM(words, speculative_config={"model": other, "num_speculative_tokens": 2}, **ENGINE)

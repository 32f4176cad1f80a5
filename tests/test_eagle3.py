"""Speculative decoding with an EAGLE-3 head (atlasjax/eagle3.py, models/eagle3.py): a one-layer draft that reads
the target's hidden states. The output must be the target's alone (greedy and seeded); every draft the engine
proposes must be what an independent torch implementation of the head proposes from the same tokens (the head's
cache follows prefill chunks, verifies with any number of drafts accepted, plain and multi-step decodes and the
prefix cache); a bad head is refused with the reason."""
import json
import os

import jax
import numpy as np
import pytest
import torch

from atlasjax import LLM, SamplingParams
from atlasjax.eagle3 import make_tensors
from atlasjax.errors import EngineConfigError
from tests.test_draft_model import _ran_verify_rounds
from tests.test_engine import _alone, _assert_idle, _run_staggered, _workload
from tests.test_speculative import end_behind_a_pipelined_launch

# float32: on a GPU in bf16 a verify's rows round unlike a decode's and near-equal tokens of a random model flip
# num_pages: a full-length sequence per slot (a CPU's default), so that on a GPU the many engines alive in one
# module do not each take most of the free memory (the last got one page on an H200)
ENGINE = dict(max_num_seqs=8, max_model_len=160, page_size=8, max_num_batched_tokens=64, dtype="float32",
              num_pages=160)
GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
PROMPTS = [[7, 8, 9, 10, 7, 8], list(range(3, 40)), list(range(3, 100))]   # the last prefills in two chunks
K = 3
# On a GPU float32 matmuls round as TF32: a draft whose logit leads the next by less is not compared (nor those after)
TIE = 0.05 if jax.default_backend() == "gpu" else 0.0
LOGPROB_ATOL = 5e-3 if jax.default_backend() == "gpu" else 1e-4


def _head_config(draft_vocab=None, **extra):
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "vocab_size": 512, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 1024, **extra}


def _save_head(path, hf, tensors):
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return str(path)


@pytest.fixture(scope="module")
def target(hf_model_factory):
    return hf_model_factory("llama_7layers")


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A random head over a draft vocabulary of 96 of the 512 tokens (d2t), (path, config, tensors)."""
    hf = _head_config(draft_vocab=96)
    tensors = make_tensors(hf, 64, np.random.default_rng(0), std=0.15)
    return _save_head(tmp_path_factory.mktemp("eagle3"), hf, tensors), hf, tensors


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target[1], **ENGINE)


@pytest.fixture(scope="module")
def eagle(target, head):
    return LLM(target[1], speculative_config={"method": "eagle3", "model": head[0], "num_speculative_tokens": K},
               **ENGINE)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


class ReferenceHead:
    """The EAGLE-3 head in torch, from the checkpoint's tensors, written from its published definition (vLLM's and
    SGLang's): every draft recomputed over the whole sequence, no cache."""

    def __init__(self, hf_target, hf, tensors, aux=None):
        self.target, self.hf = hf_target, hf
        self.t = {k: torch.tensor(np.asarray(v, np.float32) if v.dtype != np.int64 else v) for k, v in tensors.items()}
        layers = hf_target.config.num_hidden_layers
        self.aux = aux or (2, layers // 2, layers - 3)

    def _rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]))

    def _layer(self, embeds, features):
        t, hf = self.t, self.hf
        n, heads, kv = embeds.shape[0], hf["num_attention_heads"], hf["num_key_value_heads"]
        hd = hf["hidden_size"] // heads
        x = torch.cat([self._rms(embeds, t["midlayer.input_layernorm.weight"]),
                       self._rms(features, t["midlayer.hidden_norm.weight"])], -1)
        q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, hd)
        k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, hd)
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, hd)
        inv = 1.0 / hf["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

        def rope(a):
            return a * cos + torch.cat([-a[..., hd // 2:], a[..., :hd // 2]], -1) * sin
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        x = features + out @ t["midlayer.self_attn.o_proj.weight"].T
        h = self._rms(x, t["midlayer.post_attention_layernorm.weight"])
        gate, up = h @ t["midlayer.mlp.gate_proj.weight"].T, h @ t["midlayer.mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T

    def _propose(self, prenorm):
        """(the draft token, how far its logit leads the next)"""
        logits = self._rms(prenorm, self.t["norm.weight"]) @ self.t["lm_head.weight"].T
        top = logits.topk(2).values
        d = int(logits.argmax())
        return d + int(self.t["d2t"][d]) if "d2t" in self.t else d, float(top[0] - top[1])

    @torch.no_grad()
    def drafts(self, seq: list[int], k: int) -> list[int]:
        """The k drafts after seq (its last token is the verify step's last token, not yet run by the target), up to
        the first whose logit leads the next by less than TIE (where the engine's rounding may pick the other)."""
        hidden = self.target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i][0] for i in self.aux], -1) @ self.t["fc.weight"].T
        embed = self.target.get_input_embeddings()
        if "embed_tokens.weight" in self.t:   # the head's own
            embed = torch.nn.Embedding.from_pretrained(self.t["embed_tokens.weight"])
        embeds = embed(torch.tensor(seq[1:]))
        out = []
        for _ in range(k):
            prenorm = self._layer(embeds, features)[-1]
            token, lead = self._propose(prenorm)
            if lead < TIE:
                return out
            out.append(token)
            embeds = torch.cat([embeds, embed(torch.tensor([out[-1]]))])
            features = torch.cat([features, prenorm[None]])
        return out


def _recorded_drafts(llm):
    """Wraps the runner's verify: each round's (request's last position, its drafts) for one-request steps (a launch
    of several rounds: each round it took part in, its position moved along by what the rounds before emitted)."""
    runner, seen = llm.engine.runner, []
    verify = runner.verify

    def recording(batch, *args, **kwargs):
        out = verify(batch, *args, **kwargs)
        n = int(batch["query_start"][1])
        if int(batch["num_seqs"]) == 1:
            inputs = np.asarray(out.inputs).reshape(-1, len(batch["tokens"]))
            advance = np.ones((1, 1), int) if out.advance is None else np.asarray(out.advance)
            # a pipelined launch packs the known tokens' position; the step moved it along by `shift`
            position = int(batch["positions"][0]) + (0 if out.shift is None else int(np.asarray(out.shift)[0]))
            for q in range(len(inputs)):
                if advance[q, 0]:
                    seen.append((position, inputs[q, 1:n].tolist()))
                    position += int(advance[q, 0])
        return out
    runner.verify = recording
    return seen


def test_greedy_tokens_are_the_targets_and_every_draft_is_the_reference_heads(target, head, plain, eagle):
    seen = _recorded_drafts(eagle)
    try:
        for prompt in PROMPTS:
            seen.clear()
            got = _tokens(eagle, [prompt], GREEDY)[0]
            assert got == _tokens(plain, [prompt], GREEDY)[0]
            _assert_reference_drafts(seen, prompt + got, ReferenceHead(target[0], head[1], head[2]))
    finally:
        del eagle.engine.runner.verify
    spec = eagle.engine.stats.spec
    assert spec.num_draft_tokens > 0
    _assert_idle(eagle.engine)


def _assert_reference_drafts(seen, seq, reference):
    assert len(seen) > 2
    for position, drafts in seen:
        want = reference.drafts(seq[:position + 1], K)
        assert drafts[:len(want)] == want[:len(drafts)], position


def test_drafts_accepted_in_part_and_every_kind_of_step(target, tmp_path, plain):
    """A head whose draft vocabulary is two tokens, 5 and 6, beside a target that repeats 5 (a logit bias): about
    half its drafts are accepted, so verifies advance by 1 to K + 1 positions, and the drafts after each are still
    the reference's (the head's cache and kept output follow the accepted rows). A penalized request beside it runs
    plain decodes, four per launch, first; the prompt served again from the prefix cache drafts as the reference."""
    hf = _head_config(draft_vocab=2)
    tensors = make_tensors(hf, 64, np.random.default_rng(1), std=0.15)
    tensors["d2t"] = np.array([5, 5], np.int64)   # draft ids 0, 1 -> tokens 5, 6
    path = _save_head(tmp_path / "h", hf, tensors)
    llm = LLM(target[1], speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": K},
              num_scheduler_steps=4, **ENGINE)
    seen = _recorded_drafts(llm)
    reference = ReferenceHead(target[0], hf, tensors)
    biased = SamplingParams(temperature=0, ignore_eos=True, max_tokens=30, logit_bias={5: 50.0})
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=9, ignore_eos=True), biased]
    got = _tokens(llm, PROMPTS[:2], params)
    assert got == _tokens(plain, PROMPTS[:2], params)
    assert any(k[0] == "decode" and len(k) == 4 for k in llm.engine.runner._compiled)   # a multi-step launch
    assert _ran_verify_rounds(llm, 4)
    _assert_reference_drafts(seen, PROMPTS[1] + got[1], reference)
    spec = llm.engine.stats.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.accepted_per_pos[1] > 0   # some verifies kept 2 drafts or more
    hits = llm.engine.pool.num_hit_pages
    seen.clear()
    assert _tokens(llm, [PROMPTS[1]], [biased])[0] == got[1]
    assert llm.engine.pool.num_hit_pages > hits
    _assert_reference_drafts(seen, PROMPTS[1] + got[1], reference)
    _assert_idle(llm.engine)


def test_seeded_sampling_and_logprobs_are_the_targets(target, head, plain, eagle):
    seeded = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=0.5, min_p=0.05, seed=4, max_tokens=12, min_tokens=6, logprobs=1)]
    for a, b in zip(plain.generate(PROMPTS[:2], seeded), eagle.generate(PROMPTS[:2], seeded)):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            np.testing.assert_allclose([v.logprob for v in da.values()], [v.logprob for v in db.values()],
                                       atol=LOGPROB_ATOL)
    _assert_idle(eagle.engine)


@pytest.fixture(scope="module")
def eagle_rounds(target, head):
    """Three verify rounds per launch (num_scheduler_steps; a GPU's default of 4 gives four)."""
    return LLM(target[1], speculative_config={"method": "eagle3", "model": head[0], "num_speculative_tokens": K},
               num_scheduler_steps=3, **ENGINE)


def test_several_verify_rounds_per_launch_emit_what_plain_decoding_does(target, head, plain, eagle_rounds):
    """Each launch runs three rounds of drafting and verifying: the tokens, finish reasons and logprobs are plain
    decoding's (greedy, seeded, ending mid-launch at max_tokens or at a stop token), every round's drafts are the
    reference head's, and a request takes a launch per three rounds, not per round."""
    engine = eagle_rounds.engine
    seen = _recorded_drafts(eagle_rounds)
    try:
        for prompt in PROMPTS:
            seen.clear()
            launches = engine.stats.num_steps
            got = _tokens(eagle_rounds, [prompt], GREEDY)[0]
            assert got == _tokens(plain, [prompt], GREEDY)[0]
            _assert_reference_drafts(seen, prompt + got, ReferenceHead(target[0], head[1], head[2]))
            # one token from the prefill, then three rounds of one token at least per launch (+1: a 2-chunk prompt)
            assert engine.stats.num_steps - launches <= 2 + -(-(GREEDY.max_tokens - 1) // 3)
    finally:
        del engine.runner.verify
    assert _ran_verify_rounds(eagle_rounds, 3)
    assert engine.launcher.num_pipelined_verifies > 0   # launches scheduled while the one before still ran
    greedy = _tokens(plain, [PROMPTS[1]], GREEDY)[0]
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True,
                             logprobs=3),
              SamplingParams(temperature=0.5, min_p=0.05, seed=4, max_tokens=12, min_tokens=6, logprobs=1),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[greedy[9]])]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    for a, b in zip(plain.generate(prompts, params), eagle_rounds.generate(prompts, params)):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        for da, db in zip(a.logprobs or [], b.logprobs or []):
            assert da.keys() == db.keys()
            np.testing.assert_allclose([v.logprob for v in da.values()], [v.logprob for v in db.values()],
                                       atol=LOGPROB_ATOL)
    assert b.finish_reason == "stop" and len(b.token_ids) <= 10
    _assert_idle(engine)


def test_a_request_aborted_or_stopped_behind_a_pipelined_launch_frees_everything(plain, eagle_rounds):
    """A launch is scheduled while the one before still runs (verify_rounds.py): a request aborted, or stopped by a
    token the launch before emitted, while the next launch in flight still holds it gives its pages and slot back
    once that launch is read back, and the other request's tokens stay plain decoding's."""
    end_behind_a_pipelined_launch(eagle_rounds.engine, plain, PROMPTS[1])


@pytest.mark.parametrize("rounds", [1, 3])
def test_staggered_requests_and_preemption_equal_plain_decoding(target, head, rounds):
    work = _workload(n=16, seed=3)
    want = _alone(LLM(target[1], enable_prefix_caching=False, **ENGINE).engine, work)
    engine = LLM(target[1], speculative_config={"method": "eagle3", "model": head[0], "num_speculative_tokens": 2},
                 enable_prefix_caching=False, num_scheduler_steps=rounds, **{**ENGINE, "num_pages": 24}).engine
    assert _run_staggered(engine, work) == want
    assert engine.scheduler.num_preemptions > 0 and engine.stats.spec.num_draft_tokens > 0
    assert (engine.launcher.num_pipelined_verifies > 0) == (rounds > 1)
    _assert_idle(engine)


@pytest.mark.parametrize("change, match", [
    (lambda hf, t: hf.update(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 checkpoint"),
    (lambda hf, t: hf.update(num_hidden_layers=2), "only one"),
    (lambda hf, t: hf.update(vocab_size=1000), "vocabulary of 1000 tokens"),
    (lambda hf, t: t.pop("fc.weight"), "has no tensor fc.weight"),
    (lambda hf, t: t.update({"fc.weight": t["fc.weight"][:, :128]}), r"fc.weight has shape \[64, 128\]"),
    (lambda hf, t: hf.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}), "three distinct layers"),
    (lambda hf, t: hf.update(eagle_aux_hidden_state_layer_ids=[1, 4, 7]), r"layers \[1, 4, 7\]"),
    (lambda hf, t: t.update(d2t=t["d2t"] + 1000), "past the model's vocabulary"),
])
def test_a_bad_head_is_refused_with_the_reason(target, head, tmp_path, change, match):
    hf, tensors = dict(head[1]), dict(head[2])
    change(hf, tensors)
    path = _save_head(tmp_path / "bad", hf, tensors)
    with pytest.raises(EngineConfigError, match=match):
        LLM(target[1], speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": 2}, **ENGINE)


def test_eagle3_needs_a_model_and_one_device(target, head):
    with pytest.raises(EngineConfigError, match="'eagle3' needs model"):
        LLM(target[1], speculative_config={"method": "eagle3", "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(EngineConfigError, match="EAGLE-1"):
        LLM(target[1], speculative_config={"method": "eagle", "model": head[0], "num_speculative_tokens": 2},
            **ENGINE)


def test_a_head_beside_a_tensor_parallel_target_proposes_as_on_one_device(target, head):
    """TP=2: the target split over two devices returns its (replicated) residual stream; the head runs whole on
    each device with a replicated KV pool; tokens and every draft are one device's (three verify rounds a launch)."""
    llm = LLM(target[1], tensor_parallel_size=2,   # vLLM's draft_tensor_parallel_size 1 (or 2): the head is whole
              speculative_config={"method": "eagle3", "model": head[0], "num_speculative_tokens": K,
                                  "draft_tensor_parallel_size": 1}, num_scheduler_steps=3, **ENGINE)
    pool = llm.engine.runner.state.draft_kv[0][0]
    assert len(pool.sharding.device_set) == 2 and pool.sharding.is_fully_replicated
    seen = _recorded_drafts(llm)
    got = _tokens(llm, [PROMPTS[1]], GREEDY)[0]
    assert got == _tokens(LLM(target[1], **ENGINE), [PROMPTS[1]], GREEDY)[0]
    _assert_reference_drafts(seen, PROMPTS[1] + got, ReferenceHead(target[0], head[1], head[2]))
    assert _ran_verify_rounds(llm, 3)
    _assert_idle(llm.engine)


def test_the_heads_weights_sleep_and_wake_with_the_targets(target, head, eagle, plain):
    before = _tokens(eagle, PROMPTS[:2], GREEDY)
    weights = eagle.engine.runner.draft_params
    for level in (1, 2):
        params = jax.tree.map(np.asarray, eagle.params) if level == 2 else None
        eagle.sleep(level=level)
        assert all(x.is_deleted() for x in jax.tree.leaves(weights))
        eagle.wake_up()
        if level == 2:
            eagle.update_params(params)
        assert _tokens(eagle, PROMPTS[:2], GREEDY) == before == _tokens(plain, PROMPTS[:2], GREEDY)
        weights = eagle.engine.runner.draft_params
    _assert_idle(eagle.engine)


def test_a_pytorch_bin_head_with_other_names_loads_as_the_same_head(target, head, eagle, tmp_path):
    """pytorch_model.bin (read with torch), names `model.layers.0.*` instead of `midlayer.*`: the same drafts."""
    path = tmp_path / "bin"
    path.mkdir()
    torch.save({("model." + k.replace("midlayer.", "layers.0.")): torch.from_numpy(np.asarray(v))
                for k, v in head[2].items()}, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(head[1]))
    other = LLM(target[1], speculative_config={"method": "eagle3", "model": str(path), "num_speculative_tokens": K},
                **ENGINE)
    drafts = []
    for llm in (eagle, other):
        seen = _recorded_drafts(llm)
        try:
            _tokens(llm, [PROMPTS[1]], GREEDY)
        finally:
            del llm.engine.runner.verify
        drafts.append(seen)
    assert drafts[0] == drafts[1] and len(drafts[0]) > 2


def test_a_qwen3_target_and_a_head_with_its_own_embedding(hf_model_factory, tmp_path):
    """A Qwen3 target (q/k norms, tied embeddings) and a head that carries its own embed_tokens: tokens are the
    target's, drafts the reference head's (which embeds with the head's table)."""
    qwen, path = hf_model_factory("qwen3_7layers")
    hf = _head_config(draft_vocab=64)
    tensors = make_tensors(hf, 64, np.random.default_rng(2), std=0.15)
    tensors["embed_tokens.weight"] = np.random.default_rng(3).standard_normal((512, 64)).astype(np.float32)
    head_dir = _save_head(tmp_path / "h", hf, tensors)
    llm = LLM(path, speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": K}, **ENGINE)
    assert llm.engine.runner.draft.own_embedding
    seen = _recorded_drafts(llm)
    got = _tokens(llm, [PROMPTS[1]], GREEDY)[0]
    assert got == _tokens(LLM(path, **ENGINE), [PROMPTS[1]], GREEDY)[0]
    _assert_reference_drafts(seen, PROMPTS[1] + got, ReferenceHead(qwen, hf, tensors))
    _assert_idle(llm.engine)


@pytest.mark.parametrize("names", [{"eagle_aux_hidden_state_layer_ids": [1, 3, 6]},
                                   {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}])
def test_the_layers_a_head_reads_in_either_engines_convention(target, head, tmp_path, names):
    """vLLM's top-level ids are hidden_states indices (the input of layer j); SGLang's eagle_config ids name layer
    outputs (the input of layer j + 1): both name layers 1, 3 and 6 here, and the drafts are the reference's."""
    hf = {**head[1], **names}
    path = _save_head(tmp_path / "h", hf, head[2])
    llm = LLM(target[1], speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": K}, **ENGINE)
    assert llm.engine.runner.model.aux_layers == (1, 3, 6)
    seen = _recorded_drafts(llm)
    got = _tokens(llm, [PROMPTS[1]], GREEDY)[0]
    _assert_reference_drafts(seen, PROMPTS[1] + got, ReferenceHead(target[0], hf, head[2], aux=(1, 3, 6)))


def test_a_head_in_the_speculators_format_drafts_as_the_reference(target, head, tmp_path):
    """vLLM's speculators format (Red Hat's published heads): the layer's config nested in transformer_layer_config,
    weights named layers.0.*, aux layers as vLLM's hidden_states indices."""
    layer = {k: v for k, v in head[1].items() if k not in ("architectures", "draft_vocab_size")}
    hf = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
          "draft_vocab_size": head[1]["draft_vocab_size"], "norm_before_residual": False,
          "eagle_aux_hidden_state_layer_ids": [1, 3, 6], "speculators_config": {"algorithm": "eagle3"}}
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in head[2].items()}
    path = _save_head(tmp_path / "h", hf, tensors)
    llm = LLM(target[1], speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": K}, **ENGINE)
    seen = _recorded_drafts(llm)
    got = _tokens(llm, [PROMPTS[1]], GREEDY)[0]
    _assert_reference_drafts(seen, PROMPTS[1] + got, ReferenceHead(target[0], head[1], head[2], aux=(1, 3, 6)))

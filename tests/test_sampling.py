"""On-device sampling semantics, per row in one batch."""
import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.sampling import SamplingTensors, pack_rows, sample
from tests.hf_models import hf_greedy

V = 32


def _sample(logits, rows, counts=None, prompt_mask=None):
    logits = jnp.asarray(logits, jnp.float32)
    n = logits.shape[0]
    f, i = pack_rows(rows, n)
    counts = jnp.zeros((n, V), jnp.int32) if counts is None else jnp.asarray(counts)
    prompt_mask = jnp.zeros((n, V), bool) if prompt_mask is None else jnp.asarray(prompt_mask)
    return [np.asarray(x) for x in sample(logits, counts, prompt_mask, SamplingTensors(jnp.asarray(f), jnp.asarray(i)))]


def _row(seed=0, step=0, eos=(), **kw):
    return (SamplingParams(**kw), seed, step, eos)


def test_greedy_and_filters_that_leave_one_token():
    logits = np.random.RandomState(0).randn(5, V)
    rows = [_row(temperature=0), _row(temperature=1, top_k=1), _row(temperature=1, top_p=1e-6),
            _row(temperature=1, min_p=1.0), _row(temperature=5, top_k=1, top_p=0.5)]
    tokens, *_ = _sample(logits, rows)
    assert (tokens == logits.argmax(-1)).all()


def test_top_k_keeps_only_the_k_best():
    logits = np.tile(np.arange(V, dtype=np.float32) * 0.01, (64, 1))     # nearly uniform
    tokens, *_ = _sample(logits, [_row(seed=s, temperature=1, top_k=3) for s in range(64)])
    assert set(tokens.tolist()) <= {V - 1, V - 2, V - 3} and len(set(tokens.tolist())) > 1


def test_same_seed_same_token_different_seeds_differ():
    logits = np.zeros((16, V), np.float32)
    a, *_ = _sample(logits, [_row(seed=7, step=3, temperature=1)] * 16)
    b, *_ = _sample(logits, [_row(seed=s, step=3, temperature=1) for s in range(16)])
    assert len(set(a.tolist())) == 1 and len(set(b.tolist())) > 4


def test_penalties():
    logits = np.zeros((3, V), np.float32)
    logits[:, 5] = 1.0
    logits[:, 6] = 0.9
    counts = np.zeros((3, V), np.int32)
    counts[:, 5] = 2
    rows = [_row(temperature=0, frequency_penalty=0.1), _row(temperature=0, presence_penalty=0.05),
            _row(temperature=0, repetition_penalty=1.2)]
    tokens, *_ = _sample(logits, rows, counts=counts)
    # 1.0 - 0.1*2 = 0.8 < 0.9; 1.0 - 0.05 = 0.95 > 0.9; 1.0 / 1.2 = 0.83 < 0.9
    assert tokens.tolist() == [6, 5, 6]
    mask = np.zeros((1, V), bool)
    mask[0, 5] = True                                                  # seen in the prompt only
    tokens, *_ = _sample(logits[:1], [_row(temperature=0, repetition_penalty=1.2)], prompt_mask=mask)
    assert tokens.tolist() == [6]


def test_min_tokens_blocks_stop_ids_until_reached():
    logits = np.zeros((3, V), np.float32)
    logits[:, 2] = 5.0     # the eos id is the most likely
    rows = [_row(temperature=0, min_tokens=3, step=1, eos=(2,)), _row(temperature=0, min_tokens=3, step=3, eos=(2,)),
            _row(temperature=0, min_tokens=3, step=0, eos=(2,), ignore_eos=True)]
    tokens, *_ = _sample(logits, rows)
    assert tokens[0] != 2 and tokens[1] == 2 and tokens[2] == 2


def test_logprobs_are_raw_and_sorted():
    logits = np.random.RandomState(1).randn(2, V)
    tokens, chosen, top_vals, top_ids = _sample(logits, [_row(temperature=0, logprobs=5), _row(temperature=2.0)])
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert np.allclose(chosen, ref[np.arange(2), tokens], atol=1e-5)
    assert (top_ids[0, :5] == np.argsort(-ref[0])[:5]).all()
    assert np.allclose(top_vals[0, :5], np.sort(ref[0])[::-1][:5], atol=1e-5)


def test_repetition_penalty_matches_hf_generate(hf_model_factory):
    import torch
    hf, path = hf_model_factory("llama_gqa4")
    llm = LLM(path, max_model_len=128, max_num_seqs=2)
    prompt = [5, 9, 5, 9, 100, 7]
    ours = llm.generate([prompt], SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=16,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          repetition_penalty=1.5, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
    assert ours != hf_greedy(hf, prompt, 16)      # the penalty changed something


@pytest.mark.parametrize("n", [1, 3])
def test_seeded_generation_is_reproducible_across_batches(hf_model_factory, n):
    llm = LLM(hf_model_factory("llama_gqa4")[1], max_model_len=128, max_num_seqs=4)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True, n=n)
    alone = llm.generate([[1, 2, 3]], p)[0]
    batched = llm.generate([[4, 5], [1, 2, 3]], [SamplingParams(temperature=1.0, max_tokens=10), p])[1]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in batched.outputs]


def _sample_biased(logits, rows, biases):
    from atlasjax.sampling import logit_bias_row, plan_rows
    logits = jnp.asarray(logits, jnp.float32)
    n = logits.shape[0]
    f, i = pack_rows(rows, n)
    ids, vals = map(np.stack, zip(*(logit_bias_row(b) for b in biases)))
    zeros = jnp.zeros((n, V), jnp.int32)
    return np.asarray(sample(logits, zeros, zeros > 0, SamplingTensors(jnp.asarray(f), jnp.asarray(i)),
                             plan_rows(rows), (jnp.asarray(ids), jnp.asarray(vals)))[0])


def test_logit_bias_forces_and_bans_tokens_per_row():
    logits = np.random.RandomState(1).randn(4, V)
    best = logits.argmax(-1)
    rows = [_row(temperature=0, logit_bias=b) for b in ({5: 100}, {int(best[1]): -100}, None, {7: 100, 9: 0.5})]
    tokens = _sample_biased(logits, rows, [r[0].logit_bias for r in rows])
    second = np.argsort(-logits[1])[1]
    assert tokens.tolist() == [5, second, best[2], 7]


def test_logprobs_are_computed_only_when_a_row_asks_and_never_change_the_draw():
    from atlasjax.sampling import SamplingPlan, plan_rows
    logits = np.random.RandomState(3).randn(16, V).astype(np.float32)
    sampled = [_row(seed=s, temperature=0.8, top_p=0.9) for s in range(16)]
    asking = [_row(seed=s, temperature=0.8, top_p=0.9, logprobs=2) for s in range(16)]
    assert plan_rows(sampled) == SamplingPlan(greedy=False, logprobs=False)
    assert plan_rows(asking) == plan_rows(sampled[:15] + asking[15:]) == SamplingPlan(greedy=False, logprobs=True)
    assert plan_rows([_row(temperature=0), None]) == SamplingPlan(greedy=True, logprobs=False)
    f, i = pack_rows(sampled, 16)

    def draw(plan):
        return [np.asarray(x) for x in sample(jnp.asarray(logits), jnp.zeros((16, V), jnp.int32),
                                              jnp.zeros((16, V), bool), SamplingTensors(jnp.asarray(f), jnp.asarray(i)),
                                              plan)]
    without, with_logprobs = draw(plan_rows(sampled)), draw(plan_rows(asking))
    np.testing.assert_array_equal(without[0], with_logprobs[0])
    assert not without[1].any() and not without[2].any()         # nothing computed, nothing reported
    expected = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(with_logprobs[1], expected[np.arange(16), with_logprobs[0]], rtol=1e-5, atol=1e-6)


def test_logit_bias_moves_a_sampled_row_and_takes_greedy_off_the_fast_path():
    from atlasjax.sampling import plan_rows
    logits = np.zeros((64, V), np.float32)
    rows = [_row(seed=s, temperature=1, logit_bias={3: 100}) for s in range(64)]
    assert (_sample_biased(logits, rows, [{3: 100}] * 64) == 3).all()
    assert not plan_rows([_row(temperature=0, logit_bias={3: 1})]).greedy
    assert plan_rows([_row(temperature=0)]).greedy


@pytest.mark.parametrize("bias, match", [({"x": 1}, "keys must be token ids"), ({-1: 1}, "non-negative"),
                                         ({1: 101}, r"\[-100, 100\]"), ({1: float("nan")}, r"\[-100, 100\]"),
                                         ({1: "1"}, r"\[-100, 100\]"), ({i: 1 for i in range(301)}, "at most 300"),
                                         ([1], "map token ids")])
def test_bad_logit_bias_is_refused(bias, match):
    from atlasjax.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={"7": 2, 8: -1.5}).logit_bias == {7: 2.0, 8: -1.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_allowed_token_ids_confine_every_kind_of_row_to_the_list():
    from atlasjax.sampling import plan_rows
    logits = np.random.RandomState(2).randn(4, V)
    allowed = [[3, 4], [9], [3, 4], [int(logits[3].argmax())]]
    rows = [_row(temperature=0, allowed_token_ids=allowed[0]), _row(seed=5, temperature=2.0, allowed_token_ids=[9]),
            _row(temperature=0, allowed_token_ids=[3, 4], logit_bias={4: 100, 5: 100}), _row(temperature=0)]
    tokens = _sample_biased(logits, rows, [r[0].bias_table() for r in rows])
    assert tokens[0] == [3, 4][int(logits[0, 4] > logits[0, 3])]      # the better of the two allowed
    assert tokens[1] == 9 and tokens[2] == 4                          # a bias outside the list changes nothing
    assert tokens[3] == logits[3].argmax()                            # the row without a list is free
    sampled = _sample_biased(np.zeros((64, V)), [_row(seed=s, temperature=1, allowed_token_ids=[1, 2])
                                                 for s in range(64)], [{1: 0.0, 2: 0.0}] * 64)
    assert set(sampled.tolist()) == {1, 2}
    assert not plan_rows([_row(temperature=0, allowed_token_ids=[1])]).greedy


@pytest.mark.parametrize("ids, match", [([], "non-empty"), ("12", "non-empty"), ([1.5], "integer"),
                                        ([True], "integer"), ([-1], "non-negative"),
                                        (list(range(301)), "at most 300")])
def test_bad_allowed_token_ids_are_refused(ids, match):
    from atlasjax.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(allowed_token_ids=ids)
    assert SamplingParams(allowed_token_ids=[np.int64(4), 2, 4]).allowed_token_ids == [4, 2]


def test_truncate_prompt_tokens_keeps_the_prompts_end():
    from atlasjax.errors import InvalidRequestError
    ids = list(range(100))
    assert SamplingParams(truncate_prompt_tokens=10).truncated_prompt(ids, 64) == ids[-10:]
    assert SamplingParams(truncate_prompt_tokens=500).truncated_prompt(ids, 64) == ids    # (too long: refused later)
    assert SamplingParams(max_tokens=24, truncate_prompt_tokens=-1).truncated_prompt(ids, 64) == ids[-40:]
    assert SamplingParams(max_tokens=None, truncate_prompt_tokens=-1).truncated_prompt(ids, 64) == ids[-63:]
    assert SamplingParams().truncated_prompt(ids, 64) == ids
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_the_fast_sort_and_top_k_equal_xla_s_own(monkeypatch):
    """sampling's descending sort (of order keys) and chunked top-k give exactly what a float sort and one
    lax.top_k give, ties, infinities and a ragged last chunk included."""
    import jax
    from atlasjax import sampling
    rs = np.random.RandomState(4)
    x = rs.randn(3, 100).astype(np.float32)
    x[0, :30] = np.round(x[0, :30])                       # ties
    x[1, ::7], x[2, 3] = -np.inf, np.inf
    x[2, 10:14] = [0.0, -0.0, 1e-38, -1e-38]
    np.testing.assert_array_equal(np.asarray(sampling._sort_desc(jnp.asarray(x))), -np.sort(-x, axis=-1))
    monkeypatch.setattr(sampling, "TOP_K_CHUNK", 16)     # 7 chunks, the last of 4
    for k in (1, 5, 16):
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        vals, ids = sampling._top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


def test_top_p_measures_the_mass_top_k_kept():
    """Hugging Face's and vLLM's order: top-k first, then top-p over the renormalized survivors. Probabilities
    0.3, 0.3, 0.2, 0.2 with top_k=2 leave 0.5 / 0.5, so top_p=0.5 keeps only the first (over the whole
    distribution the first holds 0.3 < 0.5, and the second would survive too)."""
    logits = np.full((64, V), -np.inf, np.float32)
    logits[:, :4] = np.log([0.3, 0.2999, 0.2, 0.2])
    tokens, *_ = _sample(logits, [_row(seed=s, temperature=1.0, top_k=2, top_p=0.5) for s in range(64)])
    assert set(tokens.tolist()) == {0}
    tokens, *_ = _sample(logits, [_row(seed=s, temperature=1.0, top_p=0.5) for s in range(64)])
    assert set(tokens.tolist()) == {0, 1}            # top-p alone: the first two reach 0.5

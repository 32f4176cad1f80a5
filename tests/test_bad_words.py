"""vLLM's `bad_words`: a word is never generated. Its last token is banned right after the request generated
the tokens before it (a one-token word: always). The engine must decode as a greedy loop over the model's
own logits that bans by that rule (host side, `LLM.forward`), with one step per launch or four, with or
without asynchronous scheduling, through preemption; sampled rows never draw a banned token; bad requests
are refused."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import LLM, SamplingParams
from atlasjax.bad_words import HISTORY, MAX_BAD_WORD_TOKENS, table, token_sequences
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.errors import InvalidRequestError
from atlasjax.sampling import banned_by_bad_words


def _llm(tiny, **kw):
    args = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=200, max_num_batched_tokens=64)
    return LLM.from_engine(LLMEngine(EngineConfig(**{**args, **kw}), loaded=tiny))


def test_the_mask_bans_a_words_last_token_after_its_prefix():
    seqs = [[7], [3, 4], [1, 2, 5]]
    recent = np.array([[-1] * (HISTORY - 3) + [9, 1, 2],       # ... 1 2: bans 5 (and 7)
                       [-1] * (HISTORY - 2) + [2, 3],          # ... 3: bans 4 (and 7)
                       [-1] * HISTORY]).astype(np.int32)        # nothing generated: 7 only
    mask = np.asarray(banned_by_bad_words(jnp.asarray(np.stack([table(seqs)] * 3)), jnp.asarray(recent), 10))
    assert [np.flatnonzero(row).tolist() for row in mask] == [[5, 7], [4, 7], [7]]


def _reference(llm, prompt, seqs, n):
    """Greedy over full forward passes, banning by vLLM's rule on the generated tokens."""
    out = []
    for _ in range(n):
        logits = llm.forward([prompt + out])[0][-1].copy()
        for seq in seqs:
            if len(seq) == 1 or out[-(len(seq) - 1):] == seq[:-1]:
                logits[seq[-1]] = -np.inf
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize("kw", [dict(), dict(num_scheduler_steps=4), dict(async_scheduling=False),
                                dict(num_pages=14)])                # 14 pages: requests preempt each other
def test_greedy_decoding_with_bad_words_equals_a_reference_loop(tiny, kw):
    llm = _llm(tiny, **kw)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, 512, size=12).tolist() for _ in range(3)]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                                 ignore_eos=True))]
    # per prompt: its first free token alone, and a two-token word it generates later
    words = [[f"w{g[0]}", f"w{g[5]} w{g[6]}"] for g in free]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=w) for w in words]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, w, g, f in zip(prompts, words, got, free):
        seqs = token_sequences(w, llm.tokenizer)
        assert g == _reference(llm, prompt, seqs, 24) != f
        assert seqs[0][0] not in g
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages
    if "num_pages" in kw:
        assert llm.engine.scheduler.num_preemptions > 0


def test_sampled_rows_never_draw_a_banned_token(tiny):
    llm = _llm(tiny)
    prompt = list(range(10, 20))
    likely = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    outs = llm.generate([prompt] * 16, [SamplingParams(temperature=1.5, seed=s, max_tokens=8, ignore_eos=True,
                                                       bad_words=[f"w{likely}"]) for s in range(16)])
    assert all(likely not in o.outputs[0].token_ids for o in outs)


@pytest.mark.parametrize("words, match", [("w1", "list of non-empty strings"), ([""], "non-empty"),
                                          ([f"w{i}" for i in range(17)], "at most 16")])
def test_malformed_bad_words_are_refused(words, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(bad_words=words)


def test_a_word_too_long_for_the_table_is_refused_and_nothing_is_queued(tiny):
    llm = _llm(tiny)
    long_word = " ".join(f"w{i}" for i in range(MAX_BAD_WORD_TOKENS + 1))
    with pytest.raises(InvalidRequestError, match="tokens long"):
        llm.generate([[1, 2, 3]], SamplingParams(bad_words=[long_word]))
    assert not llm.engine.has_unfinished()

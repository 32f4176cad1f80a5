"""Long-context decode programs (atlasjax/long_context_decode.py): a decode bucket compiled again with its
attention's context splits sized for fewer busy rows, run while it holds fewer requests than rows and one
context is long. Steps on them give the default program's results; the engine picks them only then; a
server compiles them at start.

TIERS' context thresholds are lowered here so CI-sized prompts reach them. Their speed is a GPU figure
(docs/performance.md, sessions 58-59)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import EngineConfigError, SamplingParams
from atlasjax import long_context_decode as lcd
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling import pack_rows


def test_policy_picks_the_tier_of_the_active_rows_and_longest_context():
    compiled = (1, 2, 4, 5)
    assert lcd.split_rows(1, 5000, compiled) == 1                      # a lone request past 4,096: one row's splits
    assert lcd.split_rows(1, 2000, compiled) == 2                      # a shorter one: two rows' splits
    assert lcd.split_rows(4, 1024, compiled) == 2
    assert lcd.split_rows(6, 1024, compiled) == 4
    assert lcd.split_rows(7, 2048, compiled) == 5                      # 7 busy rows: splits for 5
    assert lcd.split_rows(1, 1023, compiled) is None                   # short: the default program
    assert lcd.split_rows(7, 2047, compiled) is None
    assert lcd.split_rows(8, 5000, compiled) is None                   # every row busy: the default program
    assert lcd.split_rows(9, 2048, (8,)) == 8                          # 9-10 of the 16-row step: splits for 8
    assert lcd.split_rows(12, 8000, (8,)) is None                      # 11-16: the default program
    assert lcd.split_rows(17, 2048, (8,)) == 8 and lcd.split_rows(21, 8000, (8,)) is None   # of the 32-row step
    assert lcd.split_rows(1, 5000, (2,)) == 2                      # only what was compiled
    assert lcd.split_rows(1, 5000, ()) is None
    # very long contexts: more than one wave of splits (session 70)
    longer = (0.25, 0.5, 1, 2, 4, 5)
    assert lcd.split_rows(1, 49152, longer) == 0.25 and lcd.split_rows(1, 49151, longer) == 1
    assert lcd.split_rows(2, 65536, longer) == 0.25 and lcd.split_rows(2, 65535, longer) == 2
    assert lcd.split_rows(4, 65536, longer) == 0.5 and lcd.split_rows(3, 16384, longer) == 1
    assert lcd.split_rows(4, 16383, longer) == 2


def test_resolve_compiles_the_tiers_a_context_can_reach():
    on = dict(on_gpu=True, attention_backend="auto", decode_buckets=(8, 16, 32, 64), max_model_len=8192)
    assert lcd.resolve(None, **on) == {8: (1, 2, 4, 5), 16: (8,), 32: (8,)}   # 9-16 requests run the 16-row step
    assert lcd.resolve(None, **{**on, "max_model_len": 4096}) == {8: (2, 4, 5), 16: (8,), 32: (8,)}   # none > 4,096
    assert lcd.resolve(None, **{**on, "max_model_len": 131072}) == {8: (0.25, 1, 0.5, 2, 4, 5), 16: (8,), 32: (8,)}
    assert lcd.resolve(None, **{**on, "max_model_len": 40960})[8] == (1, 2, 4, 5)   # 3-4 requests at 16k: 1
    assert lcd.resolve(None, **{**on, "max_model_len": 2048}) == {8: (2, 4)}
    assert lcd.resolve(None, **{**on, "max_model_len": 1024}) == {}
    assert lcd.resolve(None, **{**on, "on_gpu": False}) == {}              # the reference does not split
    assert lcd.resolve(None, **{**on, "attention_backend": "reference"}) == {}
    # 4 rows split for 4 already; the 16-row step then runs 5-16 requests
    assert lcd.resolve(True, **{**on, "decode_buckets": (4, 16)}) == {4: (1, 2), 16: (4, 5, 8)}
    assert lcd.resolve(True, **{**on, "decode_buckets": (8, 32)}) == {8: (1, 2, 4, 5), 32: (8,)}   # 9-10 and 17-20
    assert lcd.resolve(True, **{**on, "on_gpu": False}) == {8: (1, 2, 4, 5), 16: (8,), 32: (8,)}
    assert lcd.resolve(False, **on) == {}


@pytest.mark.parametrize("value", ["on", 1])
def test_a_bad_setting_is_refused(value):
    with pytest.raises(EngineConfigError, match="long_context_decode"):
        EngineConfig(long_context_decode=value)


def test_the_flag_reaches_the_config():
    import argparse

    from atlasjax.__main__ import add_engine_args, engine_kwargs
    from atlasjax.bench.__main__ import build_parser
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["long_context_decode"] is None
    assert engine_kwargs(p.parse_args(["--long-context-decode", "off"]))["long_context_decode"] is False
    args = build_parser().parse_args(["latency", "--preset", "tiny", "--long-context-decode", "on"])
    assert args.long_context_decode == "on"


def _engine(loaded, monkeypatch, one_row_context=40, two_rows_context=24, more_tiers=(), **kw):
    monkeypatch.setattr(lcd, "TIERS", ((1, 1, one_row_context, 1), (1, 4, two_rows_context, 2), *more_tiers))
    args = dict(max_num_seqs=8, max_model_len=96, page_size=8, num_pages=8 * 12 + 1, max_num_batched_tokens=64,
                long_context_decode=True)
    return LLMEngine(EngineConfig(**{**args, **kw}), loaded=loaded)


def _record_split_rows(engine):
    """[(active rows, split_rows)] per decode the engine dispatches."""
    seen, decode = [], engine.runner.decode

    def record(tokens, page_table, seq_lens, *args, split_rows=None):
        seen.append((int((np.asarray(seq_lens) > 0).sum()), split_rows))
        return decode(tokens, page_table, seq_lens, *args, split_rows=split_rows)
    engine.runner.decode = record
    return seen


def _generate(engine, prompts, sp):
    """Each prompt with sp (or its own of a list)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sp[i] if isinstance(sp, list) else sp)
    while engine.has_unfinished():
        engine.step()
    out = {rid: [(r.output_token_ids, r.logprobs) for r in seqs] for rid, seqs in engine.requests.items()}
    for rid in list(out):
        engine.release(rid)
    assert engine.pool.num_free_pages == engine.pool.num_pages
    return out


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=1,
                         repetition_penalty=1.1)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_lone_long_request_runs_them_with_the_default_programs_results(tiny, monkeypatch, steps):
    """One request whose context passes both thresholds as it decodes (24, then 40 tokens): its steps
    run the default program, then two rows' splits, then one row's; tokens and logprobs match an engine
    without them. Five at once keep the default program until four or fewer are left."""
    prompts = [list(range(3, 23))]                 # 20 tokens; 30 new ones take the context past 40
    sp = dataclasses.replace(SAMPLED, max_tokens=30)
    want = _generate(_engine(tiny, monkeypatch, long_context_decode=False, num_scheduler_steps=steps), prompts, sp)
    engine = _engine(tiny, monkeypatch, num_scheduler_steps=steps)
    assert engine.runner.long_context_split_rows == {8: (1, 2)}
    seen = _record_split_rows(engine)
    assert _generate(engine, prompts, sp) == want
    order = [split for _, split in seen]
    assert order == sorted(order, key=lambda s: {None: 0, 2: 1, 1: 2}[s]) and {None, 1, 2} <= set(order)
    assert {k[0] for k in engine.runner._compiled} >= {"decode_long_context_1", "decode_long_context_2"}
    seen.clear()
    # the other four end after 10-16 tokens, one by one: 4, then 3 active with contexts past 24
    others = [dataclasses.replace(SAMPLED, max_tokens=10 + 2 * i) for i in range(4)]
    five = _generate(engine, [prompts[0]] + [list(range(30 + 5 * i, 52 + 5 * i)) for i in range(4)], [sp] + others)
    assert all(split is None for active, split in seen if active > 4)
    assert any(split == 2 for active, split in seen if active in (3, 4))
    assert five["r0"][0][0] == want["r0"][0][0]      # its tokens (logprobs round apart in a fuller batch)


def test_a_server_compiles_them_at_start_for_the_smallest_bucket(tiny, monkeypatch):
    engine = _engine(tiny, monkeypatch, max_num_seqs=16, compile_at_start=True, num_scheduler_steps=2)
    compiled = set(engine.runner._compiled)
    long_context = sorted((k[0], k[1], len(k)) for k in compiled if k[0].startswith("decode_long_context"))
    # 4 sampling plans x 1 and 2 steps per launch, 8 rows only, for each tier
    assert long_context == sorted([(f"decode_long_context_{s}", 8, n) for s in (1, 2) for n in (3, 4)] * 4)
    n = engine.runner.num_compiles
    _generate(engine, [list(range(3, 23))], SAMPLED)
    assert engine.runner.num_compiles == n                   # serving compiles nothing more


def test_the_runner_refuses_it_for_other_buckets(tiny, monkeypatch):
    engine = _engine(tiny, monkeypatch, max_num_seqs=16)
    z = np.zeros
    for rows, split in ((16, 2), (8, 4)):
        with pytest.raises(ValueError, match=f"no long-context decode program with split_rows={split} for {rows}"):
            engine.runner.decode(z(rows, np.int32), z((rows, 12), np.int32), z(rows, np.int32), *pack_rows([], rows),
                                 split_rows=split)


def test_a_bucket_runs_the_tiers_of_the_requests_it_holds(tiny, monkeypatch):
    """With a 3-row smallest bucket, four requests run the 8-row step, and on two rows' splits once a
    context passes the threshold (the 2-row tier covers up to 4 requests); the one-row tier stays with
    the 3-row bucket. Tokens as an engine without the programs."""
    engine = _engine(tiny, monkeypatch, decode_batch_sizes=(3,))
    assert engine.runner.decode_buckets == (3, 8) and engine.runner.long_context_split_rows == {3: (1, 2), 8: (2,)}
    prompts = [list(range(3 + i, 30 + i)) for i in range(4)]
    sp = dataclasses.replace(SAMPLED, max_tokens=6)
    want = _generate(_engine(tiny, monkeypatch, decode_batch_sizes=(3,), long_context_decode=False), prompts, sp)
    seen = _record_split_rows(engine)
    assert _generate(engine, prompts, sp) == want
    assert seen and all(split == 2 for active, split in seen if active == 4)


def test_nine_requests_run_the_sixteen_row_step_on_eight_rows_splits(tiny, monkeypatch):
    """With the 10-request tier (splits for 8 rows), 9 requests run the 16-row step on it, compiled for
    that bucket alone; tokens as an engine without the programs."""
    prompts = [list(range(3 + i, 30 + i)) for i in range(9)]
    sp = dataclasses.replace(SAMPLED, max_tokens=6)
    sixteen = dict(max_num_seqs=16, num_pages=16 * 12 + 1)
    want = _generate(_engine(tiny, monkeypatch, long_context_decode=False, **sixteen), prompts, sp)
    engine = _engine(tiny, monkeypatch, more_tiers=((9, 10, 24, 8),), **sixteen)
    assert engine.runner.long_context_split_rows == {8: (1, 2), 16: (8,)}
    seen = _record_split_rows(engine)
    assert _generate(engine, prompts, sp) == want
    assert any(active == 9 for active, _ in seen)
    assert all(split == 8 for active, split in seen if active == 9)


def test_through_the_kernel_in_interpret_mode(monkeypatch):
    """The decode kernel (interpret mode) under two rows' splits: a lone request's 330-token
    context (6 blocks of 64) is attended in 6 splits, where the 4-row step's default (5 splits for 4 rows
    x 8 KV heads) makes 3 of 2 blocks; greedy tokens as the default program's, logprobs within kernel
    rounding."""
    from atlasjax.bench.presets import synthetic_tokenizer
    from atlasjax.loader import LoadedModel, random_params
    from tests.test_pallas_model_interpret import CFG_ROPE
    cfg = dataclasses.replace(CFG_ROPE, num_heads=16, num_kv_heads=8, num_layers=1, max_position_embeddings=512)
    loaded = LoadedModel(cfg, random_params(cfg, jnp.bfloat16, 5), tokenizer=synthetic_tokenizer(cfg), source="test")
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    prompts = [list(np.random.default_rng(1).integers(0, cfg.vocab_size, 330))]
    results = []
    for on in (False, True):
        engine = _engine(loaded, monkeypatch, 1000, 256, dtype="bfloat16", attention_backend="interpret",
                         max_num_seqs=4, max_model_len=384, page_size=16, num_pages=4 * 24 + 1,
                         max_num_batched_tokens=384, long_context_decode=on, num_scheduler_steps=1)
        seen = _record_split_rows(engine)
        results.append(_generate(engine, prompts, greedy)["r0"][0])
        assert all(split == (2 if on else None) for _, split in seen) and seen
    (want_tokens, want_lp), (tokens, lp) = results
    assert tokens == want_tokens
    np.testing.assert_allclose([next(iter(x.values())).logprob for x in lp],
                               [next(iter(x.values())).logprob for x in want_lp], atol=5e-3)

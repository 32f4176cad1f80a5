"""The long-context decode program (atlasjax/long_context_decode.py): the smallest decode bucket
compiled again with its attention's context splits sized for 2 busy rows, run while at most 2
requests decode and one context is long. Steps on it give the default program's results; the
engine picks it only then; a server compiles it at start.

MIN_CONTEXT is lowered here so CI-sized prompts reach it. Its speed is a GPU figure
(docs/performance.md, session 58)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from atlasjax import EngineConfigError, SamplingParams
from atlasjax import long_context_decode as lcd
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig


def test_policy_runs_it_for_few_rows_with_a_long_context():
    assert lcd.split_rows(1, lcd.MIN_CONTEXT) == lcd.split_rows(lcd.FEW_ROWS, 5000) == lcd.FEW_ROWS
    assert lcd.split_rows(1, lcd.MIN_CONTEXT - 1) is None                  # short: the default program
    assert lcd.split_rows(lcd.FEW_ROWS + 1, 5000) is None                  # busy: the default program
    on = dict(on_gpu=True, attention_backend="auto", smallest_bucket=8, max_model_len=4096)
    assert lcd.resolve(None, **on)
    assert not lcd.resolve(None, **{**on, "on_gpu": False})                # the reference does not split
    assert not lcd.resolve(None, **{**on, "attention_backend": "reference"})
    assert not lcd.resolve(True, **{**on, "smallest_bucket": 2})          # already split for 2 rows
    assert not lcd.resolve(True, **{**on, "max_model_len": 512})          # no context gets long
    assert lcd.resolve(True, **{**on, "on_gpu": False}) and not lcd.resolve(False, **on)


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


def _engine(loaded, monkeypatch, min_context=24, **kw):
    monkeypatch.setattr(lcd, "MIN_CONTEXT", min_context)
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
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sp)
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
def test_a_lone_long_request_runs_it_with_the_default_programs_results(tiny, monkeypatch, steps):
    """One request whose context passes MIN_CONTEXT as it decodes: its later steps run the long-context
    program; tokens and logprobs match an engine without it. Three at once keep the default."""
    prompts = [list(range(3, 23))]                 # 20 tokens: the context reaches 24 while decoding
    want = _generate(_engine(tiny, monkeypatch, long_context_decode=False, num_scheduler_steps=steps), prompts,
                     SAMPLED)
    engine = _engine(tiny, monkeypatch, num_scheduler_steps=steps)
    seen = _record_split_rows(engine)
    assert _generate(engine, prompts, SAMPLED) == want
    assert (1, None) in seen and (1, lcd.FEW_ROWS) in seen                # short first, then long
    assert any(k[0] == "decode_long_context" for k in engine.runner._compiled)
    seen.clear()
    three = _generate(engine, [prompts[0], list(range(30, 52)), list(range(60, 85))], SAMPLED)
    assert all(split is None for active, split in seen if active > lcd.FEW_ROWS)
    assert three["r0"][0][0] == want["r0"][0][0]     # its tokens (logprobs round apart in a fuller batch)


def test_a_server_compiles_it_at_start_for_the_smallest_bucket(tiny, monkeypatch):
    engine = _engine(tiny, monkeypatch, max_num_seqs=16, compile_at_start=True, num_scheduler_steps=2)
    compiled = set(engine.runner._compiled)
    long_context = sorted((k[1], len(k)) for k in compiled if k[0] == "decode_long_context")
    assert long_context == [(8, 3)] * 3 + [(8, 4)] * 3          # 3 sampling plans x 1 and 2 steps, 8 rows only
    n = engine.runner.num_compiles
    _generate(engine, [list(range(3, 23))], SAMPLED)
    assert engine.runner.num_compiles == n                   # serving compiles nothing more


def test_the_runner_refuses_it_for_other_buckets(tiny, monkeypatch):
    engine = _engine(tiny, monkeypatch, max_num_seqs=16)
    z = np.zeros
    with pytest.raises(ValueError, match="no long-context decode program for 16 rows"):
        engine.runner.decode(z(16, np.int32), z((16, 12), np.int32), z(16, np.int32), *engine_rows(16),
                             split_rows=lcd.FEW_ROWS)


def engine_rows(rows):
    from atlasjax.sampling import pack_rows
    return pack_rows([], rows)


def test_through_the_kernel_in_interpret_mode(monkeypatch):
    """The decode kernel (interpret mode) under the long-context program: a lone request's 330-token
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
        engine = _engine(loaded, monkeypatch, min_context=256, dtype="bfloat16", attention_backend="interpret",
                         max_num_seqs=4, max_model_len=384, page_size=16, num_pages=4 * 24 + 1,
                         max_num_batched_tokens=384, long_context_decode=on, num_scheduler_steps=1)
        seen = _record_split_rows(engine)
        results.append(_generate(engine, prompts, greedy)["r0"][0])
        assert all(split == (lcd.FEW_ROWS if on else None) for _, split in seen) and seen
    (want_tokens, want_lp), (tokens, lp) = results
    assert tokens == want_tokens
    np.testing.assert_allclose([next(iter(x.values())).logprob for x in lp],
                               [next(iter(x.values())).logprob for x in want_lp], atol=5e-3)

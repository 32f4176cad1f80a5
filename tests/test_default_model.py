"""The embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end, and the CLI."""
import subprocess
import sys

from atlasjax import SamplingParams


def test_default_model_answers_paris(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"          # ended on <|im_end|>, not by length
    assert "<|im_end|>" not in out[0].outputs[0].text


def test_stop_strings_are_not_emitted(smollm2):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = smollm2.chat(msgs, SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text
    cut = smollm2.chat(msgs, SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]))[0].outputs[0]
    assert cut.text == full[:full.index("Paris")]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"


def test_detokenize_false_returns_the_same_tokens_without_text(smollm2):
    """vLLM's detokenize=False (token ids only, as RL rollouts want them): the same ids and logprobs, no text,
    no decoded logprob tokens; stop strings, which need text, are refused."""
    import pytest

    from atlasjax.errors import InvalidRequestError
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(temperature=0, max_tokens=12, logprobs=2)
    full = smollm2.chat(msgs, SamplingParams(**kw))[0].outputs[0]
    ids = smollm2.chat(msgs, SamplingParams(detokenize=False, **kw))[0].outputs[0]
    assert ids.token_ids == full.token_ids and ids.text == "" and full.text
    for got, want in zip(ids.logprobs, full.logprobs):   # (the second run's prompt comes from the prefix cache)
        assert got.keys() == want.keys()
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-4)
    assert all(lp.decoded_token is None for d in ids.logprobs for lp in d.values())
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["Paris"])


def test_text_prompts_share_a_batch(smollm2):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    together = smollm2.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    alone = [smollm2.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12 for o in together)
    assert together[1].outputs[0].text == smollm2.tokenizer.decode(together[1].outputs[0].token_ids)


def test_cli_reports_a_missing_model_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "atlasjax", "generate", "hi", "--model", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_cli_reports_an_unsupported_model(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"], "model_type": "falcon"}')
    r = subprocess.run([sys.executable, "-m", "atlasjax", "chat", "hi", "--model", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unsupported model architecture" in r.stderr and "LlamaForCausalLM" in r.stderr
    assert "Traceback" not in r.stderr


def test_verbose_flag_goes_before_or_after_the_command():
    from atlasjax.__main__ import build_parser
    for argv in (["-v", "serve"], ["serve", "-v"], ["generate", "hi", "--verbose"], ["save", "out", "-v"]):
        assert build_parser().parse_args(argv).verbose, argv
    assert not build_parser().parse_args(["serve"]).verbose


def test_only_the_server_compiles_every_shape_at_start():
    from atlasjax.__main__ import build_parser, engine_kwargs
    assert engine_kwargs(build_parser().parse_args(["serve"]))["compile_at_start"]
    assert not engine_kwargs(build_parser().parse_args(["generate", "hi"]))["compile_at_start"]

"""LoRA adapters (atlasjax/lora.py): each request runs with its PEFT adapter, several adapters and the base model in
one batch, and every output equals Hugging Face's model with that adapter merged into its weights (W + scale B A)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference models are Hugging Face transformers (torch)")

from atlasjax import LLM, EngineConfigError, InvalidRequestError, LoRARequest, SamplingParams  # noqa: E402
from tests.hf_models import hf_logprobs  # noqa: E402
from tests.lora_adapters import make_adapter, merged_model  # noqa: E402

PROMPTS = [list(range(5, 45)), [7, 3, 99, 12, 400, 8, 8, 31]]   # the first is longer than two pages
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
# float32 everywhere (on a GPU its matmuls run TF32: the logprobs' tolerance widens there)
ENGINE = dict(max_num_seqs=4, dtype="float32")
# (name, rank, alpha, targets, rslora)
ADAPTERS = {"all": (4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
            "qv": (8, 16.0, ("q_proj", "v_proj"), True)}


@pytest.fixture(scope="module")
def setup(hf_model_factory, tmp_path_factory):
    """(base dir, {name: LoRARequest}, {name or None: HF reference model})"""
    model, base = hf_model_factory("llama_gqa4")
    root = tmp_path_factory.mktemp("adapters")
    requests, refs = {}, {None: model}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = str(root / name)
        pairs = make_adapter(model, path, rank=rank, alpha=alpha, targets=targets, seed=i, rslora=rslora)
        requests[name] = LoRARequest(name, i + 1, path)
        refs[name] = merged_model(model, pairs, rank=rank, alpha=alpha, rslora=rslora)
    return base, requests, refs


@pytest.fixture(scope="module")
def llm(setup):
    return LLM(setup[0], enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)


def _reference(model, prompt, n=GREEDY.max_tokens):
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()


def _check(out, ref_model, prompt):
    """Greedy tokens as the merged reference's, and each token's logprob as its distribution gives it."""
    tokens = out.outputs[0].token_ids
    assert tokens == _reference(ref_model, prompt)
    ref = hf_logprobs(ref_model, prompt + tokens[:-1])[len(prompt) - 1:]
    got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    import jax
    np.testing.assert_allclose(got, ref[np.arange(len(tokens)), tokens],
                               atol=3e-2 if jax.default_backend() == "gpu" else 2e-3)


def test_one_batch_mixes_adapters_and_the_base_model(llm, setup):
    _, requests, refs = setup
    names = ["all", "qv", None, "all"]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    outs = llm.generate(prompts, GREEDY, lora_request=[requests[n] if n else None for n in names])
    for out, name, prompt in zip(outs, names, prompts):
        _check(out, refs[name], prompt)
        assert out.lora_request == (requests[name] if name else None)
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids   # the adapter changes the answer


def test_cached_prompt_pages_are_per_adapter(llm, setup):
    """A prompt computed under the base model is not a cache hit for an adapter (its K/V differ), and is for the
    same adapter again."""
    _, requests, refs = setup
    prompt = [p + 1 for p in PROMPTS[0]]
    base = llm.generate([prompt], GREEDY)[0]
    first = llm.generate([prompt], GREEDY, lora_request=requests["qv"])[0]
    again = llm.generate([prompt], GREEDY, lora_request=requests["qv"])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    _check(base, refs[None], prompt)
    _check(again, refs["qv"], prompt)


def test_one_device_slot_runs_adapters_in_turn(setup):
    """max_loras=1: requests of the resident adapter are admitted past one waiting for the slot, which then swaps."""
    base, requests, refs = setup
    engine = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE).engine
    names = ["all", "qv", "all"]
    for i, name in enumerate(names):
        engine.add_request(str(i), PROMPTS[1], GREEDY, lora_request=requests[name])
    engine.step()
    assert engine.stats.running_lora_adapters == ("all",) and engine.stats.waiting_lora_adapters == ("qv",)
    while engine.has_unfinished():
        engine.step()
    for i, name in enumerate(names):
        assert engine.requests[str(i)][0].output_token_ids == _reference(refs[name], PROMPTS[1])
    assert engine.lora.num_loads == 2     # "all" once for both of its requests, then "qv"


def test_unusable_adapters_fail_the_request_not_the_engine(llm, setup, tmp_path):
    base, requests, refs = setup
    good = requests["all"].lora_path

    def adapter(name, tensors=None, config=None, raw=None):
        from safetensors.numpy import save_file
        path = tmp_path / name
        path.mkdir()
        with open(path / "adapter_config.json", "w") as f:
            json.dump(config or {"peft_type": "LORA", "r": 2, "lora_alpha": 2}, f)
        if raw is not None:
            (path / "adapter_model.safetensors").write_bytes(raw)
        elif tensors is not None:
            save_file(tensors, str(path / "adapter_model.safetensors"))
        return LoRARequest(name, 100 + len(os.listdir(tmp_path)), str(path))

    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = {
        "missing": (LoRARequest("missing", 50, str(tmp_path / "nowhere")), "adapter_config.json"),
        "no weights": (adapter("noweights"), "adapter_model.safetensors"),
        "corrupt": (adapter("corrupt", raw=open(os.path.join(good, "adapter_model.safetensors"), "rb").read()[:300]),
                    "unreadable"),
        "rank": (adapter("rank", {f"{layer}.lora_A.weight": np.zeros((16, 64), np.float32),
                                  f"{layer}.lora_B.weight": np.zeros((64, 16), np.float32)}), "max_lora_rank=8"),
        "shape": (adapter("shape", {f"{layer}.lora_A.weight": np.zeros((2, 96), np.float32),
                                    f"{layer}.lora_B.weight": np.zeros((64, 2), np.float32)}), "do not fit the model"),
        "lm head": (adapter("head", {"base_model.model.lm_head.lora_A.weight": np.zeros((2, 64), np.float32),
                                     "base_model.model.lm_head.lora_B.weight": np.zeros((512, 2), np.float32)}),
                    "LM head"),
        "dora": (adapter("dora", config={"peft_type": "LORA", "r": 2, "use_dora": True}), "DoRA"),
    }
    for case, (request, message) in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([PROMPTS[1]], GREEDY, lora_request=request)
    with pytest.raises(InvalidRequestError, match="positive integer"):
        LoRARequest("x", 0, good)
    pool = llm.engine.pool
    assert pool.num_free_pages == pool.num_pages and not llm.engine.scheduler.has_work   # nothing held or queued
    _check(llm.generate([PROMPTS[1]], GREEDY, lora_request=requests["all"])[0], refs["all"], PROMPTS[1])


@pytest.mark.parametrize("tp", [2, 4])
def test_adapters_under_tensor_parallelism_answer_as_merged_weights(setup, tp):
    """Split over 2 devices (a KV head each), and over 4 (each of the 2 KV heads on two devices): the stacks are
    split as their weights are, a row-parallel projection's x @ a all-reduced (tests/conftest.py: 8 CPU devices)."""
    base, requests, refs = setup
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=tp, **ENGINE)
    names = ["all", "qv", None, "all"]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    outs = llm.generate(prompts, GREEDY, lora_request=[requests[n] if n else None for n in names])
    for out, name, prompt in zip(outs, names, prompts):
        _check(out, refs[name], prompt)


def test_lora_settings_are_checked(setup):
    base, requests, _ = setup
    for kwargs, message in ((dict(enable_lora=True, max_loras=0), "max_loras"),
                            (dict(enable_lora=True, max_lora_rank=1024), "max_lora_rank"),
                            (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), "max_cpu_loras")):
        with pytest.raises(EngineConfigError, match=message):
            LLM(base, **kwargs)


def test_adapters_need_enable_lora(tiny, setup):
    from atlasjax.engine import LLMEngine
    from atlasjax.engine_config import EngineConfig
    engine = LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=64), loaded=tiny)
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        engine.add_request("r", [1, 2, 3], GREEDY, lora_request=setup[1]["all"])
    assert not engine.scheduler.has_work


def test_served_adapters_are_models_by_name(llm, setup, tmp_path, monkeypatch):
    """`--lora-modules` names adapters in requests' "model" field; /v1/models lists them; with runtime updates
    allowed an adapter is loaded and unloaded over HTTP (a bad one refused at once)."""
    import asyncio

    import httpx

    from atlasjax.async_llm import AsyncLLM
    from serving.app import create_app
    from serving.lora_routes import parse_lora_modules
    base, requests, refs = setup
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    modules = parse_lora_modules([f"all={requests['all'].lora_path}"])
    engine = AsyncLLM(engine=llm.engine)
    app = create_app(engine, served_model_name="base", lora_modules=modules)
    prompt = PROMPTS[1]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            def complete(model):
                return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 10,
                                                            "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                            "return_tokens_as_token_ids": True})
            got = {"models": (await client.get("/v1/models")).json(), "all": await complete("all"),
                   "base": await complete("base"), "unknown": await complete("qv")}
            got["load"] = await client.post("/v1/load_lora_adapter",
                                            json={"lora_name": "qv", "lora_path": requests["qv"].lora_path})
            got["qv"] = await complete("qv")
            got["bad load"] = await client.post("/v1/load_lora_adapter",
                                                json={"lora_name": "bad", "lora_path": str(tmp_path)})
            got["unload"] = await client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
            got["unloaded"] = await complete("qv")
            got["unload again"] = await client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
            got["metrics"] = (await client.get("/metrics")).text
            return got
    try:
        got = asyncio.run(go())
    finally:
        engine.shutdown(drain=False)
    cards = {card["id"]: card for card in got["models"]["data"]}
    assert cards["all"]["parent"] == "base" and cards["all"]["root"] == requests["all"].lora_path
    for name, ref in (("all", refs["all"]), ("base", refs[None]), ("qv", refs["qv"])):
        assert got[name].status_code == 200, got[name].text
        tokens = got[name].json()["choices"][0]["logprobs"]["tokens"]
        assert [int(t.removeprefix("token_id:")) for t in tokens] == _reference(ref, prompt)
        assert got[name].json()["model"] == name
    assert got["unknown"].status_code in (400, 404)
    assert "does not exist" in got["unknown"].text
    assert got["load"].status_code == 200 and got["bad load"].status_code == 400
    assert "adapter_config.json" in got["bad load"].text
    assert got["unload"].status_code == 200 and got["unloaded"].status_code in (400, 404)
    assert got["unload again"].status_code == 404
    assert 'atlasjax_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in got["metrics"]


def test_beam_search_runs_the_adapter(llm, setup):
    """One beam is greedy search: its tokens are the merged model's greedy tokens."""
    from atlasjax import BeamSearchParams
    _, requests, refs = setup
    out = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True),
                          lora_request=requests["qv"])[0]
    assert out.sequences[0].tokens[len(PROMPTS[1]):] == _reference(refs["qv"], PROMPTS[1], 6)


@pytest.mark.parametrize("drafts", ["ngram", "draft_model"])
def test_speculative_verify_runs_each_requests_adapter(setup, drafts):
    """Drafts verified in one step keep each row on its request's adapter: the merged models' tokens. The draft
    model (here the base model itself) proposes without adapters, as vLLM's does."""
    base, requests, refs = setup
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
            if drafts == "ngram" else {"model": base, "num_speculative_tokens": 3})
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE, speculative_config=spec)
    loop = [7, 8, 9, 10] * 4
    names = ["all", "qv", None]
    outs = llm.generate([loop] * 3, GREEDY, lora_request=[requests[n] if n else None for n in names])
    for out, name in zip(outs, names):
        assert out.outputs[0].token_ids == _reference(refs[name], loop)
    assert llm.engine.stats.spec.num_draft_tokens > 0     # verify steps ran


def test_lora_modules_flag():
    """--lora-modules: name=path or vLLM's JSON form, ids in order; a bad entry names itself."""
    import subprocess
    import sys

    from serving.lora_routes import parse_lora_modules
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}'])
    assert modules == {"sql": LoRARequest("sql", 1, "/a/sql"), "chat": LoRARequest("chat", 2, "/a/chat", "m")}
    for bad, message in ((["sql"], "name=path"), (["a=/x", "a=/y"], "twice"), (['{"name": "a"}'], '"path"'),
                         (["{oops"], "not valid JSON")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
    run = subprocess.run([sys.executable, "-m", "atlasjax", "serve", "--lora-modules", "sql=/a/sql"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--enable-lora" in run.stderr

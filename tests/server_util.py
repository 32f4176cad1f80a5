"""Live-server helpers for the server tests: a tiny model with a real tokenizer, a server subprocess.

The model is a random 2-layer Llama (hidden 64) whose vocabulary is the Llama 3 tokenizer's, so
text round-trips and the chat template works; its embedding is drawn wide enough that greedy
choices are decided by clear logit gaps, not by float noise between batch shapes. The server is
`python -m atlasjax serve --port 0` in a subprocess (its log in a file), shared by every test
module of a pytest run through `shared_server`; `reference_llm` is an in-process `LLM` with the
same engine settings, for greedy references.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "assets")
TOKENIZER_DIR = os.path.join(ASSETS, "tokenizers", "llama3")
API_KEY = "sk-atlasjax-test"
MODEL_NAME = "tiny-llama3"
ENGINE_KWARGS = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=128)
READY_TIMEOUT_S = 240
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_cache: dict = {}


def make_tiny_model(out_dir: str, seed: int = 0) -> str:
    """A random Llama with the Llama 3 tokenizer (skips the test when the tokenizer asset is absent); another
    seed, other weights of the same architecture."""
    if not os.path.exists(os.path.join(TOKENIZER_DIR, "tokenizer.json")):
        pytest.skip(f"test assets not found at {TOKENIZER_DIR} (the Llama 3 tokenizer is needed for text)")
    from safetensors.numpy import save_file
    vocab, hidden, inter, layers, heads, kv_heads = 128256, 64, 128, 2, 4, 2
    head_dim = hidden // heads
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                  hidden_act="silu", tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128009],
                  torch_dtype="float32")
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.08):
        return rng.normal(0.0, std, shape).astype(np.float32)
    tensors = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0), "lm_head.weight": w(vocab, hidden, std=0.5),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32)})
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), out_dir)
    return out_dir


def engine_flags(kwargs: dict) -> list[str]:
    return [x for k, v in kwargs.items() for x in (f"--{k.replace('_', '-')}", str(v))]


class ServerProcess:
    """`python -m atlasjax serve` on 127.0.0.1, a free port, output in a log file."""

    def __init__(self, model_dir: str, log_path: str, *extra_args: str, engine_kwargs: dict = ENGINE_KWARGS):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        env.pop("ATLASJAX_API_KEY", None)
        cmd = [sys.executable, "-m", "atlasjax", "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", "0",
               "--served-model-name", MODEL_NAME, *engine_flags(engine_kwargs), *extra_args]
        if os.environ.get("ATLASJAX_TEST_ENGINE_PROCESS") == "1" and "--engine-process" not in cmd:
            cmd.append("--engine-process")   # every server test against an engine process (run by hand)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.url = self._wait_ready()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if line.startswith("atlasjax: ready on "):
                    return line.split("ready on ", 1)[1].strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"the server was not ready after {READY_TIMEOUT_S}s:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful: in-flight requests finish), then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def tiny_model_dir(tmp_path_factory) -> str:
    if "model" not in _cache:
        _cache["model"] = make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama3")))
    return _cache["model"]


def shared_server(request, tmp_path_factory, name: str = "main", *extra_args: str,
                  engine_kwargs: dict = ENGINE_KWARGS) -> ServerProcess:
    """One server per (name) for the whole pytest run, stopped when pytest finishes."""
    if name not in _cache:
        model = tiny_model_dir(tmp_path_factory)
        log_path = str(tmp_path_factory.mktemp(f"server_{name}") / "server.log")
        server = ServerProcess(model, log_path, *extra_args, engine_kwargs=engine_kwargs)
        request.config.add_cleanup(server.stop)
        _cache[name] = server
    return _cache[name]


def main_server(request, tmp_path_factory) -> ServerProcess:
    """The server most tests use: API key required, small body limit (so 413 is cheap to test)."""
    return shared_server(request, tmp_path_factory, "main", "--api-key", API_KEY, "--max-body-bytes", str(1 << 20))


def engine_process_server(request, tmp_path_factory) -> ServerProcess:
    """The server with its engine in a process of its own, logging requests and stats (every 0.5 s)."""
    return shared_server(request, tmp_path_factory, "engine_process", "--api-key", API_KEY, "--engine-process",
                         "--log-requests", "--log-stats-interval", "0.5")


def reference_llm(tmp_path_factory):
    """An in-process LLM over the same model and engine settings (greedy references)."""
    if "llm" not in _cache:
        from atlasjax import LLM
        _cache["llm"] = LLM(tiny_model_dir(tmp_path_factory), **ENGINE_KWARGS)
    return _cache["llm"]


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


def chat_reference(llm, messages, max_tokens: int, **kwargs):
    """The greedy answer of LLM.chat to one conversation."""
    from atlasjax import SamplingParams
    return llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs))[0]


def greedy_reference(llm, prompts, max_tokens: int, **kwargs):
    """Greedy outputs of LLM.generate for prompts (strings or token-id lists)."""
    from atlasjax import SamplingParams
    return llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs))


def metric_value(text: str, name: str) -> float:
    """A sample's value from Prometheus text (the first sample with that exact name, labels ignored)."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def sse_events(lines) -> list[dict]:
    """The JSON events of a server-sent-events body (its lines), which must end with `data: [DONE]`."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-1:]
    return [json.loads(d) for d in data[:-1]]


def post_in_process(app, path: str, body: dict):
    """POST `body` to an ASGI app in this process (a scripted engine behind `create_app`); the httpx response,
    read whole."""
    import asyncio

    import httpx

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)
    return asyncio.run(go())

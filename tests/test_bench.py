"""`python -m atlasjax.bench`: every mode end to end on the tiny preset (CPU), JSON with all fields.

The serve mode runs against the real server (`python -m atlasjax serve`, through
`atlasjax.bench.preset_server` so it serves the tiny preset) on loopback; the server starts when
this module does, so it compiles while the other modes run.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from atlasjax.bench import report, roofline, serve
from atlasjax.bench.__main__ import main
from atlasjax.bench.presets import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_SERVING = importlib.util.find_spec("serving.cli") is not None
HAS_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


@pytest.fixture(scope="module")
def server():
    """A live `python -m atlasjax serve` on the tiny preset; yields its base URL (or None)."""
    if not HAS_SERVING:
        yield None
        return
    cmd = [sys.executable, "-m", "atlasjax.bench.preset_server", "--preset", "tiny", "--port", "0",
           "--max-num-seqs", "4", "--max-model-len", "128", "--max-num-batched-tokens", "64",
           "--scheduling-policy", "priority"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    state = {"proc": proc}
    yield state
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(autouse=True, scope="module")
def _start_server_early(server):
    yield


def run_bench(tmp_path, *argv) -> dict:
    out = tmp_path / "result.json"
    assert main([*argv, "--output", str(out)]) == 0
    return json.loads(out.read_text())


def check_common(rep: dict, mode: str) -> None:
    assert rep["mode"] == mode
    env = rep["environment"]
    for key in ("device", "jax", "jaxlib", "flax", "git_commit", "command", "timestamp"):
        assert env.get(key), key
    assert env["command"].startswith("python") and f"atlasjax.bench {mode}" in env["command"]
    assert "xla_flags" in env   # what the backend read: XLA_FLAGS change the numbers
    ceil = rep["roofline"]["ceilings"]
    assert ceil["copy_bandwidth_Bps"] > 1e8 and ceil["matmul_flops_per_s"] > 1e8


def test_latency_mode(tmp_path, capsys):
    argv = ["latency", "--preset", "tiny", "--batch-size", "2", "--input-len", "12", "--output-len", "6",
            "--num-iters", "2"]
    rep = run_bench(tmp_path, *argv, *(["--compare", "hf"] if HAS_TORCH else []))
    check_common(rep, "latency")
    r = rep["results"]
    assert r["num_decode_steps"] == 2 * 5                       # output_len - 1 decode steps per iteration
    for name in ("ttft_s", "tpot_s", "decode_tokens_per_s", "e2e_latency_s", "output_tokens_per_s"):
        s = r[name]
        assert 0 < s["p10"] <= s["median"] <= s["p90"], name
    assert r["num_compiles_while_timed"] == 0                   # the warm-up compiled every shape
    # Each decode step splits into host work and time blocked on the device's results.
    assert r["decode_host_s"]["n"] == r["decode_wait_s"]["n"] == r["num_decode_steps"]
    assert 0 < r["decode_host_s"]["median"] <= r["tpot_s"]["max"] and 0 <= r["decode_wait_s"]["min"]
    assert r["decode_wait_s"]["max"] <= r["tpot_s"]["max"]
    dec = rep["roofline"]["decode_step"]
    assert dec["batch"] == 2 and dec["context"] == 12 + 3
    assert 0 < dec["frac_copy_bandwidth"] and 0 < dec["frac_matmul_rate"] and dec["bound"] in ("memory", "compute")
    assert rep["roofline"]["prefill"]["tokens"] == 24
    if HAS_TORCH:
        assert rep["compare"]["hf"]["tpot_s"] > 0 and rep["compare"]["tpot_speedup"] > 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "TPOT" in out and "roofline" in out and "waiting for the device" in out


def test_latency_with_multi_step_decoding_reports_per_token_times(tmp_path):
    # --num-scheduler-steps 4: 9 decode tokens per request come from 3 launches (4 + 4 + 1), each
    # timed and divided by the tokens it gave each request, so TPOT stays a time per output token.
    rep = run_bench(tmp_path, "latency", "--preset", "tiny", "--batch-size", "2", "--input-len", "12",
                    "--output-len", "10", "--num-iters", "2", "--num-scheduler-steps", "4")
    r = rep["results"]
    assert rep["settings"]["engine"]["num_scheduler_steps"] == 4
    assert r["num_decode_steps"] == 2 * 3 and r["num_compiles_while_timed"] == 0
    assert 0 < r["tpot_s"]["median"] and r["decode_host_s"]["n"] == 2 * 3
    assert r["decode_tokens_per_s"]["max"] == pytest.approx(2 / r["tpot_s"]["min"], rel=1e-9)   # per token


def test_latency_compare_quantization(tmp_path, capsys):
    # The "against the same engine in bf16, measured in one run": the main run, then each format.
    rep = run_bench(tmp_path, "latency", "--preset", "tiny", "--batch-size", "1", "--input-len", "8",
                    "--output-len", "4", "--num-iters", "1", "--compare-quantization", "int8,int4,gguf-q4_k_m")
    rows = rep["compare_quantization"]
    assert [r["quantization"] for r in rows] == ["none", "int8", "int4", "gguf-q4_k_m"]
    assert rep["settings"]["weights"].startswith("weights ")   # the main run's formats and bytes
    assert rows[0]["tpot_vs_main"] == 1.0 and all(r["tpot_s"] > 0 and r["ttft_s"] > 0 for r in rows)
    assert "weight formats" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown"):
        main(["latency", "--preset", "tiny", "--compare-quantization", "int3"])


def test_gguf_layouts_follow_llama_cpp():
    # gguf-q4_k_m: Q6_K v / down in llama.cpp's "more bits" layers and a Q6_K LM head, Q4_K elsewhere,
    # each in the layout the loader keeps that type in
    import jax

    from atlasjax.bench.gguf_layouts import llama_cpp_type, quantize_like_gguf, use_more_bits
    from atlasjax.loader import random_params
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert llama_cpp_type("gguf-q4_k_m", "down_proj", 6, 32) == "Q6_K"
    assert llama_cpp_type("gguf-q4_k_m", "down_proj", 7, 32) == "Q4_K"
    assert llama_cpp_type("gguf-q4_k_m", "q_proj", 0, 32) == "Q4_K"
    assert llama_cpp_type("gguf-q8_0", "lm_head", None, 32) == "Q8_0"
    assert llama_cpp_type("gguf-q4_0", "lm_head", None, 32) == "Q6_K"
    with pytest.raises(ValueError, match="unknown GGUF layout"):
        llama_cpp_type("gguf-q3_k_s", "q_proj", 0, 32)
    cfg = PRESETS["tiny"]   # 2 layers: layer 1 is a "more bits" layer
    params = quantize_like_gguf(random_params(cfg, jax.numpy.float32, 0), "gguf-q4_k_m", cfg.num_layers)

    def kind(layer, module, proj):   # (format, group size, float offsets)
        w = params[layer][module][proj]["kernel"]
        return w.format, w.group_size, w.zeros is not None and not w.zero_point
    assert kind("layers_0", "mlp", "down_proj") == kind("layers_0", "self_attn", "v_proj") == ("int4", 32, True)  # Q4_K
    assert kind("layers_1", "mlp", "down_proj") == kind("layers_1", "self_attn", "v_proj") == ("int8", 32, False)  # Q6_K
    assert kind("layers_1", "self_attn", "q_proj") == ("int4", 32, True)
    head = params["lm_head"]["kernel"]
    assert (head.format, head.group_size) == ("int8", 32)
    with pytest.raises(SystemExit, match="--preset"):
        main(["latency", "--quantization", "gguf-q4_k_m", "--num-iters", "1"])


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_quantized_preset_is_the_random_preset_quantized(quantization):
    """Presets quantize each weight as it is made (no full-precision tree in device memory at once);
    the weights are those of quantizing the whole random tree, so figures stay comparable."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from atlasjax.bench.presets import load_preset
    from atlasjax.loader import random_params
    from atlasjax.quantization import quantize_params
    got = load_preset("tiny", jnp.float32, quantization, seed=3, quantize_lm_head=True).params
    want = quantize_params(random_params(PRESETS["tiny"], jnp.float32, 3), quantization, quantize_lm_head=True)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def test_preset_server_lays_out_a_gguf_preset(monkeypatch):
    # `python -m atlasjax.bench.preset_server --quantization gguf-q4_0`: the preset is laid out as
    # the file type loads; the server's own --quantization (int8 / fp8 / int4) is not told
    import jax.numpy as jnp

    import atlasjax.__main__ as cli
    import atlasjax.model_source as model_source
    from atlasjax.bench import preset_server
    from atlasjax.engine_config import EngineConfig
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(model_source, "load_for_engine", model_source.load_for_engine)   # restored afterwards
    assert preset_server.main(["--preset", "tiny", "--quantization", "gguf-q4_0", "--port", "0"]) == 0
    assert "--quantization" not in seen[0] and seen[0][:3] == ["serve", "--port", "0"]
    down = model_source.load_for_engine(EngineConfig(), jnp.float32).params["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert (down.format, down.group_size, down.zeros) == ("int4", 32, None)   # Q4_0: symmetric int4, groups of 32
    preset_server.main(["--preset", "tiny", "--quantization", "int8"])
    assert seen[1][1:3] == ["--quantization", "int8"]


def test_throughput_mode_random_prompts(tmp_path):
    rep = run_bench(tmp_path, "throughput", "--preset", "tiny", "--num-prompts", "6", "--input-len", "10",
                    "--output-len", "8", "--range-ratio", "0.5", "--max-num-seqs", "4",
                    "--max-num-batched-tokens", "16", "--compare-async")
    check_common(rep, "throughput")
    r = rep["results"]
    c = rep["compare_async"]["summary"]          # same requests with async scheduling off, then on
    assert c["outputs_identical"] and c["num_steps_on"] == c["num_steps_off"] > 0
    assert c["mean_step_s_on"] > 0 and c["mean_step_s_off"] > 0 and c["host_per_step_s_off"] > 0
    assert r["num_requests"] == 6 and 6 * 5 <= r["prompt_tokens"] <= 6 * 15
    assert 6 * 4 <= r["output_tokens"] <= 6 * 12
    assert r["requests_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"] > 0
    assert r["num_compiles_while_timed"] == 0
    assert rep["roofline"]["run"]["frac_copy_bandwidth"] > 0


def test_embed_mode(tmp_path):
    rep = run_bench(tmp_path, "embed", "--preset", "tiny", "--num-prompts", "12", "--input-len", "20",
                    "--range-ratio", "0.5", "--num-iters", "2")
    check_common(rep, "embed")
    r = rep["results"]
    assert r["num_inputs"] == 12 and 12 * 10 <= r["tokens"] <= 12 * 30 and r["tokens"] <= r["padded_tokens"]
    assert r["inputs_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["median_s"])
    assert 1 <= r["num_programs"] <= r["batches_per_pass"] and r["num_compiles_while_timed"] == 0
    assert rep["roofline"]["run"]["frac_matmul_rate"] > 0


def test_throughput_warm_up_compiles_every_decode_bucket_the_run_reaches(tmp_path):
    # the warm-up's short requests decode a few rows at a time; the run fills every bucket up to 16
    rep = run_bench(tmp_path, "throughput", "--preset", "tiny", "--num-prompts", "20", "--input-len", "6",
                    "--output-len", "6", "--max-num-seqs", "16", "--decode-batch-sizes", "4,8,16",
                    "--max-num-batched-tokens", "32", "--num-scheduler-steps", "2")
    assert rep["results"]["num_compiles_while_timed"] == 0
    assert rep["results"]["output_tokens"] == 20 * 6


def test_throughput_mode_dataset(tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "w1 w2 w3 w4 w5", "output_len": 3}, {"prompt_token_ids": [7] * 9, "output_len": 5},
            {"prompt": "w9 " * 20}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rep = run_bench(tmp_path, "throughput", "--preset", "tiny", "--dataset", str(data), "--output-len", "4",
                    "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", "64", "--no-warmup",
                    "--no-async-scheduling")
    r = rep["results"]
    assert r["async_scheduling"] is False and rep["settings"]["engine"]["async_scheduling"] is False
    assert r["num_requests"] == 3 and r["prompt_tokens"] == 5 + 9 + 20
    assert r["output_tokens"] == 3 + 5 + 4                    # ignore_eos: exactly the asked lengths


def test_kernels_mode(tmp_path):
    rep = run_bench(tmp_path, "kernels", "--preset", "tiny", "--prefill-tokens", "32")
    check_common(rep, "kernels")
    dense = rep["results"]["dense"]
    assert {d["case"].split()[0] for d in dense} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert all(d["seconds"] > 0 and d["frac_copy_bandwidth"] > 0 for d in dense)
    assert "needs a GPU" in rep["results"]["attention"]["skipped"]


def test_kernel_sweep_names_any_rows_kernel_config(monkeypatch):
    # bench_kernels_quant --paths: the fixed paths, and rows_tm<T|all>[_k<S>][_d<D>] for any tile,
    # K split and depth; an unknown name is an error naming what it takes
    import jax.numpy as jnp
    from atlasjax import bench_kernels_quant as bkq
    from pallas_kernels import rows_matmul
    calls = []
    monkeypatch.setattr(rows_matmul, "rows_matmul", lambda x, w, **kw: calls.append(kw))
    bkq._sweep_path("rows_tmall_k4_d6")(jnp.zeros((40, 8)), None)   # all: one M tile of every row
    bkq._sweep_path("rows_tm128")(jnp.zeros((300, 8)), None)
    assert calls == [dict(m_tile=40, k_splits=4, max_concurrent_steps=6), dict(m_tile=128, k_splits=1, max_concurrent_steps=4)]
    assert bkq._sweep_path("engine") is bkq.SWEEP_PATHS["engine"]
    with pytest.raises(ValueError, match=re.escape("rows_tm<T|all>")):
        bkq._sweep_path("rows_tm")


@pytest.mark.skipif(not HAS_SERVING, reason="serving not available")
def test_serve_mode_against_atlasjax_server(tmp_path, server):
    proc = server["proc"]
    deadline = time.time() + 90
    url = None
    while url is None and time.time() < deadline:       # the server prints its URL once it has warmed up
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}")
        m = re.search(r"ready on (http://\S+)", line)
        url = m.group(1) if m else None
    assert url, "the server did not become ready in 90s"
    threading.Thread(target=proc.stderr.read, daemon=True).start()   # keep its stderr pipe from filling
    rep = run_bench(tmp_path, "serve", "--base-url", url, "--num-prompts", "8", "--max-concurrency", "3",
                    "--request-rate", "40", "--input-len", "10", "--output-len", "6", "--range-ratio", "0.3",
                    "--preset", "tiny", "--num-warmups", "2")
    r = rep["results"]
    assert r["completed"] == 8 and r["failed"] == 0 and r["peak_concurrency"] <= 3
    assert rep["settings"]["model"] == "tiny"
    out_lens = [n for _, _, n in serve.make_prompts(_Args(10, 6, 0.3, 8, 2))][2:]
    assert r["total_output_tokens"] == sum(out_lens)          # ignore_eos honoured, usage counted
    for name in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert r[name]["n"] > 0 and 0 < r[name]["median"] <= r[name]["p99"], name
    assert r["itl_s"]["n"] == sum(n - 1 for n in out_lens)    # one chunk per token: n - 1 gaps
    assert r["ttft_s"]["median"] < r["e2el_s"]["median"]
    assert r["request_throughput"] > 0 and r["total_token_throughput"] > r["output_throughput"] > 0
    assert rep["roofline"]["roofline_output_tokens_per_s"] > 0
    # --priority-fraction: a seeded share of the requests carry a priority; the report splits them out
    rep = run_bench(tmp_path, "serve", "--base-url", url, "--num-prompts", "8", "--input-len", "10",
                    "--output-len", "6", "--num-warmups", "1", "--no-warmup-buckets", "--priority-fraction", "0.5",
                    "--priority", "-2", "--no-ceilings")
    classes = rep["results"]["by_priority"]
    picked = serve.priority_classes(SimpleNamespace(priority_fraction=0.5, priority=-2, seed=0), 8)
    assert set(classes) == {"priority -2", "others"} and rep["results"]["failed"] == 0
    assert classes["priority -2"]["completed"] == picked.count(-2) and 0 < picked.count(-2) < 8
    assert classes["others"]["completed"] == 8 - picked.count(-2)
    assert all(c["ttft_s"]["n"] == c["completed"] for c in classes.values())


class _Args:
    def __init__(self, input_len, output_len, range_ratio, num_prompts, num_warmups):
        self.input_len, self.output_len, self.range_ratio = input_len, output_len, range_ratio
        self.num_prompts, self.num_warmups, self.seed = num_prompts, num_warmups, 0
        self.prompt_format, self.vocab_size, self.preset = "ids", None, "tiny"


def test_serve_prompts_behind_shared_prefixes():
    """--prefix-len / --num-prefixes: each prompt starts with one of N prefixes (drawn with the seed), then its own
    --input-len tokens."""
    args = _Args(10, 6, 0.0, 39, 1)
    plain = serve.make_prompts(args)
    args.prefix_len, args.num_prefixes = 32, 3
    shared = serve.make_prompts(args)
    assert [n for _, n, _ in shared] == [32 + 10] * 40 and [len(p) for p, _, _ in shared] == [42] * 40
    heads = [tuple(p[:32]) for p, _, _ in shared]
    assert len(set(heads)) == 3 and all(heads.count(h) >= 5 for h in heads)
    assert heads == [tuple(p[:32]) for p, _, _ in serve.make_prompts(args)]
    assert len({tuple(p[32:]) for p, _, _ in shared}) == 40                # each prompt's own part differs
    assert [p for p, _, _ in serve.make_prompts(_Args(10, 6, 0.0, 39, 1))] == [p for p, _, _ in plain]   # seeded


def test_serve_metrics_definitions():
    outs = [dict(ttft=0.1, itl=[0.02, 0.03, 0.05], e2el=0.2, output_tokens=4, prompt_tokens=10, error=None),
            dict(ttft=0.3, itl=[], e2el=0.3, output_tokens=1, prompt_tokens=None, error=None),
            dict(ttft=None, itl=[], e2el=None, output_tokens=None, prompt_tokens=None, error="HTTP 500: boom")]
    m = serve.metrics(outs, [(None, 10, 4), (None, 7, 1), (None, 5, 4)], duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["HTTP 500: boom"]
    assert m["tpot_s"]["n"] == 1 and m["tpot_s"]["mean"] == pytest.approx((0.2 - 0.1) / 3)
    assert m["itl_s"]["n"] == 3 and m["e2el_s"]["median"] == pytest.approx(0.25)
    assert m["total_input_tokens"] == 17 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == 1.0 and m["total_token_throughput"] == pytest.approx(11.0)


def test_roofline_counts_match_the_llama_8b_anchor():
    cfg = PRESETS["llama-3.1-8b"]
    w = roofline.estimate_weight_bytes(cfg, 2)
    assert w == pytest.approx(15.01e9, rel=2e-3)                # PERFORMANCE_ANCHORS.md: 15.01 GB per step
    d = roofline.decode_cost(cfg, w, 2, batch=1, context=128)
    assert d["kv_bytes"] == 128 * 2 * 32 * 8 * 128 * 2
    matmul_weights = (w - 4096 * 2) / 2 - 32 * 2 * 4096 - 4096    # less the embedding row and the norms
    assert d["flops"] == pytest.approx(2 * matmul_weights + 4 * 128 * 32 * 32 * 128)
    q = roofline.estimate_weight_bytes(cfg, 2, "int8")
    assert 0.5 < q / w < 0.6                                    # projections at 1 byte, embeddings stay bf16


def test_tensor_parallel_step_is_held_against_every_device(tmp_path, capsys):
    # At TP=2 each device moves half the bytes, so the roofline is two devices' copy bandwidth and
    # matmul rate (the ceilings are measured on one): a TP=2 step at the one-device floor is at 50%.
    rep = run_bench(tmp_path, "latency", "--preset", "tiny", "--batch-size", "2", "--input-len", "12",
                    "--output-len", "4", "--num-iters", "1", "-tp", "2")
    assert rep["settings"]["engine"]["tensor_parallel_size"] == 2
    ceil, dec = rep["roofline"]["ceilings"], rep["roofline"]["decode_step"]
    assert dec["devices"] == 2
    assert dec["frac_copy_bandwidth"] == pytest.approx(dec["bytes_per_s"] / (2 * ceil["copy_bandwidth_Bps"]))
    assert dec["frac_matmul_rate"] == pytest.approx(dec["flops_per_s"] / (2 * ceil["matmul_flops_per_s"]))
    assert "of copy x 2 devices" in capsys.readouterr().out
    one = roofline.achieved(dict(bytes=1e9, flops=1e9), 1.0, ceil)
    two = roofline.achieved(dict(bytes=1e9, flops=1e9), 1.0, ceil, devices=2)
    assert two["floor_seconds"] == pytest.approx(one["floor_seconds"] / 2)


def test_summarize_percentiles():
    s = report.summarize([4.0, 1.0, 3.0, 2.0, float("nan"), None])
    assert s["n"] == 4 and s["median"] == 2.5 and s["mean"] == 2.5
    assert s["p10"] == pytest.approx(1.3) and s["p90"] == pytest.approx(3.7)
    assert report.summarize([])["median"] is None

"""`--compare hf`: Hugging Face transformers (PyTorch) on the same shapes, in a subprocess.

The subprocess runs before the benchmark's JAX backend starts (JAX reserves most GPU memory
when it initializes), builds the same architecture with random weights from the preset's
`ModelConfig`, and times `generate` on a random batch:
- GPU: bf16 (or --dtype), static KV cache, transformers' automatic torch.compile of the decode
  step (the configuration PERFORMANCE_ANCHORS.md measured); CPU: eager, dynamic cache, f32.
- TTFT = generate(max_new_tokens=1); TPOT = (generate(output_len) - TTFT) / (output_len - 1).
Run directly: `python -m atlasjax.bench.hf_compare --spec JSON --output FILE` (see run_subprocess).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from atlasjax.config import ModelConfig

_HF_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def is_available() -> bool:
    import importlib.util  # noqa: PLC0415
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def run_subprocess(cfg: ModelConfig, *, batch_size: int, input_len: int, output_len: int, num_iters: int,
                   dtype: str, seed: int = 0) -> dict:
    """Runs the comparison in a fresh Python (no JAX there); returns its figures or {"error": ...}."""
    spec = dict(model_config=dataclasses.asdict(cfg), batch_size=batch_size, input_len=input_len,
                output_len=output_len, num_iters=num_iters, dtype=dtype, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hf.json")
        cmd = [sys.executable, "-m", "atlasjax.bench.hf_compare", "--spec", json.dumps(spec), "--output", out]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:                   # relay its progress to our stderr
            sys.stderr.write(line)
        proc.wait()
        if proc.returncode != 0 or not os.path.exists(out):
            return dict(error=f"the transformers run failed (exit {proc.returncode}); see stderr")
        with open(out) as f:
            return json.load(f)


def _hf_config(mc: dict):
    import transformers  # noqa: PLC0415
    rope = mc["rope_scaling"]
    kw = dict(vocab_size=mc["vocab_size"], hidden_size=mc["hidden_size"], intermediate_size=mc["intermediate_size"],
              num_hidden_layers=mc["num_layers"], num_attention_heads=mc["num_heads"],
              num_key_value_heads=mc["num_kv_heads"], head_dim=mc["head_dim"], rms_norm_eps=mc["rms_norm_eps"],
              max_position_embeddings=mc["max_position_embeddings"], tie_word_embeddings=mc["tie_word_embeddings"],
              rope_theta=mc["rope_theta"])
    if rope["rope_type"] != "default":
        yarn_keys = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
        kept = {k: v for k, v in rope.items() if v is not None and (rope["rope_type"] == "yarn" or k not in yarn_keys)}
        kw["rope_scaling"] = dict(kept, rope_theta=mc["rope_theta"])
    if mc["family"] == "llama":
        kw["attention_bias"] = mc["qkv_bias"]
    return getattr(transformers, _HF_CLASSES[mc["family"]])(**kw)


def measure(spec: dict) -> dict:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    name = spec["dtype"] if spec["dtype"] != "auto" else ("bfloat16" if on_gpu else "float32")
    dtype = getattr(torch, name)
    torch.manual_seed(spec["seed"])
    t = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(spec["model_config"]), dtype=dtype).eval()
    print(f"[bench/hf] built {type(model).__name__} on {device} in {time.perf_counter() - t:.1f}s",
          file=sys.stderr, flush=True)
    bs, n_in, n_out = spec["batch_size"], spec["input_len"], spec["output_len"]
    ids = torch.randint(0, spec["model_config"]["vocab_size"], (bs, n_in), device=device)
    mask = torch.ones_like(ids)
    extra = dict(cache_implementation="static") if on_gpu else {}

    def generate(n: int) -> float:
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, logits_processor=transformers.LogitsProcessorList([stamp]),
                                 **extra)
        if on_gpu:
            torch.cuda.synchronize()
        assert out.shape[1] == n_in + n, out.shape
        return time.perf_counter() - t0

    stamps: list[float] = []

    def stamp(input_ids, scores):
        # Called once per generated token: a timestamp per step gives TPOT without subtracting noisy totals.
        if on_gpu:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return scores

    for i in range(2 if on_gpu else 1):       # the first runs compile (GPU)
        t = generate(n_out)
        print(f"[bench/hf] warm-up {i + 1}: {t:.2f}s", file=sys.stderr, flush=True)
    ttfts, totals, gaps = [], [], []
    for _ in range(spec["num_iters"]):
        ttfts.append(generate(1))
        stamps.clear()
        totals.append(generate(n_out))
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]   # one gap per decode step, timed directly
    ttft, total = sorted(ttfts)[len(ttfts) // 2], sorted(totals)[len(totals) // 2]
    tpot = sorted(gaps)[len(gaps) // 2] if gaps else None
    return dict(mode=f"{'static cache + auto torch.compile' if on_gpu else 'eager'}, {name}, {device}",
                transformers=transformers.__version__, torch=torch.__version__,
                device=torch.cuda.get_device_name() if on_gpu else "cpu", batch_size=bs, input_len=n_in,
                output_len=n_out, ttft_s=ttft, total_s=total, tpot_s=tpot,
                output_tokens_per_s=bs * n_out / total, decode_tokens_per_s=bs / tpot if tpot else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="JSON: model_config, batch_size, input_len, output_len, ...")
    p.add_argument("--output", required=True)
    args = p.parse_args()
    result = measure(json.loads(args.spec))
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

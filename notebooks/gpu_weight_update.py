"""GPU: new weights from disk while serving (`LLM.update_weights_from_disk`, atlasjax/weight_update.py) on
Llama-3.1-8B shapes (random weights over MODEL's config.json), against restarting the engine on them.

Per format (bf16, fp8 quantized at load), an engine starts (programs compiled, or loaded from the caches under
/tmp), saves its weights (`LLM.save`, orbax) and then:
- takes them back from the files cold (dropped from the page cache, posix_fadvise DONTNEED) and warm;
- a new engine starts on the saved directory with the caches warm (a restart);
- greedy tokens of one prompt before, after the update, and from the restarted engine (all equal: the same weights).
JSON lines on stdout.

    MODEL=.cache/llama8b FORMATS=bf16,fp8 SOURCES=hf,orbax SAVE=/tmp/weights python notebooks/gpu_weight_update.py
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kv_disk import drop_page_cache  # noqa: E402

from atlasjax import LLM, SamplingParams, compile_cache  # noqa: E402

MODEL = os.environ.get("MODEL", ".cache/llama8b")
FORMATS = os.environ.get("FORMATS", "bf16,fp8").split(",")
SAVE = os.environ.get("SAVE", "/tmp/weights")
PROMPT = list(range(100, 200))   # (ids every test model has)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024)


def tokens(llm) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids)


def write_hf_checkpoint(path: str) -> None:
    """MODEL's config.json and tokenizer with random bf16 weights as a Hugging Face directory (one safetensors file
    per layer), what a trainer's `save_pretrained` leaves; drawn with torch (a test-only dependency), on the GPU."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(MODEL, "config.json")) as f:
        c = json.load(f)
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(MODEL, path, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def w(*shape):
        return (torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02).cpu()
    save_file({"model.embed_tokens.weight": w(c["vocab_size"], h), "lm_head.weight": w(c["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, os.path.join(path, "model-outer.safetensors"))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        save_file({p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                   p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                   p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                   p + "mlp.down_proj.weight": w(h, inter),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)},
                  os.path.join(path, f"model-{i:05d}.safetensors"))


def run(fmt: str, source: str) -> dict:
    """source "orbax": the engine's own weights saved by `LLM.save` (quantized once) and taken back; "hf": a Hugging
    Face directory of other weights (SAVE/hf, written first), quantized as the engine's were at load."""
    quant = None if fmt == "bf16" else fmt
    t0 = time.perf_counter()
    llm = LLM(MODEL, load_format="dummy", quantization=quant, **ENGINE)
    start = time.perf_counter() - t0
    before = tokens(llm)
    path, save = os.path.join(SAVE, "hf"), None
    if source == "orbax":
        path = os.path.join(SAVE, fmt)
        shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter()
        llm.save(path)
        save = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)
    os.sync()
    dropped = drop_page_cache(path)
    stats = llm.engine.runner.params["embed_tokens"]["embedding"].devices().pop().memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    cold = llm.update_weights_from_disk(path)
    after_cold = tokens(llm)
    warm = llm.update_weights_from_disk(path)
    after_warm = tokens(llm)
    compiles = llm.engine.runner.num_compiles
    del llm
    t0 = time.perf_counter()
    restarted = LLM(path, quantization=None if source == "orbax" else quant, **ENGINE)
    restart = time.perf_counter() - t0
    same = after_cold == after_warm == tokens(restarted) and (source == "hf" or before == after_cold)
    return {"format": fmt, "source": source, "checkpoint_bytes": size, "files_dropped": dropped,
            "first_start_s": start, "save_s": save, "update_cold": cold, "update_warm": warm, "restart_s": restart,
            "compiles_after_updates": compiles, "device_free_bytes": free, "host": os.environ.get("HOST", "pinned"),
            "same_tokens": same}


def main() -> None:
    compile_cache.enable("/tmp/atlasjax-jax-cache")
    if os.environ.get("HOST") == "numpy":     # a probe: the old weights kept as numpy arrays, not pinned buffers
        import jax

        from atlasjax import sleep_mode
        sleep_mode.to_host = jax.device_get
    sources = os.environ.get("SOURCES", "orbax").split(",")
    if "hf" in sources:
        t0 = time.perf_counter()
        write_hf_checkpoint(os.path.join(SAVE, "hf"))
        print(json.dumps({"wrote_hf_checkpoint_s": time.perf_counter() - t0}), flush=True)
    for source in sources:
        for fmt in FORMATS:
            print(json.dumps(run(fmt, source)), flush=True)


if __name__ == "__main__":
    main()

"""gpt-fast's bs=1 decode step on this GPU: the peer #5 compares against, measured on the same machine.

The issue asks for the quantized step "against gpt-fast's int8 step on the same GPU". Its anchor
(6.33 ms) is an H100's; only H200s are lent now. This harness times gpt-fast's own model and
quantizers (pytorch-labs/gpt-fast, not part of this project: copy its `model.py` and `quantize.py`
into GPT_FAST_DIR) the way its generate.py decodes: `torch.compile(mode="reduce-overhead",
fullgraph=True)` on one-token steps, inductor's coordinate-descent tuning on, attention on the math
kernel; Llama-3.1-8B shapes with random weights, a 128-token prompt, a KV cache of 256 positions,
greedy. Variants: bf16, int8 (WeightOnlyInt8QuantHandler: every Linear, the LM head included, as
`--quantize-lm-head`) and int4 (groups of 128, torch's tinygemm kernel; its packing adapted to
torch >= 2.5, which takes uint8 nibbles).

    GPT_FAST_DIR=.peers/gpt-fast VARIANTS=bf16,int8,int4 python notebooks/gpu_gpt_fast_peer.py

Writes `$OUT/gpt_fast.json` after each variant: ms per decode step back to back (one sync after
all, as generate.py's tokens/s), and the median / p10 of steps each waited for; compile seconds.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.environ.get("GPT_FAST_DIR", ".peers/gpt-fast"))
sys.modules.setdefault("tokenizer", types.SimpleNamespace(get_tokenizer=None))   # quantize.py imports it; unused here
import quantize  # noqa: E402
from model import Transformer  # noqa: E402

torch._inductor.config.coordinate_descent_tuning = True
torch._inductor.config.triton.unique_kernel_names = True
PROMPT, CACHE, STEPS = int(os.environ.get("PROMPT", 128)), int(os.environ.get("CACHE", 256)), int(os.environ.get("STEPS", 100))
OUT = os.environ.get("OUT", ".")
MODEL = os.environ.get("MODEL", "llama-3.1-8b")   # a gpt-fast config name; "stories15M" smoke-tests on a CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_model() -> Transformer:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer.from_name(MODEL)
    model = model.to_empty(device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model


def int4_pack(weight_bf16, groupsize, inner_k_tiles):
    """quantize.prepare_int4_weight_and_scales_and_zeros for torch >= 2.5: nibbles as uint8 [N, K / 2]."""
    w, scales_and_zeros = quantize.group_quantize_tensor(weight_bf16, n_bit=4, groupsize=groupsize)
    packed = (w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles), scales_and_zeros


def quantized(model: Transformer, variant: str) -> Transformer:
    if variant == "bf16":
        return model
    if variant == "int8":
        handler = quantize.WeightOnlyInt8QuantHandler(model)
    elif variant == "int4":
        quantize.prepare_int4_weight_and_scales_and_zeros = int4_pack
        handler = quantize.WeightOnlyInt4QuantHandler(model, groupsize=128)
    else:
        raise ValueError(variant)
    state = handler.create_quantized_state_dict()
    model = handler.convert_for_runtime()
    model.load_state_dict(state, assign=True)
    return model.to(DEV)


def decode_one_token(model, x, input_pos):
    logits = model(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True).to(torch.int)


def measure(variant: str) -> dict:
    model = quantized(random_model(), variant)
    with torch.device(DEV):
        model.setup_caches(max_batch_size=1, max_seq_length=CACHE)
    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True) if DEV == "cuda" else decode_one_token
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel   # noqa: PLC0415
        math_only = lambda: sdpa_kernel(SDPBackend.MATH)   # noqa: E731
    except ImportError:
        math_only = lambda: torch.backends.cuda.sdp_kernel(enable_flash=False, enable_mem_efficient=False)   # noqa: E731
    with torch.no_grad(), math_only():
        prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), device=DEV)
        token = decode_one_token(model, prompt, torch.arange(PROMPT, device=DEV))
        pos = torch.tensor([PROMPT], device=DEV)
        t0 = time.perf_counter()
        for _ in range(3):                       # compiles, records the graph
            token = step(model, token.view(1, -1), pos).clone()
            pos += 1
        sync()
        compile_s = time.perf_counter() - t0
        n = min(STEPS, (CACHE - PROMPT - 4) // 2)
        # back to back, one sync at the end, as generate.py decodes (its tokens/s)
        t0 = time.perf_counter()
        for _ in range(n):
            token = step(model, token.view(1, -1), pos).clone()
            pos += 1
        sync()
        back_to_back_ms = (time.perf_counter() - t0) * 1e3 / n
        times = []   # each step waited for, as a served token is
        for _ in range(n):
            t = time.perf_counter()
            token = step(model, token.view(1, -1), pos).clone()
            sync()
            times.append((time.perf_counter() - t) * 1e3)
            pos += 1
    del model, step
    torch._dynamo.reset()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return dict(ms_back_to_back=round(back_to_back_ms, 4), ms_synced_median=round(statistics.median(times), 4),
                ms_synced_p10=round(sorted(times)[len(times) // 10], 4), steps=n, compile_s=round(compile_s, 1))


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    results = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__, prompt=PROMPT, cache=CACHE)
    for variant in os.environ.get("VARIANTS", "bf16,int8,int4").split(","):
        try:
            results[variant] = measure(variant)
        except Exception as error:   # one variant failing (e.g. int4's packing on another torch) leaves the rest
            results[variant] = dict(error=f"{type(error).__name__}: {error}"[:500])
        print(variant, results[variant], flush=True)
        with open(os.path.join(OUT, "gpt_fast.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

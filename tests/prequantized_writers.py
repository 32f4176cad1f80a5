"""Test helper: save a tiny Hugging Face model the way quantization tools save their checkpoints.

`write_prequantized(model, out_dir, fmt)` quantizes the decoder's linear layers by plain rounding,
writes them in the layout of `fmt` (`CONFIGS`) with a matching `quantization_config`, and sets the
torch model's weights to exactly what the saved tensors mean, so that the model is the reference
for the engine loading the directory. Written from the formats' conventions (AutoAWQ / AutoGPTQ
packing, llm-compressor and transformers' FP8 tensors), independently of atlasjax/prequantized.py.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble i of a word holds column 8c + order[i]
FP8_MAX = 448.0



def _ct_int_config(fmt, bits, strategy, symmetric, group=64):
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "dynamic": False}
    weights |= {"group_size": group} if strategy == "group" else {}
    activations = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True} if bits == 8 else None
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"]}


CONFIGS = {
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                              "dynamic": False}}},
                    "ignore": ["lm_head"]},
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
    "fbgemm-fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "awq-g32": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq"},
    "gptq-8bit": {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": True,
                  "checkpoint_format": "gptq"},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True,
                       "checkpoint_format": "gptq"},
    # llm-compressor (compressed-tensors): W4A16 packed, symmetric and with zero points; W8A8 int8
    "ct-w4a16": _ct_int_config("pack-quantized", 4, "group", True),
    "ct-w4a16-asym": _ct_int_config("pack-quantized", 4, "group", False),
    "ct-w8a8-int": _ct_int_config("int-quantized", 8, "channel", True),
}


def write_prequantized(model, out_dir: str, fmt: str) -> None:
    """Saves `model` (a float32 transformers model, changed in place) quantized as `fmt` into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, param in model.state_dict().items():
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in LINEARS and parts[-1] == "weight":
            root = name[: -len(".weight")]
            saved, meaning = _ENCODERS[fmt](param.numpy().astype(np.float32), rng)
            tensors |= {f"{root}.{k}": v.contiguous() for k, v in saved.items()}
            with torch.no_grad():
                param.copy_(torch.from_numpy(meaning))
        else:
            tensors[name] = param.detach().clone().contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": CONFIGS[fmt]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)


def _to_fp8(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.clip(x, -FP8_MAX, FP8_MAX).astype(np.float32)).to(torch.float8_e4m3fn)


def _fp8_channel(w, rng, scale_dtype=torch.bfloat16, extra=("input_scale",)):
    scale = torch.from_numpy(np.abs(w).max(axis=1, keepdims=True) / FP8_MAX).to(scale_dtype)   # [N, 1]
    q = _to_fp8(w / scale.float().numpy())
    meaning = q.float().numpy() * scale.float().numpy()
    saved = {"weight": q, "weight_scale": scale} | {k: torch.tensor([0.02], dtype=torch.float32) for k in extra}
    return saved, meaning


def _fp8_block(w, rng, block=128):
    n, k = w.shape
    bn, bk = -(-n // block), -(-k // block)
    padded = np.zeros((bn * block, bk * block), np.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(bn, block, bk, block)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / FP8_MAX        # [bn, bk]
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[:n, :k]
    q = _to_fp8(w / full)
    return {"weight": q, "weight_scale_inv": torch.from_numpy(scale.astype(np.float32))}, q.float().numpy() * full


def _int_grid(w, group, bits, symmetric, rng):
    """Round-to-nearest codes [K, N] in 0 .. 2^bits - 1, zero points and f16 scales [K / g, N]."""
    wt = w.T.astype(np.float32)                                 # [K, N]
    k, n = wt.shape
    g = wt.reshape(k // group, group, n)
    top = (1 << bits) - 1
    if symmetric:
        scale = np.maximum(np.abs(g).max(axis=1), 1e-8) / ((top + 1) // 2 - 1)
        zero = np.full_like(scale, (top + 1) // 2)
    else:
        lo, hi = np.minimum(g.min(axis=1), 0), np.maximum(g.max(axis=1), 0)
        scale = np.maximum(hi - lo, 1e-8) / top
        zero = np.clip(np.rint(-lo / scale), 1, top)             # >= 1: GPTQ v1 stores z - 1
    scale = scale.astype(np.float16)
    s = scale.astype(np.float32)
    q = np.clip(np.rint(g / s[:, None]) + zero[:, None], 0, top)
    meaning = ((q - zero[:, None]) * s[:, None]).reshape(k, n)
    return q.reshape(k, n).astype(np.uint32), zero.astype(np.uint32), scale, meaning


def _pack(values: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    """Packs unsigned values along `axis` into int32 words, value i of a word in bits bits*i...; with
    `order`, value i of word c is element per_word * c + order[i]."""
    per_word = 32 // bits
    v = np.moveaxis(values, axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per_word)
    if order is not None:
        v = v[..., list(order)]
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(per_word):
        words |= v[..., i].astype(np.uint32) << np.uint32(bits * i)
    return torch.from_numpy(np.moveaxis(words, -1, axis).astype(np.uint32).view(np.int32).copy())


def _awq(w, rng, group=64):
    q, z, s, meaning = _int_grid(w, group, 4, False, rng)
    saved = {"qweight": _pack(q, 4, axis=1, order=AWQ_PACK_ORDER), "qzeros": _pack(z, 4, axis=1, order=AWQ_PACK_ORDER),
             "scales": torch.from_numpy(s)}
    return saved, meaning.T.copy()


def _gptq(w, rng, bits=4, group=64, symmetric=False, act_order=False):
    k = w.shape[1]
    perm = rng.permutation(k) if act_order else np.arange(k)
    q, z, s, meaning = _int_grid(w[:, perm], group, bits, symmetric, rng)   # groups of permuted rows
    inverse = np.argsort(perm)
    g_idx = (np.arange(k) // group)[inverse]                               # row k's group
    saved = {"qweight": _pack(q[inverse], bits, axis=0), "qzeros": _pack((z - 1) & ((1 << bits) - 1), bits, axis=1),
             "scales": torch.from_numpy(s), "g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    return saved, meaning[inverse].T.copy()


def _ct_int(w, rng, bits=4, group=64, symmetric=True, packed=True):
    """compressed-tensors: signed codes q, w = (q - zp) * s, scales (bf16) [N, K / g] or [N, 1]."""
    n, k = w.shape
    group = group or k
    g = w.reshape(n, k // group, group)
    lo_q, hi_q = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if symmetric:
        s = np.maximum(np.abs(g).max(-1), 1e-8) / hi_q
        zp = np.zeros_like(s)
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        s = np.maximum(hi - lo, 1e-8) / (hi_q - lo_q)
        zp = np.clip(np.rint(lo_q - lo / s), lo_q, hi_q)
    scale = torch.from_numpy(s.astype(np.float32)).to(torch.bfloat16)
    s = scale.float().numpy()
    q = np.clip(np.rint(g / s[..., None]) + zp[..., None], lo_q, hi_q)
    meaning = ((q - zp[..., None]) * s[..., None]).reshape(n, k)
    q = q.reshape(n, k).astype(np.int64)
    offset = 1 << (bits - 1)
    saved = {"weight_scale": scale}
    if packed:
        saved |= {"weight_packed": _pack((q + offset).astype(np.uint32), bits, axis=1),
                  "weight_shape": torch.tensor([n, k])}
    else:
        saved["weight"] = torch.from_numpy(q.astype(np.int8))
    if not symmetric:
        saved["weight_zero_point"] = _pack((zp.astype(np.int64) + offset).astype(np.uint32), bits, axis=0)
    return saved, meaning.astype(np.float32)


_ENCODERS = {
    "fp8-channel": _fp8_channel,
    "fp8-block": _fp8_block,
    "fbgemm-fp8": lambda w, rng: _fp8_channel(w, rng, torch.float32, extra=("input_scale_ub",)),
    "awq": _awq,
    "awq-g32": lambda w, rng: _awq(w, rng, group=32),
    "gptq": _gptq,
    "gptq-8bit": lambda w, rng: _gptq(w, rng, bits=8, group=32, symmetric=True),
    "gptq-act-order": lambda w, rng: _gptq(w, rng, symmetric=True, act_order=True),
    "ct-w4a16": _ct_int,
    "ct-w4a16-asym": lambda w, rng: _ct_int(w, rng, symmetric=False),
    "ct-w8a8-int": lambda w, rng: _ct_int(w, rng, bits=8, group=None, packed=False),
}

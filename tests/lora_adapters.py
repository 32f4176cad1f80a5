"""PEFT LoRA adapters with random weights for tests, and their merged models (the reference: W + scale * B @ A)."""
from __future__ import annotations

import json
import math
import os

import numpy as np

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_adapter(model, out_dir: str, *, rank: int, alpha: float, targets=tuple(MODULES), seed: int = 0,
                 rslora: bool = False, std: float = 0.3) -> dict:
    """Write a PEFT adapter for the torch `model` (random A and B on `targets` of every layer); returns
    {(layer, module name): (A [r, in], B [out, r])} as float32 numpy."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors, pairs = {}, {}
    for i, layer in enumerate(model.model.layers):
        for name in targets:
            weight = getattr(getattr(layer, MODULES[name]), name).weight
            out_f, in_f = weight.shape
            a = rng.normal(0, std, (rank, in_f)).astype(np.float32)
            b = rng.normal(0, std, (out_f, rank)).astype(np.float32)
            prefix = f"base_model.model.model.layers.{i}.{MODULES[name]}.{name}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            pairs[(i, name)] = (a, b)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "use_rslora": rslora, "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return pairs


def merged_model(model, pairs: dict, *, rank: int, alpha: float, rslora: bool = False):
    """A copy of the torch model with each LoRA pair merged into its weight."""
    import copy

    import torch
    merged = copy.deepcopy(model)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    with torch.no_grad():
        for (i, name), (a, b) in pairs.items():
            weight = getattr(getattr(merged.model.layers[i], MODULES[name]), name).weight
            weight += torch.from_numpy(scale * (b @ a))
    return merged

"""Tiny random Hugging Face models (float32, saved as safetensors) for reference comparisons."""
from __future__ import annotations

import os

import torch
import transformers

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5)

CASES = {
    # name: (config class, overrides)
    "llama_gqa4": (transformers.LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2,
                                                  tie_word_embeddings=False)),
    "llama_tied_mha": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4,
                                                      tie_word_embeddings=True)),
    "llama31_rope": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2": (transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                            tie_word_embeddings=True)),
    # yarn past a 64-token original context (Qwen3's long-context setting, scaled down): the prompts of
    # tests/test_models_vs_hf.py run up to 110 positions
    "qwen3_yarn": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                 tie_word_embeddings=False, rope_scaling={
                                                     "rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})),
    # an EAGLE-3 head's target: its default layers (2, L // 2, L - 3) are three distinct ones from 7 layers on
    "llama_7layers": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                                     num_hidden_layers=7, tie_word_embeddings=False)),
    "qwen3_7layers": (transformers.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                     num_hidden_layers=7, tie_word_embeddings=True)),
}


# Shapes for tensor parallelism up to 8 devices: 8 query heads; fewer KV heads than devices; a vocab
# that does not split evenly over 8 (padded); qkv bias (qwen2); q/k norm and tied embeddings (qwen3).
TP_CASES = {
    "qwen3_tp": (transformers.Qwen3Config, dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                                               vocab_size=500, tie_word_embeddings=True)),
    "qwen2_tp": (transformers.Qwen2Config, dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=500,
                                               tie_word_embeddings=False)),
}


def make_hf_model(name: str, out_dir: str, seed: int = 0):
    """Create, save (safetensors) and return the torch model for CASES[name] (or TP_CASES[name])."""
    cls, overrides = {**CASES, **TP_CASES}[name]
    torch.manual_seed(seed)
    config = cls(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so logits are not all near-uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def hf_logprobs(model, token_ids: list[int]):
    """log_softmax logits [len, vocab] of a single sequence, float64 for comparisons."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


def hf_greedy(model, token_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(token_ids):].tolist()

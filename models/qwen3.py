"""Qwen3 (dense) family: the llama architecture with per-head RMSNorm on q and k before RoPE
(`ModelConfig.qk_norm`) and an explicit head_dim. Checkpoint names are llama's, plus
`self_attn.q_norm` / `self_attn.k_norm`."""
from models.llama import build_model, is_ignored, param_path  # noqa: F401

FAMILY = "qwen3"

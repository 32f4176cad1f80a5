"""Qwen2 / Qwen2.5 family: the llama architecture with biases on q/k/v projections
(`ModelConfig.qkv_bias`). Checkpoint names are llama's, plus the `.bias` tensors."""
from models.llama import build_model, is_ignored, param_path  # noqa: F401

FAMILY = "qwen2"

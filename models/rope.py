"""Rotary position embedding: each scaling type's inverse frequencies (as Hugging Face computes them)
and the rotate-half rotation.

Scalings (`ModelConfig.rope_scaling.rope_type`): `default`; `linear` (positions divided by the factor);
`llama3` (Llama 3.1+: long wavelengths divided, short kept, a smooth blend between); `yarn` (Qwen2.5/3
past 32k tokens: the same split by rotations per original context, and cos / sin scaled by an attention
factor, `rope_attention_factor`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def rope_inv_freq(cfg) -> jax.Array:
    """Inverse frequencies [head_dim // 2] f32 of `cfg`'s RoPE, scaling applied."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * inv / rs.factor + smooth * inv
        inv = jnp.where(wavelen > low_wavelen, inv / rs.factor,
                        jnp.where(wavelen < high_wavelen, inv, smoothed))
    elif rs.rope_type == "yarn":
        low, high = _yarn_ramp_bounds(rs, hd, cfg.rope_theta)
        if low == high:
            high += 0.001   # HF's guard against a zero-width ramp
        kept = 1.0 - jnp.clip((jnp.arange(hd // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
        inv = inv / rs.factor * (1.0 - kept) + inv * kept
    return inv


def _yarn_ramp_bounds(rs, head_dim: int, theta: float) -> tuple[float, float]:
    """The frequency indices between which yarn blends from kept (fast: beta_fast rotations or more over
    the original context) to interpolated (slow: beta_slow rotations or fewer)."""
    def index_at(rotations: float) -> float:
        return head_dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))
    low, high = index_at(rs.beta_fast), index_at(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def rope_attention_factor(cfg) -> float:
    """The scale yarn puts on cos and sin (so on every attention logit, squared); 1 for the others."""
    rs = cfg.rope_scaling
    if rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if rs.mscale and rs.mscale_all_dim:
        return mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim)
    return mscale(rs.factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotate-half RoPE (HF convention). x: [tokens, heads, head_dim]; positions: [tokens]; scale:
    `rope_attention_factor` (cos and sin multiplied by it)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [tokens, head_dim // 2]
    cos = jnp.concatenate([jnp.cos(freqs)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(freqs)] * 2, axis=-1)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)

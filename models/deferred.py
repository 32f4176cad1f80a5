"""Activations not computed yet, so that the matmul consuming them may fuse them into its prologue.

A decoder layer hands its projections `RMSNormed(x, scale, eps)` instead of the normalized
activations, and the MLP hands down_proj `SwiGLU(gate_up)` instead of silu(gate) * up. The one
matmul entry (`models.layers.matmul`) either passes them to the decode kernel, which computes
them tile by tile as the weight streams (pallas_kernels/decode_matmul.py: one kernel fewer per norm
and per MLP in a decode layer), or calls `materialize` and proceeds as before, so every other path
(CPU, prefill, quantized weights the kernel does not take, tensor-parallel weights) computes what
the unfused model computes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """scale * x / rms(x) over the last axis, in f32 and rounded to x's dtype (HF's order)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * xf.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RMSNormed:
    """rms_norm(x, scale, eps), not yet computed. x: [tokens, features]; scale: [features]."""
    x: jax.Array
    scale: jax.Array
    eps: float
    prologue = "rms_norm"   # its name in pallas_kernels/decode_matmul.py

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype

    def materialize(self) -> jax.Array:
        return rms_norm(self.x, self.scale, self.eps)

    def kernel_operands(self):
        """(x, keyword arguments) for `pallas_kernels.decode_matmul.decode_matmul`."""
        return self.x, {"norm_scale": self.scale, "norm_eps": self.eps}


@dataclasses.dataclass(frozen=True)
class SwiGLU:
    """silu(gate) * up, not yet computed, from gate_up: [tokens, 2 * mlp] (gate | up, per shard)."""
    gate_up: jax.Array
    prologue = "swiglu"

    @property
    def shape(self):
        return (*self.gate_up.shape[:-1], self.gate_up.shape[-1] // 2)

    @property
    def dtype(self):
        return self.gate_up.dtype

    def materialize(self) -> jax.Array:
        gate, up = jnp.split(self.gate_up, 2, axis=-1)
        return jax.nn.silu(gate) * up

    def kernel_operands(self):
        return self.gate_up, {"swiglu": True}


Deferred = RMSNormed | SwiGLU


def materialize(x):
    """The array itself, or a deferred activation computed."""
    return x.materialize() if isinstance(x, Deferred) else x

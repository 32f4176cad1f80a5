"""Building blocks shared by every model family: linear (the one matmul entry), RMSNorm, MLP (RoPE:
models/rope.py).

Parameters are created with logical axis names (`embed, heads, kv_heads, head_dim, mlp, vocab`)
so that tensor parallelism is a rules table (atlasjax/sharding.py), not a model rewrite.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import reference
from models.deferred import Deferred, RMSNormed, SwiGLU, materialize, rms_norm
from models.parallel import Parallel
from pallas_kernels import decode_matmul, decode_matmul_rules

_init = nn.initializers.normal(stddev=0.02)


def is_quantized(w) -> bool:
    return hasattr(w, "qweight")


def matmul(x, w, out_dtype=None, residual: jax.Array | None = None, *, decode_kernel: bool = True
           ) -> jax.Array:
    """The one matmul entry. x: [tokens, in] array, or a deferred `RMSNormed` / `SwiGLU`
    (models/deferred.py); w: [in, out] array or a quantized weight pytree. residual: None or
    [tokens, out], returned as `residual + x @ w` (the product rounded to out_dtype first).
    The decode kernel (bf16 or per-channel int8 / fp8 weights) computes a deferred x in its
    prologue and adds the residual in its epilogue; every
    other path materializes x first (and at decode rows on a GPU hands it to XLA's GEMM behind an
    optimization barrier).
    decode_kernel=False keeps the other paths (tensor-parallel partial sums: on 2x H200 the kernel
    made the TP=2 step slower, 3.31-3.33 against 3.26 ms, docs/performance.md session 19)."""
    out_dtype = out_dtype or x.dtype
    decode_rows = decode_kernel and len(x.shape) == 2 and _on_gpu()   # where our decode kernels may run
    w_dtype = decode_matmul_rules.weight_dtype(w) if decode_rows else None
    if w_dtype is not None and decode_matmul_rules.pays(*x.shape, w.shape[1], x.dtype, w_dtype):
        # a decode step's qkv / o_proj / down (bf16, or int8 / fp8 per channel): no split-K sum
        # kernel, the input RMSNorm or SwiGLU in the kernel's prologue and the residual add in its
        # epilogue (pallas_kernels/decode_matmul.py)
        if (isinstance(x, Deferred)
                and decode_matmul_rules.prologue_pays(x.prologue, x.shape[0], w_dtype, w.shape[1], w.shape[0])):
            operand, fused = x.kernel_operands()
        else:
            operand, fused = materialize(x), {}
        return decode_matmul.decode_matmul(operand, w, residual, out_dtype=jnp.dtype(out_dtype), **fused)
    x = materialize(x)
    if decode_rows and x.shape[0] <= decode_matmul_rules.MAX_ROWS:
        # Keep a decode step's activations out of XLA's GEMM fusion. Fused with the RMSNorm's scale,
        # its autotuner gave the one-step executable tiles that stream slower (H100: 8B fp8 gate_up
        # 45.8 against 42.2 us; H200: fp8 / int8 steps 0.16-0.21 ms slower, bf16 0.03-0.06); a
        # multi-step scan body never fused it (docs/performance.md, session 28).
        x = jax.lax.optimization_barrier(x)
    if is_quantized(w):
        from pallas_kernels.quantized_matmul import quantized_matmul  # noqa: PLC0415
        # out_dtype goes in: the f32 accumulator is cast once to it, not first rounded to x's dtype
        # (bf16 on GPU): the logits of a quantized LM head and a row-parallel projection's partial
        # sums stay f32, as they do for an unquantized weight.
        y = quantized_matmul(x, w, out_dtype=jnp.dtype(out_dtype),
                             backend="reference" if reference.active() else "auto")
    else:
        # Out in x's dtype, the GEMM rounds its f32 accumulator to it itself. Asked for f32 and cast after, XLA
        # ran cuBLAS's GEMM with an f32 output and a convert kernel after it: 0.1 ms per layer of a 2,048-token
        # bf16 prefill on the H200 (qkv and gate_up, session 82).
        acc = out_dtype if jnp.dtype(out_dtype) == x.dtype else jnp.float32
        y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=acc).astype(out_dtype)
    return y if residual is None else residual + y


def _on_gpu() -> bool:
    """Where the GPU kernels may run: a GPU, outside `models.reference.reference_kernels()`."""
    return jax.default_backend() == "gpu" and not reference.active()


def given_or_param(module: nn.Module, name: str, init, axes: tuple[str, ...], shape: tuple[int, ...], dtype):
    """The given parameter as it is (a per-device shard, or a quantized pytree, neither of which
    flax may shape-check against `shape`), or a new one with logical axes when initializing."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Linear(nn.Module):
    """y = x @ kernel (+ bias). kernel: [in, out] tagged with logical axes.

    Under tensor parallelism the kernel is a shard; contracting over a split `in` axis
    (row-parallel) leaves partial sums, all-reduced here (in float32) before the bias.
    """
    features: int
    axes: tuple[str, str]
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    out_dtype: jnp.dtype | None = None
    parallel: Parallel = Parallel()

    @nn.compact
    def __call__(self, x, residual=None, lora_mask=None):
        """x [tokens, in]; residual None or [tokens, out]: added to y. lora_mask [tokens, max_loras]: each token's
        LoRA slot (one-hot; zeros: none), with the "lora" collection holding this layer's stacks (atlasjax/lora.py)."""
        kernel = given_or_param(self, "kernel", _init, self.axes, (x.shape[-1], self.features), self.dtype)
        if lora_mask is not None and self.has_variable("lora", "a"):
            delta = lora_delta(materialize(x), self.get_variable("lora", "a"), self.get_variable("lora", "b"),
                               lora_mask, self.out_dtype or x.dtype, lambda xa: self.parallel.reduce(xa, self.axes[0]))
            residual = delta if residual is None else residual + delta
        if self.parallel.mesh_axis(self.axes[0]) is None:
            if not self.use_bias:
                return matmul(x, kernel, self.out_dtype, residual)
            y = matmul(x, kernel, self.out_dtype)
        else:
            # Partial sums are all-reduced in float32 and rounded once, as one device's f32-accumulated
            # matmul is: bf16 outputs then match the single-device engine (2x bytes on a tiny all-reduce).
            partial = matmul(x, kernel, jnp.float32, decode_kernel=False)
            y = self.parallel.reduce(partial, self.axes[0]).astype(self.out_dtype or x.dtype)
        if self.use_bias:
            bias = given_or_param(self, "bias", nn.initializers.zeros, self.axes[1:], (self.features,), self.dtype)
            y = y + bias.astype(y.dtype)
        return y if residual is None else residual + y


def lora_delta(x, a, b, mask, out_dtype, reduce=lambda xa: xa) -> jax.Array:
    """Each token's LoRA term (x @ a[slot]) @ b[slot]: x [tokens, in], a [slots, in, r], b [slots, r, out] (scaling
    folded in), mask [tokens, slots] one-hot. Every slot's x @ a is computed and masked, so the shapes stay fixed;
    the products are rounded to x's dtype in between, as PEFT's two linear layers are. reduce: all-reduces x @ a
    where x and a hold a share of the inputs (a row-parallel projection under tensor parallelism)."""
    xa = reduce(jnp.einsum("ti,sir->tsr", x, a.astype(x.dtype), preferred_element_type=jnp.float32))
    xa = (xa * mask[:, :, None]).astype(x.dtype)
    return jnp.einsum("tsr,sro->to", xa, b.astype(x.dtype), preferred_element_type=jnp.float32).astype(out_dtype)


class Embed(nn.Module):
    """Token embedding [vocab, embed]; `attend` is the tied LM head (hidden @ table.T)."""
    vocab_size: int
    features: int
    dtype: jnp.dtype = jnp.float32
    parallel: Parallel = Parallel()

    def setup(self):
        self.embedding = given_or_param(self, "embedding", nn.initializers.normal(0.02), ("vocab", "embed"),
                                        (self.vocab_size, self.features), self.dtype)

    def __call__(self, tokens):
        return self.parallel.embed(self.embedding, tokens).astype(self.dtype)

    def attend(self, hidden):
        """hidden [n, embed] -> f32 logits over this device's vocab rows [n, vocab (shard)]."""
        return jnp.dot(hidden, self.embedding.T.astype(hidden.dtype), preferred_element_type=jnp.float32)


class RMSNorm(nn.Module):
    eps: float
    axis_name: str = "embed"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, *, deferred: bool = False):
        """deferred: return `RMSNormed` for the next matmul to compute (models/deferred.py)."""
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                           (x.shape[-1],), self.dtype)
        return RMSNormed(x, scale, self.eps) if deferred else rms_norm(x, scale, self.eps)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
    hidden_size: int
    intermediate_size: int
    dtype: jnp.dtype = jnp.float32
    parallel: Parallel = Parallel()

    @nn.compact
    def __call__(self, x, residual=None, lora_mask=None):
        """x [tokens, embed] (or deferred); residual: added to the output; lora_mask: Linear's."""
        linear = functools.partial(Linear, dtype=self.dtype, parallel=self.parallel)
        kernels = None if lora_mask is not None else self._int4_kernels(x)
        if kernels is not None:   # opt-in: one persistent kernel for the MLP (pallas_kernels/int4_mlp.py)
            from pallas_kernels.int4_mlp import int4_mlp_partials  # noqa: PLC0415
            h = jax.lax.optimization_barrier(materialize(x))   # as `matmul` keeps it from XLA's fusions
            y = int4_mlp_partials(h, *kernels).sum(axis=0).astype(h.dtype)
            return y if residual is None else residual + y
        if self.has_variable("params", "gate_up_proj"):   # the runner's fused layout (models/fused.py)
            act = SwiGLU(linear(0, ("embed", "mlp"), name="gate_up_proj")(x, lora_mask=lora_mask))  # down may fuse it
        else:
            x = materialize(x)
            gate = linear(self.intermediate_size, ("embed", "mlp"), name="gate_proj")(x, lora_mask=lora_mask)
            up = linear(self.intermediate_size, ("embed", "mlp"), name="up_proj")(x, lora_mask=lora_mask)
            act = nn.silu(gate) * up
        return linear(self.hidden_size, ("mlp", "embed"), name="down_proj")(act, residual, lora_mask)

    def _int4_kernels(self, x):
        """(gate_up, down) when the persistent int4 MLP kernel takes this call (opt-in,
        `ATLASJAX_INT4_MLP=on`): a decode step (few rows) on a GPU, one device, fused gate_up, both
        weights in the engine's int4 format. Else None."""
        from pallas_kernels import decode_switches, int4_mlp  # noqa: PLC0415
        if not (self.has_variable("params", "gate_up_proj") and self.has_variable("params", "down_proj")
                and len(x.shape) == 2 and _on_gpu() and self.parallel.mesh_axis("mlp") is None):
            return None
        gate_up_params = self.get_variable("params", "gate_up_proj")
        gate_up, down = gate_up_params.get("kernel"), self.get_variable("params", "down_proj").get("kernel")
        if not (is_quantized(gate_up) and is_quantized(down)) or "bias" in gate_up_params:
            return None
        if decode_switches.int4_mlp_on() and int4_mlp.fits(x.shape[0], gate_up, down):
            return gate_up, down
        return None

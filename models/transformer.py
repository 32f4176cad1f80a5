"""The decoder-only transformer shared by the llama, qwen2 and qwen3 families.

Pure functional: `Transformer(cfg).apply({"params": params}, tokens, positions, kv_caches, meta)`
returns `(hidden, kv_caches)`; `.apply(..., hidden, method=Transformer.logits)` gives f32 logits.
Under tensor parallelism the same code runs per device on its shard (head counts come from the
shard's weights, never from the config); `parallel` (models/parallel.py) supplies the collectives.
Family differences are config flags (qkv bias for qwen2, per-head q/k RMSNorm for qwen3); the
family files (llama.py, qwen2.py, qwen3.py) own checkpoint naming. Projections come either as
checkpoints name them or fused (qkv_proj, gate_up_proj: models/fused.py); the runner fuses. Layers are unrolled (one
param subtree and one KV page pool per layer) so each layer's pool is a separate donated buffer
that kernels read directly. Each layer runs as a call of one jitted function (`_layer_caller`), so jax
traces and lowers a layer once per step program, not once per layer; XLA inlines the calls.
"""
from __future__ import annotations

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.attention import AttentionMetadata, rope_in_kernel, rope_write_and_attend, write_and_attend
from models.deferred import materialize
from models.layers import MLP, Embed, Linear, RMSNorm
from models.parallel import Parallel
from models.rope import apply_rope, rope_attention_factor, rope_inv_freq
from pallas_kernels.rope import rope_tables

KVCache = tuple[tuple[jax.Array, jax.Array], ...]   # per layer (k_pages, v_pages)


class Attention(nn.Module):
    cfg: object
    attn_backend: str = "auto"
    dtype: jnp.dtype = jnp.float32
    parallel: Parallel = Parallel()

    @nn.compact
    def __call__(self, x, positions, kv, meta: AttentionMetadata, residual=None, rope=None, lora_mask=None):
        """-> (o_proj output + residual (when given), kv). rope: the step's `rope_tables` (decode steps);
        lora_mask: Linear's."""
        cfg = self.cfg
        t = x.shape[0]
        hd = cfg.head_dim
        linear = functools.partial(Linear, dtype=self.dtype, parallel=self.parallel)
        fused = self.has_variable("params", "qkv_proj")   # the runner's fused layout (models/fused.py)
        if fused:
            # x may be a deferred RMSNormed (models/deferred.py), for the qkv matmul to compute
            qkv = linear(0, ("embed", "heads"), cfg.qkv_bias, name="qkv_proj")(x, lora_mask=lora_mask)
            nq = cfg.num_heads * hd // self.parallel.shards("heads")
        if fused and rope is not None and not cfg.qk_norm:   # RoPE in the attention kernel
            out, kv = rope_write_and_attend(qkv, rope, kv, meta, num_heads=nq // hd, backend=self.attn_backend)
        else:
            if fused:
                q, k, v = jnp.split(qkv, [nq, nq + (qkv.shape[-1] - nq) // 2], axis=-1)
            else:
                x = materialize(x)
                q = linear(cfg.num_heads * hd, ("embed", "heads"), cfg.qkv_bias, name="q_proj")(x, lora_mask=lora_mask)
                k = linear(cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg.qkv_bias, name="k_proj")(
                    x, lora_mask=lora_mask)
                v = linear(cfg.num_kv_heads * hd, ("embed", "kv_heads"), cfg.qkv_bias, name="v_proj")(
                    x, lora_mask=lora_mask)
            q = q.reshape(t, -1, hd)   # [tokens, heads (this shard's), head_dim]
            k = k.reshape(t, -1, hd)   # [tokens, kv_heads (this shard's), head_dim]
            v = v.reshape(t, -1, hd)
            if cfg.qk_norm:
                q = RMSNorm(cfg.rms_norm_eps, "head_dim", self.dtype, name="q_norm")(q)
                k = RMSNorm(cfg.rms_norm_eps, "head_dim", self.dtype, name="k_norm")(k)
            inv_freq, scale = rope_inv_freq(cfg), rope_attention_factor(cfg)
            q = apply_rope(q, positions, inv_freq, scale)
            k = apply_rope(k, positions, inv_freq, scale)
            out, kv = write_and_attend(q, k, v, kv, meta, backend=self.attn_backend)   # K/V land in the donated pool
        out = linear(cfg.hidden_size, ("heads", "embed"), False, name="o_proj")(out.reshape(t, -1), residual, lora_mask)
        return out, kv


class DecoderLayer(nn.Module):
    cfg: object
    attn_backend: str = "auto"
    dtype: jnp.dtype = jnp.float32
    parallel: Parallel = Parallel()

    @nn.compact
    def __call__(self, x, positions, kv, meta, rope=None, lora_mask=None):
        cfg = self.cfg
        # The norms go to the projections after them as deferred activations and the residual adds
        # into the projections (x + o_proj(...), x + down(...)): a decode matmul kernel can take the
        # norm into its prologue and the add into its epilogue (models/deferred.py).
        h = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, name="input_layernorm")(x, deferred=True)
        x, kv = Attention(cfg, self.attn_backend, self.dtype, self.parallel, name="self_attn")(
            h, positions, kv, meta, residual=x, rope=rope, lora_mask=lora_mask)
        h = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, name="post_attention_layernorm")(x, deferred=True)
        x = MLP(cfg.hidden_size, cfg.intermediate_size, self.dtype, self.parallel, name="mlp")(h, x, lora_mask)
        return x, kv


class Transformer(nn.Module):
    cfg: object
    attn_backend: str = "auto"
    dtype: jnp.dtype = jnp.float32
    parallel: Parallel = Parallel()
    # layers whose input (the residual stream) is also returned, concatenated: an EAGLE-3 head's features
    # (models/eagle3.py); empty: the call returns (hidden, kv_caches) only
    aux_layers: tuple[int, ...] = ()

    def setup(self):
        cfg = self.cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype, self.parallel)
        self.layers = [DecoderLayer(cfg, self.attn_backend, self.dtype, self.parallel, name=f"layers_{i}")
                       for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, ("embed", "vocab"), dtype=self.dtype, out_dtype=jnp.float32,
                                  parallel=self.parallel)

    def __call__(self, tokens, positions, kv_caches: KVCache, meta: AttentionMetadata, lora_ids=None):
        """tokens, positions: [num_tokens] int32 -> (hidden [num_tokens, embed], kv_caches). lora_ids: [num_tokens]
        each token's LoRA slot (-1: none), with the adapters' stacks passed as the "lora" collection
        (atlasjax/lora.py). With aux_layers: (hidden, kv_caches, [num_tokens, len(aux_layers) * embed])."""
        x = self.embed_tokens(tokens)
        lora = self.variables.get("lora") if lora_ids is not None else None
        lora_mask = None
        if lora is not None:
            num_slots = jax.tree.leaves(lora)[0].shape[0]
            lora_mask = (lora_ids[:, None] == jnp.arange(num_slots)[None, :]).astype(jnp.float32)
        # A decode step's RoPE tables, once for all layers, for attention kernels that rotate q and k
        rope = (rope_tables(positions, rope_inv_freq(self.cfg), rope_attention_factor(self.cfg))
                if meta.is_decode and rope_in_kernel() else None)
        new_caches, aux = [], []
        call_layer = _layer_caller() if layer_calls() and not self.is_initializing() else None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(x)
            with jax.named_scope(f"layer_{i}"):
                if call_layer:
                    x, kv = call_layer(layer.clone(parent=None, name=None), self.variables["params"][layer.name],
                                       None if lora is None else lora[layer.name], x, positions, kv_caches[i], meta,
                                       rope, lora_mask)
                else:
                    x, kv = layer(x, positions, kv_caches[i], meta, rope, lora_mask)
            new_caches.append(kv)
        if self.aux_layers:
            return self.norm(x), tuple(new_caches), jnp.concatenate(aux, axis=-1)
        return self.norm(x), tuple(new_caches)

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def init_all(self, tokens, positions, kv_caches, meta):
        """Touches every parameter (used by `init` to create the full tree)."""
        hidden = self(tokens, positions, kv_caches, meta)[0]
        return self.logits(hidden)

    def logits(self, hidden):
        """hidden: [n, embed] -> f32 logits [n, vocab] (whole on every device under tensor parallelism)."""
        if self.cfg.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        # A vocab-split head is gathered; rows padded to split the vocab evenly are dropped.
        return self.parallel.gather(logits, "vocab")[:, :self.cfg.vocab_size]


def layer_calls() -> bool:
    """Whether layers run as calls of one jitted function (`_layer_caller`); `ATLASJAX_LAYER_CALLS=off`
    traces every layer inline, for A/B measurements of start-up and step time."""
    return os.environ.get("ATLASJAX_LAYER_CALLS", "").lower() not in ("off", "0", "false")


def _layer_caller():
    """One jitted function for the layers of one trace: the layers of a step program with the same
    module config and param shapes share one trace and one lowered function. Made afresh for every
    trace (a new function, so jax's trace cache cannot hand it an old trace): a step traced later
    sees the kernel routing of its own time (environment switches, patched rules)."""
    def call_layer(layer: DecoderLayer, params, lora, x, positions, kv, meta, rope, lora_mask):
        variables = {"params": params} if lora is None else {"params": params, "lora": lora}
        return layer.apply(variables, x, positions, kv, meta, rope, lora_mask)
    return jax.jit(call_layer, static_argnums=0)


def init_kv_cache(cfg, num_pages: int, page_size: int, dtype, num_kv_heads: int | None = None) -> KVCache:
    """Zeroed page pools; num_kv_heads overrides the config's (KV heads replicated for tensor parallelism)."""
    shape = (num_kv_heads or cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def abstract_params(cfg, dtype=jnp.float32, attn_backend="reference"):
    """Param tree of ShapeDtypeStructs wrapped in flax LogicallyPartitioned boxes (no memory)."""
    model = Transformer(cfg, attn_backend=attn_backend, dtype=dtype)
    kv = init_kv_cache_abstract(cfg, dtype)
    meta = AttentionMetadata(slot_mapping=jnp.zeros((1,), jnp.int32), page_table=jnp.zeros((1, 1), jnp.int32),
                             seq_lens=jnp.ones((1,), jnp.int32))

    def init(rng):
        return model.init(rng, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), kv, meta,
                          method=Transformer.init_all)["params"]
    return jax.eval_shape(init, jax.random.key(0))


def init_kv_cache_abstract(cfg, dtype):
    shape = (cfg.num_kv_heads, 1, 1, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))

"""The EAGLE-3 draft head (speculative decoding, vLLM's and SGLang's `method: "eagle3"`).

One decoder layer that drafts from the target model's own hidden states: at position i it takes the embedding of
token i + 1 and a feature of position i, which is `fc` of the target's residual stream at three of its layers
(`Transformer(aux_layers=...)`) for positions the target has run, or the head's own previous output while it
drafts past them. Its attention reads both halves ([embedding | feature], 2 x hidden wide) and writes a KV pool of
one layer. Its LM head covers a smaller draft vocabulary whose ids map to the target's through `d2t`.

    residual = feature; x = [input_layernorm(embed) | hidden_norm(feature)]
    x = residual + o_proj(attention(x)); x = x + mlp(post_attention_layernorm(x))   -> prenorm (the next feature)
    draft token = d2t-mapped argmax(lm_head(norm(prenorm)))

Params (atlasjax/eagle3.py loads them): fc [3 * target_hidden, hidden], layers_0 (a decoder layer whose q/k/v
projections take 2 x hidden), layers_0.hidden_norm, norm, lm_head [hidden, draft_vocab], d2t [draft_vocab] int32
(target id - draft id), and embed_tokens only where the checkpoint has its own (else the target's is used).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models.layers import MLP, Linear, RMSNorm
from models.transformer import Attention


class Eagle3Layer(nn.Module):
    cfg: object
    attn_backend: str = "auto"
    dtype: jnp.dtype = jnp.float32
    norm_before_residual: bool = False   # some checkpoints' variant: the residual is the normed feature

    @nn.compact
    def __call__(self, embeds, feature, positions, kv, meta):
        cfg = self.cfg
        embeds = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, name="input_layernorm")(embeds)
        normed = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, name="hidden_norm")(feature)
        residual = normed if self.norm_before_residual else feature
        x, kv = Attention(cfg, self.attn_backend, self.dtype, name="self_attn")(
            jnp.concatenate([embeds, normed], axis=-1), positions, kv, meta, residual=residual)
        h = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, name="post_attention_layernorm")(x, deferred=True)
        return MLP(cfg.hidden_size, cfg.intermediate_size, self.dtype, name="mlp")(h, x), kv


class Eagle3Head(nn.Module):
    """`__call__(embeds, feature, positions, kv, meta) -> (prenorm [n, hidden], kv)`: feature is the target's
    concatenated aux hidden states [n, 3 * target_hidden] (fc applies) or the head's own prenorm [n, hidden];
    `propose(prenorm)` -> the draft tokens in the target's ids [n]; `embed(tokens)` where the head has its own
    embedding."""
    cfg: object
    target_hidden: int
    draft_vocab: int
    attn_backend: str = "auto"
    dtype: jnp.dtype = jnp.float32
    norm_before_residual: bool = False

    def setup(self):
        cfg = self.cfg
        self.fc = Linear(cfg.hidden_size, ("embed", "embed"), dtype=self.dtype)
        self.layers_0 = Eagle3Layer(cfg, self.attn_backend, self.dtype, self.norm_before_residual)
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype)
        self.lm_head = Linear(self.draft_vocab, ("embed", "vocab"), dtype=self.dtype, out_dtype=jnp.float32)

    def __call__(self, embeds, feature, positions, kv, meta):
        if feature.shape[-1] != self.cfg.hidden_size:
            feature = self.fc(feature.astype(self.dtype))
        x, new_kv = self.layers_0(embeds.astype(self.dtype), feature, positions, kv[0], meta)
        return x, (new_kv,)

    def propose(self, prenorm):
        """The greedy draft token of each row, as a target token id."""
        draft = jnp.argmax(self.lm_head(self.norm(prenorm)), axis=-1).astype(jnp.int32)
        return draft + self.variables["params"]["d2t"][draft]

    def embed(self, tokens):
        return self.variables["params"]["embed_tokens"]["embedding"][tokens].astype(self.dtype)

    def init_all(self, embeds, target_feature, positions, kv, meta):
        """Touches every parameter (`init` builds the full tree; d2t and embed_tokens are added by the caller)."""
        prenorm, _ = self(embeds, target_feature, positions, kv, meta)
        return self.lm_head(self.norm(prenorm))

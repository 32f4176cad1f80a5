"""Activation smoothing before int8 W8A8 quantization at load (SmoothQuant's migration).

Per-token int8 activations lose a row's small values beside its outlier channels: 255 levels set by
the row's largest. SmoothQuant (Xiao et al., 2023) divides each input channel j of a projection by
s_j and multiplies the weight's row j by s_j, which leaves the product unchanged and moves the
outliers into the weight, whose per-channel int8 scales absorb them better:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

with max|X_j| measured on a calibration text (atlasjax/kv_calibration.py's) and max|W_j| over the
weights that read X. The division folds into what produces X, so no step pays for it:
- qkv's input is the input RMSNorm's output: its scale / s, Wq / Wk / Wv rows * s;
- gate_up's input is the post-attention RMSNorm's: the same with Wgate / Wup;
- down's input is silu(gate) * up: Wup's columns (and bias) / s, Wdown rows * s.
o_proj's input (the attention output) is left alone: on SmolLM2 its int8 rounding costs ~0.0003
nats per token, and its fold (into Wv, shared by a group of query heads) would constrain s.

Exact in real arithmetic; in the model's dtype the scaled weights and norms round once more before
quantization. Applied where the engine quantizes a float checkpoint to int8 at load for int8
activations, in one process: on one device, or under tensor parallelism on the float model gathered
onto the first device (atlasjax/model_source.py); a checkpoint made for W8A8 int8 was smoothed by
its maker. Measured in docs/quantization.md.
"""
from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("atlasjax.smoothing")

ALPHA = 0.5
# (norm that produces the input, projections that read it) per layer; down's producer is up_proj
GROUPS = (("input_layernorm", ("self_attn", ("q_proj", "k_proj", "v_proj"))),
          ("post_attention_layernorm", ("mlp", ("gate_proj", "up_proj"))),
          (("mlp", "up_proj"), ("mlp", ("down_proj",))))
RECORDED = {"q_proj": 0, "gate_proj": 1, "down_proj": 2}   # the projection whose input stands for its group


def input_amax(cfg, params, ids: list[int], dtype) -> dict[tuple[int, int], np.ndarray]:
    """{(layer, group): max |x_j| over the calibration tokens, per input channel} for the inputs of
    q_proj, gate_proj and down_proj (one sequence, reference attention). params: the checkpoint-layout
    tree on one device."""
    from atlasjax.kv_calibration import reference_prefill  # noqa: PLC0415
    from models.deferred import materialize  # noqa: PLC0415
    from models.layers import Linear  # noqa: PLC0415
    model, positions, new_kv, meta = reference_prefill(cfg, len(ids), dtype)

    def layers(module, tokens, layer_seen):   # the Transformer's loop, each layer's index known
        x, kv = module.embed_tokens(tokens), new_kv()
        for i, layer in enumerate(module.layers):
            layer_seen[0] = i
            x, _ = layer(x, positions, kv[i], meta, None)
        return x

    @jax.jit
    def amax(params, tokens):
        seen, layer_seen = {}, [None]

        def record(next_fun, args, kwargs, context):
            module = context.module
            if isinstance(module, Linear) and context.method_name == "__call__" and module.name in RECORDED:
                x = materialize(args[0]).astype(jnp.float32)
                seen[(layer_seen[0], RECORDED[module.name])] = jnp.max(jnp.abs(x), axis=0)
            return next_fun(*args, **kwargs)
        with nn.intercept_methods(record):
            model.apply({"params": params}, tokens, layer_seen, method=layers)
        return seen
    return {key: np.asarray(v) for key, v in amax(params, jnp.asarray(ids, jnp.int32)).items()}


def smoothing_factors(x_amax: np.ndarray, w_amax: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """s_j = x_amax_j ** alpha / w_amax_j ** (1 - alpha), 1 where either is zero, within [1e-4, 1e4]."""
    x_amax, w_amax = np.asarray(x_amax, np.float64), np.asarray(w_amax, np.float64)
    ok = (x_amax > 0) & (w_amax > 0) & np.isfinite(x_amax) & np.isfinite(w_amax)
    s = np.where(ok, np.power(np.where(ok, x_amax, 1), alpha) / np.power(np.where(ok, w_amax, 1), 1 - alpha), 1.0)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def _get(tree, path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _replaced(tree: dict, path: tuple, value) -> dict:
    """A copy of the nested dict with the leaf at `path` replaced (the rest shared)."""
    return value if not path else {**tree, path[0]: _replaced(tree[path[0]], path[1:], value)}


def _times(a, factor, axis: int):
    """a * factor along `axis` (factor f32 [a.shape[axis]]), computed in f32, back in a's dtype."""
    shape = [1] * a.ndim
    shape[axis] = -1
    return (a.astype(jnp.float32) * jnp.asarray(factor).reshape(shape)).astype(a.dtype)


def _is_float(a) -> bool:
    return isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)


def smooth(params: dict, amax: dict, alpha: float = ALPHA) -> tuple[dict, int]:
    """(params with each measured group smoothed, how many groups). A group is skipped where its
    layer lacks the expected float weights (e.g. already quantized, a mixture of experts, a linear
    attention layer)."""
    params = dict(params)
    done = 0
    for (layer, group), x_amax in sorted(amax.items()):
        producer, (block, names) = GROUPS[group]
        tree = params.get(f"layers_{layer}")
        kernels = [_get(tree, (block, name, "kernel")) for name in names]
        producer_path = (producer, "scale") if isinstance(producer, str) else (*producer, "kernel")
        source = _get(tree, producer_path)
        if not (_is_float(source) and all(_is_float(k) and k.ndim == 2 for k in kernels)):
            continue
        w_amax = np.max([np.asarray(jnp.max(jnp.abs(k.astype(jnp.float32)), axis=1)) for k in kernels], axis=0)
        s = smoothing_factors(x_amax, w_amax, alpha)
        for name, kernel in zip(names, kernels):   # the rows that read channel j, * s_j
            tree = _replaced(tree, (block, name, "kernel"), _times(kernel, s, 0))
        # what produces channel j, / s_j: a norm's scale, or up_proj's output column (and bias)
        tree = _replaced(tree, producer_path, _times(source, 1 / s, source.ndim - 1))
        bias = None if isinstance(producer, str) else _get(tree, (*producer, "bias"))
        if bias is not None:
            tree = _replaced(tree, (*producer, "bias"), _times(bias, 1 / s, 0))
        params[f"layers_{layer}"] = tree
        done += 1
    return params, done


def smooth_for_int8_activations(cfg, params: dict, tokenizer, dtype, max_len: int, alpha: float = ALPHA) -> dict:
    """params with SmoothQuant's migration applied on the calibration text (module docstring)."""
    from atlasjax.kv_calibration import calibration_ids  # noqa: PLC0415
    ids = calibration_ids(tokenizer, cfg.vocab_size, max_len)
    params, done = smooth(params, input_amax(cfg, params, ids, dtype), alpha)
    log.info("int8 activations: %d groups of projections smoothed on %d calibration tokens (alpha %.2f)",
             done, len(ids), alpha)
    return params

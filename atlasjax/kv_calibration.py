"""KV-cache scales computed at start (`calculate_kv_scales`, vLLM's `--calculate-kv-scales`).

An fp8 KV cache stores K and V unscaled unless the checkpoint brings calibrated scales
(atlasjax/kv_scales.py). For a checkpoint without them, the engine can measure its own: before the
step programs are built, one prefill of a fixed calibration text (prose, code, numbers) runs through
the model with a cache in the model's dtype, and each layer's largest |K| and |V| as stored (after
RoPE and any q/k norm) give its scales. They fold into the attention weights as a checkpoint's do:
- scores, q.k = (k_scale q).(k / k_scale): Wq (and its bias) times k_scale, Wk (and its bias) over
  it; with q/k norms (Qwen3) the norms' weights instead;
- values, sum p v = v_scale sum p (v / v_scale): Wv (and its bias) over v_scale, Wo times v_scale.
A quantized weight takes its factor in its scale rows (and float offsets), so its codes stay.

Each scale is a power of two, so the folds are exact in every float format the weights are held in,
and the model computes the same function; the scale puts the calibration text's largest value
between 1/4 and 1/2 of the cache dtype's largest finite value (`HEADROOM`): room for prompts that
reach further than the calibration text, fine steps for the small values. vLLM instead measures the
first batch it serves (amax / 200 for K, / 100 for V); a fixed text keeps a server's numerics
independent of its first request.

Scope: one device's param tree. Under tensor parallelism (one host) the engine gathers its shards
onto the first device for this and places the folded weights again (atlasjax/model_source.py);
across hosts it needs a checkpoint with calibrated scales.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import is_quantized

log = logging.getLogger("atlasjax.kv_calibration")

HEADROOM = 2.0        # the calibration text's largest |K| or |V| lands in (max / 4, max / 2] of the cache dtype
MAX_TOKENS = 512      # calibration tokens at most (the text is 414 tokens in Llama 3's vocabulary, 446 in Qwen3's)
CALIBRATION_TEXT = (
    "The history of astronomy is one of the oldest of the natural sciences. Early cultures identified "
    "celestial objects with gods and spirits, and related them to rain, drought, seasons and tides.\n\n"
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "| year | population (millions) | growth |\n|------|-----------------------|--------|\n"
    "| 1950 | 2,536 | 1.8% |\n| 1975 | 4,079 | 2.0% |\n| 2000 | 6,149 | 1.3% |\n| 2025 | 8,191 | 0.9% |\n\n"
    "Q: What is 17 * 23? A: 17 * 23 = 391. Q: Solve 3x + 7 = 25. A: x = 6.\n"
    "La lune tourne autour de la Terre en environ vingt-sept jours. Der schnelle braune Fuchs springt "
    "uber den faulen Hund. El agua hierve a cien grados Celsius al nivel del mar.\n"
    "<user>Can you summarize the plot of Hamlet in two sentences?</user>\n<assistant>Prince Hamlet "
    "seeks revenge on his uncle Claudius, who murdered Hamlet's father to seize the throne of Denmark. "
    "His hesitation and feigned madness lead to a chain of deaths that ends with the royal family "
    "destroyed.</assistant>\n"
    "SELECT name, COUNT(*) AS n FROM orders WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY n DESC;\n"
    "Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2. "
    "In 1969, astronauts first walked on the Moon; the capital of France is Paris; water boils at 100 C.\n")


def calibration_ids(tokenizer, vocab_size: int, max_len: int) -> list[int]:
    """The calibration text's token ids (random ids of the vocabulary for a model without a tokenizer),
    at most MAX_TOKENS and max_len."""
    n = min(MAX_TOKENS, max_len)
    if tokenizer is not None:
        return list(tokenizer.encode(CALIBRATION_TEXT))[:n]
    return [int(t) for t in np.random.default_rng(0).integers(0, vocab_size, size=n)]


def reference_prefill(cfg, n: int, dtype):
    """(model, positions, kv cache maker, metadata) for one n-token sequence through the reference
    Transformer (reference attention, a cache in `dtype`): the calibration forwards' set-up."""
    from models.attention import AttentionMetadata  # noqa: PLC0415
    from models.transformer import Transformer, init_kv_cache  # noqa: PLC0415
    page = 16
    pages = -(-n // page)
    meta = AttentionMetadata(slot_mapping=jnp.arange(n), page_table=jnp.arange(pages)[None],
                             seq_lens=jnp.array([n]), query_start=jnp.array([0, n]), num_seqs=jnp.array(1))
    return (Transformer(cfg, attn_backend="reference", dtype=dtype), jnp.arange(n),
            lambda: init_kv_cache(cfg, pages, page, dtype), meta)


def kv_amax(cfg, params, ids: list[int], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the largest |K| and |V| the model stores for `ids` (one sequence, reference attention,
    a cache in `dtype`). params: the checkpoint-layout tree on one device."""
    model, positions, new_kv, meta = reference_prefill(cfg, len(ids), dtype)

    @jax.jit
    def amax(params, tokens):
        _, kv = model.apply({"params": params}, tokens, positions, new_kv(), meta)
        return jnp.stack([jnp.stack([jnp.max(jnp.abs(k.astype(jnp.float32))), jnp.max(jnp.abs(v.astype(jnp.float32)))])
                          for k, v in kv])
    out = np.asarray(amax(params, jnp.asarray(ids, jnp.int32)))
    return out[:, 0], out[:, 1]


def power_of_two_scale(amax: float, dtype_max: float) -> float:
    """The power of two s with amax / s in (dtype_max / (2 HEADROOM), dtype_max / HEADROOM]; 1 for a
    layer that stored nothing but zeros (or non-finite values, which no scale fixes)."""
    if not (math.isfinite(amax) and amax > 0):
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / dtype_max))


def scaled(w, factor: float):
    """A weight (array, or QuantizedWeight through its scale rows) times a power-of-two factor."""
    def times(a):   # in a's own float dtype: exact for a power of two
        return a * jnp.asarray(factor, a.dtype)
    if not is_quantized(w):
        return times(w)
    if w.two_level:   # codes under float super rows: those carry the factor
        rows = ["super_scales"] + (["super_zeros"] if w.super_zeros is not None else [])
    else:   # float offsets scale with the weight; integer zero points do not
        rows = ["scales"] + (["zeros"] if w.zeros is not None and not w.zero_point else [])
    return dataclasses.replace(w, **{r: times(getattr(w, r)) for r in rows})


def fold(params: dict, cfg, k_scales, v_scales) -> dict:
    """params with each layer's K and V scales folded into its attention weights (module docstring)."""
    params = dict(params)
    for i, (ks, vs) in enumerate(zip(k_scales, v_scales)):
        attn = {name: dict(part) for name, part in params[f"layers_{i}"]["self_attn"].items()}

        def times(name, factor, keys=("kernel", "bias")):
            for key in keys:
                if key in attn.get(name, {}):
                    attn[name][key] = scaled(attn[name][key], factor)
        if cfg.qk_norm:
            times("q_norm", ks, ("scale",))
            times("k_norm", 1 / ks, ("scale",))
        else:
            times("q_proj", ks)
            times("k_proj", 1 / ks)
        times("v_proj", 1 / vs)
        times("o_proj", vs, ("kernel",))
        params[f"layers_{i}"] = {**params[f"layers_{i}"], "self_attn": attn}
    return params


def calculate_kv_scales(cfg, params: dict, tokenizer, dtype, kv_dtype, max_len: int) -> dict:
    """params with KV-cache scales measured on the calibration text folded in, for a `kv_dtype` cache."""
    ids = calibration_ids(tokenizer, cfg.vocab_size, max_len)
    k_amax, v_amax = kv_amax(cfg, params, ids, dtype)
    top = float(jnp.finfo(kv_dtype).max)
    k_scales = [power_of_two_scale(float(a), top) for a in k_amax]
    v_scales = [power_of_two_scale(float(a), top) for a in v_amax]
    log.info("%s KV cache: scales computed on %d calibration tokens for %d layers (K %s, V %s); largest |K| "
             "%.3g, |V| %.3g", jnp.dtype(kv_dtype).name, len(ids), cfg.num_layers, _span(k_scales),
             _span(v_scales), float(np.max(k_amax)), float(np.max(v_amax)))
    return fold(params, cfg, k_scales, v_scales)


def _span(scales) -> str:
    lo, hi = int(math.log2(min(scales))), int(math.log2(max(scales)))
    return f"2^{lo}" if lo == hi else f"2^{lo} to 2^{hi}"

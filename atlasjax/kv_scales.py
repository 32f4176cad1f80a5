"""Calibrated KV-cache scales of a checkpoint, folded into its attention weights at load.

Checkpoints made for an fp8 KV cache (llm-compressor, AutoFP8, ModelOpt) carry per-layer scales for
K and V: vLLM stores k / k_scale and reads it back times k_scale. The engine's fp8 pool stores K and
V unscaled (saturating at e4m3's 448), so the scales go into the weights that make and read K and V
instead, which is exact in real arithmetic and leaves the attention kernels as they are:
- scores, q·k = (k_scale q)·(k / k_scale): Wq (and its bias) times k_scale, Wk (and its bias) over
  it. With per-head q/k RMSNorm after the projections (Qwen3), which removes any scale of its input,
  the norms' weights take the factors instead;
- values, Σ p v = v_scale Σ p (v / v_scale): Wv (and its bias) over v_scale, Wo times v_scale.
A linear saved quantized (FP8 `weight_scale` / `weight_scale_inv`, AWQ / GPTQ `scales`,
compressed-tensors `weight_scale`) takes its factor into that scale tensor: w = (q - z) s, so the
codes and zero points stay as they are.

Data flow: `loader.load_hf` passes the checkpoint's (name, reader) stream through `fold_kv_scales`
before `prequantized.quantized_tensors` and `assemble_params`. It lists the names, reads the small
scale tensors at once (a bad one fails before any weight is read), drops them from the stream and
wraps the readers of the tensors they scale: those read in float32 times the factor (a float16
tensor stays float16, the storage the engine keeps for group scales), whole or as slices. So
quantization at load and tensor-parallel placement see the folded tensors.

Names (as vLLM's `maybe_remap_kv_scale_name` reads them): `<layer>.self_attn.k_scale` / `.v_scale`
(llm-compressor), `.self_attn.k_proj.k_scale` / `.v_proj.v_scale` (ModelOpt),
`.self_attn.k_proj.output_scale` / `.v_proj.output_scale` (AutoFP8) and the older
`.self_attn.kv_scale` (one for both); `.self_attn.q_scale` (for fp8 attention) is dropped unused.
A scale is a scalar or one per KV head ([num_kv_heads]); per-head scales fold into float weights
(the channels of that KV head, and of its query heads in Wq and Wo) and are refused
(UnsupportedModelError) on a linear saved quantized or as the K scale of a q/k-normed model. A layer
without a scale keeps 1.0. With a KV cache that is not fp8 the scales are dropped unread (vLLM
ignores them too), and the weights load as they would without them.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import numpy as np

from atlasjax.errors import CheckpointError, UnsupportedModelError

log = logging.getLogger("atlasjax.kv_scales")

_SCALE_NAME = re.compile(r"^(?P<attn>.+\.self_attn)\.(?:(?P<own>k_scale|v_scale|kv_scale|q_scale)"
                         r"|k_proj\.(?P<k>k_scale|output_scale)|v_proj\.(?P<v>v_scale|output_scale))$")
# a linear saved quantized: the tensor its dequantized weight is proportional to
_QUANTIZED_SCALES = ("weight_scale", "weight_scale_inv", "scales")


def fold_kv_scales(tensors: Iterable, cfg, kv_cache_fp8: bool) -> Iterator:
    """The checkpoint's (name, reader) pairs without its KV-cache scales; with `kv_cache_fp8`, the
    scales folded into the attention tensors they apply to (module docstring). cfg: the ModelConfig."""
    scales, rest = _split_scales(tensors)
    if not scales:
        return iter(rest)
    if not kv_cache_fp8:
        log.info("the checkpoint has KV-cache scales for %d layers; unused, as the KV cache is not fp8", len(scales))
        return iter(rest)
    names = {name for name, _ in rest}
    factors: dict[str, np.ndarray] = {}
    for attn, layer in scales.items():
        for part, (name, reader) in layer.items():
            factors.update(_factors(attn, part, _read_scale(name, reader, cfg), cfg, names))
    log.info("fp8 KV cache: folded the checkpoint's KV-cache scales of %d of %d layers into their attention "
             "weights", len(scales), cfg.num_layers)
    return ((name, _scaled(reader, factors[name]) if name in factors else reader) for name, reader in rest)


def _split_scales(tensors: Iterable) -> tuple[dict, list]:
    """({attention prefix: {"k" | "v": (name, reader)}}, the other tensors); q scales are dropped."""
    scales: dict[str, dict] = {}
    rest = []
    for name, reader in tensors:
        m = _SCALE_NAME.match(name)
        if m is None:
            rest.append((name, reader))
            continue
        kind = m["own"].removesuffix("_scale") if m["own"] else ("k" if m["k"] else "v")
        if kind == "q":
            continue
        layer = scales.setdefault(m["attn"], {})
        for part in ("k", "v") if kind == "kv" else (kind,):
            if part in layer:
                raise CheckpointError(f"two {part.upper()} cache scales for {m['attn']}: {layer[part][0]!r} "
                                      f"and {name!r}")
            layer[part] = (name, reader)
    return scales, rest


def _read_scale(name: str, reader, cfg) -> np.ndarray:
    """A KV-cache scale as float32: shape () for one scale, or [num_kv_heads]."""
    value = np.asarray(reader(), np.float32)
    if value.size == 1:
        value = value.reshape(())
    elif value.shape != (cfg.num_kv_heads,):
        raise CheckpointError(f"KV-cache scale {name!r} has shape {value.shape}; expected one value or one per "
                              f"KV head ({cfg.num_kv_heads})")
    if not np.all(np.isfinite(value) & (value > 0)):
        raise CheckpointError(f"KV-cache scale {name!r} is {value.tolist()}; a scale must be finite and positive")
    return value


def _factors(attn: str, part: str, scale: np.ndarray, cfg, names: set) -> dict[str, np.ndarray]:
    """{tensor name: factor} folding one layer's K ("k") or V ("v") scale."""
    per_kv_channel = _channels(scale, cfg.head_dim)                       # Wk / Wv output channels
    per_query_channel = _channels(scale, cfg.group_size * cfg.head_dim)   # the KV head's query heads
    if part == "v":
        return _linear(f"{attn}.v_proj", 1 / per_kv_channel, "out", names) | _linear(
            f"{attn}.o_proj", per_query_channel, "in", names)
    if cfg.qk_norm:   # the norms after the projections: q_norm(Wq x) k_scale, k_norm(Wk x) / k_scale
        if scale.ndim:
            raise UnsupportedModelError(f"{attn}: per-head K cache scales on a model with q/k norms (one norm "
                                        "weight for all heads) are not supported")
        return {_present(f"{attn}.q_norm.weight", names): scale, _present(f"{attn}.k_norm.weight", names): 1 / scale}
    return _linear(f"{attn}.q_proj", per_query_channel, "out", names) | _linear(
        f"{attn}.k_proj", 1 / per_kv_channel, "out", names)


def _channels(scale: np.ndarray, width: int) -> np.ndarray:
    """A scalar as it is; per-head scales repeated over each head's `width` channels."""
    return scale if scale.ndim == 0 else np.repeat(scale, width)


def _linear(root: str, factor: np.ndarray, side: str, names: set) -> dict[str, np.ndarray]:
    """Factors scaling a linear's output channels (side "out", its bias too) or input rows ("in"),
    as broadcast against the checkpoint's [out, in] layout."""
    folds = {f"{root}.bias": factor} if side == "out" and f"{root}.bias" in names else {}
    quantized = next((f"{root}.{key}" for key in _QUANTIZED_SCALES if f"{root}.{key}" in names), None)
    if quantized is not None:
        if factor.ndim:
            raise UnsupportedModelError(f"{root}: per-head KV cache scales on a linear saved quantized are not "
                                        "supported (only one scale per layer)")
        return folds | {quantized: factor}
    if factor.ndim:
        factor = factor[:, None] if side == "out" else factor[None, :]
    return folds | {_present(f"{root}.weight", names): factor}


def _present(name: str, names: set) -> str:
    if name not in names:
        raise CheckpointError(f"the checkpoint has KV-cache scales but no {name!r} to fold them into")
    return name


def _scaled(reader, factor: np.ndarray):
    """`reader` whose tensor (or slice of it) comes multiplied by `factor`, in float32 (float16 kept)."""
    from atlasjax.loader import TensorReader  # noqa: PLC0415

    def fold(array, f=factor):
        array = np.asarray(array)
        out_dtype = np.float16 if array.dtype == np.float16 else np.float32
        return (array.astype(np.float32) * f).astype(out_dtype)

    def read_range(axis, start, stop):
        f = factor
        if f.ndim > axis and f.shape[axis] > 1:   # the factor's slice along the same axis
            f = f[(slice(None),) * axis + (slice(start, stop),)]
        return fold(reader.read_range(axis, start, stop), f)
    return TensorReader(reader.shape, lambda: fold(reader()), read_range if hasattr(reader, "read_range") else None,
                        quantized=getattr(reader, "quantized", False))

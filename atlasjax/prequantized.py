"""Hugging Face checkpoints saved quantized, read into the engine's formats without re-quantizing.

config.json's `quantization_config` names the method (`scheme_of`):
- FP8 weights, kept as the "fp8" format (W8A16: activation scales of W8A8 checkpoints are unused):
  - "compressed-tensors" with 8-bit float weights (llm-compressor's FP8 / FP8-Dynamic models):
    `weight_scale` per channel ([N, 1]), per tensor ([1]) or per block ([N / bn, K / bk]);
  - "fbgemm_fp8": `weight_scale` per channel;
  - "fp8" (transformers' FineGrainedFP8: Qwen3-*-FP8, DeepSeek): `weight_scale_inv`, one per
    `weight_block_size` block (it multiplies, despite the name); without a block size, AutoFP8's
    per-tensor `weight_scale`.
  Per-tensor scales become per-channel ones; a block's scale becomes the scale of its columns in
  each group of bk rows along K. Exact.
- "awq" (GEMM packing) and "gptq" (4 bits; 8 bits when symmetric): int4 (int8) with the checkpoint's
  groups along K, scales and whole-number zero points. Exact. Where the engine's contiguous groups
  cannot hold a weight (GPTQ act-order, whose g_idx is not k // group; a v1 zero point of 16; no
  groups), it is dequantized to floats at load, with a warning.
Anything else (bitsandbytes, HQQ, MXFP4, compressed-tensors integer packs, ...) is refused with an
error naming the method.

Packing (int32 words, value i of a word in bits 4i .. 4i + 3):
- AWQ: qweight [K, N / 8] and qzeros [K / g, N / 8] pack along N, word c's value i holding
  column 8c + AWQ_ORDER[i]; scales [K / g, N]; w = (q - z) * s.
- GPTQ: qweight [K / 8, N] packs along K (word r's value i is row 8r + i); qzeros [K / g, N / 8]
  along N in plain order; scales [K / g, N]; g_idx [K] each row's group. The v1 format (the default)
  stores z - 1 (read back as (stored & 15) + 1); "gptq_v2" stores z.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import numpy as np

from atlasjax.errors import CheckpointError, UnsupportedModelError

log = logging.getLogger("atlasjax.prequantized")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")
INT_METHODS = ("awq", "gptq")
# tensors a quantized linear carries besides its weight; the activation / KV-cache scales of W8A8
# checkpoints are not used (weights only)
_UNUSED = ("input_scale", "input_scale_ub", "output_scale", "k_scale", "v_scale", "q_scale")


@dataclasses.dataclass(frozen=True)
class Scheme:
    method: str                # "fp8" (any FP8 method), "awq" or "gptq"
    bits: int = 8
    group_size: int = -1       # awq / gptq: along K; -1 per channel
    gptq_v1: bool = True       # GPTQ zero points stored minus one


def scheme_of(config: dict | None, where: str = "checkpoint") -> Scheme | None:
    """The `quantization_config` of a config.json, or None for an unquantized checkpoint.

    Raises UnsupportedModelError for methods or settings the engine cannot read."""
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method in FP8_METHODS:
        if method == "compressed-tensors":
            _check_compressed_tensors(config, where)
        elif method == "fp8" and str(config.get("fmt", "e4m3")).lower() != "e4m3":
            raise UnsupportedModelError(f"{where}: fp8 weights in {config.get('fmt')!r}; supported: e4m3")
        return Scheme("fp8")
    if method in INT_METHODS:
        bits = int(config.get("bits", config.get("w_bit", 4)))
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedModelError(f"{where}: AWQ version {config.get('version')!r}; supported: 'gemm'")
        if bits != 4 and not (method == "gptq" and bits == 8):
            raise UnsupportedModelError(f"{where}: {bits}-bit {method.upper()}; supported: 4-bit AWQ, "
                                        "4- and 8-bit GPTQ")
        v1 = str(config.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
        return Scheme(method, bits, group, v1)
    raise UnsupportedModelError(
        f"{where}: weights saved with quantization method {method or config!r}, which atlasjax cannot "
        f"read; supported: {', '.join(FP8_METHODS + INT_METHODS)} (or load an unquantized checkpoint, "
        "optionally with quantization=...)")


def _check_compressed_tensors(config: dict, where: str) -> None:
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            raise UnsupportedModelError(
                f"{where}: compressed-tensors group {name!r} has {weights.get('num_bits')}-bit "
                f"{weights.get('type')} weights; supported: 8-bit float (FP8)")


def quantized_tensors(scheme: Scheme, tensors: Iterator, as_floats: bool = False) -> Iterator:
    """The checkpoint's (name, reader) pairs with each quantized linear's pieces joined into one
    "<prefix>.weight" reader returning a [K, N] QuantizedWeight (or, with `as_floats`, the
    dequantized [N, K] float32 weight, for quantizing again at load)."""
    from atlasjax.loader import TensorReader  # noqa: PLC0415
    pieces = dict(tensors)
    fp8 = scheme.method == "fp8"
    roots = [n[: -len(".qweight")] for n in pieces if n.endswith(".qweight")] if not fp8 else \
        [n[: -len(".weight")] for n in pieces if n.endswith(".weight")
         and (f"{n[:-len('.weight')]}.weight_scale" in pieces or f"{n[:-len('.weight')]}.weight_scale_inv" in pieces)]
    used, warned = set(), set()
    for root in roots:
        parts = {key: pieces[name] for key in ("weight", "weight_scale", "weight_scale_inv", "qweight", "qzeros",
                                               "scales", "g_idx")
                 if (name := f"{root}.{key}") in pieces}
        used.update(f"{root}.{key}" for key in parts)
        shape = _hf_shape(scheme, parts)
        read = _reader(scheme, root, parts, shape, as_floats, warned)
        yield f"{root}.weight", TensorReader(shape, read, quantized=not as_floats)
    for name, reader in pieces.items():
        if name in used or name.rsplit(".", 1)[-1] in _UNUSED:
            continue
        yield name, reader


def _hf_shape(scheme: Scheme, parts: dict) -> tuple[int, int]:
    """(N, K) of the linear, from its pieces' shapes."""
    if scheme.method == "fp8":
        return tuple(parts["weight"].shape)
    packed = parts["qweight"].shape
    per_word = 32 // scheme.bits
    return (packed[1] * per_word, packed[0]) if scheme.method == "awq" else (packed[1], packed[0] * per_word)


def _reader(scheme, root, parts, shape, as_floats, warned: set):
    def read():
        try:
            arrays = {key: np.asarray(r()) for key, r in parts.items()}
            if scheme.method == "fp8":
                qw = _fp8(arrays, shape)
            else:
                qw = _int(scheme, arrays, shape)
        except (ValueError, KeyError, IndexError) as e:
            raise CheckpointError(f"{root}: cannot read its {scheme.method} weight: {e}") from e
        if isinstance(qw, str):   # why it cannot be kept: once per checkpoint, at its first weight
            if qw not in warned:
                warned.add(qw)
                log.warning("%s weights dequantized to floats at load (%s), starting with %s",
                            scheme.method.upper(), qw, root)
            qw = _int(scheme, arrays, shape, as_floats_because=qw)
        if as_floats or isinstance(qw, np.ndarray):
            from atlasjax.quantization import dequantize  # noqa: PLC0415
            return qw if isinstance(qw, np.ndarray) else np.asarray(dequantize(qw), np.float32).T
        return qw
    return read


def _fp8(arrays: dict, shape: tuple[int, int]):
    """An FP8 weight [N, K] with per-tensor, per-channel or per-block scales, as the fp8 format."""
    from atlasjax.quantization import QuantizedWeight, padded_sizes  # noqa: PLC0415
    n, k = shape
    w = arrays["weight"]
    if str(w.dtype) != "float8_e4m3fn":
        raise ValueError(f"weight dtype {w.dtype}, expected float8_e4m3fn")
    scale = np.asarray(arrays["weight_scale"] if "weight_scale" in arrays else arrays["weight_scale_inv"], np.float32)
    if scale.ndim <= 1 or scale.shape[-1] == 1:    # per tensor / per channel: one group over K
        if scale.size not in (1, n):
            raise ValueError(f"{scale.size} weight scales for {n} output channels")
        group, rows = None, np.broadcast_to(scale.reshape(1, -1), (1, n))
    else:                                          # [ceil(N / bn), ceil(K / bk)] blocks of powers of two
        bn, bk = (1 << int(np.ceil(np.log2(-(-size // blocks)))) for size, blocks in zip((n, k), scale.shape))
        if scale.ndim != 2 or bk < 16 or -(-n // bn) != scale.shape[0] or -(-k // bk) != scale.shape[1]:
            raise ValueError(f"block scales of shape {scale.shape} for a {n} x {k} weight")
        group, rows = bk, np.repeat(scale.T, bn, axis=1)[:, :n]   # [K / bk, N]
    k_pad, n_pad, group = padded_sizes(k, n, group)
    q = np.zeros((n_pad, k_pad), w.dtype)
    q[:n, :k] = w
    scales = np.zeros((k_pad // group, n_pad), np.float32)
    scales[: rows.shape[0], :n] = rows
    import jax.numpy as jnp  # noqa: PLC0415
    return QuantizedWeight(jnp.asarray(q), jnp.asarray(scales), None, "fp8", group, (k, n))


def _unpack(words: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """int32 words -> their 32 / bits unsigned values, interleaved along `axis` (value i of word j
    at position per_word * j + order[i])."""
    per_word = 32 // bits
    u = words.astype(np.uint32)
    values = np.stack([(u >> (bits * i)) & ((1 << bits) - 1) for i in range(per_word)], axis=-1)  # [..., per_word]
    if order is not None:
        values = values[..., np.argsort(order)]
    values = np.moveaxis(values, -1, axis + 1) if axis == 0 else values
    shape = list(words.shape)
    shape[axis] *= per_word
    return values.reshape(shape).astype(np.int16)


def _int(scheme: Scheme, arrays: dict, shape: tuple[int, int], as_floats_because: str | None = None):
    """An AWQ / GPTQ weight as int4 (int8) with integer zero points; when the engine's formats cannot
    hold it, the reason (a str), and with `as_floats_because` the dequantized [N, K] float32 weight."""
    from atlasjax.quantization import QuantizedWeight, padded_sizes, with_mma_order  # noqa: PLC0415
    n, k = shape
    bits = scheme.bits
    awq = scheme.method == "awq"
    order = AWQ_ORDER if awq else None
    q = _unpack(arrays["qweight"], bits, axis=1 if awq else 0, order=order)      # [K, N] 0 .. 2^bits - 1
    scales = arrays["scales"]
    groups = scales.shape[0]
    if "qzeros" in arrays:
        z = _unpack(arrays["qzeros"], bits, axis=1, order=order)[:, :n]           # [G, N]
        if not awq and scheme.gptq_v1:
            z = (z & ((1 << bits) - 1)) + 1
    else:
        z = np.full((groups, n), 1 << (bits - 1), np.int16)
    group = k // groups if k % groups == 0 else 0
    g_idx = arrays.get("g_idx")
    contiguous = group > 0 and (g_idx is None or np.array_equal(np.asarray(g_idx), np.arange(k) // group))
    mid = 1 << (bits - 1)
    fits = (contiguous and group & (group - 1) == 0 and group >= 16 and z.max() < 2 * mid
            and (bits == 4 or np.all(z == mid)))
    if not fits:
        if as_floats_because is None:
            return "groups not contiguous along K" if not contiguous else "outside the engine's formats"
        index = np.asarray(g_idx) if g_idx is not None else np.arange(k) // max(group, 1)
        w = (q - z[index]).astype(np.float32) * scales[index].astype(np.float32)   # [K, N]
        return np.ascontiguousarray(w.T)
    fmt = "int4" if bits == 4 else "int8"
    k_pad, n_pad, group = padded_sizes(k, n, group)
    codes = np.zeros((n_pad, k_pad), np.int8)
    codes[:n, :k] = (q[:, :n] - mid).T
    stored = scales.dtype if scales.dtype in (np.float16, np.float32) else np.float32
    s = np.zeros((k_pad // group, n_pad), stored)
    s[:groups, :n] = scales[:, :n]
    import jax.numpy as jnp  # noqa: PLC0415
    if fmt == "int8":   # symmetric: z = mid everywhere
        return QuantizedWeight(jnp.asarray(codes), jnp.asarray(s), None, "int8", group, (k, n))
    zeros = np.zeros((k_pad // group, n_pad), np.float16)
    zeros[:groups, :n] = z - mid
    return with_mma_order(QuantizedWeight(jnp.asarray(codes.astype(jnp.int4)), jnp.asarray(s), jnp.asarray(zeros),
                                          "int4", group, (k, n), zero_point=True))

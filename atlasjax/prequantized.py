"""Hugging Face checkpoints saved quantized, read into the engine's formats without re-quantizing.

config.json's `quantization_config` names the method (`scheme_of`):
- FP8 weights, kept as the "fp8" format (W8A16 unless the engine asks for fp8 activations,
  `activation_quantization="fp8"`, which per-channel FP8 takes; the checkpoint's own activation
  scales are unused, and a checkpoint made for fp8 activations gets a log line saying so; int8
  W8A8 checkpoints alike, with `activation_quantization="int8"`):
  - "compressed-tensors" with 8-bit float weights (llm-compressor's FP8 / FP8-Dynamic models):
    `weight_scale` per channel ([N, 1]), per tensor ([1]) or per block ([N / bn, K / bk]);
  - "fbgemm_fp8": `weight_scale` per channel;
  - "fp8" (transformers' FineGrainedFP8: Qwen3-*-FP8, DeepSeek): `weight_scale_inv`, one per
    `weight_block_size` block (it multiplies, despite the name); without a block size, AutoFP8's
    per-tensor `weight_scale`.
  Per-tensor scales become per-channel ones; a block's scale becomes the scale of its columns in
  each group of bk rows along K. Exact.
- "awq" (GEMM packing), "gptq" (4 bits; 8 bits when symmetric) and "compressed-tensors" with 4- or
  8-bit int weights (llm-compressor's W4A16 / W8A16 / W8A8 int models, packed or not): int4 (int8)
  with the checkpoint's groups along K (per channel for symmetric int8), scales and whole-number
  zero points. Exact. Where the engine's contiguous groups
  cannot hold a weight (GPTQ act-order, whose g_idx is not k // group; a v1 zero point of 16; no
  groups), it is dequantized to floats at load, with a warning.
- "compressed-tensors" with no weight groups, only a `kv_cache_scheme` (the KV cache calibrated, the
  weights left as they were): an unquantized checkpoint; atlasjax/kv_scales.py reads its scales.
Anything else (bitsandbytes, HQQ, MXFP4 or NVFP4, 2- and 3-bit GPTQ, ...) is refused with an error
naming the method.

Packing (int32 words, value i of a word in bits 4i .. 4i + 3):
- AWQ: qweight [K, N / 8] and qzeros [K / g, N / 8] pack along N, word c's value i holding
  column 8c + AWQ_ORDER[i]; scales [K / g, N]; w = (q - z) * s.
- GPTQ: qweight [K / 8, N] packs along K (word r's value i is row 8r + i); qzeros [K / g, N / 8]
  along N in plain order; scales [K / g, N]; g_idx [K] each row's group. The v1 format (the default)
  stores z - 1 (read back as (stored & 15) + 1); "gptq_v2" stores z.
- compressed-tensors "pack-quantized": weight_packed [N, K / 8] packs along K in plain order the
  signed values plus 2^(bits-1); weight_zero_point (asymmetric) [N / 8, K / g] packs along N the
  same way; weight_scale [N, K / g] ([N, 1] per channel); w = (q - z) * s. "int-quantized" /
  "naive-quantized" store int8 values as `weight`.
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
# tensors a quantized linear carries besides its weight; the activation scales of W8A8 checkpoints are
# not used (weights only). KV-cache scales are taken out of the stream before (atlasjax/kv_scales.py).
_PIECES = ("weight", "weight_scale", "weight_scale_inv", "weight_packed", "weight_zero_point", "weight_g_idx",
           "weight_shape", "qweight", "qzeros", "scales", "g_idx")
_UNUSED = ("input_scale", "input_scale_ub", "output_scale", "k_scale", "v_scale", "q_scale")


@dataclasses.dataclass(frozen=True)
class Scheme:
    method: str                # "fp8" (any FP8 method), "awq", "gptq" or "compressed-tensors" (int)
    bits: int = 8
    gptq_v1: bool = True       # GPTQ zero points stored minus one


def scheme_of(config: dict | None, where: str = "checkpoint") -> Scheme | None:
    """The `quantization_config` of a config.json, or None for an unquantized checkpoint.

    Raises UnsupportedModelError for methods or settings the engine cannot read."""
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(config, where)
    if method in FP8_METHODS:
        if method == "fp8" and str(config.get("fmt", "e4m3")).lower() != "e4m3":
            raise UnsupportedModelError(f"{where}: fp8 weights in {config.get('fmt')!r}; supported: e4m3")
        # fbgemm's FP8 is per channel with dynamic per-row activations; FineGrainedFP8 is in blocks,
        # per channel only without a block size (AutoFP8)
        _w8a8_hint(where, "fp8", per_channel=method == "fbgemm_fp8" or not config.get("weight_block_size"))
        return Scheme("fp8")
    if method in INT_METHODS:
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedModelError(f"{where}: AWQ version {config.get('version')!r}; supported: 'gemm'")
        if bits != 4 and not (method == "gptq" and bits == 8):
            raise UnsupportedModelError(f"{where}: {bits}-bit {method.upper()}; supported: 4-bit AWQ, "
                                        "4- and 8-bit GPTQ")
        v1 = str(config.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
        return Scheme(method, bits, v1)
    raise UnsupportedModelError(
        f"{where}: weights saved with quantization method {method or config!r}, which atlasjax cannot "
        f"read; supported: {', '.join(FP8_METHODS + INT_METHODS)} (or load an unquantized checkpoint, "
        "optionally with quantization=...)")


def _w8a8_hint(where: str, fmt: str, per_channel: bool) -> None:
    """The checkpoint was made to multiply `fmt` ("fp8" / "int8") activations (W8A8); say how the
    engine runs it."""
    if per_channel:
        log.info("%s: made for %s activations (W8A8); it runs with bf16 activations (W8A16) unless "
                 "activation_quantization='%s' (--activation-quantization %s) is set", where, fmt, fmt, fmt)
    else:
        log.info("%s: made for %s activations (W8A8); its %s weights in groups or blocks run with bf16 "
                 "activations (W8A16): %s activations take weights with one scale per channel only",
                 where, fmt, fmt.upper(), fmt)


def _compressed_tensors(config: dict, where: str) -> Scheme | None:
    """llm-compressor's format: FP8 weights, or int4 / int8 ones (packed, or int8 as they are); None
    for a model whose weights it left unquantized, only calibrating its KV cache (`kv_cache_scheme`)."""
    groups = list((config.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not weights and config.get("kv_cache_scheme"):
        return None
    kinds = {(w.get("type"), int(w.get("num_bits", 0))) for w in weights}
    if len(kinds) != 1:
        raise UnsupportedModelError(f"{where}: compressed-tensors with {len(kinds)} kinds of weights "
                                    f"{sorted(kinds)}; supported: one kind")
    kind, bits = kinds.pop()
    per_channel = all(w.get("strategy") in ("channel", "tensor") and (kind == "float" or w.get("symmetric", True))
                      for w in weights)   # int weights with zero points are not read per channel
    if any((g.get("input_activations") or {}).get("type") == kind for g in groups) and bits == 8:
        _w8a8_hint(where, "fp8" if kind == "float" else "int8", per_channel)
    if (kind, bits) == ("float", 8):
        return Scheme("fp8")
    if kind == "int" and bits in (4, 8):
        return Scheme("compressed-tensors", bits)
    raise UnsupportedModelError(f"{where}: compressed-tensors with {bits}-bit {kind} weights; supported: "
                                "8-bit float (FP8), 4- and 8-bit int")


def quantized_tensors(scheme: Scheme, tensors: Iterator, as_floats: bool = False) -> Iterator:
    """The checkpoint's (name, reader) pairs with each quantized linear's pieces joined into one
    "<prefix>.weight" reader returning a [K, N] QuantizedWeight (or, with `as_floats`, the
    dequantized [N, K] float32 weight, for quantizing again at load)."""
    from atlasjax.loader import TensorReader  # noqa: PLC0415
    pieces = dict(tensors)
    roots = []
    for name in pieces:
        root, _, key = name.rpartition(".")
        if key in ("qweight", "weight_packed") or (
                key == "weight" and (f"{root}.weight_scale" in pieces or f"{root}.weight_scale_inv" in pieces)):
            roots.append(root)
    used, warned = set(), set()
    for root in roots:
        parts = {key: pieces[name] for key in _PIECES if (name := f"{root}.{key}") in pieces}
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
    if "weight" in parts:
        return tuple(parts["weight"].shape)
    if "weight_packed" in parts:   # [N, K * bits / 32]
        rows, words = parts["weight_packed"].shape
        return rows, words * 32 // scheme.bits
    packed = parts["qweight"].shape
    per_word = 32 // scheme.bits
    return (packed[1] * per_word, packed[0]) if scheme.method == "awq" else (packed[1], packed[0] * per_word)


def _reader(scheme, root, parts, shape, as_floats, warned: set):
    def read():
        try:
            arrays = {key: np.asarray(r()) for key, r in parts.items()}
            qw, why = (_fp8(arrays, shape), None) if scheme.method == "fp8" else _int(scheme, arrays, shape)
        except (ValueError, KeyError, IndexError) as e:
            raise CheckpointError(f"{root}: cannot read its {scheme.method} weight: {e}") from e
        if why is not None and why not in warned:   # read as floats: said once per checkpoint and reason
            warned.add(why)
            log.warning("%s weights dequantized to floats at load (%s), starting with %s",
                        scheme.method.upper(), why, root)
        if as_floats or isinstance(qw, np.ndarray):
            from atlasjax.quantization import dequantize  # noqa: PLC0415
            return qw if isinstance(qw, np.ndarray) else np.asarray(dequantize(qw), np.float32).T
        return qw
    return read


def _fp8(arrays: dict, shape: tuple[int, int]):
    """An FP8 weight [N, K] with per-tensor, per-channel or per-block scales, as the fp8 format."""
    from atlasjax.quantization import from_codes  # noqa: PLC0415
    n, k = shape
    w = arrays["weight"]
    if str(w.dtype) != "float8_e4m3fn":
        raise ValueError(f"weight dtype {w.dtype}, expected float8_e4m3fn")
    scale = np.asarray(arrays["weight_scale"] if "weight_scale" in arrays else arrays["weight_scale_inv"], np.float32)
    if scale.size == 1 or scale.shape in ((n,), (n, 1)):   # per tensor / per channel: one group over K
        group, rows = None, np.broadcast_to(scale.reshape(1, -1), (1, n))
    else:                                          # [ceil(N / bn), ceil(K / bk)] blocks of powers of two
        bn, bk = (1 << int(np.ceil(np.log2(-(-size // blocks)))) for size, blocks in zip((n, k), scale.shape))
        if scale.ndim != 2 or bk < 16 or -(-n // bn) != scale.shape[0] or -(-k // bk) != scale.shape[1]:
            raise ValueError(f"block scales of shape {scale.shape} for a {n} x {k} weight")
        group, rows = bk, np.repeat(scale.T, bn, axis=1)[:, :n]   # [K / bk, N]
    return from_codes(w, rows, format="fp8", group_size=group)


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


def _int(scheme: Scheme, arrays: dict, shape: tuple[int, int]):
    """An integer weight (AWQ, GPTQ, compressed-tensors int): (int4 / int8 QuantizedWeight with integer
    zero points, None), or, where the engine's formats cannot hold it, (the dequantized [N, K]
    float32 weight, why)."""
    from atlasjax.quantization import from_codes  # noqa: PLC0415
    n, k = shape
    bits, mid = scheme.bits, 1 << (scheme.bits - 1)
    if scheme.method == "compressed-tensors":   # signed values stored with + mid; [N, ...] layouts
        q = (_unpack(arrays["weight_packed"], bits, axis=1)[:, :k] if "weight_packed" in arrays
             else arrays["weight"].astype(np.int16) + mid).T                       # [K, N]
        scales = np.asarray(arrays["weight_scale"]).reshape(n, -1).T                # [G, N]
        z = (_unpack(arrays["weight_zero_point"], bits, axis=0)[:n].T if "weight_zero_point" in arrays
             else np.full(scales.shape, mid, np.int16))
        g_idx = arrays.get("weight_g_idx")
    else:
        awq = scheme.method == "awq"
        order = AWQ_ORDER if awq else None
        q = _unpack(arrays["qweight"], bits, axis=1 if awq else 0, order=order)   # [K, N] 0 .. 2^bits - 1
        scales = arrays["scales"]
        if "qzeros" in arrays:
            z = _unpack(arrays["qzeros"], bits, axis=1, order=order)[:, :n]       # [G, N]
            if not awq and scheme.gptq_v1:
                z = (z & ((1 << bits) - 1)) + 1
        else:
            z = np.full(scales.shape, mid, np.int16)
        g_idx = arrays.get("g_idx")
    q = q[:, :n]
    groups = scales.shape[0]
    group = k // groups if k % groups == 0 else 0
    contiguous = group > 0 and (g_idx is None or np.array_equal(np.asarray(g_idx), np.arange(k) // group))
    symmetric = bool(np.all(z == mid))
    per_channel = groups == 1 and bits == 8 and symmetric
    fits = contiguous and z.max() < 2 * mid and (bits == 4 or symmetric) and (
        per_channel or (group & (group - 1) == 0 and group >= 16))
    if not fits:
        index = np.asarray(g_idx) if g_idx is not None else np.arange(k) // max(group, 1)
        w = (q - z[index]).astype(np.float32) * scales[index].astype(np.float32)   # [K, N]
        return np.ascontiguousarray(w.T), ("groups not contiguous along K" if not contiguous
                                            else "outside the engine's formats")
    qw = from_codes((q - mid).T.astype(np.int8), scales, None if symmetric else z - mid,
                    format="int4" if bits == 4 else "int8", group_size=None if per_channel else group,
                    zero_point=not symmetric)
    return qw, None

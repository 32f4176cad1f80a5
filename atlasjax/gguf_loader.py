"""Read a GGUF checkpoint (llama.cpp's format) into Hugging Face terms, lazily.

`load_gguf(path)` memory-maps the file once and returns a `GGUFModel`:
  - `config`: a Hugging Face config.json-style dict built from the `{arch}.*` metadata;
  - `tensors`: HF parameter name -> `GGUFTensor`, a zero-copy view of the quantized bytes that
    dequantizes to float32 in the HF shape on demand (`gguf.quants` does the block math);
  - `tokenizer`, `chat_template`, `special_tokens`: built from `tokenizer.*` metadata by
    `atlasjax.gguf_tokenizer`.

Data flow: file -> `_parse_header` (our own small reader; it reports truncation and corruption as
`CheckpointError` naming what is wrong, and is much faster than `gguf.GGUFReader` on 150k-entry
vocabularies) -> metadata dict + tensor table -> `_hf_config` + `_hf_tensors`.

Layout facts the conversion relies on:
  - GGUF lists dims fastest-first (ne[0] is the row length), so the HF shape is the reverse.
  - llama.cpp's HF->GGUF converter permutes the rows of q_proj / k_proj (weights and biases) of
    `llama` models, per head, from HF's "rotate_half" layout to interleaved pairs. `GGUFTensor`
    records the head count and `dequantize()` undoes it. qwen2/qwen3 files are not permuted.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from typing import Any

import gguf
import numpy as np
import tokenizers

from atlasjax.errors import CheckpointError, UnsupportedModelError
from atlasjax.gguf_tokenizer import build_tokenizer

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_Q = gguf.GGMLQuantizationType


@dataclasses.dataclass
class GGUFTensor:
    """One checkpoint tensor, still in the file's encoding."""
    name: str                     # Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]        # HF shape, e.g. (out_features, in_features)
    raw: np.ndarray               # read-only view of the file: float32/float16 elements, or uint8 blocks
    permute_heads: int | None     # q/k of llama files: heads whose llama.cpp row permutation to undo

    def dequantize(self) -> np.ndarray:
        """Returns the float32 tensor in `shape`, permutation undone (read-only for unpermuted F32)."""
        out = np.asarray(gguf.quants.dequantize(self.raw, self.qtype), dtype=np.float32)
        out = out.reshape(self.shape)
        if self.permute_heads is not None:
            out = unpermute_heads(out, self.permute_heads)
        return out


@dataclasses.dataclass
class GGUFModel:
    config: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    tokenizer: tokenizers.Tokenizer
    chat_template: str | None
    special_tokens: dict[str, Any]


def unpermute_heads(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's per-head q/k row permutation (interleaved pairs -> rotate_half halves).

    Args:
      w: [rows, cols] weight or [rows] bias, rows = num_heads * head_dim.
    Returns: the same shape, rows reordered.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike) -> GGUFModel:
    """Opens a GGUF file lazily: metadata and tokenizer now, tensor data when dequantized.

    Raises:
      CheckpointError: not a GGUF file, truncated or corrupt, or missing/unexpected/mis-shaped tensors.
      UnsupportedModelError: an architecture, tensor encoding or tokenizer atlasjax cannot run.
    """
    path = os.fspath(path)
    meta, table = _parse_header(path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    config = _hf_config(path, meta, table)
    tensors = _hf_tensors(path, config, table)
    try:
        tokenizer, chat_template, special = build_tokenizer(meta)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from None
    config["bos_token_id"] = special["bos_token_id"]
    eos_ids = special["eos_token_ids"]
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    config["pad_token_id"] = special["pad_token_id"]
    return GGUFModel(config, tensors, tokenizer, chat_template, special)


# ---------------------------------------------------------------------------------------------
# Header parsing: magic, version, metadata key/values, tensor infos, then aligned tensor data.

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_ELEMENT_DTYPES = {_Q.F32: np.float32, _Q.F16: np.float16, _Q.F64: np.float64, _Q.I8: np.int8,
                   _Q.I16: np.int16, _Q.I32: np.int32, _Q.I64: np.int64}


class _Cursor:
    """Little-endian reads from the mapped file that fail as CheckpointError, not struct.error."""

    def __init__(self, path: str, buf: memoryview):
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise CheckpointError(f"{self.path}: file ends inside {what} (offset {start}, "
                                  f"file size {len(self.buf)} bytes): truncated or corrupt GGUF")
        self.pos += n
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = "<" + _SCALAR_FORMATS[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        start = self.take(n, what)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype in _SCALAR_FORMATS:
            return self.scalar(vtype, what)
        if vtype != _ARRAY:
            raise CheckpointError(f"{self.path}: {what} has unknown GGUF value type {vtype}: corrupt file")
        item_type, count = self.scalar(4, what), self.scalar(10, what)
        if item_type in _NUMPY_TYPES:  # numeric arrays stay zero-copy numpy views
            dtype = np.dtype(_NUMPY_TYPES[item_type]).newbyteorder("<")
            start = self.take(count * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype, count, start)
        return [self.value(item_type, f"{what}[{i}]") for i in range(count)]


def _parse_header(path: str) -> tuple[dict[str, Any], dict[str, tuple[_Q, tuple[int, ...], np.ndarray]]]:
    """Returns (metadata, {gguf tensor name: (qtype, ne dims fastest-first, raw view)})."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except ValueError as e:  # numpy refuses to map an empty file
        raise CheckpointError(f"{path}: not a GGUF file ({e})") from None
    cur = _Cursor(path, memoryview(data))
    if len(data) < 8 or bytes(data[:4]) != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it does not start with the magic bytes b'GGUF')")
    cur.pos = 4
    version = cur.scalar(4, "the version")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                              "a big-endian file also reads as a huge version)")
    num_tensors, num_kv = cur.scalar(10, "the tensor count"), cur.scalar(10, "the metadata count")
    meta: dict[str, Any] = {}
    for i in range(num_kv):
        key = cur.string(f"metadata key #{i}")
        meta[key] = cur.value(cur.scalar(4, f"the type of metadata {key!r}"), f"metadata {key!r}")
    infos = []
    for i in range(num_tensors):
        name = cur.string(f"tensor info #{i}")
        n_dims = cur.scalar(4, f"tensor info {name!r}")
        if n_dims > 4:
            raise CheckpointError(f"{path}: tensor {name!r} claims {n_dims} dims (GGUF allows 4): corrupt file")
        dims = tuple(cur.scalar(10, f"tensor info {name!r}") for _ in range(n_dims))
        raw_type, offset = cur.scalar(4, f"tensor info {name!r}"), cur.scalar(10, f"tensor info {name!r}")
        infos.append((name, dims, raw_type, offset))
    alignment = int(meta.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment {alignment} is not a power of two: corrupt file")
    data_start = -(-cur.pos // alignment) * alignment
    table = {}
    for name, dims, raw_type, offset in infos:
        table[name] = _tensor_view(path, data, name, dims, raw_type, data_start + offset)
    return meta, table


def _tensor_view(path: str, data: np.ndarray, name: str, dims: tuple[int, ...], raw_type: int,
                 start: int) -> tuple[_Q, tuple[int, ...], np.ndarray]:
    try:
        qtype = _Q(raw_type)
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown GGML type id {raw_type}") from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if dims and dims[0] % block_size:
        raise CheckpointError(f"{path}: tensor {name!r} row length {dims[0]} is not a multiple of the "
                              f"{qtype.name} block size {block_size}: corrupt file")
    nbytes = math.prod(dims) // block_size * type_size
    if start + nbytes > len(data):
        raise CheckpointError(
            f"{path}: tensor {name!r} ({qtype.name}, {nbytes} bytes at offset {start}) extends past the "
            f"end of the file ({len(data)} bytes): the file is truncated")
    np_shape = tuple(reversed(dims))
    if qtype in _ELEMENT_DTYPES:
        raw = data[start:start + nbytes].view(_ELEMENT_DTYPES[qtype]).reshape(np_shape)
    else:  # block-quantized (and BF16): bytes, one row of blocks per HF row, as gguf.GGUFReader lays them
        raw = data[start:start + nbytes].reshape(gguf.quant_shape_to_byte_shape(np_shape, qtype))
    return qtype, dims, raw


# ---------------------------------------------------------------------------------------------
# Metadata -> Hugging Face config dict.

_TORCH_DTYPES = {gguf.LlamaFileType.ALL_F32: "float32", gguf.LlamaFileType.MOSTLY_F16: "float16"}
_REQUIRED = object()


def _hf_config(path: str, meta: dict[str, Any], table: dict) -> dict[str, Any]:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = _REQUIRED) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is _REQUIRED:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: attention value_length != key_length is not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: partial rotary embeddings (rope.dimension_count "
                                    f"{get('rope.dimension_count')} < head_dim {head_dim}) are not supported")
    if "token_embd.weight" not in table:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
    theta = float(get("rope.freq_base", 10000.0))
    return {
        "model_type": arch,
        "architectures": [_HF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(path, arch, meta, table, theta, head_dim),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(table["token_embd.weight"][1][1]),
        "tie_word_embeddings": "output.weight" not in table,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in table,
        "torch_dtype": _TORCH_DTYPES.get(meta.get("general.file_type"), "bfloat16"),
    }


def _rope_scaling(path: str, arch: str, meta: dict, table: dict, theta: float, head_dim: int) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
                int(meta.get(f"{arch}.rope.scaling.original_context_length", 0)) or None}
    if kind not in ("none", "") and kind is not None:
        raise UnsupportedModelError(f"{path}: rope scaling type {kind!r} is not supported")
    if "rope_freqs.weight" not in table:
        return None
    # llama3 files store the per-frequency divisors instead of the HF parameters: recover them.
    qtype, _, raw = table["rope_freqs.weight"]
    divisors = np.asarray(gguf.quants.dequantize(raw, qtype), np.float64).reshape(-1)
    return _llama3_params_from_divisors(path, divisors, theta, head_dim)


def _llama3_divisors(params: dict, theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisor HF's llama3 rope applies (what llama.cpp stores as rope_freqs)."""
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    old, low, high = params["original_max_position_embeddings"], params["low_freq_factor"], params["high_freq_factor"]
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / params["factor"] + smooth)


def _llama3_params_from_divisors(path: str, divisors: np.ndarray, theta: float, head_dim: int) -> dict:
    # Between the two cut-offs, smooth = (factor/d - 1)/(factor - 1) = old/(high-low)/wavelen - low/(high-low):
    # a line in 1/wavelen. Every Llama 3.x uses low_freq_factor = 1, which pins the third unknown.
    factor = float(divisors.max())
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    inv_wavelen = 1 / (2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim))
    mid = (divisors > 1 + 1e-4) & (divisors < factor - 1e-4)
    if factor > 1 and mid.sum() >= 2:
        slope, intercept = np.polyfit(inv_wavelen[mid], (factor / divisors[mid] - 1) / (factor - 1), 1)
        if intercept < 0:
            high = round(float(1 - 1 / intercept), 4)
            params.update(high_freq_factor=high, original_max_position_embeddings=int(round(slope * (high - 1))))
    if len(divisors) != head_dim // 2 or not np.allclose(_llama3_divisors(params, theta, head_dim), divisors,
                                                         rtol=1e-3):
        raise UnsupportedModelError(f"{path}: rope_freqs does not match a llama3 rope scaling")
    return params


# ---------------------------------------------------------------------------------------------
# Tensor table -> HF names, with shape checks.

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_IGNORED = {"rope_freqs.weight"}  # folded into config["rope_scaling"]


def hf_tensor_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name ("blk.3.ffn_up.weight" -> "model.layers.3.mlp.up_proj.weight")."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint with this config must hold."""
    d, f, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
        if config["attention_bias"]:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


def _hf_tensors(path: str, config: dict[str, Any], table: dict) -> dict[str, GGUFTensor]:
    expected = expected_shapes(config)
    permuted = config["model_type"] == "llama"
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors, unknown = {}, []
    for gguf_name, (qtype, dims, raw) in table.items():
        name = hf_tensor_name(gguf_name)
        if name is None or name not in expected:
            if gguf_name not in _IGNORED:
                unknown.append(gguf_name)
            continue
        shape = tuple(reversed(dims))
        if shape != expected[name]:
            raise CheckpointError(f"{path}: tensor {gguf_name!r} ({name}) has shape {shape}, "
                                  f"expected {expected[name]} from the metadata")
        proj = name.split(".")[-2]
        tensors[name] = GGUFTensor(name, qtype, shape, raw, heads.get(proj) if permuted else None)
    if unknown:
        raise CheckpointError(f"{path}: unexpected tensors for a {config['model_type']} model: "
                              f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise CheckpointError(f"{path}: missing tensors: {', '.join(missing[:8])}"
                              f"{' ...' if len(missing) > 8 else ''}")
    for qtype in {t.qtype for t in tensors.values()}:
        _check_dequantizable(path, qtype)
    return tensors


def _check_dequantizable(path: str, qtype: _Q) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    probe = np.zeros((1, block_size if qtype in _ELEMENT_DTYPES else type_size),
                     _ELEMENT_DTYPES.get(qtype, np.uint8))
    try:
        gguf.quants.dequantize(probe, qtype)
    except NotImplementedError:
        raise UnsupportedModelError(f"{path}: tensors of GGML type {qtype.name} cannot be dequantized") from None

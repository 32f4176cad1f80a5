"""Checkpoint loading: HF safetensors directories and GGUF files -> (ModelConfig, params).

Tensors are read one at a time (safetensors memory-maps; GGUF is memory-mapped by the gguf
package), checked against the model's expected param shapes, cast to the engine dtype (or
quantized) and placed in the param tree. Any missing, unexpected or mis-shaped tensor, or a
truncated file, raises CheckpointError naming it.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging
import os
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.config import ModelConfig, from_hf_config
from atlasjax.errors import CheckpointError, UnsupportedModelError
from models import get_family
from models.layers import is_quantized
from models.transformer import abstract_params
from pallas_kernels.quant_format import ARRAY_FIELDS, n_axis

log = logging.getLogger("atlasjax.loader")

# (hf_name, reader): reader() returns the tensor (numpy/jax array in HF layout, or a QuantizedWeight).
# A `TensorReader` also tells its shape and can read slices, which sharded loading uses.
NamedTensor = tuple[str, Callable[[], np.ndarray]]


class TensorReader:
    """A checkpoint tensor not read yet: `shape` (HF layout), `reader()`, and optionally
    `read_range(axis, start, stop)` reading only a slice. `quantized`: reader() gives a QuantizedWeight."""

    def __init__(self, shape, read, read_range=None, quantized: bool = False):
        self.shape = tuple(shape)
        self._read = read
        if read_range is not None:
            self.read_range = read_range
        self.quantized = quantized

    def __call__(self):
        return self._read()


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: object | None      # atlasjax.tokenizer.Tokenizer, or None if the checkpoint has none
    source: str
    plan: object | None = None    # atlasjax.sharding.TensorParallel when the params are sharded over a mesh
    generation: object | None = None   # atlasjax.generation_config.GenerationDefaults (None: not resolved yet)
    classifier: object | None = None   # atlasjax.pooling.ClassifierHead of a *ForSequenceClassification checkpoint
    pooling_model: bool = False        # the checkpoint has no LM head (a base model, a classifier): runner auto pools


def model_format(path: str) -> str:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return "hf"
        if os.path.exists(os.path.join(path, "atlasjax_checkpoint.json")):
            return "orbax"
        raise CheckpointError(f"{path} is a directory without config.json (not a Hugging Face model directory)")
    if os.path.exists(path):
        raise UnsupportedModelError(f"{path}: unsupported model file (expected a .gguf file or an HF directory)")
    raise CheckpointError(f"model path {path!r} does not exist")


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
        for f in files:
            if not os.path.exists(f):
                raise CheckpointError(f"shard {os.path.basename(f)} listed in {index} is missing")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


# safetensors' numpy reader has no float8 dtypes: these are read from the mapped file directly
_RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# On a GPU the float tensors are read so too: each goes to the device straight from the page cache, where
# safetensors' get_tensor first copies it on one thread (~1.5 GB/s on an H200's host: 10.8 of an 8B's 16.7 s).
# Not on the CPU backend, whose arrays may share the file's memory, which the file's next writer would change.
_VIEW_DTYPES = {**_RAW_DTYPES, "BF16": "bfloat16", "F16": "float16", "F32": "float32"}
MAP_FILE_VIEWS: bool | None = None   # None: on a GPU


@functools.lru_cache(maxsize=16)
def _safetensors_header(path: str, version: tuple[int, int]) -> tuple[int, dict]:
    """(byte offset of the data, the header's tensor table) of a safetensors file, read once per
    version (its mtime and size: a file written again is read again)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def _read_raw(path: str, name: str) -> np.ndarray:
    """One tensor of a float8 dtype, viewed from the memory-mapped file (the header says where)."""
    import ml_dtypes  # noqa: PLC0415 (a jax dependency)
    stat = os.stat(path)
    base, table = _safetensors_header(path, (stat.st_mtime_ns, stat.st_size))
    info = table[name]
    start, stop = info["data_offsets"]
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=base + start, shape=(stop - start,))
    kind = _VIEW_DTYPES[info["dtype"]]
    return data.view(getattr(ml_dtypes, kind, None) or np.dtype(kind)).reshape(info["shape"])


def iter_safetensors(model_dir: str) -> Iterator[NamedTensor]:
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415
    viewed = _RAW_DTYPES
    if MAP_FILE_VIEWS or (MAP_FILE_VIEWS is None and jax.default_backend() == "gpu"):
        viewed = _VIEW_DTYPES
    for path in _safetensors_files(model_dir):
        try:
            handle = safe_open(path, framework="numpy")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path}: {e} (truncated or corrupt file?)") from e

        def read(name, index=None, handle=handle, path=path, viewed=viewed):
            try:
                if handle.get_slice(name).get_dtype() in viewed:
                    whole = _read_raw(path, name)
                    return whole if index is None else whole[index]
                if index is None:
                    return handle.get_tensor(name)
                return handle.get_slice(name)[index]
            except (SafetensorError, OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from e

        def read_range(axis, start, stop, name, r=read):
            return r(name, (slice(None),) * axis + (slice(start, stop),))
        for name in names:
            try:
                shape = handle.get_slice(name).get_shape()
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from e
            yield name, TensorReader(shape, lambda n=name, r=read: r(n),
                                     lambda a, b, c, n=name: read_range(a, b, c, n))


def assemble_params(cfg: ModelConfig, tensors: Iterator[NamedTensor], dtype,
                    convert: Callable | None = None, plan=None) -> dict:
    """Place checkpoint tensors into the model's param tree, validating names and shapes.

    convert(path, array) may replace the default cast (used for quantization at load).
    plan (atlasjax.sharding.TensorParallel): place each tensor sharded over the mesh instead, each
    device receiving only its slice (read as a slice where the reader can).
    """
    family = get_family(cfg.family)
    expected = nn.unbox(abstract_params(cfg, dtype))
    flat_expected = {path: leaf for path, leaf in _flatten(expected)}
    if plan is not None:
        from atlasjax.sharding import logical_axes  # noqa: PLC0415
        logical = dict(_flatten(logical_axes(cfg, dtype)))
    params: dict = {}
    loaded: set = set()
    for name, read in tensors:
        mapped = family.param_path(name)
        if mapped is None:
            if family.is_ignored(name):
                continue
            raise CheckpointError(f"unexpected tensor {name!r} in checkpoint for a {cfg.family} model")
        path, transpose = mapped
        if path not in flat_expected:
            if path == ("lm_head", "kernel") and cfg.tie_word_embeddings:
                continue  # tied checkpoints sometimes store the head too
            raise CheckpointError(f"unexpected tensor {name!r} (no such parameter {'/'.join(path)} in this config)")
        want = flat_expected[path].shape
        if (plan is not None and convert is None and hasattr(read, "shape")
                and not getattr(read, "quantized", False)):
            _check_shape(name, read.shape, want, transpose)
            _set(params, path, plan.place_array(logical[path], read, transpose, dtype))
            loaded.add(path)
            continue
        value = _materialize(name, read(), want, transpose, dtype, path, convert)
        if plan is not None:
            value = (plan.place_quantized(value, logical[path]) if is_quantized(value)
                     else plan.place_array(logical[path], TensorReader(value.shape, lambda v=value: v), False, dtype))
        _set(params, path, value)
        loaded.add(path)
    missing = [p for p in flat_expected if p not in loaded]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. "
                              + ", ".join("/".join(p) for p in missing[:5]))
    return params


def _check_shape(name, shape, want, transpose) -> None:
    got = tuple(shape[::-1]) if transpose else tuple(shape)
    if got != tuple(want):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(shape)}, expected "
                              f"{tuple(want[::-1]) if transpose else tuple(want)}")


def _materialize(name, array, want, transpose, dtype, path, convert):
    """One tensor read whole: checked, transposed to [in, out], cast (or converted, e.g. quantized)."""
    if is_quantized(array):       # already a [K, N] QuantizedWeight (GGUF blocks kept as they are)
        if tuple(array.shape) != want:
            raise CheckpointError(f"tensor {name!r} has logical shape {array.shape}, expected {want}")
        return array
    _check_shape(name, array.shape, want, transpose)
    array = jnp.asarray(array)
    if transpose:
        array = array.T
    value = convert(path, array) if convert else None
    return array.astype(dtype) if value is None else value


def _plan_for(cfg: ModelConfig, mesh):
    if mesh is None:
        return None
    from atlasjax.sharding import TensorParallel  # noqa: PLC0415
    return TensorParallel(mesh, cfg)


def load_hf(model_dir: str, dtype, convert=None, mesh=None, kv_cache_fp8: bool = False,
            heads: dict | None = None) -> tuple[ModelConfig, dict]:
    """kv_cache_fp8: the engine's KV cache is fp8, so the checkpoint's KV-cache scales, if any, are
    folded into the attention weights (atlasjax/kv_scales.py); otherwise they are dropped unused.
    heads: receives a sequence classifier's head (`classifier_head`) under "classifier"."""
    from atlasjax import prequantized  # noqa: PLC0415
    from atlasjax.kv_scales import fold_kv_scales  # noqa: PLC0415
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    cfg = from_hf_config(hf_config)
    found: dict = {}
    tensors = fold_kv_scales(as_causal_lm(iter_safetensors(model_dir), cfg, found), cfg, kv_cache_fp8)
    scheme = prequantized.scheme_of(hf_config.get("quantization_config"), model_dir)
    if scheme is not None:   # saved quantized: weights as QuantizedWeight (floats when re-quantizing)
        tensors = prequantized.quantized_tensors(scheme, tensors, as_floats=convert is not None)
    params = assemble_params(cfg, tensors, dtype, convert, _plan_for(cfg, mesh))
    if heads is not None:
        heads["pooling_model"] = found.get("no_lm_head", False)
        if "score" in found:
            heads["classifier"] = classifier_head(found["score"], hf_config, cfg)
    return cfg, params


def classifier_head(reader, hf_config: dict, cfg: ModelConfig):
    """A `score.weight` [num_labels, hidden] as a ClassifierHead (float32, host memory), labels from id2label."""
    from atlasjax.pooling import ClassifierHead  # noqa: PLC0415
    weight = np.asarray(reader(), np.float32)
    if weight.ndim != 2 or weight.shape[1] != cfg.hidden_size:
        raise CheckpointError(f"tensor 'score.weight' has shape {weight.shape}, expected [num_labels, "
                              f"{cfg.hidden_size}]")
    names = hf_config.get("id2label") or {}
    labels = tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(weight.shape[0]))
    return ClassifierHead(weight, labels)


_BASE_MODEL_NAMES = ("layers.", "embed_tokens.", "norm.")


def as_causal_lm(tensors: Iterator[NamedTensor], cfg: ModelConfig, heads: dict | None = None
                 ) -> Iterator[NamedTensor]:
    """A checkpoint read as the causal LM's names. A base model (saved from Qwen3Model or LlamaModel, as
    embedding models such as Qwen3-Embedding ship: `layers.0...`, `embed_tokens.weight`, no `model.` prefix)
    gets the prefix; a sequence classifier's `score.weight` (`*ForSequenceClassification`: reward models) goes
    to `heads["score"]` instead of the param tree. Neither has an LM head: an untied one is taken from the
    embedding table (with a warning: embeddings and classification never use it, generation means little)."""
    renamed, embed, head, score = False, None, False, False
    if heads is not None:
        heads["no_lm_head"] = False
    for name, reader in tensors:
        if name.startswith(_BASE_MODEL_NAMES):
            name, renamed = "model." + name, True
        if name == "score.weight" and heads is not None:
            heads["score"], score = reader, True
            continue
        if name == "model.embed_tokens.weight":
            embed = reader
        head = head or name == "lm_head.weight"
        yield name, reader
    if (renamed or score) and not head and heads is not None:
        heads["no_lm_head"] = True      # (tied or not: a checkpoint made for pooling, not for generating)
    if (renamed or score) and not head and not cfg.tie_word_embeddings and embed is not None:
        log.warning("the checkpoint has no LM head (an embedding model or a classifier): the head is the "
                    "embedding table, so generation means little; embeddings and classification are not affected")
        yield "lm_head.weight", embed


def _flatten(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def random_params(cfg: ModelConfig, dtype, seed: int = 0, plan=None, each=None) -> dict:
    """Random weights built directly on the device (benchmarks / presets); with a TensorParallel
    `plan`, built directly sharded over its mesh (each device makes only its shard). One small jit
    per distinct shape (a single jit over all leaves compiles for minutes on a GPU).
    each: fn(path, leaf) applied to each leaf as it is made (a quantizer: `leaf_quantizer`), so the
    full-precision tree never exists whole and its freed leaves do not leave the memory in holes."""
    model_shapes = nn.unbox(abstract_params(cfg, dtype))
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(model_shapes)
    paths = [tuple(str(getattr(k, "key", k)) for k in path) for path, _ in paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]
    shapes = [leaf.shape for leaf in leaves]
    shardings = [None] * len(leaves)
    if plan is not None:
        from jax.sharding import NamedSharding  # noqa: PLC0415

        from atlasjax.sharding import logical_axes  # noqa: PLC0415
        names = jax.tree_util.tree_leaves(logical_axes(cfg, dtype), is_leaf=lambda x: isinstance(x, tuple))
        shapes = [plan.global_shape(n, s) for n, s in zip(names, shapes)]
        shardings = [NamedSharding(plan.mesh, plan.spec(n)) for n in names]
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for path, key, shape, leaf, sharding in zip(paths, keys, shapes, leaves, shardings):
        x = _random_leaf(key, shape, leaf.dtype, sharding)
        out.append(x if each is None else jax.block_until_ready(each(path, x)))
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_leaf(key, shape, dtype, sharding):
    if len(shape) == 1:   # norms and biases
        x = jnp.ones(shape, dtype)
    else:
        x = (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _gguf_reader(name: str, t, keep_quantized: bool):
    """Loader for one GGUF tensor: projection weights and an untied LM head (`output.weight`) in a
    block type stay quantized (atlasjax/gguf_blocks.py: Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K as stored,
    the other types as int8), as llama.cpp runs them; embeddings and norms load as floats."""
    from atlasjax.gguf_blocks import is_block_type  # noqa: PLC0415
    from atlasjax.quantization import DEFAULT_PROJECTIONS  # noqa: PLC0415
    parts = name.split(".")
    linear = (parts[-1] == "weight" and parts[-2] in DEFAULT_PROJECTIONS) or name == "lm_head.weight"
    if not (keep_quantized and is_block_type(t.qtype) and len(t.shape) == 2 and linear):
        return TensorReader(t.shape, t.dequantize)

    def read():
        from atlasjax.gguf_blocks import gguf_weight  # noqa: PLC0415
        from atlasjax.gguf_loader import unpermute_heads  # noqa: PLC0415
        try:
            qw = gguf_weight(np.asarray(t.raw), t.qtype, t.shape)
        except ValueError as e:   # blocks the kept format cannot hold
            log.warning("GGUF tensor %s: %s; it is read as floats instead", name, e)
            return t.dequantize()
        if t.permute_heads is not None:   # undo llama.cpp's q/k row order on the output channels
            n = t.shape[0]
            perm = unpermute_heads(np.arange(n), t.permute_heads)
            full = np.arange(qw.qweight.shape[0])
            full[:n] = perm
            qw = dataclasses.replace(qw, **{f: jnp.take(getattr(qw, f), full, axis=n_axis(f))
                                            for f in ARRAY_FIELDS if getattr(qw, f) is not None})
        return qw
    return TensorReader(t.shape, read, quantized=True)


def load_model(path: str, dtype, convert=None, keep_gguf_quantized: bool = True, mesh=None,
               kv_cache_fp8: bool = False) -> LoadedModel:
    """Load any supported checkpoint: HF directory, .gguf file, or a saved atlasjax checkpoint.

    mesh: shard the params over it (tensor parallelism, atlasjax/sharding.py) while loading.
    kv_cache_fp8: the KV cache is fp8: an HF checkpoint's KV-cache scales are folded into its weights.
    """
    from atlasjax.tokenizer import Tokenizer  # noqa: PLC0415
    fmt = model_format(path)
    if fmt == "hf":
        heads: dict = {}
        cfg, params = load_hf(path, dtype, convert, mesh, kv_cache_fp8, heads)
        return LoadedModel(cfg, params, Tokenizer.from_dir(path, cfg.eos_token_ids), path, _plan_for(cfg, mesh),
                           classifier=heads.get("classifier"), pooling_model=heads.get("pooling_model", False))
    if fmt == "gguf":
        from atlasjax.gguf_loader import load_gguf  # noqa: PLC0415
        g = load_gguf(path)
        cfg = from_hf_config(g.config)
        tensors = ((name, _gguf_reader(name, t, keep_gguf_quantized and convert is None))
                   for name, t in g.tensors.items())
        plan = _plan_for(cfg, mesh)
        params = assemble_params(cfg, tensors, dtype, convert, plan)
        st = g.special_tokens
        tok = Tokenizer(g.tokenizer, bos_token=st.get("bos_token"), eos_token=st.get("eos_token"),
                        eos_token_ids=tuple(st.get("eos_token_ids") or cfg.eos_token_ids),
                        add_bos=bool(st.get("add_bos_token")), chat_template=g.chat_template)
        return LoadedModel(cfg, params, tok, path, plan)
    from atlasjax.checkpoint import load_checkpoint  # noqa: PLC0415
    loaded = load_checkpoint(path, dtype)
    if mesh is None:
        return loaded
    # A saved atlasjax checkpoint is restored whole, then placed tensor by tensor.
    from atlasjax.sharding import logical_axes  # noqa: PLC0415
    plan = _plan_for(loaded.config, mesh)
    params = plan.shard_params(loaded.params, logical_axes(loaded.config, dtype))
    return dataclasses.replace(loaded, params=params, plan=plan)

"""Save / load a ready-to-serve param tree (quantized or not) with orbax-checkpoint.

`LLM.save(dir)` writes: `atlasjax_checkpoint.json` (model config, which params are quantized and
how, tokenizer specials), `params/` (orbax, one array per leaf), `tokenizer.json`, and the model's
`generation_config.json` defaults where it had any. `LLM(dir)`
loads it back directly, skipping checkpoint conversion and quantization. int4 leaves are stored
widened to int8 (tensorstore has no 4-bit type) and narrowed again on load.
"""
from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import generation_config
from atlasjax.config import ModelConfig, RopeScaling
from atlasjax.errors import CheckpointError
from atlasjax.loader import LoadedModel, _flatten, _set
from models.layers import is_quantized
from models.transformer import abstract_params
from pallas_kernels.quant_format import GROUP_ROWS, QuantizedWeight, layout_problem

FORMAT_VERSION = 1
CLASSIFIER_FILE = "classifier_head.npz"   # a sequence classifier's score layer and labels, when the model has one


def save_checkpoint(loaded: LoadedModel, directory: str) -> None:
    import orbax.checkpoint as ocp  # noqa: PLC0415
    os.makedirs(directory, exist_ok=True)
    leaves, quantized = {}, {}
    for path, leaf in _flatten(loaded.params):
        key = "/".join(path)
        if is_quantized(leaf):
            quantized[key] = dict(format=leaf.format, group_size=leaf.group_size, shape=list(leaf.shape),
                                  qweight_dtype=str(leaf.qweight.dtype), zero_point=leaf.zero_point,
                                  mma_order=leaf.mma_order)
            qweight = leaf.qweight.astype(jnp.int8) if leaf.qweight.dtype == jnp.int4 else leaf.qweight
            leaves[key + "|qweight"] = qweight
            for f in GROUP_ROWS:   # scales, and zeros and two-level rows where present
                if getattr(leaf, f) is not None:
                    leaves[key + "|" + f] = getattr(leaf, f)
        else:
            leaves[key] = leaf
    if jax.process_count() > 1:   # multi-host: process 0 holds the whole (gathered) tree and writes it alone
        leaves = {k: np.asarray(v) for k, v in leaves.items()}
        ckpt = ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=0, active_processes={0}))
    else:
        ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(os.path.join(directory, "params")), leaves, force=True)
    ckpt.wait_until_finished()
    tok = loaded.tokenizer
    meta = dict(version=FORMAT_VERSION, config=_config_dict(loaded.config), quantized=quantized,
                pooling_model=bool(loaded.pooling_model),
                tokenizer=None if tok is None else dict(bos_token=tok.bos_token, eos_token=tok.eos_token,
                                                        eos_token_ids=list(tok.eos_token_ids), add_bos=tok.add_bos,
                                                        chat_template=tok.chat_template))
    if tok is not None:
        tok.tok.save(os.path.join(directory, "tokenizer.json"))
    generation = os.path.join(directory, generation_config.FILENAME)
    if loaded.generation:   # the model's sampling defaults and end ids travel with it
        with open(generation, "w") as f:
            json.dump(loaded.generation.to_json(), f, indent=1)
    elif os.path.exists(generation):   # a checkpoint replaced in place keeps no stale defaults
        os.remove(generation)
    head = os.path.join(directory, CLASSIFIER_FILE)
    if loaded.classifier is not None:   # a sequence classifier's head travels with it
        np.savez(head, weight=loaded.classifier.weight, labels=np.array(loaded.classifier.labels))
    elif os.path.exists(head):
        os.remove(head)
    with open(os.path.join(directory, "atlasjax_checkpoint.json"), "w") as f:
        json.dump(meta, f, indent=1)


def load_checkpoint(directory: str, dtype) -> LoadedModel:
    """Reads a saved checkpoint back. Anything unreadable, damaged or inconsistent with its own model
    config (a missing, unexpected or mis-shaped parameter, a quantized weight whose arrays disagree
    with its format) raises CheckpointError naming it, before any array reaches the device."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    import tokenizers  # noqa: PLC0415

    from atlasjax.tokenizer import Tokenizer  # noqa: PLC0415
    try:
        with open(os.path.join(directory, "atlasjax_checkpoint.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the atlasjax checkpoint in {directory}: {e}") from e
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{directory}: unsupported atlasjax checkpoint version {version}")
    try:
        cfg = _config_from_dict(meta["config"])
        quantized = dict(meta["quantized"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{directory}: atlasjax_checkpoint.json has no valid model config or quantized "
                              f"table ({type(e).__name__}: {e})") from e
    try:
        leaves = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(directory, "params")))
    except Exception as e:   # orbax and tensorstore raise plain Exceptions for damaged arrays
        raise CheckpointError(f"cannot read the arrays of the atlasjax checkpoint in {directory}: "
                              f"{str(e).splitlines()[0][:300]}") from e
    params = _params(leaves, quantized, dtype, directory)
    _check_against_config(params, cfg, dtype, directory)
    tok = None
    if meta.get("tokenizer"):
        t = meta["tokenizer"]
        tok = Tokenizer(tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")),
                        bos_token=t["bos_token"], eos_token=t["eos_token"], eos_token_ids=t["eos_token_ids"],
                        add_bos=t["add_bos"], chat_template=t["chat_template"])
    return LoadedModel(cfg, params, tok, directory, classifier=_classifier(directory, cfg),
                       pooling_model=bool(meta.get("pooling_model", False)))


def _classifier(directory: str, cfg):
    """The classification head saved beside the params, if any (atlasjax.pooling.ClassifierHead)."""
    from atlasjax.pooling import ClassifierHead  # noqa: PLC0415
    path = os.path.join(directory, CLASSIFIER_FILE)
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as f:
            weight, labels = np.asarray(f["weight"], np.float32), tuple(str(x) for x in f["labels"])
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if weight.ndim != 2 or weight.shape[1] != cfg.hidden_size or len(labels) != weight.shape[0]:
        raise CheckpointError(f"{path}: a classifier head of shape {weight.shape} with {len(labels)} labels does "
                              f"not fit a model of hidden size {cfg.hidden_size}")
    return ClassifierHead(weight, labels)


def _params(leaves: dict, quantized: dict, dtype, directory: str) -> dict:
    """The param tree from the restored arrays and the checkpoint's quantized table."""
    params: dict = {}
    for key, q in quantized.items():
        try:
            qweight = jnp.asarray(leaves[key + "|qweight"]).astype(jnp.dtype(q["qweight_dtype"]))
            rows = {f: jnp.asarray(leaves[key + "|" + f]) if key + "|" + f in leaves else None for f in GROUP_ROWS}
            qw = QuantizedWeight(qweight, format=q["format"], group_size=int(q["group_size"]),
                                 shape=tuple(int(d) for d in q["shape"]), zero_point=bool(q.get("zero_point", False)),
                                 mma_order=bool(q.get("mma_order", False)), **rows)
            problem = layout_problem(qw)
        except (KeyError, TypeError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
        if problem:
            raise CheckpointError(f"{directory}: quantized parameter {key!r} is damaged: {problem}")
        _set(params, tuple(key.split("/")), qw)
    for key, value in leaves.items():
        if "|" not in key:
            _set(params, tuple(key.split("/")), jnp.asarray(value).astype(dtype))
    return params


def _check_against_config(params: dict, cfg: ModelConfig, dtype, directory: str) -> None:
    """Every parameter the config's model has, with its shape (a quantized one: its logical shape), and no other."""
    expected = dict(_flatten(nn.unbox(abstract_params(cfg, dtype))))
    got = dict(_flatten(params))
    missing = [p for p in expected if p not in got]
    unexpected = [p for p in got if p not in expected]
    if missing or unexpected:
        names = [["/".join(p) for p in paths[:5]] for paths in (missing, unexpected)]
        raise CheckpointError(f"{directory}: parameters do not match its model config: missing {names[0]}, "
                              f"unexpected {names[1]}")
    for path, leaf in got.items():
        if tuple(leaf.shape) != tuple(expected[path].shape):
            raise CheckpointError(f"{directory}: parameter {'/'.join(path)} has shape {tuple(leaf.shape)}, its model "
                                  f"config gives {tuple(expected[path].shape)}")


def _config_dict(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def _config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelConfig(**d)

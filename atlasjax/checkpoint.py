"""Save / load a ready-to-serve param tree (quantized or not) with orbax-checkpoint.

`LLM.save(dir)` writes: `atlasjax_checkpoint.json` (model config, which params are quantized and
how, tokenizer specials), `params/` (orbax, one array per leaf), `tokenizer.json`. `LLM(dir)`
loads it back directly, skipping checkpoint conversion and quantization. int4 leaves are stored
widened to int8 (tensorstore has no 4-bit type) and narrowed again on load.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.config import ModelConfig, RopeScaling
from atlasjax.errors import CheckpointError
from atlasjax.loader import LoadedModel, _flatten, _set
from models.layers import is_quantized
from pallas_kernels.quant_format import GROUP_ROWS, QuantizedWeight

FORMAT_VERSION = 1


def save_checkpoint(loaded: LoadedModel, directory: str) -> None:
    import orbax.checkpoint as ocp  # noqa: PLC0415
    os.makedirs(directory, exist_ok=True)
    leaves, quantized = {}, {}
    for path, leaf in _flatten(loaded.params):
        key = "/".join(path)
        if is_quantized(leaf):
            quantized[key] = dict(format=leaf.format, group_size=leaf.group_size, shape=list(leaf.shape),
                                  qweight_dtype=str(leaf.qweight.dtype), has_zeros=leaf.zeros is not None,
                                  zero_point=leaf.zero_point, mma_order=leaf.mma_order)
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
                tokenizer=None if tok is None else dict(bos_token=tok.bos_token, eos_token=tok.eos_token,
                                                        eos_token_ids=list(tok.eos_token_ids), add_bos=tok.add_bos,
                                                        chat_template=tok.chat_template))
    if tok is not None:
        tok.tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "atlasjax_checkpoint.json"), "w") as f:
        json.dump(meta, f, indent=1)


def load_checkpoint(directory: str, dtype) -> LoadedModel:
    import orbax.checkpoint as ocp  # noqa: PLC0415
    import tokenizers  # noqa: PLC0415

    from atlasjax.tokenizer import Tokenizer  # noqa: PLC0415
    try:
        with open(os.path.join(directory, "atlasjax_checkpoint.json")) as f:
            meta = json.load(f)
        leaves = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(directory, "params")))
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the atlasjax checkpoint in {directory}: {e}") from e
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: unsupported atlasjax checkpoint version {meta.get('version')}")
    cfg = _config_from_dict(meta["config"])
    params: dict = {}
    for key, q in meta["quantized"].items():
        qweight = jnp.asarray(leaves[key + "|qweight"]).astype(jnp.dtype(q["qweight_dtype"]))
        rows = {f: jnp.asarray(leaves[key + "|" + f]) if key + "|" + f in leaves else None for f in GROUP_ROWS}
        _set(params, tuple(key.split("/")), QuantizedWeight(qweight, format=q["format"], group_size=q["group_size"],
                                                            shape=tuple(q["shape"]), zero_point=q.get("zero_point", False),
                                                            mma_order=q.get("mma_order", False), **rows))
    for key, value in leaves.items():
        if "|" not in key:
            _set(params, tuple(key.split("/")), jnp.asarray(value).astype(dtype))
    tok = None
    if meta.get("tokenizer"):
        t = meta["tokenizer"]
        tok = Tokenizer(tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")),
                        bos_token=t["bos_token"], eos_token=t["eos_token"], eos_token_ids=t["eos_token_ids"],
                        add_bos=t["add_bos"], chat_template=t["chat_template"])
    return LoadedModel(cfg, params, tok, directory)


def _config_dict(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def _config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelConfig(**d)

"""Hugging Face Hub model ids as vLLM takes them: `LLM("Qwen/Qwen3-8B")`, `serve --model Qwen/Qwen3-8B`.

A `model` (or `tokenizer`) that is no local path but reads as a Hub id ("org/name") is fetched into the Hugging Face
cache with huggingface_hub (what a checkpoint needs: configs, safetensors, tokenizer files, chat templates), or
found there without the network under HF_HUB_OFFLINE=1, and loaded from that snapshot. HF_TOKEN reaches gated
repositories, HF_HUB_CACHE / HF_HOME place the cache and HF_ENDPOINT a mirror, as for transformers.
"""
from __future__ import annotations

import os
import re

from atlasjax.errors import EngineConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
# What loading reads (weights in safetensors only; the .bin / .pt / .gguf / onnx copies some repos carry are left)
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*"]
_TRUE = ("1", "true", "yes", "on")


def is_hub_id(name: str | None) -> bool:
    """True for "org/name" when no such local path exists (a path always wins, as in vLLM)."""
    return (isinstance(name, str) and HUB_ID.match(name) is not None and not os.path.exists(name)
            and not name.endswith(".gguf"))


def resolve(name: str | None, what: str = "model", revision: str | None = None) -> str | None:
    """`name` itself, or for a Hub id the local snapshot directory it was fetched (or found) in: of `revision` (a
    branch, tag or commit; None: main)."""
    if not is_hub_id(name):
        return name
    from huggingface_hub import snapshot_download  # noqa: PLC0415
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE
    try:
        return snapshot_download(name, revision=revision, allow_patterns=CHECKPOINT_FILES, local_files_only=offline,
                                 cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception as e:  # noqa: BLE001 (the hub's errors: not found, gated, offline, network)
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the Hugging Face Hub"
        at = f" at revision {revision!r}" if revision else ""
        raise EngineConfigError(f"{what} {name!r} is not a local path, and as a Hub id it was not found{at} {where}: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None

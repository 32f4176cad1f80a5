"""LoRA adapters over HTTP, as vLLM serves them (atlasjax/lora.py runs them).

`serve --enable-lora --lora-modules sql=/adapters/sql` names adapters that generation requests select through
their "model" field; /v1/models lists each with its base model as `parent`. With
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (vLLM's switch; ATLASJAX_ALLOW_RUNTIME_LORA_UPDATING too) the server also
takes POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}. A loaded
adapter is read and checked at once (a bad one is refused, 400); an unloaded one still serves the requests that
named it before.
"""
from __future__ import annotations

import asyncio
import json
import os

from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from atlasjax.errors import InvalidRequestError
from atlasjax.lora import LoRARequest, read_adapter
from serving.errors import APIError, invalid
from serving.protocol import Fields
from serving.state import read_json, server_state


def parse_lora_modules(values: list[str] | None) -> dict[str, LoRARequest]:
    """--lora-modules entries, `name=path` or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...},
    as {name: LoRARequest} with ids 1, 2, ... in order (ValueError naming a bad entry)."""
    out: dict[str, LoRARequest] = {}
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({e})") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                    or not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs \"name\" and \"path\" strings")
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
            base = None
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = LoRARequest(name, len(out) + 1, path, base)
    return out


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes")
               for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "ATLASJAX_ALLOW_RUNTIME_LORA_UPDATING"))


def lora_cards(state) -> list[dict]:
    """/v1/models entries of the served adapters."""
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "atlasjax", "root": lora.lora_path,
             "parent": lora.base_model_name or state.model_name, "max_model_len": state.max_model_len}
            for name, lora in state.lora_modules.items()]


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    f = Fields(await read_json(request))
    name, path = f.str("lora_name"), f.str("lora_path")
    if not name or not path:
        raise invalid("both 'lora_name' and 'lora_path' are required", param="lora_name" if not name else "lora_path")
    if name in state.lora_modules or name in state.model_names:
        raise invalid(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    lora = LoRARequest(name, state.new_lora_id(), path)
    try:   # read now, off the event loop: a bad adapter is refused here, not by its first request
        await asyncio.to_thread(read_adapter, lora, state.llm.engine.model_config, state.max_lora_rank)
    except InvalidRequestError as e:
        raise invalid(str(e), param="lora_path") from None
    state.lora_modules[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    name = Fields(await read_json(request)).str("lora_name")
    if not name:
        raise invalid("'lora_name' is required", param="lora_name")
    if state.lora_modules.pop(name, None) is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", code="model_not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


ROUTES = [   # only with LoRA enabled and runtime updates allowed
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]

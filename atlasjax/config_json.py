"""An engine option given as a dict or as its JSON text (vLLM's `--speculative-config`, `--hf-overrides`)."""
from __future__ import annotations

import json

from atlasjax.errors import EngineConfigError


def json_dict(value, name: str) -> dict:
    """value (a dict, or a JSON object as text) as a dict; anything else is an EngineConfigError naming `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise EngineConfigError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise EngineConfigError(f"{name} must be a dict (or its JSON), got {type(value).__name__}")
    return value

"""Per-request log lines (`serve --log-requests`, as vLLM's `--enable-log-requests`), on the
`atlasjax.requests` logger at INFO: what each engine request asked for when it is submitted, and
how each of its sequences ended. Lengths and settings only: prompt and answer text never reach the
log.
"""
from __future__ import annotations

import dataclasses
import logging

from atlasjax.sampling_params import SamplingParams

log = logging.getLogger("atlasjax.requests")
_DEFAULTS = SamplingParams()
_COUNTED = ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids")   # long values: their sizes only


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


def params_summary(params: SamplingParams) -> str:
    """The fields that differ from SamplingParams' defaults, as name=value (long ones as their sizes)."""
    parts = []
    for field in dataclasses.fields(SamplingParams):
        value = getattr(params, field.name)
        if value == getattr(_DEFAULTS, field.name):
            continue
        parts.append(f"{field.name}=[{len(value)}]" if field.name in _COUNTED and value else f"{field.name}={value!r}")
    return ", ".join(parts) or "defaults"


def submitted(request_id: str, num_prompt_tokens: int, params: SamplingParams, priority: int) -> None:
    log.info("request %s: %d prompt tokens, %s%s", request_id, num_prompt_tokens, params_summary(params),
             f", priority {priority}" if priority else "")


def finished(request_id: str, index: int, reason: str, num_tokens: int, ttft: float | None, e2e: float) -> None:
    first = f", first token at {ttft:.3f} s" if ttft is not None else ""
    log.info("request %s sequence %d: %s after %d tokens%s, %.3f s in all", request_id, index, reason, num_tokens,
             first, e2e)


def aborted(request_id: str, num_unfinished: int, e2e: float) -> None:
    log.info("request %s: the client went away after %.3f s; unfinished sequences aborted: %d", request_id, e2e,
             num_unfinished)

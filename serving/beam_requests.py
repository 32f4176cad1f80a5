"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` is the beam width and
the n best beams come back as the choices, best first (atlasjax/beam_search.py runs the search).

Beam search answers whole: `stream`, logprobs, `echo` and stop strings are refused with a 400, as
are `n` past the widest beam; `length_penalty` (vLLM's field, default 1.0) and `ignore_eos` apply.
Its rounds are engine requests of their own, so the per-sequence metrics do not count it.
"""
from __future__ import annotations

from starlette.requests import Request

from atlasjax.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_async, gather_all
from atlasjax.errors import InvalidRequestError
from serving.bridge import until_disconnect
from serving.errors import APIError, from_engine_error, invalid
from serving.protocol import Fields

NOT_WITH_BEAMS = ("stream", "logprobs", "top_logprobs", "echo", "stop", "prompt_logprobs", "thinking_token_budget")


def beam_params(f: Fields, n: int, max_tokens: int | None) -> BeamSearchParams | None:
    """The request's beam search, or None without `use_beam_search`."""
    if not f.bool("use_beam_search"):
        return None
    for name in NOT_WITH_BEAMS:
        if f.body.get(name) not in (None, False, []):
            raise invalid(f"'{name}' is not supported with use_beam_search", param=name)
    try:
        return BeamSearchParams(beam_width=n, max_tokens=max_tokens or 16, ignore_eos=f.bool("ignore_eos"),
                                length_penalty=f.float("length_penalty", 1.0))
    except InvalidRequestError as e:
        raise invalid(str(e).replace("beam_width", "n (the beam width)"), param="n") from None


async def run_beam_search(request: Request, state, jobs: list[tuple[str, list[int]]], params: BeamSearchParams,
                          priority: int, lora_request=None, cache_salt: str | None = None) -> list[BeamSearchOutput]:
    """Each (engine request id, prompt ids) job's search, run concurrently; a client leaving aborts them."""
    eos = state.llm.engine.eos_token_ids

    async def search_all():
        try:
            return await gather_all([beam_search_async(state.llm, ids, params, rid, eos, state.max_model_len,
                                                       priority, lora_request, cache_salt) for rid, ids in jobs])
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 (what the engine raises becomes an HTTP error)
            raise from_engine_error(e) from e
    return await until_disconnect(request, search_all())

"""A reasoning budget: `thinking_token_budget` on /v1/chat/completions (vLLM's field) and Anthropic's
`thinking.budget_tokens`. A completion still inside its reasoning after its first `budget` tokens is
closed with `CLOSE_TEXT` and goes on to its answer, within max_tokens.

It runs around the engine, as two requests for a completion that reaches the budget:
  1. the request as asked, with max_tokens = budget (and min_tokens cut to it);
  2. for each completion that ran to the budget (finish "length" before its own max_tokens): the
     close tokens if its reasoning is still open (ReasoningStream's state), then a request that
     continues from the prompt + every token so far with the rest of max_tokens. Its prompt is
     mostly prefix-cache hits: only the tokens past the last full page are computed again.
The caller sees one stream per completion: request 1's last delta passes on unfinished, the close
tag arrives as a delta of its own (its tokens' logprobs are 0: they were forced, not sampled), and
request 2's deltas follow under the completion's index. Request 2 counts repetition penalties over
its own output only, and a seeded completion draws from a seed derived from its own.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from atlasjax.outputs import Logprob, StreamDelta
from atlasjax.sampling_params import SamplingParams
from serving.reasoning import ReasoningStream
from serving.streams import merge

CLOSE_TEXT = "\n</think>\n\n"


@dataclasses.dataclass(frozen=True)
class ThinkingBudget:
    tokens: int                    # the answer's first tokens that may be reasoning
    parser: str                    # serving/reasoning.py's, to tell whether the reasoning is still open
    close_ids: tuple[int, ...]     # CLOSE_TEXT's token ids


@dataclasses.dataclass
class _Completion:
    splitter: ReasoningStream
    token_ids: list[int] = dataclasses.field(default_factory=list)


async def budgeted(llm, prompt_ids: list[int], params: SamplingParams, request_id: str,
                   budget: ThinkingBudget, priority: int = 0, lora_request=None,
                   cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
    """`llm.generate(prompt_ids, params, request_id, priority=..., lora_request=..., cache_salt=...)`, with the
    reasoning closed at the budget."""
    ask = dict(priority=priority, lora_request=lora_request, cache_salt=cache_salt)
    if params.max_tokens is not None and budget.tokens >= params.max_tokens:
        plain_deltas = llm.generate(prompt_ids, params, request_id, **ask)
        async with contextlib.aclosing(plain_deltas) as plain:
            async for delta in plain:
                yield delta
        return
    first = dataclasses.replace(params, max_tokens=budget.tokens, min_tokens=min(params.min_tokens, budget.tokens))
    completions = [_Completion(ReasoningStream(budget.parser)) for _ in range(params.n)]
    over: list[int] = []      # completions that ran to the budget, to continue
    first_deltas = llm.generate(prompt_ids, first, request_id, **ask)
    async with contextlib.aclosing(first_deltas) as deltas:
        async for delta in deltas:
            c = completions[delta.index]
            c.token_ids += delta.new_token_ids
            c.splitter.add(delta.new_text)
            if delta.finished and delta.finish_reason == "length" and len(c.token_ids) >= budget.tokens:
                over.append(delta.index)
                delta = dataclasses.replace(delta, finished=False, finish_reason=None, stop_reason=None)
            yield delta
    if not over:
        return
    closes = {i: _still_reasoning(completions[i].splitter) for i in over}
    for i in over:
        if closes[i] and params.max_tokens is not None and budget.tokens + len(budget.close_ids) > params.max_tokens:
            closes[i] = None     # no room for the close tag: the completion ends at the budget
            yield StreamDelta(request_id, i, [], "", True, "length")
        elif closes[i]:
            yield _close_delta(request_id, i, budget.close_ids, params.logprobs is not None)
    over = [i for i in over if closes[i] is not None]
    rest = []
    for i in over:
        so_far = completions[i].token_ids + (list(budget.close_ids) if closes[i] else [])
        rest.append(_continue(llm, prompt_ids + so_far, params, f"{request_id}-answer{i}", i, len(so_far), ask))
    async with contextlib.aclosing(merge(rest)) as deltas:
        async for k, delta in deltas:
            yield dataclasses.replace(delta, request_id=request_id, index=over[k])


def _still_reasoning(splitter: ReasoningStream) -> bool:
    return splitter.state == "reasoning" or (splitter.state == "start" and splitter.parser == "deepseek_r1")


def _close_delta(request_id: str, index: int, close_ids, with_logprobs: bool) -> StreamDelta:
    logprobs = [{t: Logprob(0.0, 1)} for t in close_ids] if with_logprobs else None
    return StreamDelta(request_id, index, list(close_ids), CLOSE_TEXT, False, new_logprobs=logprobs)


async def _continue(llm, prompt_ids: list[int], params: SamplingParams, request_id: str, index: int,
                    done: int, ask: dict) -> AsyncIterator[StreamDelta]:
    """The rest of one completion, `done` tokens into it (ask: generate's priority, lora_request and cache_salt);
    one with no room left (max_tokens, or the context when max_tokens is unset) ends here."""
    left = None if params.max_tokens is None else params.max_tokens - done
    if (left is not None and left <= 0) or len(prompt_ids) >= llm.engine.max_model_len:
        yield StreamDelta(request_id, 0, [], "", True, "length")
        return
    seed = None if params.seed is None else hash((params.seed, index, done)) & 0x7FFFFFFF
    rest = dataclasses.replace(params, n=1, max_tokens=left, min_tokens=max(0, params.min_tokens - done),
                               seed=seed, prompt_logprobs=None, truncate_prompt_tokens=None)   # (cut once, before)
    rest_deltas = llm.generate(prompt_ids, rest, request_id, **ask)
    async with contextlib.aclosing(rest_deltas) as deltas:
        async for delta in deltas:
            yield delta

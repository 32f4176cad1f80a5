"""Beam search (vLLM's `LLM.beam_search` and the server's `use_beam_search`), driven from outside the engine.

Each round extends every live beam by one token: the beam's tokens go to the engine as a request of
one token that reports its 2 x beam_width likeliest next tokens' logprobs (the model's own
distribution). Every (beam, candidate) pair is scored, and the beam_width best become the next round's
beams; a candidate that is an end token completes its beam instead. After max_tokens rounds the
completed and the live beams are ranked together and the beam_width best returned, best first.
The score is vLLM's: the cumulative logprob over (prompt + generated length) ** length_penalty, not
counting a final end token. The prefix cache keeps each round cheap: a beam's earlier tokens are the
cached pages of the round before, so only its last partial page is computed again.

`BeamSearch` is one prompt's search, stepped by a caller: `LLM.beam_search` batches every prompt's
beams into one `generate` per round; `beam_search_async` runs them as concurrent requests (the server).
"""
from __future__ import annotations

import asyncio
import dataclasses

from atlasjax.errors import InvalidRequestError
from atlasjax.outputs import Logprob
from atlasjax.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2   # each round reads 2 x beam_width candidates per beam


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        for name, value in (("beam_width", self.beam_width), ("max_tokens", self.max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"beam_width must be at most {MAX_BEAM_WIDTH} (each round reads 2 x beam_width "
                                      f"of the {MAX_LOGPROBS} logprobs computed per token), got {self.beam_width}")
        if not isinstance(self.length_penalty, int | float) or self.length_penalty != self.length_penalty:
            raise InvalidRequestError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]                  # the prompt's, then the generated ones (as vLLM's)
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)   # per generated token
    text: str | None = None            # the generated tokens' text (set on the returned sequences)
    finish_reason: str | None = None   # "stop" (an end token) or "length"
    stop_reason: int | None = None     # the end token

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first


class BeamSearch:
    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids, max_model_len: int):
        if len(prompt_ids) + params.max_tokens > max_model_len:
            raise InvalidRequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                      f"max_model_len={max_model_len}")
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_ids), len(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return self.rounds >= self.params.max_tokens or not self.beams

    def step_params(self) -> SamplingParams:
        """One token, greedy, with the candidates' logprobs."""
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.params.beam_width, ignore_eos=True)

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos)
        return beam.cum_logprob / length ** self.params.length_penalty

    def advance(self, entries: list[dict[int, Logprob]]) -> None:
        """entries[b]: the logprobs the engine reported for live beam b's next token."""
        if len(entries) != len(self.beams):
            raise ValueError(f"got {len(entries)} logprob entries for {len(self.beams)} beams")
        width = 2 * self.params.beam_width
        grown = []
        for beam, entry in zip(self.beams, entries):
            for token, lp in sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:width]:
                new = BeamSearchSequence(beam.tokens + [token], beam.num_prompt_tokens, beam.cum_logprob + lp.logprob,
                                         beam.logprobs + [entry])
                if token in self.eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    self.completed.append(new)
                else:
                    grown.append(new)
        self.beams = sorted(grown, key=self.score, reverse=True)[:self.params.beam_width]
        self.rounds += 1

    def output(self, tokenizer=None) -> BeamSearchOutput:
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.output_token_ids) if tokenizer is not None else None
        return BeamSearchOutput(best)


async def beam_search_async(llm, prompt_ids: list[int], params: BeamSearchParams, request_id: str,
                            eos_token_ids, max_model_len: int, priority: int = 0, lora_request=None,
                            cache_salt: str | None = None) -> BeamSearchOutput:
    """One prompt's search over an AsyncLLM-like `llm` (its async `generate(prompt_ids, params, request_id,
    priority=..., lora_request=..., cache_salt=...)`), each round's beams as concurrent requests. Cancelling it
    aborts the round's requests."""
    search = BeamSearch(prompt_ids, params, eos_token_ids, max_model_len)

    async def next_token(ids: list[int], rid: str) -> dict[int, Logprob]:
        entry = None
        async for delta in llm.generate(ids, search.step_params(), rid, priority=priority, lora_request=lora_request,
                                        cache_salt=cache_salt):
            if delta.new_logprobs:
                entry = delta.new_logprobs[0]
        if entry is None:
            raise RuntimeError(f"beam search request {rid} returned no logprobs")
        return entry
    while not search.done:
        search.advance(await gather_all([next_token(beam.tokens, f"{request_id}-r{search.rounds}-b{b}")
                                         for b, beam in enumerate(search.beams)]))
    return search.output(llm.tokenizer)


async def gather_all(coroutines) -> list:
    """Their results in order; the first to fail cancels the others and its exception is raised as is."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except ExceptionGroup as e:
        first = e.exceptions[0]
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]

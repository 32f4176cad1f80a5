"""Sampled tokens in, stream deltas out: detokenization, logprobs, stop checks and finishes.

Plain Python on the engine thread. `process` takes a step read back to the host
(step_readback.HostOutput) and, per sampled row, appends the token to its request, detokenizes it
incrementally, applies the stop tokens, stop strings and length limits token by token (a multi-step
decode's K tokens included: what follows a stop is dropped), holds back text that may still become
a stop string, and finishes the request with the scheduler. It returns one delta per request.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from atlasjax import ngram_gate
from atlasjax.metrics import EngineStats
from atlasjax.outputs import Logprob, StreamDelta
from atlasjax.request import Request
from atlasjax.scheduler import Scheduler
from atlasjax.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from atlasjax.step_readback import HostOutput, LaunchedStep


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, scheduler: Scheduler, stats: EngineStats):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.stats = stats
        self._detok: dict[Request, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        """Start the request's detokenizer (none for a model without a tokenizer)."""
        if self.tokenizer is not None and req.params.detokenize:
            self._detok[req] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                      req.params.skip_special_tokens)

    def forget(self, req: Request) -> None:
        self._detok.pop(req, None)

    def process(self, step: LaunchedStep, host: HostOutput) -> list[StreamDelta]:
        deltas, row = [], 0
        for i, c in enumerate(step.sched.prefills):
            if step.record_prompt_logprobs[i]:
                self._record_prompt_logprobs(c.request, c, host.prompt, row)
            row += c.num_tokens
            self.stats.prompt_tokens += c.num_tokens
        for req, r in step.sample_rows.items():
            delta = None
            num_tokens, rounds = step.sched.steps.get(req, 1), {}
            if step.spans is not None:   # a verify step: per round, the accepted drafts and the token after them
                num_tokens = 0
                for num_drafts, accepted in host.spec_rounds[r - (host.tokens.shape[1] - len(host.spec_rounds))]:
                    rounds[num_tokens] = num_drafts, accepted   # by the index of its first token
                    num_tokens += accepted + 1
            appended = 0
            for j in range(num_tokens):
                # A request finished (or aborted) while this step ran, or at an earlier token of this
                # step: its tokens from here on are dropped unread (and the rounds after, uncounted).
                if req.is_finished:
                    break
                if j in rounds:
                    self.stats.spec.record(*rounds[j])
                    ngram_gate.record_round(req, rounds[j][1])
                delta = merged(delta, self._append_token(req, host, r, j))
                appended += 1
            if step.spans is not None:
                # what it did not emit of its bound was never sampled (a pipelined launch's bound stays pending)
                req.num_pending_tokens -= step.reach[req] - appended
                self.scheduler.speculated(req)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _append_token(self, req: Request, host: HostOutput, row: int, j: int = 0) -> StreamDelta:
        """Token j of this step's row for req (j > 0: a later iteration of a multi-step decode)."""
        token = int(host.tokens[j, row])
        req.num_pending_tokens -= 1
        req.output_token_ids.append(token)
        self.stats.generation_tokens += 1
        p = req.params
        new_lp = None
        if p.logprobs is not None:
            new_lp = [self._logprob_dict(token, float(host.logprob[j, row]), host.top_vals[j, row],
                                         host.top_ids[j, row], p.logprobs, p.detokenize)]
            req.logprobs.extend(new_lp)
        num_out = len(req.output_token_ids)
        finish, stop_reason = None, None
        is_stop_token = (token in req.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if is_stop_token and num_out > p.min_tokens - 1:
            finish, stop_reason = "stop", token
        detok = self._detok.get(req)
        text = detok.add(token) if detok is not None and not is_stop_token else ""
        prev_len = len(req.text)
        req.text += text
        if finish is None and p.stop and num_out >= p.min_tokens:
            hit = find_stop(req.text, p.stop, prev_len)
            if hit is not None:
                idx, s = hit
                req.text = req.text[:idx + (len(s) if p.include_stop_str_in_output else 0)]
                finish, stop_reason = "stop", s
        if finish is None and (num_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            finish = "length"
        # Hold back text that might still become a stop string.
        emitted = req.emitted_chars
        hold = 0 if finish or not p.stop else max(len(s) for s in p.stop) - 1
        upto = max(emitted, len(req.text) - hold)
        new_text = req.text[emitted:upto]
        req.emitted_chars = upto
        if finish:
            req.stop_reason = stop_reason
            self.scheduler.finish(req, finish)
            self.stats.record_finish(req)
        return StreamDelta(req.parent_id, req.index, [token], new_text, bool(finish), finish, stop_reason, new_lp,
                           len(req.prompt_token_ids), num_out, req.num_cached_tokens or 0,
                           req.prompt_logprobs if num_out == 1 else None,
                           req.queue_seconds if num_out == 1 else None)

    def _logprob_dict(self, token, lp, top_vals, top_ids, k, detokenize: bool = True) -> dict[int, Logprob]:
        d = {}
        for rank, (tid, val) in enumerate(zip(top_ids[:k], top_vals[:k]), start=1):
            d[int(tid)] = Logprob(float(val), rank, self._tok_str(tid, detokenize))
        if token not in d:
            d[token] = Logprob(lp, None, self._tok_str(token, detokenize))
        return d

    def _tok_str(self, tid, detokenize: bool = True):
        return self.tokenizer.decode([int(tid)], skip_special_tokens=False) if self.tokenizer and detokenize else None

    def _record_prompt_logprobs(self, req: Request, c, prompt_out, row: int) -> None:
        """Append the logprobs of the prompt tokens that chunk c's rows (from `row`) predict, those not recorded
        yet: a request preempted mid-prompt prefills its prompt again from a position already recorded (or
        earlier), and chunks are read back in order, so each position is recorded once and in order."""
        chosen, vals, ids = prompt_out
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        assert len(req.prompt_logprobs) > c.start, "a prompt-logprob chunk left a gap"
        k = req.params.prompt_logprobs
        for pos in range(len(req.prompt_logprobs), min(c.start + c.num_tokens + 1, len(req.prompt_token_ids))):
            r = row + pos - 1 - c.start      # the row that predicts prompt token pos
            req.prompt_logprobs.append(self._logprob_dict(req.prompt_token_ids[pos], float(chosen[r]), vals[r],
                                                          ids[r], k, req.params.detokenize))


def merged(a: StreamDelta | None, b: StreamDelta) -> StreamDelta:
    """One delta for consecutive tokens of a sequence (a multi-step decode's)."""
    if a is None:
        return b
    lp = None if a.new_logprobs is None and b.new_logprobs is None else (a.new_logprobs or []) + (b.new_logprobs or [])
    return dataclasses.replace(b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text,
                               new_logprobs=lp)


def find_stop(text: str, stops: list[str], prev_len: int) -> tuple[int, str] | None:
    """The earliest stop string in text that ends past prev_len (the text before it was checked already)."""
    best = None
    for s in stops:
        idx = text.find(s, max(0, prev_len - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best

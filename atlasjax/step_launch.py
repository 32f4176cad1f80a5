"""Dispatching one scheduled step, asynchronously (nothing waits for the device): the admit step for the requests
admitted, then the prefill and decode steps, or one verify launch when the step has drafts; each packed into the
fixed bucket shapes (step_packing.py) and run by the runner. The `LaunchedStep` it returns is read back by
step_readback.py. A step's pending tokens (sampled by the step still in flight, values unknown) are gathered on the
device from that step's outputs by row.
"""
from __future__ import annotations

import time

from atlasjax import long_context_decode
from atlasjax.draft_scheduling import verify_reach
from atlasjax.sampling import pack_rows, plan_rows
from atlasjax.scheduler_output import SchedulerOutput
from atlasjax.step_packing import pack_decode, pack_prefill, pack_verify
from atlasjax.step_readback import LaunchedStep, start_copies


class StepLauncher:
    def __init__(self, runner, scheduler, pool, *, num_slots: int, num_scheduler_steps: int, kv_offload=None,
                 lora=None):
        """kv_offload: the host tier (atlasjax/kv_offload.py) synced before each step; lora: the LoRAManager that
        assigns admitted requests' adapters (atlasjax/lora.py)."""
        self.runner = runner
        self.scheduler = scheduler
        self.pool = pool
        self.num_slots = num_slots
        self.num_scheduler_steps = num_scheduler_steps
        self.kv_offload = kv_offload
        self.lora = lora
        self.num_pipelined_verifies = 0   # verify launches dispatched behind another still in flight

    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Dispatch the admit, prefill and decode steps (asynchronous: nothing waits for the device). prev: the step
        in flight (not read back yet), whose sampled tokens this one's pending tokens are gathered from."""
        if self.kv_offload is not None:   # evicted pages out, refilled pages in, before the step reads them
            self.kv_offload.sync(self.pool, self.runner)
        if sched.admitted:
            now = time.monotonic()
            for req in sched.admitted:
                if req.queue_seconds is None:
                    req.queue_seconds = max(0.0, now - req.arrival_time)
            self.runner.admit([(req.slot, req.all_token_ids, len(req.prompt_token_ids), req.params.bias_table(),
                                req.bad_word_ids) for req in sched.admitted])
            if self.lora is not None:
                self.lora.assign(sched.admitted)
        if sched.drafts:
            return self._verify(sched, prev)
        if prev is not None and prev.spans is not None:   # its requests' positions are known only on the device
            raise RuntimeError("only a verify launch may be dispatched behind a verify launch in flight")
        prefill_out, record_lp = self._prefill(sched) if sched.prefills else (None, [])
        # a multi-step launch runs the compiled K iterations (each request its own sched.steps of them)
        num_steps = self.num_scheduler_steps if sched.num_steps > 1 else 1
        decode_out = self._decode(sched, num_steps, prev) if sched.decodes else None
        s = self.num_slots
        rows = {c.request: i for i, c in enumerate(sched.prefills) if c.completes_prompt}
        rows.update((req, s + r) for r, req in enumerate(sched.decodes))   # _decode's row order
        for req in rows:
            req.num_pending_tokens += sched.steps.get(req, 1)
        self.scheduler.dispatched(sched)
        launched = LaunchedStep(sched, prefill_out, decode_out, record_lp, rows,
                                any(r.params.logprobs is not None for r in rows), num_steps)
        start_copies(launched)
        return launched

    def _verify(self, sched: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """A speculative step (only decodes, some with drafts): one verify launch (of sched.rounds rounds) samples
        every row; its output takes the decode's place, read back by request (`LaunchedStep.spans`). Behind a verify
        launch still in flight (pipelined: the engine checked `Scheduler.can_pipeline_verify`) each request is
        packed from its known tokens and moved along on the device by what that launch emits for it."""
        t = self.runner.bucket_for(sum(1 + len(sched.drafts.get(r, ())) for r in sched.decodes))
        pipelined = prev is not None and prev.spans is not None
        if pipelined and (sched.rounds == 1 or prev.decode.emitted is None or sched.prefills or sched.preempted):
            raise RuntimeError("a verify launch behind another must be a verify-rounds launch of the same requests")
        shift_rows = {req: r for r, req in enumerate(prev.sched.decodes)} if pipelined else {}
        self.num_pipelined_verifies += pipelined
        batch, rows, spans = pack_verify(sched, {} if prev is None else prev.sample_rows, num_tokens=t,
                                         num_slots=self.num_slots, page_size=self.pool.page_size,
                                         num_pages=self.pool.num_pages, pages_per_seq=self.runner.pages_per_seq,
                                         shift_rows=shift_rows)
        f, ints = pack_rows(rows, t)
        out = self.runner.verify(batch, f, ints, self._prev_tokens(prev), plan_rows(rows), sched.rounds,
                                 prev.decode.emitted if pipelined else None)
        s, reach = self.num_slots, {}
        for req in sched.decodes:   # at most: read back as accepted
            known = len(req.output_token_ids) if req in shift_rows else None
            reach[req] = verify_reach(req, len(sched.drafts.get(req, ())), sched.rounds, known)
            self.scheduler.verify_dispatched(req, reach[req])
        self.scheduler.dispatched(sched)
        launched = LaunchedStep(sched, None, out, [], {req: s + r for r, req in enumerate(sched.decodes)},
                                any(r.params.logprobs is not None for r in sched.decodes), spans=spans, reach=reach)
        start_copies(launched)
        return launched

    @staticmethod
    def _prev_tokens(prev: LaunchedStep | None) -> tuple:
        """The in-flight step's sampled tokens a new step gathers its pending tokens from (prefill, decode)."""
        return (None, None) if prev is None else tuple(None if o is None else o.gather_tokens
                                                       for o in (prev.prefill, prev.decode))

    def _prefill(self, sched: SchedulerOutput):
        # decided now: a preemption before a chunk is read back must not drop its rows
        record_lp = [c.request.records_prompt_logprobs for c in sched.prefills]
        t = self.runner.bucket_for(sum(c.num_tokens for c in sched.prefills), with_prompt_logprobs=any(record_lp))
        batch, rows = pack_prefill(sched, num_tokens=t, num_slots=self.num_slots, page_size=self.pool.page_size,
                                   num_pages=self.pool.num_pages, pages_per_seq=self.runner.pages_per_seq)
        f, ints = pack_rows(rows, self.num_slots)
        return self.runner.prefill(batch, f, ints, with_prompt_logprobs=any(record_lp)), record_lp

    def _decode(self, sched: SchedulerOutput, num_steps: int, prev: LaunchedStep | None):
        """Row r of the step runs sched.decodes[r]; the rows are the smallest decode bucket that holds them."""
        n = self.runner.decode_rows_for(len(sched.decodes))
        b, rows = pack_decode(sched, {} if prev is None else prev.sample_rows, num_rows=n,
                              num_slots=self.num_slots, pages_per_seq=self.runner.pages_per_seq)
        f, ints = pack_rows(rows, n)
        prev_tokens = self._prev_tokens(prev)
        split_rows = None   # the default program, unless one of the bucket's long-context programs fits
        if compiled := self.runner.long_context_split_rows.get(n):
            longest = int((b["seq_lens"] + b["row_steps"] - 1).max())   # the longest context this launch reaches
            split_rows = long_context_decode.split_rows(len(sched.decodes), longest, compiled)
        return self.runner.decode(b["tokens"], b["page_table"], b["seq_lens"], f, ints, prev_tokens, plan_rows(rows),
                                  b["row_steps"] if num_steps > 1 else None, num_steps, b["slots"],
                                  split_rows=split_rows)

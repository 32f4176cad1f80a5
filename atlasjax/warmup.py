"""What `ModelRunner.warmup` compiles: every step program serving can reach, as `StepSpec`s with empty inputs of
each shape (decode buckets x sampling plans, with their multi-step and long-context variants; each prefill bucket and
the prompt-logprobs prefill; admit; the verify steps of speculative decoding, one and K rounds)."""
from __future__ import annotations

import functools

import numpy as np

from atlasjax import sampling, steps
from atlasjax.step_compiler import StepSpec


def step_specs(runner, num_steps: int, plans, max_decode_rows: int, max_prefill_tokens: int | None) -> list[StepSpec]:
    """The specs `runner.warmup` compiles (its arguments: see there)."""
    s, p = runner.max_num_seqs, runner.pages_per_seq
    z = functools.partial(np.zeros, dtype=np.int32)
    specs = []
    for rows in (b for b in runner.decode_buckets if b <= max_decode_rows):
        f, i = sampling.pack_rows([], rows)
        host = (z(rows), z((rows, p)), z(rows), z(rows), f, i)
        variants = (None, *runner.long_context_split_rows.get(rows, ()))
        for plan in plans:
            for split_rows in variants:
                specs.append(runner.decode_spec(host, (runner.no_prev_tokens,) * 2, plan, 1, split_rows))
                if num_steps > 1:
                    specs.append(runner.decode_spec(host + (z(rows),), (runner.no_prev_tokens,) * 2, plan, num_steps,
                                                   split_rows))
    f, i = sampling.pack_rows([], s)
    serving = max_prefill_tokens is None
    prefills = [(t, False) for t in runner.prefill_buckets if serving or t <= max_prefill_tokens]
    prefills += [(runner.prompt_logprobs_tokens, True)] if serving else []
    def ragged(t):   # a packed-chunks step's attention inputs, empty
        return dict(tokens=z(t), positions=z(t), slot_mapping=z(t), page_table=z((s, p)), seq_lens=z(s),
                    query_start=z(s + 1), num_seqs=np.int32(0))
    for t, with_prompt_logprobs in prefills:
        batch = dict(ragged(t), sample_rows=z(s), slot_ids=z(s), commit=np.zeros(s, bool), next_tokens=z(t))
        specs.append(runner.prefill_spec([batch[n] for n in steps.PREFILL_INPUTS] + [f, i], with_prompt_logprobs))
    if serving:
        specs.append(runner.admit_spec([]))
    for t in runner.verify_buckets if serving else ():
        f, i = sampling.pack_rows([], t)
        batch = dict(ragged(t), row_slots=z(t), budgets=z(s), caps=z(s), shift_from=z(s))
        specs += [runner.verify_spec(batch, f, i, (runner.no_prev_tokens,) * 2, plan, rounds) for plan in plans
                  for rounds in dict.fromkeys((1, runner.verify_rounds))]
    return specs

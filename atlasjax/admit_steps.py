"""Admit steps: each newly admitted request's slot gets its per-slot sampling state reset (penalty counts and
prompt mask from its tokens, its logit-bias table, its bad words) by `steps.admit_step`, several requests packed
into one fixed-shape program of `admit_rows` rows and `admit_tokens` tokens, in as few programs as hold them.

`AdmitSteps` is a base of `ModelRunner` (atlasjax/runner.py), which sets `max_num_seqs`, `max_model_len` and
`state`, and gives `_run`, `_host` and `_state_arg`.
"""
from __future__ import annotations

import functools

import numpy as np

from atlasjax import bad_words, sampling, steps
from atlasjax.bad_words import MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS
from atlasjax.sampling_params import MAX_LOGIT_BIAS
from atlasjax.step_compiler import StepSpec

ADMIT_ROWS = 16   # requests one admit step resets (runner.admit_rows)
ADMIT_TOKENS = 4096   # tokens one admit step holds at least (runner.admit_tokens): 16 requests of 256 tokens


class AdmitSteps:
    """Packs and runs the admit steps of the requests an engine step admits."""

    @property
    def admit_rows(self) -> int:
        """Requests one admit step takes (more admitted in one engine step run more admit steps)."""
        return min(self.max_num_seqs, ADMIT_ROWS)

    @property
    def admit_tokens(self) -> int:
        """Tokens one admit step holds: a request of max_model_len, or ADMIT_TOKENS of shorter ones. (Sized
        max_model_len alone, a step admitting 64 prompts of 128 tokens at max_model_len 257 ran 32 admit programs,
        45 ms of host time before its prefill could start, against 11 ms with 4 programs; H200, session 82.)"""
        return max(self.max_model_len, ADMIT_TOKENS)

    def admit_spec(self, group) -> StepSpec:
        """group: (slot, token ids, prompt_len, bias table, bad-word sequences) of up to `admit_rows` requests,
        distinct slots, `admit_tokens` tokens in all (`admit` packs them so)."""
        rows = self.admit_rows
        slots = np.full(rows, self.max_num_seqs, np.int32)
        starts = np.zeros(rows + 1, np.int32)
        prompt_lens = np.zeros(rows, np.int32)
        tokens = np.zeros(self.admit_tokens, np.int32)
        bias_ids = np.zeros((rows, MAX_LOGIT_BIAS), np.int32)
        bias_vals = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
        bad = np.full((rows, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS), -1, np.int32)
        for r, (slot, token_ids, prompt_len, bias, bad_seqs) in enumerate(group):
            slots[r], prompt_lens[r] = slot, prompt_len
            starts[r + 1] = starts[r] + len(token_ids)
            tokens[starts[r]:starts[r + 1]] = token_ids
            bias_ids[r], bias_vals[r] = sampling.logit_bias_row(bias)
            bad[r] = bad_words.table(bad_seqs)
        starts[len(group) + 1:] = starts[len(group)]   # padding rows: empty
        packed, layout = steps.pack_host((slots, starts, prompt_lens, tokens, bias_ids, bias_vals, bad))
        return StepSpec(("admit", self.admit_tokens, rows), functools.partial(steps.admit_step, layout), (0,),
                        (self._state_arg, self._host(packed)))

    def admit(self, requests) -> None:
        """Reset the sampling state of each request's slot: requests, (slot, token ids so far, prompt_len,
        SamplingParams.bias_table(), bad-word token sequences) each (the first prompt_len tokens its prompt; a
        request's tokens past max_model_len are left out). They run in as few admit steps as hold them: up to
        `admit_rows` requests and `admit_tokens` tokens each, in order (a slot named twice starts a new step, so
        the later one wins)."""
        group, used = [], 0
        for slot, token_ids, prompt_len, bias, bad_seqs in requests:
            token_ids = token_ids[:self.max_model_len]
            if group and (len(group) == self.admit_rows or used + len(token_ids) > self.admit_tokens
                          or any(slot == g[0] for g in group)):
                self.state = self._run(self.admit_spec(group))
                group, used = [], 0
            group.append((slot, token_ids, prompt_len, bias, bad_seqs))
            used += len(token_ids)
        if group:
            self.state = self._run(self.admit_spec(group))

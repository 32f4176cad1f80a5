"""The long-context decode program: the smallest decode bucket compiled a second time, its attention
splitting each context as if only FEW_ROWS rows were busy; a step runs it when at most FEW_ROWS
requests decode and one of their contexts reaches MIN_CONTEXT tokens.

Why: the decode attention kernel gives every row of a step the same number of context splits, sized so
one wave of programs covers all of the step's rows (pallas_kernels/paged_attention.py). A lone request
in the 8-row step then attends on 3 splits x 8 KV heads = 24 programs of the H200's 132 SMs: at 4k
tokens 34 us per layer, 18 us with the 9 splits sized for 2 rows (docs/performance.md, session 57). With
every row busy those 9 splits are slower, and at short contexts the default is within ~1 us of the
best, so no one split count serves every step. The host knows each step's active rows and contexts
and picks the program.
"""
from __future__ import annotations

FEW_ROWS = 2         # the rows the long-context program sizes its splits for: the most active rows it runs
MIN_CONTEXT = 1024   # tokens; below it the default splits measured within ~1-3 us of the best (session 57)


def resolve(setting: bool | None, *, on_gpu: bool, attention_backend: str, smallest_bucket: int,
            max_model_len: int) -> bool:
    """Whether the engine compiles and runs the long-context program: never when the smallest decode
    bucket holds FEW_ROWS rows or fewer (it splits for them already) or no context reaches MIN_CONTEXT;
    else as set, and when None (auto) on a GPU whose decode attention is the Pallas kernel (the reference
    backend does not split contexts)."""
    if smallest_bucket <= FEW_ROWS or max_model_len < MIN_CONTEXT:
        return False
    if setting is None:
        return on_gpu and attention_backend in ("auto", "pallas")
    return setting


def split_rows(num_active: int, longest_context: int) -> int | None:
    """The `split_rows` of a decode step (models/attention.py AttentionMetadata) with `num_active`
    requests, the longest reaching `longest_context` tokens during the launch; None: the default
    program."""
    return FEW_ROWS if num_active <= FEW_ROWS and longest_context >= MIN_CONTEXT else None

"""Long-context decode programs: a decode bucket compiled again with its attention's context splits sized
for fewer busy rows (`split_rows`), run while it holds fewer requests than rows and one of their contexts
is long (TIERS).

Why: the decode attention kernel gives every row of a step the same number of context splits, sized so
one wave of programs covers all of the step's rows (pallas_kernels/paged_attention.py). A lone request
in the 8-row step then attends on 3 splits x 8 KV heads = 24 programs of the H200's 132 SMs. Measured
on an H200 (Llama-3.1-8B's heads, us per layer; docs/performance.md, sessions 57-58):

| active rows, context | default (3 splits) | 4 (split_rows 5) | 5 (split_rows 4) | 9 (split_rows 2) | 17 (1) |
|---|---|---|---|---|---|
| 1, 4k / 8k / 32k | 34.1 / 62.2 / 240 | | | 18.4 / 28.3 / 87.6 | 16.9 / 23.4 / 56.0 |
| 2, 4k / 32k | 35.4 / 242 | | | 20.0 / 90.3 | 21.3 / 96.0 |
| 3, 1k / 4k | 13.1 / 36.9 | | 12.3 / 26.6 | 11.1 / 21.9 | |
| 4, 2k / 8k | 20.7 / 66.2 | | 17.5 / 46.5 | 15.9 / 50.9 | |
| 5, 2k / 8k | 21.0 / 66.5 | 18.4 / 55.5 | 18.3 / 50.1 | 19.9 / 55.5 | |
| 6, 4k / 8k | 38.9 / 67.6 | 34.0 / 57.7 | 33.4 / 55.4 | 36.7 / 57.7 | |
| 7, 2k / 4k / 8k | 22.9 / 39.8 / 69.1 | 21.6 / 36.7 / 62.8 | 26.6 / 46.8 / 84.6 | 24.8 / 39.1 / 63.7 | |

With every row busy more splits are slower (8 rows at 4k: 41.5 us with 3, 44.4 with 8), and at short
contexts the default is within ~1 us of the best, so no one split count serves every step. The host
knows each step's active rows and contexts and picks the program.

The 16-row step (9-16 requests when the smallest bucket has 8 rows) splits a context in 2 for 16 rows,
the 32-row step (17-32) in 1. With 9-10 busy rows of 16, or 17-20 of 32, 3 splits (split_rows 8) are
faster; with more busy rows the default is as fast or faster (session 59, us per layer):

| active of 16 rows, context | default (2 splits) | 3 (split_rows 8) | 5 |
|---|---|---|---|
| 9, 2k / 4k / 8k | 30.8 / 53.7 / 99.7 | 27.4 / 45.5 / 80.3 | 32.0 / 53.1 / 95.0 |
| 10, 2k / 4k / 8k | 31.0 / 54.4 / 100.4 | 29.0 / 48.4 / 87.2 | 33.3 / 54.2 / 96.7 |
| 12, 4k / 8k | 57.3 / 105.7 | 73.0 / 139.0 | 58.9 / 104.3 |

| active of 32 rows, context | default (1 split) | 2 | 3 (split_rows 8) |
|---|---|---|---|
| 17, 2k / 4k / 8k | 54.3 / 99.4 / 189.7 | 56.6 / 105.5 / 202.1 | 47.9 / 83.6 / 154.2 |
| 20, 2k / 4k / 8k | 54.9 / 102.9 / 192.1 | 61.5 / 114.2 / 217.9 | 52.1 / 90.9 / 164.7 |
| 24, 4k / 8k | 105.9 / 202.4 | 116.1 / 221.0 | 120.5 / 230.2 |

Past 16k tokens more than one wave of splits pays (session 70, H200, us per layer): split_rows a fraction of a
row (0.25: 66 splits a row, 0.5: 33, for any count of KV heads) where it measured faster. With 4 KV heads
(Qwen2.5-7B's; or an 8B at TP=2) one request took 37.2 / 39.0 / 44.1 us at 32k with 33 / 66 / 132 splits, 59.9 /
60.0 / 59.3 at 64k, 105.1 / 89.9 / 94.4 at 128k; two requests at 128k 187.6 / 140.1 / 142.1 with 17 / 33 / 66.
So a lone request takes 66 splits from 48k on.

| active rows, context | 9 splits (split_rows 2) | 17 (1) | 34 (~0.5) | 68 (~0.25) | 136 |
|---|---|---|---|---|---|
| 1, 16k / 64k / 128k | | 36.4 / 100.9 / 187.5 | 36.6 / 104.0 / 189.8 | 41.3 / 91.3 / 164.7 | 56.5 / 98.0 / 159.6 |
| 2, 16k / 64k / 128k | 51.3 / 174.0 / 338.5 | 49.4 / 188.8 / 373.6 | 51.0 / 151.1 / 302.6 | 55.7 / 149.6 / 278.5 | |
| 4, 16k / 64k / 128k | 99.6 / 376.6 / 735.7 | 78.6 / 302.1 / 598.6 | 82.2 / 264.0 / 536.4 | | |
"""
from __future__ import annotations

# (fewest active rows, most active rows, least longest context in tokens, split_rows): the first that
# holds picks the program. A fraction of a row: more than one wave of splits (0.25: 66 splits a row, whatever
# the model's KV heads).
TIERS = ((1, 1, 49152, 0.25), (1, 1, 4096, 1), (2, 2, 65536, 0.25), (3, 4, 65536, 0.5), (3, 4, 16384, 1),
         (1, 4, 1024, 2), (5, 6, 1024, 4), (7, 7, 2048, 5), (9, 10, 2048, 8), (17, 20, 2048, 8))


def resolve(setting: bool | None, *, on_gpu: bool, attention_backend: str, decode_buckets: tuple[int, ...],
            max_model_len: int) -> dict[int, tuple[float, ...]]:
    """The split_rows each decode bucket compiles long-context programs for (buckets without any left out).
    A bucket runs the steps of more requests than the bucket below it holds, so it takes the tiers of such
    request counts whose split_rows is below its rows (with as many rows or more its default splits as
    finely already) and whose context threshold max_model_len lets a context pass. `setting` None (auto):
    on a GPU whose decode attention is the Pallas kernel (the reference backend does not split contexts);
    True / False: as said."""
    if setting is None:
        setting = on_gpu and attention_backend in ("auto", "pallas")
    programs, below = {}, 0
    for bucket in sorted(decode_buckets) if setting else ():
        splits = tuple(dict.fromkeys(split for fewest, most, context, split in TIERS
                                     if most > below and fewest <= bucket and split < bucket
                                     and max_model_len > context))
        if splits:
            programs[bucket] = splits
        below = bucket
    return programs


def split_rows(num_active: int, longest_context: int, compiled: tuple[float, ...]) -> float | None:
    """The split_rows of a decode step (models/attention.py AttentionMetadata) with `num_active` requests,
    the longest reaching `longest_context` tokens during the launch, among the `compiled` programs of its
    bucket; None: the default program."""
    for fewest, most, context, split in TIERS:
        if fewest <= num_active <= most and longest_context >= context and split in compiled:
            return split
    return None

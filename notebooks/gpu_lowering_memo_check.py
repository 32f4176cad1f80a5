"""Does the kernel lowering memo (pallas_kernels/lowering_memo.py) hand a program the module jax would
have made for it? Lowers a server's whole warm-up with the memo on and, for every kernel the memo
answers, lowers it again without the memo and compares the two modules: their text without source
locations (the call site) and without `mosaic_gpu.dump_basename`, a file name for debug dumps that jax
numbers anew each time it lowers a kernel (`quantized_matmul_int4_0`, `_1`...).

GPU: `PRESET=llama-3.1-8b QUANT=int4 python notebooks/gpu_lowering_memo_check.py`
CPU: not meaningful (kernels run interpreted there and are not lowered to Mosaic GPU).
Prints the step programs lowered, the memo's hits and misses, the seconds and every mismatch;
writes $OUT/lowering_memo_check.json when $OUT is set.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import time

os.environ["ATLASJAX_KERNEL_LOWERING_MEMO"] = "on"

from jax._src.pallas.mosaic_gpu import lowering  # noqa: E402

from atlasjax.bench.presets import load_preset  # noqa: E402
from atlasjax.engine import LLMEngine  # noqa: E402
from atlasjax.engine_config import EngineConfig  # noqa: E402
from atlasjax.runner import ModelRunner  # noqa: E402

PRESET, QUANT = os.environ.get("PRESET", "tiny"), os.environ.get("QUANT", "none").replace("none", "") or None

memoized = lowering.lower_jaxpr_to_module
assert hasattr(memoized, "stats"), "the memo is not installed"
jax_lower = memoized.__wrapped__
checked, mismatches, diffs = [], [], []


def text(result) -> str:
    """The module without source locations or its dump file name (jax numbers each lowering of a kernel)."""
    asm = result.module.operation.get_asm(enable_debug_info=False)
    return re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "", asm)


def checking(*args, **kwargs):
    hits = memoized.stats["hits"]
    result = memoized(*args, **kwargs)
    if memoized.stats["hits"] > hits:
        fresh = jax_lower(*args, **kwargs)
        same = text(fresh) == text(result) and fresh.new_out_shapes == result.new_out_shapes
        source = args[7].debug_info.func_src_info
        checked.append(source)
        if not same:
            again = text(jax_lower(*args, **kwargs))     # is jax's own lowering the same twice?
            mismatches.append(dict(kernel=source, jax_same_twice=again == text(fresh)))
            print(f"MISMATCH {mismatches[-1]}", flush=True)
            if len(diffs) < 3:
                diffs.append("".join(difflib.unified_diff(text(result).splitlines(True), text(fresh).splitlines(True),
                                                          "memo", "fresh", n=1)))
    return result


lowering.lower_jaxpr_to_module = checking
lowered = []
original_lower = ModelRunner._lower


def timed_lower(self, spec):
    result = original_lower(self, spec)
    lowered.append((str(spec.key), round(result[1], 2)))
    print(f"lowered {spec.key}: {result[1]:.2f} s (memo {memoized.stats})", flush=True)
    return result


ModelRunner._lower = timed_lower
t0 = time.perf_counter()
loaded = load_preset(PRESET, "bfloat16", QUANT, 0)
engine = LLMEngine(EngineConfig(max_num_seqs=64, dtype="bfloat16", compile_at_start=True), loaded=loaded)
summary = dict(preset=PRESET, quantization=QUANT, programs=len(lowered), memo=memoized.stats,
               checked_hits=len(checked), mismatches=mismatches, kernels=sorted(set(checked)),
               lower_seconds=lowered, start_seconds=round(time.perf_counter() - t0, 1))
print(json.dumps(summary, indent=1))
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "lowering_memo_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(os.environ["OUT"], "lowering_memo_diffs.txt"), "w") as f:
        f.write("\n\n".join(diffs))

"""GPU: new weights from disk while serving (`LLM.update_weights_from_disk`, atlasjax/weight_update.py) on
Llama-3.1-8B shapes (random weights over MODEL's config.json), against restarting the engine on them.

Per format (bf16, fp8 quantized at load), an engine starts (programs compiled, or loaded from the caches under
/tmp), saves its weights (`LLM.save`, orbax) and then:
- takes them back from the files cold (dropped from the page cache, posix_fadvise DONTNEED) and warm;
- a new engine starts on the saved directory with the caches warm (a restart);
- greedy tokens of one prompt before, after the update, and from the restarted engine (all equal: the same weights).
JSON lines on stdout.

    MODEL=.cache/llama8b FORMATS=bf16,fp8 SAVE=/tmp/weights python notebooks/gpu_weight_update.py
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kv_disk import drop_page_cache  # noqa: E402

from atlasjax import LLM, SamplingParams, compile_cache  # noqa: E402

MODEL = os.environ.get("MODEL", ".cache/llama8b")
FORMATS = os.environ.get("FORMATS", "bf16,fp8").split(",")
SAVE = os.environ.get("SAVE", "/tmp/weights")
PROMPT = list(range(100, 200))   # (ids every test model has)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024)


def tokens(llm) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids)


def run(fmt: str) -> dict:
    quant = None if fmt == "bf16" else fmt
    t0 = time.perf_counter()
    llm = LLM(MODEL, load_format="dummy", quantization=quant, **ENGINE)
    start = time.perf_counter() - t0
    before = tokens(llm)
    path = os.path.join(SAVE, fmt)
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    llm.save(path)
    save = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)
    os.sync()
    dropped = drop_page_cache(path)
    cold = llm.update_weights_from_disk(path)["seconds"]
    after_cold = tokens(llm)
    warm = llm.update_weights_from_disk(path)["seconds"]
    after_warm = tokens(llm)
    compiles = llm.engine.runner.num_compiles
    del llm
    t0 = time.perf_counter()
    restarted = LLM(path, **ENGINE)
    restart = time.perf_counter() - t0
    return {"format": fmt, "saved_bytes": size, "files_dropped": dropped, "first_start_s": start, "save_s": save,
            "update_cold_s": cold, "update_warm_s": warm, "restart_s": restart, "compiles_after_updates": compiles,
            "same_tokens": before == after_cold == after_warm == tokens(restarted)}


def main() -> None:
    compile_cache.enable("/tmp/atlasjax-jax-cache")
    for fmt in FORMATS:
        print(json.dumps(run(fmt)), flush=True)


if __name__ == "__main__":
    main()

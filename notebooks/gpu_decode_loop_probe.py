"""GPU: k greedy decode steps inside one jitted call (a lax.fori_loop over the decode body), bs=1.

For k = 1, 4, 8: the host's time to issue one call (timed until it returns, then waited on) and
the device time per token (calls back to back). Whether the loop lets the host issue k tokens'
work for little more than one step's cost, and whether the device pays for the loop. The probe
behind the engine's multi-step decoding (docs/performance.md, session 8).

  JAX_PLATFORMS=cuda [QUANT=int4] [PRESET=llama-3.1-8b] python notebooks/gpu_decode_loop_probe.py
  (writes $OUT/multistep_{QUANT or bf16}.json; PRESET=tiny runs on a CPU)
"""
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax import sampling
from atlasjax.bench.presets import load_preset
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.sampling_params import SamplingParams
from models.attention import AttentionMetadata
from models.transformer import Transformer
from pallas_kernels.kv_write import decode_slots

OUT = os.environ.get("OUT", "/tmp")
QUANT = os.environ.get("QUANT") or None
PRESET = os.environ.get("PRESET", "llama-3.1-8b")
NUM_PAGES = 80

engine = LLMEngine(EngineConfig(num_scheduler_steps=1, dtype="bfloat16", max_num_seqs=1, max_model_len=1024,
                                page_size=16, num_pages=NUM_PAGES, max_num_batched_tokens=512),
                   load_preset(PRESET, jnp.bfloat16, QUANT, 0, 1))
engine.add_request("r0", list(range(1, 129)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
for _ in range(6):
    engine.step()
runner = engine.runner
plan = sampling.SamplingPlan(greedy=True, logprobs=False)
f, i = sampling.pack_rows([(SamplingParams(temperature=0), 0, 0, ())], 1)
st = sampling.SamplingTensors(jnp.asarray(f), jnp.asarray(i))
page_table = jnp.asarray(np.arange(runner.pages_per_seq, dtype=np.int32)[None] % NUM_PAGES)


def decode_loop(k, params, state, tokens, seq_lens):
    """k greedy decode iterations, each feeding back its token: (state, tokens [k, 1], seq_lens)."""
    _, num_pages, page_size, _ = state.kv[0][0].shape

    def body(j, carry):
        kv, counts, tokens, seq_lens, out = carry
        meta = AttentionMetadata(slot_mapping=decode_slots(page_table, seq_lens, page_size, num_pages),
                                 page_table=page_table, seq_lens=seq_lens)
        hidden, kv = runner.model.apply({"params": params}, tokens, jnp.maximum(seq_lens - 1, 0), kv, meta)
        logits = runner.model.apply({"params": params}, hidden, method=Transformer.logits)
        new = sampling.sample(logits, counts, state.prompt_mask, st, plan)[0]
        return kv, counts, new, seq_lens + 1, out.at[j].set(new)

    init = (state.kv, state.counts, tokens, seq_lens, jnp.zeros((k, 1), jnp.int32))
    kv, counts, tokens, seq_lens, out = jax.lax.fori_loop(0, k, body, init)
    return state.replace(kv=kv, counts=counts), out, seq_lens


res = {"device": jax.devices()[0].device_kind, "quant": QUANT, "preset": PRESET}
tokens, seq_lens = jnp.ones((1,), jnp.int32), jnp.asarray([140], jnp.int32)
for k in (1, 4, 8):
    fn = jax.jit(functools.partial(decode_loop, k), donate_argnums=(1,)).lower(
        runner.params, runner.state, tokens, seq_lens).compile()
    res[f"k{k}_while_loops_in_hlo"] = fn.as_text().count(" while(")
    host = []
    for _ in range(20):   # host time to issue one call, each waited on before the next
        t = time.perf_counter()
        runner.state, out, _ = fn(runner.params, runner.state, tokens, seq_lens)
        host.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    n = 40 // k           # device time: calls back to back
    t = time.perf_counter()
    for _ in range(n):
        runner.state, out, _ = fn(runner.params, runner.state, tokens, seq_lens)
    jax.block_until_ready(out)
    per_token = (time.perf_counter() - t) / (n * k)
    res[f"k{k}"] = {"host_issue_ms": 1e3 * statistics.median(host[3:]), "per_token_ms": 1e3 * per_token}
    print(k, res[f"k{k}"], flush=True)
print(json.dumps(res, indent=1))
with open(f"{OUT}/multistep_{QUANT or 'bf16'}.json", "w") as fh:
    json.dump(res, fh, indent=1)

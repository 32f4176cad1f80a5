# ruff: noqa: F401, F821  (TINY, L8B, log and SamplingParams come from the exec of gpu_decode_step.py's head)
import time, json, os, functools
import jax, jax.numpy as jnp, numpy as np
exec(open("notebooks/gpu_decode_step.py").read().split("def copy_bw")[0])  # configs, helpers
from atlasjax.engine_config import EngineConfig
from atlasjax.engine import LLMEngine
from atlasjax.loader import LoadedModel, random_params
from atlasjax.sampling import pack_rows
from models.transformer import Transformer
from models.attention import AttentionMetadata
def eng_for(cfg, params, be="pallas"):
    return LLMEngine(EngineConfig(num_scheduler_steps=1, dtype="bfloat16", page_size=16, max_model_len=2048,
                                  max_num_seqs=1,
                                  num_pages=160, attention_backend=be), loaded=LoadedModel(cfg, params, None, "r"))
def timeit(fn, n=30):
    for _ in range(3): out = fn()
    jax.block_until_ready(out); t = time.perf_counter()
    for _ in range(n): out = fn()
    jax.block_until_ready(out); return round((time.perf_counter() - t) / n * 1000, 3)
for name, cfg in (("tiny", TINY), ("8b", L8B)):
    params = random_params(cfg, jnp.bfloat16, 0)
    e = eng_for(cfg, params); r = e.runner
    tokens = np.ones(1, np.int32); pt = np.zeros((1, r.pages_per_seq), np.int32); pt[0, :9] = np.arange(9); lens = np.array([129], np.int32)
    f, i = pack_rows([(SamplingParams(temperature=0), 0, 0, ())], 1)
    log(f"{name}_step_numpy_inputs_ms", timeit(lambda: r.decode(tokens, pt, lens, f, i).tokens))
    dt, dp, dl, df, di = map(jnp.asarray, (tokens, pt, lens, f, i))
    log(f"{name}_step_device_inputs_ms", timeit(lambda: r.decode(dt, dp, dl, df, di).tokens))
    model = Transformer(cfg, attn_backend="pallas", dtype=jnp.bfloat16)
    @functools.partial(jax.jit, donate_argnums=(1,))
    def fwd(params, kv, tok, pt, lens):
        pos = lens - 1
        slot = pt[0, pos // 16] * 16 + pos % 16
        meta = AttentionMetadata(slot_mapping=slot, page_table=pt, seq_lens=lens)
        h, kv = model.apply({"params": params}, tok, pos, kv, meta)
        return jnp.argmax(model.apply({"params": params}, h, method=Transformer.logits), -1), kv
    state = {"kv": r.state.kv}
    def run():
        out, state["kv"] = fwd(params, state["kv"], dt, dp, dl); return out
    log(f"{name}_forward_argmax_only_ms", timeit(run))
    del e, r, params, state

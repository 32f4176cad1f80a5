"""GPU end-to-end: 8B-shaped decode step times (bs 1/32/128, pallas vs reference, int8), greedy equality."""
import json, os, time, traceback
import jax, jax.numpy as jnp, numpy as np
from atlasjax.config import ModelConfig, RopeScaling
from atlasjax.engine import LLMEngine
from atlasjax.engine_config import EngineConfig
from atlasjax.loader import LoadedModel, random_params
from atlasjax.sampling import pack_rows
from atlasjax.sampling_params import SamplingParams

OUT = os.environ.get("OUT", "/tmp")
res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
def log(k, v):
    res[k] = v; print(k, v, flush=True)
    json.dump(res, open(f"{OUT}/e2e.json", "w"), indent=1)

L8B = ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                  rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=131072)
TINY = ModelConfig(family="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=128, max_position_embeddings=4096)

def copy_bw():
    x = jnp.ones((1 << 30,), jnp.bfloat16)  # 2 GiB
    f = jax.jit(lambda a: a + 1)
    f(x).block_until_ready()
    t = time.perf_counter(); n = 10
    for _ in range(n): y = f(x)
    y.block_until_ready()
    return 2 * x.nbytes * n / (time.perf_counter() - t) / 1e9

def engine(cfg, params, **kw):
    ec = EngineConfig(num_scheduler_steps=1, dtype="bfloat16", page_size=16, max_model_len=2048, **kw)
    return LLMEngine(ec, loaded=LoadedModel(cfg, params, None, "random"))

def decode_time(eng, bs, ctx=129, iters=30):
    r = eng.runner; s = eng.num_slots
    pps = -(-ctx // 16)
    tokens = np.ones(s, np.int32); pt = np.zeros((s, r.pages_per_seq), np.int32); lens = np.zeros(s, np.int32)
    for i in range(bs):
        pt[i, :pps] = np.arange(i * pps, (i + 1) * pps); lens[i] = ctx
    f, ii = pack_rows([(SamplingParams(temperature=0), 0, 0, ())] * bs, s)
    for _ in range(3): out = r.decode(tokens, pt, lens, f, ii)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(iters): out = r.decode(tokens, pt, lens, f, ii)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters * 1000

def greedy(eng, prompts, n):
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while eng.has_unfinished(): eng.step()
    return [eng.requests[f"g{i}"][0].output_token_ids for i in range(len(prompts))]

try: log("copy_GBps", round(copy_bw(), 1))
except Exception: traceback.print_exc()

RUN_GREEDY = os.environ.get("RUN_GREEDY", "1") == "1"
# 1) greedy through kernels == through reference (tiny, then 8B-shaped)
for name, cfg in ((("tiny", TINY), ("llama8b", L8B)) if RUN_GREEDY else ()):
    try:
        params = random_params(cfg, jnp.bfloat16, seed=1)
        rs = np.random.RandomState(0)
        prompts = [list(map(int, rs.randint(0, cfg.vocab_size, size=n))) for n in (5, 130, 700)]
        outs = {}
        for be in ("pallas", "reference"):
            eng = engine(cfg, params, max_num_seqs=4, attention_backend=be, max_num_batched_tokens=512)
            outs[be] = greedy(eng, prompts, 24); del eng
        log(f"greedy_equal_{name}", [a == b for a, b in zip(outs["pallas"], outs["reference"])])
        log(f"greedy_prefix_match_{name}", [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                           for a, b in zip(outs["pallas"], outs["reference"])])
        del params
    except Exception: traceback.print_exc()

# 2) decode step times, llama-3.1-8b shapes
params = random_params(L8B, jnp.bfloat16, seed=0)
for bs, be in ((1, "pallas"), (1, "reference")):
    try:
        t0 = time.perf_counter()
        eng = engine(L8B, params, max_num_seqs=bs, attention_backend=be, num_pages=max(bs * 10, 128) + 16)
        ms = decode_time(eng, bs)
        log(f"decode_bs{bs}_{be}_ms", round(ms, 3)); log(f"decode_bs{bs}_{be}_tok_s", round(bs * 1000 / ms, 1))
        log(f"compile_bs{bs}_{be}_s", round(time.perf_counter() - t0, 1))
        del eng
    except Exception: traceback.print_exc()
from atlasjax.quantization import quantize_params
for fmt in ("int8", "fp8", "int4"):
    try:
        qp = quantize_params(params, fmt, symmetric=fmt != "int4")
        eng = engine(L8B, qp, max_num_seqs=1, attention_backend="pallas", num_pages=144)
        log(f"decode_bs1_{fmt}_ms", round(decode_time(eng, 1), 3)); del eng, qp
    except Exception: traceback.print_exc()
print(json.dumps(res, indent=1))

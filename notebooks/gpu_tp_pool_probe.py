"""GPU probe: the KV pool an engine gets under tensor parallelism (argv[1]: TP size; argv[2] "compile": compile
every step before the pool, as a server does), with the device allocator's statistics after it."""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
for name in ("jax", "absl"):
    logging.getLogger(name).setLevel(logging.WARNING)
from atlasjax.bench.preset_server import install_preset
install_preset("llama-3.1-8b", None)
import jax
from atlasjax import LLM
tp = int(sys.argv[1])
print("before", jax.local_devices()[0].memory_stats(), flush=True)
llm = LLM(None, tensor_parallel_size=tp, max_num_seqs=128, max_model_len=1088, num_scheduler_steps=4,
          compile_at_start=len(sys.argv) > 2 and sys.argv[2] == "compile")
print("pages", llm.engine.pool.num_pages, flush=True)
from atlasjax.device_memory import driver_memory, memory_stats
for d in jax.local_devices():
    print(d, memory_stats(d), "driver (free, total):", driver_memory(d.local_hardware_id), flush=True)
from atlasjax import SamplingParams
out = llm.generate([[1, 2, 3, 4, 5]] * 4, SamplingParams(max_tokens=8, temperature=0.0))
print("generated", [len(o.outputs[0].token_ids) for o in out], flush=True)

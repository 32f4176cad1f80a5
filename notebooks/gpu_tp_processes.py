"""Tensor parallelism with one process per GPU (jax.distributed on one host) against one process
driving every GPU: bs=1 engine step time at the same TP size.

In one process, one host thread issues every GPU's part of each step; with one process per GPU,
each host issues only its own, and process 0 publishes each step to the others (docs/tensor_parallel.md,
multi-host). Run without ATLASJAX_PROCESS_ID, the script launches TP processes on this host (GPU i
visible to process i) and prints process 0's figures:

  JAX_PLATFORMS=cuda TP=2 [PRESET=llama-3.1-8b] python notebooks/gpu_tp_processes.py
  SINGLE=1 ... runs the same loop in this one process over all its GPUs (the comparison).
  (PRESET=tiny JAX_PLATFORMS=cpu checks it on a CPU)
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import time

TP = int(os.environ.get("TP", "2"))
PRESET = os.environ.get("PRESET", "llama-3.1-8b")


def launch():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(TP):
        env = dict(os.environ, ATLASJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ATLASJAX_NUM_PROCESSES=str(TP),
                   ATLASJAX_PROCESS_ID=str(i))
        if env.get("JAX_PLATFORMS", "").startswith("cpu"):
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        procs.append(subprocess.Popen([sys.executable, __file__], env=env,
                                      stdout=subprocess.PIPE if i else None, stderr=subprocess.STDOUT if i else None))
    rc = [p.wait(timeout=900) for p in procs]
    if any(rc):
        for p in procs[1:]:
            print((p.stdout.read() or b"").decode()[-3000:])
    sys.exit(max(rc))


def run():
    from atlasjax import distributed
    distributed.initialize(distributed.DistributedConfig.from_env())
    import jax
    import jax.numpy as jnp
    from atlasjax.bench.presets import load_preset
    from atlasjax.engine import LLMEngine
    from atlasjax.engine_config import EngineConfig
    from atlasjax.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(num_scheduler_steps=1, dtype="bfloat16", max_num_seqs=8, max_model_len=1024,
                                    page_size=16, num_pages=136, max_num_batched_tokens=512, tensor_parallel_size=TP),
                       load_preset(PRESET, jnp.bfloat16, None, 0, TP))
    if not distributed.is_leader():
        engine.follow()
        return
    engine.add_request("r0", list(range(1, 129)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(12):
        engine.step()
    times = []
    for _ in range(60):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.stop_followers()
    res = {"device": jax.devices()[0].device_kind, "processes": jax.process_count(), "tp": TP, "preset": PRESET,
           "engine_step_ms": {"median": 1e3 * statistics.median(times),
                              "p10": 1e3 * sorted(times)[len(times) // 10],
                              "p90": 1e3 * sorted(times)[9 * len(times) // 10]}}
    print(json.dumps(res), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"tp{TP}_processes{jax.process_count()}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    run() if "ATLASJAX_PROCESS_ID" in os.environ or os.environ.get("SINGLE") else launch()

"""GPU probe: what copying pages to pinned host memory costs, fresh and after the allocator has grown once
(KV offloading's saves). 2 MiB pages (Llama-8B: 32 layers' K and V of 16 tokens, bf16), in batches of 64.

    python notebooks/gpu_pinned_host_alloc.py
"""
import time

import jax
import jax.numpy as jnp

dev = jax.devices()[0]
pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
pages = [jnp.full((64, 8, 16, 128), i, jnp.bfloat16) for i in range(64)]
jax.block_until_ready(pages)


def copy(kind, label):
    t = time.perf_counter()
    out = jax.device_put(pages, [kind] * len(pages))
    jax.block_until_ready(out)
    dt = time.perf_counter() - t
    print(f"{label}: 64 pages (128 MiB) in {dt * 1e3:.1f} ms = {0.125 / dt:.1f} GiB/s", flush=True)
    return out


for kind, name in ((pinned, "pinned_host"),):   # (a GPU addresses only device and pinned_host)
    held = [copy(kind, f"{name} fresh #{i}") for i in range(4)]
    del held
    for i in range(3):
        copy(kind, f"{name} after free #{i}")
    back = copy(kind, f"{name} for h2d")
    t = time.perf_counter()
    jax.block_until_ready(jax.device_put(back, [jax.sharding.SingleDeviceSharding(dev)] * len(back)))
    dt = time.perf_counter() - t
    print(f"{name} -> device: 128 MiB in {dt * 1e3:.1f} ms = {0.125 / dt:.1f} GiB/s", flush=True)

"""Does a small host-to-device put wait for the computation (or a pending device-to-host copy) in flight?

Session 42's probe behind "a 16 KB put costs 0.28-0.36 ms on the H100 host whether or not the GPU is
busy" (docs/performance.md). `JAX_PLATFORMS=cuda python notebooks/gpu_h2d_put.py`; on a CPU set
N=256 for a quick check.
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

N = int(os.environ.get("N", "8192"))
a = jnp.ones((N, N), jnp.bfloat16)


@jax.jit
def heavy(a):
    return jax.lax.fori_loop(0, 8, lambda i, x: (x @ a) * 0.5, a)[:16, 0]


@jax.jit
def small(x, packed):
    return x + packed[:16].astype(x.dtype)


packed = np.arange(4096, dtype=np.int32)   # 16 KB, like a step's packed host inputs
heavy(a).block_until_ready()
small(jnp.zeros(16, jnp.bfloat16), packed).block_until_ready()
t = time.perf_counter()
heavy(a).block_until_ready()
print(jax.devices(), jax.__version__, f"heavy alone {(time.perf_counter() - t) * 1e3:.2f} ms")


def trial(name, fn, n=10):
    ts = []
    for _ in range(n):
        y = heavy(a)
        t = time.perf_counter()
        fn(y)
        ts.append(time.perf_counter() - t)
        y.block_until_ready()
    print(f"{name:55s} median {np.median(ts) * 1e3:7.3f} ms  max {max(ts) * 1e3:7.3f}")


trial("device_put while heavy runs", lambda y: jax.device_put(packed))
trial("device_put while heavy runs + its D2H queued", lambda y: (y.copy_to_host_async(), jax.device_put(packed)))
trial("jit(numpy) while heavy runs + D2H queued", lambda y: (y.copy_to_host_async(), small(y, packed)))
trial("dependent jit(device arr) + D2H queued (put first)",
      lambda y: (y.copy_to_host_async(), small(y, jax.device_put(packed))))
pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
trial("device_put to pinned_host + D2H queued", lambda y: (y.copy_to_host_async(), jax.device_put(packed, pinned)))

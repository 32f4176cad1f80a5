"""GPU: what a grid-wide barrier costs inside a Mosaic GPU kernel (session 31).

The one design left for overlapping one projection's weight stream with the previous one's tail is
a persistent kernel whose phases are separated by a barrier over all of its blocks. This times the
barrier alone: every block copies a 4 KB row into a buffer (TMA store, waited on), then reads its
neighbour's row and stores it. With the barrier (a global semaphore from `pl.get_global`: each
block signals it and waits until all have) the neighbour's row is the one just written; without it,
each block reads its own row back. Pallas zeroes the semaphore before each call (an XLA fill in the
same launch), which the time includes; the "signal only" variant signals the semaphore without
waiting, which separates the fill's cost from the wait's. Each call's rows differ, so a read that
overtook the barrier would show as a mismatch.

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks [BLOCKS=132,128,264] python notebooks/gpu_grid_barrier.py   # -> $OUT/grid_barrier.json
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from atlasjax.bench_kernels_quant import device_ms

OUT = os.environ.get("OUT", "/tmp")
ROW = (8, 128)   # one block's row: 4 KB of f32


def kernel(src_gmem, out_gmem, buf_gmem, a_smem, b_smem, a_bar, b_bar, *, blocks, barrier):
    b = lax.axis_index("b")
    plgpu.copy_gmem_to_smem(src_gmem.at[b], a_smem, a_bar)
    plgpu.barrier_wait(a_bar)
    plgpu.copy_smem_to_gmem(a_smem, buf_gmem.at[b])
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)   # the row is in memory before the signal
    source = b
    if barrier:   # "signal" or "wait"
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        pl.semaphore_signal(sem)
    if barrier == "wait":
        pl.semaphore_wait(sem, blocks, decrement=False)
        source = lax.rem(b + 1, blocks)
    plgpu.copy_gmem_to_smem(buf_gmem.at[source], b_smem, b_bar)
    plgpu.barrier_wait(b_bar)
    plgpu.copy_smem_to_gmem(b_smem, out_gmem.at[b])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def call(blocks, barrier):
    shape = jax.ShapeDtypeStruct((blocks, *ROW), jnp.float32)
    return jax.jit(lambda src: plgpu.kernel(
        functools.partial(kernel, blocks=blocks, barrier=barrier),
        out_type=(shape, shape),
        scratch_types=[plgpu.SMEM(ROW, jnp.float32), plgpu.SMEM(ROW, jnp.float32),
                       plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)],
        grid=(blocks,), grid_names=("b",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(src)[0])


results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
for blocks in [int(b) for b in os.environ.get("BLOCKS", "132,128,264").split(",")]:
    row = {}
    for barrier in (None, "signal", "wait"):
        fn = call(blocks, barrier)
        mismatches = 0
        for it in range(50):
            src = jnp.asarray(np.random.default_rng(it).standard_normal((blocks, *ROW)), jnp.float32)
            expect = jnp.roll(src, -1, axis=0) if barrier == "wait" else src
            mismatches += int(not bool(jnp.array_equal(fn(src), expect)))
        us = device_ms(fn, src, iterations=50) * 1e3
        row[{None: "none", "signal": "signal_only", "wait": "barrier"}[barrier]] = {"us": round(us, 2), "wrong_calls_of_50": mismatches}
    row["barrier_cost_us"] = round(row["barrier"]["us"] - row["none"]["us"], 2)
    row["fill_and_signal_us"] = round(row["signal_only"]["us"] - row["none"]["us"], 2)
    results[str(blocks)] = row
    print(blocks, row, flush=True)
json.dump(results, open(f"{OUT}/grid_barrier.json", "w"), indent=1)

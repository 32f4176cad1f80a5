"""GPU: the memory floor of a persistent MLP kernel (int4 gate_up, then down, in one launch).

Sessions 15-31 put the int4 bs=1 target at or below the floor of one kernel per projection, and
left one design: a persistent kernel whose phases are separated by a grid barrier, so that blocks
done with one projection load the next one's weight while the last blocks finish. This measures
what that design could gain before anyone builds it, in the manner of session 15's stream probe:
kernels whose pipeline steps only wait for their tiles (int4 bytes of Llama-3.1-8B's gate_up,
4096 x 28672, and down, 14336 x 4096, 8 activation rows). Variants, us per call:

  separate      the two stream kernels of today's grids (gate_up 448 blocks; down 64 x 4 K splits),
                in one jitted call, back to back;
  fused_free    one kernel, 448 blocks: each streams one gate_up tile, then one down unit (64
                columns x 1/7 of K), with no barrier: the overlap's upper bound;
  fused_barrier as fused_free with a grid barrier (a global semaphore) between the phases;
  fused_prefetchP  as fused_barrier, with the unit's first P weight steps prefetched into L2
                (TMA prefetch) before the barrier, the activations loaded as usual after it;
  fused_early   the barrier inside the down pipeline's first step, after its prologue has issued
                the first `depth` weight tiles, then one activation tile loaded after the barrier
                (a real kernel must reload what its prologue read before the barrier).
The barrier needs all 448 blocks resident at once: 4 per SM on 132 SMs (~54 KB of shared memory
each at depth 4), which the script checks before it runs them.

  JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks python notebooks/gpu_persistent_mlp_floor.py
  (-> $OUT/persistent_mlp_floor.json; DEPTH=4 steps in flight)
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, copy_bandwidth, device_ms
from gpu_stream_probe import stream
from pallas_kernels.gemm_tiling import swizzled

OUT = os.environ.get("OUT", "/tmp")
ROWS, TILE_N, ROW_BYTES = 8, 64, 128          # a step: 64 weight rows x 128 bytes (256 int4 weights)
DEPTH = int(os.environ.get("DEPTH", "4"))
K1, N1 = 4096, 28672                          # gate_up
K2, N2 = 14336, 4096                          # down
STEPS1 = K1 // 2 // ROW_BYTES                 # 16
STEPS2 = K2 // 2 // ROW_BYTES                 # 56
BLOCKS = N1 // TILE_N                         # 448
SPLITS2 = BLOCKS // (N2 // TILE_N)            # 7 down units per column tile
PER2 = STEPS2 // SPLITS2                      # 8 steps per down unit
X_COLS = ROW_BYTES * 2                        # activations per step


def specs(first):
    return [plgpu.BlockSpec((TILE_N, ROW_BYTES), lambda s: (0, first + s),
                            transforms=swizzled(ROW_BYTES * 8, 8, "weight")),
            plgpu.BlockSpec((ROWS, X_COLS), lambda s: (0, first + s), transforms=swizzled(X_COLS * 16, 16, "x"))]


def fused(mode):
    def kernel(w1, x1, w2, x2, out1, out2, out_smem, xs_smem, x_bar):
        b = lax.axis_index("b")
        zeros = plgpu.layout_cast(jnp.zeros((TILE_N, ROWS), jnp.float32), plgpu.Layout.WGMMA)

        def store(acc, out, col):
            out_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out.at[:, pl.ds(col, TILE_N)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)

        acc = plgpu.emit_pipeline(lambda _, *refs: refs[-1], grid=(STEPS1,), in_specs=specs(0),
                                  max_concurrent_steps=DEPTH, init_carry=zeros)(w1.at[pl.ds(b * TILE_N, TILE_N)], x1)
        store(acc, out1, b * TILE_N)
        sem = None
        if mode != "free":
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
            pl.semaphore_signal(sem)
        tile, split = b // SPLITS2, lax.rem(b, SPLITS2)
        if mode.startswith("prefetch"):   # the unit's first weight steps into L2 before the barrier
            steps = int(mode[len("prefetch"):])
            for i in range(0, steps * ROW_BYTES, 256):   # a TMA box is at most 256 wide
                plgpu.async_prefetch(w2.at[pl.ds(tile * TILE_N, TILE_N), pl.ds(split * PER2 * ROW_BYTES + i, 256)])
        if mode == "barrier" or mode.startswith("prefetch"):
            pl.semaphore_wait(sem, BLOCKS, decrement=False)

        def step(idx, w_smem, x_smem, carry):
            if mode == "early":
                @pl.when(idx[0] == 0)
                def _():
                    pl.semaphore_wait(sem, BLOCKS, decrement=False)
                    # one round trip for activations written before the barrier (the tile
                    # the prologue loaded is stale in a real kernel): its first step's, again
                    plgpu.copy_gmem_to_smem(x2.at[:, pl.ds(split * PER2 * X_COLS, X_COLS)], xs_smem, x_bar)
                    plgpu.barrier_wait(x_bar)
            return carry

        acc = plgpu.emit_pipeline(step, grid=(PER2,), in_specs=specs(split * PER2), max_concurrent_steps=DEPTH,
                                  init_carry=zeros)(w2.at[pl.ds(tile * TILE_N, TILE_N)], x2)
        store(acc, out2.at[split], tile * TILE_N)

    call = plgpu.kernel(
        kernel, out_type=(jax.ShapeDtypeStruct((ROWS, N1), jnp.float32),
                          jax.ShapeDtypeStruct((SPLITS2, ROWS, N2), jnp.float32)),
        scratch_types=[plgpu.SMEM((ROWS, TILE_N), jnp.float32), plgpu.SMEM((ROWS, X_COLS), jnp.bfloat16),
                       plgpu.Barrier(num_arrivals=1)],
        grid=(BLOCKS,), grid_names=("b",), kernel_name=f"persistent_mlp_floor_{mode}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return lambda x1, x2, w1, w2: call(w1, x1, w2, x2)


def smem_kb_per_block():
    pipeline = DEPTH * (TILE_N * ROW_BYTES + ROWS * X_COLS * 2)
    return (pipeline + ROWS * TILE_N * 4 + ROWS * X_COLS * 2) / 1024 + 1   # + 1 KB reserved per block


def separate():
    gate_up = stream(K1, N1, bits=4, depth=DEPTH, splits=1)
    down = stream(K2, N2, bits=4, depth=DEPTH, splits=4)
    return lambda x1, x2, w1, w2: (gate_up(x1, w1), down(x2, w2))


def main():
    copy = copy_bandwidth()
    rng = np.random.default_rng(0)
    x1 = jnp.asarray(rng.standard_normal((ROWS, K1), np.float32), jnp.bfloat16)
    x2 = jnp.asarray(rng.standard_normal((ROWS, K2), np.float32), jnp.bfloat16)
    w1 = jnp.asarray(rng.integers(0, 256, (N1, K1 // 2), np.uint8))
    w2 = jnp.asarray(rng.integers(0, 256, (N2, K2 // 2), np.uint8))
    nbytes = w1.nbytes + w2.nbytes
    copies = max(2, -(-MIN_ROTATION_BYTES // nbytes))
    ws = [(w1 ^ np.uint8(i), w2 ^ np.uint8(i)) for i in range(copies)]
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_GBps": round(copy / 1e9),
               "depth": DEPTH, "mb": round(nbytes / 1e6, 1), "copy_us": round(nbytes / copy * 1e6, 2)}
    print(results, flush=True)
    resident = int(228 // smem_kb_per_block()) * jax.devices()[0].core_count
    results["resident_blocks"] = resident
    variants = [("separate", separate()), ("fused_free", fused("free"))]
    if resident >= BLOCKS:   # else the barrier would wait forever for blocks that cannot start
        variants += [("fused_barrier", fused("barrier")), ("fused_early", fused("early")),
                     ("fused_prefetch4", fused("prefetch4")), ("fused_prefetch8", fused("prefetch8"))]
    for name, fn in variants:
        try:
            one = jax.jit(lambda x1, x2, ws, fn=fn: [fn(x1, x2, *w) for w in ws])
            us = device_ms(one, x1, x2, ws) / copies * 1e3
            results[name] = {"us": round(us, 2), "copy_fraction": round(nbytes / (us * 1e-6) / copy, 3)}
        except Exception as e:   # a variant that fails to compile or run is reported, not fatal
            results[name] = {"error": str(e).splitlines()[0][:300]}
        print(name, results[name], flush=True)
    json.dump(results, open(f"{OUT}/persistent_mlp_floor.json", "w"), indent=1)


if __name__ == "__main__":
    main()

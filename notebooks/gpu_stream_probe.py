"""GPU: how fast can the int4 decode kernel's pipeline stream at all? (session 15)

A Mosaic GPU kernel with the int4 kernel's grid, TMA tiles and `emit_pipeline`, whose steps do
no work: each step only waits for its tiles. So it measures the memory side alone (the pipeline
structure, tile shape, depth, blocks per SM), which the real kernel cannot beat. For each
Llama-3.1-8B projection (int4 bytes: K / 2 per weight row), variants:
  base     64 weight rows x 128 bytes (two groups of 128) + the [8, 256] x tile, depth 4, the
           kernel's K splits (what the int4 kernel streams today);
  nox      base without the x tile;
  rows128  128 weight rows per block (16 KB tiles), twice the K splits;
  bytes256 256-byte weight rows (four groups per step);
  depthD   D steps in flight;
  occB     shared memory padded so that only B blocks fit per SM;
  splitS   S K splits;
  rows     base plus the int4 kernel's per-step scale and zero-point rows (two [2, 64] f16 tiles).
Times: CUPTI kernel time per call, weights rotated past the L2; fraction of a device-to-device copy
measured in the same run. The real int4 kernel (g128 zero points, mma order) runs beside it.

  [BITS=4,8] [KERNELS_ONLY=1] [ONLY=base,rows] JAX_PLATFORMS=cuda python notebooks/gpu_stream_probe.py   # writes $OUT/stream_probe.json
"""
import functools
import json
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, copy_bandwidth, device_ms, rotated
from atlasjax.weights_summary import weight_nbytes
from atlasjax.quantization import quantize
from pallas_kernels import int4_mma_order
from pallas_kernels.gemm_tiling import k_splits, swizzled
from pallas_kernels.quantized_matmul import quantized_matmul

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
ROWS = 8
BITS = [int(b) for b in os.environ.get("BITS", "4,8").split(",")]
KERNELS_ONLY = os.environ.get("KERNELS_ONLY") == "1"   # only the real kernels, no stream variants
ONLY = os.environ.get("ONLY", "").split(",") if os.environ.get("ONLY") else None   # these stream variants only


def kernel_splits(k, n, bits):
    """The K splits the quantized kernel picks at 8 rows (int4: steps of two groups of 128; int8: 128)."""
    per_step = 256 if bits == 4 else 128
    unroll = 2 if bits == 4 else 1
    steps = k // per_step
    return k_splits(steps, n // 64, requested=None, max_auto=steps * unroll // 8)


def stream(k, n, *, bits=4, tile_n=64, row_bytes=128, depth=4, splits=1, with_x=True, pad_kb=0, rows=False):
    """A jitted fn(x [8, K] bf16, w [N, K * bits / 8] uint8) -> [splits, 8, N] f32 of zeros that streams w."""
    steps = (k * bits // 8) // row_bytes
    assert steps % splits == 0, (k, row_bytes, splits)
    per_split = steps // splits

    def kernel(w_gmem, x_gmem, s_gmem, out_gmem, out_smem, *pad):
        ni, sp = lax.axis_index("n"), lax.axis_index("split")
        first = sp * per_split
        specs = [plgpu.BlockSpec((tile_n, row_bytes), lambda s: (0, first + s),
                                 transforms=swizzled(row_bytes * 8, 8, "weight"))]
        operands = [w_gmem.at[pl.ds(ni * tile_n, tile_n)]]
        if with_x:
            x_cols = row_bytes * 8 // bits   # the activations of a step's weight columns
            specs.append(plgpu.BlockSpec((ROWS, x_cols), lambda s: (0, first + s),
                                         transforms=swizzled(x_cols * 16, 16, "x")))
            operands.append(x_gmem)
        if rows:   # a step's groups of 128: rows [2 s, 2 s + 2) of the scales and of the zero points
            groups = row_bytes * 8 // bits // 128
            specs += [plgpu.BlockSpec((groups, tile_n), lambda s: (first + s, 0))] * 2
            operands += [s_gmem.at[:, pl.ds(ni * tile_n, tile_n)]] * 2

        def step(_, *refs):
            return refs[-1]

        acc = plgpu.emit_pipeline(
            step, grid=(per_split,), in_specs=specs, max_concurrent_steps=depth,
            init_carry=plgpu.layout_cast(jnp.zeros((tile_n, ROWS), jnp.float32), plgpu.Layout.WGMMA),
        )(*operands)
        out_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[sp, :, pl.ds(ni * tile_n, tile_n)])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, ROWS, n), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, tile_n), jnp.float32)] + (
            [plgpu.SMEM((pad_kb * 1024,), jnp.uint8)] if pad_kb else []),
        grid=(n // tile_n, splits), grid_names=("n", "split"), kernel_name="stream_probe",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    group_rows = jnp.zeros((k // 128, n), jnp.float16)
    return lambda x, w: call(w, x, group_rows)


def smem_kb(tile_n, row_bytes, depth):
    """Shared memory of an int4 stream block with its x tile: `depth` stages plus the output tile."""
    return depth * (tile_n * row_bytes + ROWS * row_bytes * 4) / 1024 + 2


def variants(name, bits):
    k, n = SHAPES[name]
    s = kernel_splits(k, n, bits)
    v = {"base": dict(splits=s), "bytes256": dict(splits=s, row_bytes=256)}
    if bits == 4:
        v["rows"] = dict(splits=s, rows=True)
    if name == "lm_head" or bits == 8:
        return v
    v |= {"nox": dict(splits=s, with_x=False), "rows128": dict(splits=2 * s, tile_n=128)}
    for d in (2, 3, 6, 8):
        v[f"depth{d}"] = dict(splits=s, depth=d)
    for b in (1, 2, 3):   # pad shared memory so that only b blocks fit in 227 KB
        v[f"occ{b}"] = dict(splits=s, pad_kb=int(227 // b - smem_kb(64, 128, 4)) - 1)
    for sp in (1, 2, 4, 8, 16):
        if sp != s and (k // 256) % sp == 0:
            v[f"split{sp}"] = dict(splits=sp)
    return v


def no_conversion(shift, with_bias):
    """Ablation: the int4 kernel with its nibble conversion replaced by a register move (wrong
    values, same loads, wgmmas and scaling): what the conversion costs."""
    return "mov.b32 $0, $1;"


def main():
    copy = copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}  jax {jax.__version__}  copy {copy / 1e9:.0f} GB/s", flush=True)
    results = []
    rng = np.random.default_rng(0)

    def timed(name, k, n, variant, fn, x, ws, nbytes, **info):
        copies = len(ws)
        try:
            us = device_ms(rotated(fn), x, ws) / copies * 1e3
        except Exception as e:  # a variant that does not fit is reported, not fatal
            print(f"{name} {variant}: failed: {str(e).splitlines()[0][:200]}", flush=True)
            return
        frac = nbytes / (us * 1e-6) / copy
        results.append(dict(proj=name, K=k, N=n, variant=variant, us=us, copy_fraction=frac, **info))
        print(f"{name} {k}x{n} {variant} {info}: {us:.2f} us ({frac:.0%} of copy)", flush=True)

    for name, (k, n) in SHAPES.items():
        x = jnp.asarray(rng.standard_normal((ROWS, k), np.float32), jnp.bfloat16)
        for bits in BITS:
            w = jnp.asarray(rng.integers(0, 256, (n, k * bits // 8), np.uint8))
            copies = max(2, -(-MIN_ROTATION_BYTES // w.nbytes))
            ws = [w ^ np.uint8(i) for i in range(copies)]
            chosen = {} if KERNELS_ONLY else variants(name, bits)
            for vname, kw in {v: kw for v, kw in chosen.items() if ONLY is None or v in ONLY}.items():
                timed(name, k, n, f"stream{bits}_{vname}", stream(k, n, bits=bits, **kw), x, ws, w.nbytes, **kw)
            del ws
            # the real kernels on the same shape: int4 g128 zero points in mma order (what quantize
            # makes), also with the conversion ablated; per-channel int8 through XLA (the engine's) and Pallas
            wb = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
            qw = quantize(wb, "int4" if bits == 4 else "int8", group_size=128 if bits == 4 else None)
            copies = max(2, -(-MIN_ROTATION_BYTES // weight_nbytes(qw)))
            qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
            nbytes = weight_nbytes(qw)
            if bits == 4:
                timed(name, k, n, "int4_kernel", functools.partial(quantized_matmul, backend="pallas"), x, qws, nbytes)
                jax.clear_caches()   # so that the jitted kernel is traced again with the patch
                with mock.patch.object(int4_mma_order, "_pair_asm", no_conversion):
                    timed(name, k, n, "int4_kernel_no_conversion",
                          functools.partial(quantized_matmul, backend="pallas"), x, qws, nbytes)
                jax.clear_caches()
            else:
                timed(name, k, n, "int8_xla", functools.partial(quantized_matmul, backend="xla"), x, qws, nbytes)
                timed(name, k, n, "int8_pallas", functools.partial(quantized_matmul, backend="pallas"), x, qws, nbytes)
            del qws
    with open(os.path.join(os.environ.get("OUT", "."), "stream_probe.json"), "w") as f:
        json.dump(dict(copy_bytes_per_s=copy, device=jax.devices()[0].device_kind, results=results), f, indent=1)


if __name__ == "__main__":
    main()

"""How the streamed decode matmul kernels (quantized_matmul, int8_mma_matmul, decode_matmul) lay a
weight out over the GPU: shared-memory tile transforms, the number of SMs, the K split that fills
them; and the interpret-mode switch they share."""
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_BUDGET = 200 * 1024  # bytes of shared memory a pipeline may use (the H100 allows 227 KB per block)


def swizzled(rows_bits: int, elem_bits: int, what: str):
    """Tiling + swizzle transforms for a shared-memory tile whose rows hold `rows_bits` bits."""
    swizzle = plgpu.find_swizzle(rows_bits, what)
    return (plgpu.TilingTransform((8, swizzle * 8 // elem_bits)), plgpu.SwizzleTransform(swizzle))


def elem_bits(dtype) -> int:
    """Bits per stored weight element: 4 for int4, else the dtype's width."""
    return 4 if jnp.dtype(dtype) == jnp.int4 else jnp.dtype(dtype).itemsize * 8


def interpret_params(interpret):
    """`plgpu.kernel`'s interpret argument from a kernel entry's: True -> default interpret-mode
    params, False/None -> native, an `InterpretGPUParams` as given."""
    return (plgpu.InterpretGPUParams() if interpret is True else interpret) or None


def num_sms() -> int:
    try:
        return jax.devices()[0].core_count
    except (AttributeError, RuntimeError):
        return 132


def k_splits(num_steps: int, num_blocks: int, *, requested: int | None, max_auto: int) -> int:
    """Grid splits of a K loop of `num_steps` steps: `requested`, clamped down to a divisor of
    num_steps; or (None) the divisor nearest to enough splits for ~2 blocks per SM (at most
    `max_auto`), the larger on a tie (int4 qkv, 96 blocks: 4 splits, not 2, measured 0.9 us faster
    on the H100; docs/perf_quant.md, session 14)."""
    if requested is not None:
        splits = max(1, min(requested, num_steps))
        while num_steps % splits:
            splits -= 1
        return splits
    want = max(1, min(max_auto, -(-2 * num_sms() // num_blocks), num_steps))
    divisors = [d for d in range(1, min(num_steps, max(max_auto, 1)) + 1) if num_steps % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))

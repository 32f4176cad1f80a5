"""bf16 activations as a sum of three e5m2 values, so that fp8 weights can multiply on the fp8 tensor
cores without rounding the activations to fp8.

A bf16 value v has 8 significant bits, an e5m2 value 3. Rounding v to e5m2, then the remainder, then
the remainder of that gives three parts whose sum is v exactly wherever the third part's lowest bit
(2^(e-7) for v in [2^e, 2^(e+1))) is not below e5m2's smallest subnormal 2^-16, i.e. for |v| >= 2^-9;
below that the sum is within 2^-17 of v. Each remainder is exact in f32. e5m2 holds up to 57344, so
activations are clipped there first, as an fp16 model (max 65504) would overflow near there.

The decode matmul (pallas_kernels/decode_matmul.py, `fp8_mma`) stages the parts in shared memory and
issues one wgmma per part into the same f32 accumulator: W @ (p1 + p2 + p3) = W @ v.
"""
import jax.numpy as jnp

FP8_PARTS = 3
E5M2_MAX = 57344.0


def split_e5m2(v):
    """v (f32, holding bf16 values; jnp or a Mosaic GPU register array) -> FP8_PARTS e5m2 arrays."""
    rest = jnp.minimum(jnp.maximum(v, -E5M2_MAX), E5M2_MAX)
    parts = []
    for i in range(FP8_PARTS):
        part = rest.astype(jnp.float8_e5m2)
        parts.append(part)
        if i + 1 < FP8_PARTS:
            rest = rest - part.astype(jnp.float32)
    return parts

"""int8 weights on the int8 tensor cores (pallas_kernels/int8_mma_matmul.py) against what the engine
runs for per-channel int8 (XLA's GEMM with the convert fused) and the bf16 dot, on Llama-3.1-8B
decode shapes. CUPTI sum of all kernels of one call, median, weights rotated past the L2.

    JAX_PLATFORMS=cuda python notebooks/gpu_int8_mma.py      # ROWS=1,8 CONFIGS=default,tk128,...

Writes $OUT/int8_mma.json and prints one line per (shape, rows, variant): us, % of copy, rel err.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench_kernels_quant import DECODE_SHAPES, MIN_ROTATION_BYTES, copy_bandwidth, device_ms, rotated
from atlasjax.quantization import dequantize, quantize
from pallas_kernels.int8_mma_matmul import Int8MmaConfig, _int8_mma_sums, int8_mma_matmul, split_activations
from pallas_kernels.quantized_matmul import quantized_matmul

CONFIGS = {
    "default": Int8MmaConfig(),
    "tk128": Int8MmaConfig(tile_k=128, max_concurrent_steps=8),
    "tk512": Int8MmaConfig(tile_k=512, max_concurrent_steps=4),
    "d4": Int8MmaConfig(max_concurrent_steps=4),
    "d8": Int8MmaConfig(max_concurrent_steps=8),
    "s1": Int8MmaConfig(num_k_splits=1),
    "s2x": Int8MmaConfig(num_k_splits=2),
    "s4x": Int8MmaConfig(num_k_splits=4),
}


def main():
    rows_list = [int(r) for r in os.environ.get("ROWS", "8,1").split(",")]
    names = os.environ.get("CONFIGS", ",".join(CONFIGS)).split(",")
    copy = copy_bandwidth()
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_GBps": copy / 1e9, "rows": []}
    print(f"{out['device']} copy {copy / 1e9:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    for k, n in DECODE_SHAPES:
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        qw = quantize(w, "int8")
        wq_bytes = qw.qweight.size + qw.scales.nbytes
        copies = max(2, -(-MIN_ROTATION_BYTES // wq_bytes))
        qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
        wcop = max(2, -(-MIN_ROTATION_BYTES // w.nbytes))
        ws = [w + i for i in range(wcop)]
        for m in rows_list:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw)), np.float32)
            row = {"K": k, "N": n, "M": m}
            row["bf16"] = device_ms(rotated(lambda x, w: x @ w), x, ws) / wcop * 1e3
            variants = {"xla_int8": lambda x, w: quantized_matmul(x, w, backend="xla")}
            for name in names:
                variants[f"mma_{name}"] = lambda x, w, c=CONFIGS[name]: int8_mma_matmul(x, w, config=c)
            for vname, fn in variants.items():
                try:
                    y = np.asarray(fn(x, qw), np.float32)
                    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
                    us = device_ms(rotated(fn), x, qws) / copies * 1e3
                    row[vname] = {"us": us, "pct_copy": 100 * wq_bytes / (us * 1e-6) / copy, "rel_err": err}
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    row[vname] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            # the kernel alone (activation split outside the timed call) and the split alone
            parts, _ = split_activations(x, qw.padded_shape[0])
            row["mma_kernel_only"] = device_ms(rotated(lambda p, w: _int8_mma_sums(p, w, Int8MmaConfig(), False)),
                                               parts, qws) / copies * 1e3
            row["split_only"] = device_ms(jax.jit(lambda x: split_activations(x, qw.padded_shape[0])), x) * 1e3
            out["rows"].append(row)
            print(f"{k}x{n} M={m}: bf16 {row['bf16']:.1f} us | kernel only {row['mma_kernel_only']:.1f} | "
                  f"split {row['split_only']:.1f}", flush=True)
            for vname in variants:
                v = row[vname]
                print(f"   {vname:14s} " + (f"{v['us']:7.1f} us {v['pct_copy']:5.1f}% err {v['rel_err']:.2e}"
                                           if "us" in v else v["error"]), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "int8_mma.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

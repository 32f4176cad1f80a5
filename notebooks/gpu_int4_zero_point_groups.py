"""Session 48: int4 groups of 32 and 64 with integer zero points (what `--quantization int4
--quantization-group-size 32|64` makes) on the fused kernel's two paths, 8B decode shapes, 8 rows.

`JAX_PLATFORMS=cuda PYTHONPATH=. python notebooks/gpu_int4_zero_point_groups.py`: the prescaled path
(what `default_config` chose before session 48) against the per-group path with the zero point in the
mma-order conversion's subtract, several groups per step; symmetric groups alongside. Prints us per
call (CUPTI, weights rotated past the L2) and the error against the reference.
"""
import json
import os

from atlasjax.bench_kernels_quant import DECODE_SHAPES, bench_decode, copy_bandwidth
from pallas_kernels.quantized_matmul import QuantMatmulConfig

CONFIGS = {"engine": None,
           "prescaled": QuantMatmulConfig(),
           "per_group_8_d3": QuantMatmulConfig(prescale=False, group_unroll=8, max_concurrent_steps=3),
           "per_group_4_d3": QuantMatmulConfig(prescale=False, group_unroll=4, max_concurrent_steps=3),
           "per_group_4": QuantMatmulConfig(prescale=False, group_unroll=4),
           "per_group_2": QuantMatmulConfig(prescale=False, group_unroll=2)}
FORMATS = [("int4", 32, "zp"), ("int4", 64, "zp"), ("int4", 64, "sym")]

if __name__ == "__main__":
    results = {"decode": [], "copy_GBps": copy_bandwidth() / 1e9}
    print(f"copy {results['copy_GBps']:.0f} GB/s")
    for k, n in DECODE_SHAPES:
        row = bench_decode(k, n, 8, results, CONFIGS, FORMATS)
        for key, v in row.items():
            if isinstance(v, dict):
                print(f"{k:6d} x {n:6d} {key:32s} " + (f"{v['us']:7.1f} us  err {v['rel_err']:.1e}" if "us" in v
                                                       else v["error"][:200]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "int4_zero_point_groups.json"), "w") as f:
        json.dump(results, f, indent=1)

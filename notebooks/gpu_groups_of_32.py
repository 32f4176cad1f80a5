"""Groups of 32 (GGUF Q4_0 / Q4_1 / Q4_K) on the fused kernel's two paths, on the 8B decode shapes.

`JAX_PLATFORMS=cuda PYTHONPATH=.:notebooks python notebooks/gpu_groups_of_32.py`: the prescaled path
(each group's scale folded into the bf16 tile) against the per-group path (each group's f32 partial
scaled; in mma order a step's groups load as one tile), with several groups per step and steps in
flight; float offsets from a ones-tile wgmma per group or from x's group sums (`x_sums`).
SHAPES="4096x4096,4096x1024" picks other (K x N) shapes; ONLY=offsets (or two_level, sym) one format. Prints us per call (CUPTI, weights rotated past the L2) and the error against the reference.
"""
import json
import os

from atlasjax.bench_kernels_quant import DECODE_SHAPES, bench_decode, copy_bandwidth
from pallas_kernels.quantized_matmul import QuantMatmulConfig
from pallas_kernels.quantized_matmul_rules import OFFSETS_CONFIG

CONFIGS = {"engine": None,
           "per_group_8": QuantMatmulConfig(prescale=False, group_unroll=8),
           "per_group_8_sums": QuantMatmulConfig(prescale=False, group_unroll=8, x_sums=True),
           "per_group_8_sums_d3": QuantMatmulConfig(prescale=False, group_unroll=8, x_sums=True, max_concurrent_steps=3),
           "per_group_4_sums": QuantMatmulConfig(prescale=False, group_unroll=4, x_sums=True),
           "prescaled_d3": OFFSETS_CONFIG}
FORMATS = [("int4", 32, "offsets"), ("int4", 32, "sym"), ("int4", 32, "two_level")]

if __name__ == "__main__":
    results = {"decode": [], "copy_GBps": copy_bandwidth() / 1e9}
    print(f"copy {results['copy_GBps']:.0f} GB/s")
    shapes = [tuple(map(int, s.split("x"))) for s in os.environ["SHAPES"].split(",")] if "SHAPES" in os.environ else DECODE_SHAPES
    for k, n in shapes:
        row = bench_decode(k, n, 8, results, CONFIGS, [f for f in FORMATS if os.environ.get("ONLY", "") in f[2]])
        for key, v in row.items():
            if isinstance(v, dict):
                print(f"{k:6d} x {n:6d} {key:42s} " + (f"{v['us']:7.1f} us  err {v['rel_err']:.1e}" if "us" in v else v["error"][:200]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "groups_of_32.json"), "w") as f:
        json.dump(results, f, indent=1)

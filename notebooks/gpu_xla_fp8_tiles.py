"""GPU: does XLA's autotuner pick the fastest tiles for the per-channel fp8 / int8 decode GEMMs? (session 53)

On an H200 each of an 8B layer's four fp8 GEMMs runs ~2.4 us longer than its bytes take at the copy
rate (docs/performance.md, session 52), and the short ones (qkv, o_proj) fit in the 50 MB L2, where
an autotuner that times a config on a warm cache could prefer tiles that stream worse from HBM. This
probe times the engine's path (`quantized_matmul`, XLA's convert-fused GEMM) at decode rows with the
weight rotated past the L2 (as bench_kernels_quant does), once with the autotuner's choice and once
per forced Triton config (`--xla_gpu_override_gemm_autotuner`, one process per config: the flag holds
for every GEMM of a process), and with `exhaustive` (`--xla_gpu_exhaustive_tiling_search`). "auto" and
"exhaustive" also write the autotuner's log (every config it timed, and its time) to $OUT. Prints us
per call per shape and the best config per shape.

  JAX_PLATFORMS=cuda PYTHONPATH=. [FMT=fp8] [ROWS=8] [CONFIGS="auto;exhaustive;..."] python notebooks/gpu_xla_fp8_tiles.py
  (-> $OUT/xla_fp8_tiles.json; a config is "bm,bn,bk,split_k,stages,warps")
"""
import json
import os
import subprocess
import sys

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CONFIGS = ["auto", "exhaustive",
           "16,64,256,1,4,4", "16,64,512,1,4,4", "16,128,256,1,4,4", "16,128,128,1,6,4",
           "16,64,256,2,4,4", "16,64,512,2,3,4", "16,128,256,2,4,4", "16,128,512,2,3,8",
           "16,64,256,4,4,4", "16,128,256,4,4,4", "16,32,512,1,4,4", "16,32,256,2,5,4",
           "16,256,128,4,4,8", "16,256,256,2,3,8", "16,128,128,8,6,4", "16,64,128,8,6,4"]


def override(config: str) -> str:
    bm, bn, bk, sk, stages, warps = config.split(",")
    return (f"--xla_gpu_override_gemm_autotuner=block_m:{bm} block_n:{bn} block_k:{bk} split_k:{sk} "
            f"num_stages:{stages} num_warps:{warps} num_ctas:1")


def child(fmt: str, rows: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from atlasjax.bench_kernels_quant import MIN_ROTATION_BYTES, device_ms, rotated
    from atlasjax.quantization import quantize
    from atlasjax.weights_summary import weight_nbytes
    from pallas_kernels.quantized_matmul import quantized_matmul
    rng = np.random.default_rng(0)
    out = {}
    for name, (k, n) in SHAPES.items():
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
        qw = quantize(w, fmt)
        copies = max(2, -(-MIN_ROTATION_BYTES // weight_nbytes(qw)))
        qws = [jax.tree.map(jnp.copy, qw) for _ in range(copies)]
        try:
            out[name] = device_ms(rotated(lambda x, w: quantized_matmul(x, w)), x, qws) / copies * 1e3
        except Exception as e:  # noqa: BLE001 - a config XLA cannot compile is a result
            out[name] = f"{type(e).__name__}: {str(e)[:160]}"
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    fmt, rows = os.environ.get("FMT", "fp8"), int(os.environ.get("ROWS", "8"))
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child(fmt, rows)
    configs = os.environ["CONFIGS"].split(";") if "CONFIGS" in os.environ else CONFIGS
    out_dir = os.environ.get("OUT", ".")
    flags = {"auto": f"--xla_gpu_dump_autotune_logs_to={out_dir}/autotune_{fmt}_auto.txt",
             "exhaustive": "--xla_gpu_exhaustive_tiling_search=true "
                           f"--xla_gpu_dump_autotune_logs_to={out_dir}/autotune_{fmt}_exhaustive.txt"}
    results = {}
    for config in configs:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + (flags.get(config) or override(config))).strip()
        proc = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True, text=True,
                              timeout=300)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
        results[config] = json.loads(line[7:]) if line else {"error": proc.stderr[-300:]}
        r = results[config]
        print(f"{config:20s} " + "  ".join(f"{s} {r[s]:6.2f}" if isinstance(r.get(s), float) else f"{s} -"
                                          for s in SHAPES) + ("" if line else f"  {r['error'][-160:]}"),
              flush=True)
    for s in SHAPES:
        timed = {c: r[s] for c, r in results.items() if isinstance(r.get(s), float)}
        if timed:
            best = min(timed, key=timed.get)
            print(f"best {s:8s} {best:20s} {timed[best]:6.2f} us (auto {timed.get('auto', float('nan')):6.2f})")
    with open(os.path.join(out_dir, f"xla_{fmt}_tiles.json"), "w") as f:
        json.dump({"fmt": fmt, "rows": rows, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

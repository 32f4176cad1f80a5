"""The roofline: what a step must move and compute, and the device's two ceilings, measured in the run.

Costs (counted, not measured):
- decode step, batch B at context C: weight bytes (every parameter except the embedding table,
  of which only B rows are read; a tied table is read whole as the LM head) + KV bytes read
  (B * C * 2 * layers * kv_heads * head_dim * itemsize); FLOPs 2 * B * matmul_params plus
  attention 4 * B * C * layers * heads * head_dim.
- prefill of prompts n_i: FLOPs 2 * sum(n_i) * layer_params + 2 * num_seqs * lm_head params
  (logits at the last row only) + causal attention 2 * sum(n_i^2) * layers * heads * head_dim;
  bytes: the weights once plus the KV written.
Ceilings (measured on the same device, in the same process, before the benchmark; a step that
runs tensor-parallel on N devices is held against N times them):
- copy bandwidth: a large device-to-device elementwise pass (bytes read + bytes written; on CPU a
  large matrix-vector product, see `measure_ceilings`);
- matmul rate: a large square product in bf16 on GPU/TPU, f32 on CPU.
"""
from __future__ import annotations

import time

import numpy as np

from atlasjax.config import ModelConfig


def time_fn(fn, *args, iters: int = 10, reps: int = 5) -> float:
    """Median seconds per call: `iters` back-to-back asynchronous calls per rep, synchronized at the end."""
    import jax  # noqa: PLC0415
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes/s) and matmul rate (FLOP/s) of the default device, measured now.

    Accelerators: a 2 GiB elementwise pass (bytes read + written). CPU: XLA runs elementwise
    passes on one thread but matmuls on all, so the bandwidth a decode step can reach there is
    that of a matrix-vector product over a 256 MiB matrix (bytes read).
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:
        w = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.float32)
        v = jax.random.normal(jax.random.key(3), (8192, 1), jnp.float32)
        t_copy = time_fn(jax.jit(lambda a, b: a @ b), w, v, iters=3, reps=3)
        moved, method = w.nbytes, "matrix-vector read, 256 MiB f32"
        del w
    else:
        x = jax.random.bits(jax.random.key(0), (1 << 29,), jnp.uint32)
        t_copy = time_fn(jax.jit(lambda a: a ^ jnp.uint32(1)), x, iters=10, reps=3)
        moved, method = 2 * x.nbytes, "elementwise pass, 2 GiB read + 2 GiB written"
        del x
    n = 1024 if on_cpu else 8192
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)   # random data: zeros run faster than real inputs
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    t_mm = time_fn(jax.jit(lambda p, q: p @ q), a, b, iters=3 if on_cpu else 10, reps=3)
    return dict(copy_bytes=moved, copy_seconds=t_copy, copy_bandwidth_Bps=moved / t_copy, copy_method=method,
                matmul_n=n, matmul_dtype=jnp.dtype(dtype).name, matmul_seconds=t_mm,
                matmul_flops_per_s=2 * n ** 3 / t_mm)


# ---- counted costs
def _leaf_bytes(leaf) -> int:
    from atlasjax.weights_summary import nbytes  # noqa: PLC0415
    return nbytes(leaf)


def weight_bytes_per_step(params: dict, cfg: ModelConfig, batch: int, act_itemsize: int) -> int:
    """Parameter bytes one forward step over `batch` tokens must read (the embedding table: B rows)."""
    import jax  # noqa: PLC0415
    total = sum(_leaf_bytes(x) for x in jax.tree_util.tree_leaves(params))
    if not cfg.tie_word_embeddings:
        total -= _leaf_bytes(params["embed_tokens"]["embedding"])
        total += batch * cfg.hidden_size * act_itemsize
    return int(total)


def estimate_weight_bytes(cfg: ModelConfig, itemsize: int, quantization: str | None = None,
                          quantize_lm_head: bool = False) -> int:
    """weight_bytes_per_step without the weights (from the config; quantized formats with their scales).
    quantize_lm_head: an untied LM head counts in the quantized format too (a tied one never does)."""
    quantized = _projection_params(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    other = _layer_params(cfg) - quantized + head + cfg.hidden_size
    if quantization and quantize_lm_head and not cfg.tie_word_embeddings:
        quantized, other = quantized + head, other - head
    per = {None: itemsize, "int8": 1 + 4 / cfg.hidden_size, "fp8": 1 + 4 / cfg.hidden_size,
           "int4": 0.5 + 4 / 128}[quantization]
    return int(quantized * per + other * itemsize)


def _projection_params(cfg: ModelConfig) -> int:
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * (attn + 3 * d * cfg.intermediate_size)


def _layer_params(cfg: ModelConfig) -> int:
    d, hd = cfg.hidden_size, cfg.head_dim
    norms = 2 * d + (2 * hd if cfg.qk_norm else 0)
    bias = hd * (cfg.num_heads + 2 * cfg.num_kv_heads) if cfg.qkv_bias else 0
    return _projection_params(cfg) + cfg.num_layers * (norms + bias)


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def decode_cost(cfg: ModelConfig, weight_bytes: int, kv_itemsize: int, batch: int, context: float) -> dict:
    """Bytes and FLOPs of one decode step: `batch` sequences, each attending to `context` tokens."""
    kv = batch * context * kv_bytes_per_token(cfg, kv_itemsize)
    matmul = _projection_params(cfg) + cfg.vocab_size * cfg.hidden_size
    attn = 4 * batch * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return dict(batch=batch, context=context, weight_bytes=int(weight_bytes), kv_bytes=int(kv),
                bytes=int(weight_bytes + kv), flops=float(2 * batch * matmul + attn))


def prefill_cost(cfg: ModelConfig, weight_bytes: int, kv_itemsize: int, prompt_lens: list[int]) -> dict:
    """Bytes and FLOPs of prefilling these prompts (logits at each prompt's last row only)."""
    n = float(sum(prompt_lens))
    attn = 2 * float(sum(x * x for x in prompt_lens)) * cfg.num_layers * cfg.num_heads * cfg.head_dim
    flops = 2 * n * _projection_params(cfg) + 2 * len(prompt_lens) * cfg.vocab_size * cfg.hidden_size + attn
    kv = n * kv_bytes_per_token(cfg, kv_itemsize)
    return dict(tokens=int(n), weight_bytes=int(weight_bytes), kv_bytes=int(kv), bytes=int(weight_bytes + kv),
                flops=flops)


def achieved(cost: dict, seconds: float, ceilings: dict | None, devices: int = 1) -> dict:
    """Bytes/s and FLOP/s of `cost` done in `seconds`, and their fractions of the measured ceilings.

    `devices`: how many devices share the work (tensor parallelism). The ceilings are measured on
    one device, so the roofline is `devices` times theirs: each device moves and computes its shard.
    """
    if not seconds or seconds <= 0:
        return dict(cost, devices=devices)
    out = dict(cost, devices=devices, seconds=seconds, bytes_per_s=cost["bytes"] / seconds,
               flops_per_s=cost["flops"] / seconds)
    if ceilings:
        bw, mm = ceilings["copy_bandwidth_Bps"] * devices, ceilings["matmul_flops_per_s"] * devices
        out.update(frac_copy_bandwidth=out["bytes_per_s"] / bw, frac_matmul_rate=out["flops_per_s"] / mm,
                   floor_seconds=max(cost["bytes"] / bw, cost["flops"] / mm),
                   bound="memory" if cost["bytes"] / bw >= cost["flops"] / mm else "compute")
        out["frac_roofline"] = out["floor_seconds"] / seconds
    return out

"""GPU benchmark of the paged attention kernels: `python -m atlasjax.bench_kernels_attention`.

Measures the two ceilings in the same run (device-to-device copy bandwidth, dense bf16 matmul
rate), then times decode (batch 32 x 4096 and batch 1 x 32768) and ragged prefill (one 4096-token
prompt) against those ceilings, over bf16 and fp8 pages (`--kv-cache-dtype fp8`), against jax's
Triton paged_attention where its constraints allow, and the jnp references; and the decode step's
K/V write fused into the kernel against an XLA scatter first, per layer of a donated chain (batch
1, 16, 32, 128). Prints a table; `--json PATH` also writes the
numbers.
"""

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlasjax.bench.roofline import time_fn
from pallas_kernels.kv_write import as_pool_dtype
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_and_write
from pallas_kernels.ragged_attention import ragged_paged_attention


def copy_bandwidth():
  x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)  # 2 GiB
  t = time_fn(jax.jit(lambda a: a + 1), x, iters=10)
  return 2 * x.nbytes / t


def matmul_rate(n=8192):
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
  t = time_fn(jax.jit(lambda x, y: x @ y), a, b, iters=10)
  return 2 * n**3 / t


def decode_case(num_seqs, ctx, num_kv_heads=8, group=4, head_dim=128, page_size=16, seed=0):
  rng = np.random.default_rng(seed)
  pages_per_seq = ctx // page_size
  num_pages = num_seqs * pages_per_seq
  table = rng.permutation(num_pages).reshape(num_seqs, pages_per_seq).astype(np.int32)
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (num_seqs, num_kv_heads * group, head_dim), jnp.bfloat16)
  shape = (num_kv_heads, num_pages, page_size, head_dim)
  k = jax.random.normal(keys[1], shape, jnp.bfloat16)
  v = jax.random.normal(keys[2], shape, jnp.bfloat16)
  return q, k, v, jnp.asarray(table), jnp.full((num_seqs,), ctx, jnp.int32)


def rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def fp8_pages(case):
  """A case with its K/V pools stored in fp8 e4m3 (`--kv-cache-dtype fp8`)."""
  q, k, v, *rest = case
  return (q, as_pool_dtype(k, jnp.float8_e4m3fn), as_pool_dtype(v, jnp.float8_e4m3fn), *rest)


def bench_decode(num_seqs, ctx, page_size, bw, rows, baselines=True):
  """The decode kernel over bf16 and fp8 pages (error of fp8 against the bf16 reference: the pool's
  rounding), the jnp reference and jax's Triton kernel."""
  case = decode_case(num_seqs, ctx, page_size=page_size)
  name = f"decode b={num_seqs} ctx={ctx} page={page_size}"
  ref = paged_decode_attention(*case, backend="reference")
  pallas = lambda *a: paged_decode_attention(*a, backend="pallas")
  fns = {"pallas (mosaic gpu)": (pallas, case), "pallas, fp8 e4m3 pages": (pallas, fp8_pages(case))}
  if baselines:
    fns["jnp reference"] = (lambda *a: paged_decode_attention(*a, backend="reference"), case)
    from jax.experimental.pallas.ops.gpu import paged_attention as triton_pa
    for splits in (16, 1):
      fns[f"jax triton paged_attention k_splits={splits}"] = (jax.jit(
          lambda q, k, v, t, l, s=splits: triton_pa.paged_attention(q, k, v, t, l, k_splits=s)), case)
  for label, (fn, args) in fns.items():
    q, k = args[:2]
    nbytes = 2 * k.nbytes + 2 * q.nbytes
    try:
      err = rel_err(fn(*args), ref)
      t = time_fn(fn, *args)
      rows.append(dict(case=name, impl=label, us=t * 1e6, gbps=nbytes / t / 1e9,
                       frac_copy_bw=nbytes / t / bw, rel_err=err))
    except Exception as e:  # a baseline's constraints may not allow the shape
      rows.append(dict(case=name, impl=label, error=f"{type(e).__name__}: {str(e)[:200]}"))


def bench_decode_write(num_seqs, ctx, rows, layers=32, backend="pallas", num_kv_heads=8, reps=5):
  """The decode step's attention as the model runs it: `layers` chained calls of
  paged_decode_attention_and_write in one jit with the pools donated, the new K/V written by the
  kernel (fused) or by an XLA scatter first, at a context of `ctx` in a table of 4 * ctx.
  Reports time per layer of each (the engine uses the fused write)."""
  q, k_pages, v_pages, table, lens = decode_case(num_seqs, 4 * ctx, num_kv_heads=num_kv_heads)
  lens = jnp.full((num_seqs,), ctx, jnp.int32)
  new_kv = jax.random.normal(jax.random.key(5), (num_seqs, num_kv_heads, q.shape[-1]), jnp.bfloat16)
  name = f"decode+write b={num_seqs} ctx={ctx} x{layers} layers"
  outs = {}
  for fused in (True, False):
    def chain(kp, vp, fused=fused):
      out = []
      for _ in range(layers):
        o, kp, vp = paged_decode_attention_and_write(q, new_kv, new_kv, kp, vp, table, lens, backend=backend,
                                                     fused_write=fused)
        out.append(o)
      return out, kp, vp
    fn = jax.jit(chain, donate_argnums=(0, 1))
    label = "fused write (kernel)" if fused else "XLA scatter + kernel"
    try:
      kp, vp = jnp.copy(k_pages), jnp.copy(v_pages)
      out, kp, vp = fn(kp, vp)
      jax.block_until_ready(out)
      outs[fused] = out[-1]
      times = []
      for _ in range(reps):
        t0 = time.perf_counter()
        out, kp, vp = fn(kp, vp)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
      us = float(np.median(times)) / layers * 1e6
      err = rel_err(outs[fused], outs[True]) if False in outs else 0.0
      rows.append(dict(case=name, impl=label, us=us, rel_err=err, per="layer"))
    except Exception as e:
      rows.append(dict(case=name, impl=label, error=f"{type(e).__name__}: {str(e)[:200]}"))


def bench_prefill(num_tokens, mm_rate, rows, page_size=64, num_kv_heads=8, group=4, head_dim=128,
                  with_reference=True, **tunables):
  case = decode_case(1, num_tokens, num_kv_heads, group, head_dim, page_size, seed=1)
  _, k, v, table, lens = case
  q = jax.random.normal(jax.random.key(7), (num_tokens, num_kv_heads * group, head_dim),
                        jnp.bfloat16)
  args = (q, k, v, table, lens, jnp.asarray([0, num_tokens], jnp.int32),
          jnp.asarray([1], jnp.int32))
  flops = 2 * 2 * num_tokens * num_tokens / 2 * num_kv_heads * group * head_dim  # causal
  name = f"prefill 1x{num_tokens} page={page_size}"
  ref = ragged_paged_attention(*args, backend="reference")
  impls = [(f"pallas (mosaic gpu) {tunables or ''}", "pallas", tunables, args)]
  if with_reference:
    impls += [("pallas, fp8 e4m3 pages", "pallas", tunables, fp8_pages(args)), ("jnp reference", "reference", {}, args)]
  for label, backend, kw, a in impls:
    fn = lambda *a, b=backend, kw=kw: ragged_paged_attention(*a, backend=b, **kw)
    try:
      err = rel_err(fn(*a), ref)
      t = time_fn(fn, *a, iters=5)
      rows.append(dict(case=name, impl=label, us=t * 1e6, tflops=flops / t / 1e12,
                       frac_matmul=flops / t / mm_rate, rel_err=err))
    except Exception as e:
      rows.append(dict(case=name, impl=label, error=f"{type(e).__name__}: {str(e)[:200]}"))


def sweep(bw, mm, rows):
  """Tunable sweep: prefill block_kv x stages, decode splits / stages."""
  case = decode_case(1, 32768, page_size=64)
  nbytes = 2 * case[1].nbytes + 2 * case[0].nbytes
  for splits in (16, 33, 66, 132):
    fn = lambda *a, n=splits: paged_decode_attention(*a, backend="pallas", num_splits=n)
    t = time_fn(fn, *case)
    rows.append(dict(case="sweep decode b=1 ctx=32768 page=64", impl=f"num_splits={splits}",
                     us=t * 1e6, gbps=nbytes / t / 1e9, frac_copy_bw=nbytes / t / bw, rel_err=0.0))
  case = decode_case(32, 4096, page_size=64)
  nbytes = 2 * case[1].nbytes + 2 * case[0].nbytes
  for stages, block in ((2, 64), (4, 64), (2, 128), (3, 128)):
    fn = lambda *a, n=stages, b=block: paged_decode_attention(
        *a, backend="pallas", num_stages=n, block_kv=b)
    t = time_fn(fn, *case)
    rows.append(dict(case="sweep decode b=32 ctx=4096 page=64", impl=f"stages={stages} block={block}",
                     us=t * 1e6, gbps=nbytes / t / 1e9, frac_copy_bw=nbytes / t / bw, rel_err=0.0))
  for block, stages in ((64, 2), (64, 4), (128, 2), (128, 3)):
    bench_prefill(4096, mm, rows, block_kv=block, num_stages=stages, with_reference=False)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--sweep", action="store_true", help="also sweep the kernels' tunables")
  args = parser.parse_args()
  bw, mm = copy_bandwidth(), matmul_rate()
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"copy {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
  rows = []
  for page_size in (16, 64):
    bench_decode(32, 4096, page_size, bw, rows)
  bench_decode(1, 32768, 16, bw, rows, baselines=True)
  bench_decode(1, 32768, 64, bw, rows, baselines=False)
  bench_prefill(4096, mm, rows)
  for num_seqs in (1, 16, 32, 128):
    bench_decode_write(num_seqs, 256, rows)
  if args.sweep:
    sweep(bw, mm, rows)
  for r in rows:
    if "error" in r:
      print(f"{r['case']:32s} {r['impl']:44s} ERROR {r['error']}")
    elif r.get("per") == "layer":
      print(f"{r['case']:32s} {r['impl']:44s} {r['us']:9.1f} us per layer  err {r['rel_err']:.1e}")
    elif "gbps" in r:
      print(f"{r['case']:32s} {r['impl']:44s} {r['us']:9.1f} us {r['gbps']:7.0f} GB/s "
            f"{100 * r['frac_copy_bw']:5.1f}% of copy  err {r['rel_err']:.1e}")
    else:
      print(f"{r['case']:32s} {r['impl']:44s} {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s "
            f"{100 * r['frac_matmul']:5.1f}% of matmul  err {r['rel_err']:.1e}")
  if args.json:
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat(), copy_gbps=bw / 1e9,
                matmul_tflops=mm / 1e12)
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()

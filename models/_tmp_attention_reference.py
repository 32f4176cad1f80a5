"""TEMPORARY jnp references used until pallas_kernels/*_attention.py land (then deleted)."""
import jax
import jax.numpy as jnp


def _gather(pages, page_table):  # pages [KV, N, ps, hd], page_table [P] -> [ctx, KV, hd]
    g = pages[:, page_table]  # [KV, P, ps, hd]
    return g.reshape(pages.shape[0], -1, pages.shape[-1]).swapaxes(0, 1)


def _attend(q, k, v, mask):  # q [T, H, hd], k/v [ctx, KV, hd], mask [T, ctx]
    t, h, hd = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, hd).astype(jnp.float32)
    s = jnp.einsum("tkgd,ckd->tkgc", qg, k.astype(jnp.float32)) / jnp.sqrt(hd)
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("tkgc,ckd->tkgd", p / jnp.where(denom == 0, 1, denom), v.astype(jnp.float32))
    return o.reshape(t, h, hd)


def decode(q, k_pages, v_pages, page_table, seq_lens, backend=None):
    def one(qs, pt, n):
        k, v = _gather(k_pages, pt), _gather(v_pages, pt)
        mask = (jnp.arange(k.shape[0]) < n)[None]
        return _attend(qs[None], k, v, mask)[0]
    return jax.vmap(one)(q, page_table, seq_lens).astype(q.dtype)


def ragged(q, k_pages, v_pages, page_table, seq_lens, query_start, num_seqs, backend=None):
    t = q.shape[0]
    rows = jnp.arange(t)

    def body(s, out):
        k, v = _gather(k_pages, page_table[s]), _gather(v_pages, page_table[s])
        qs, qe = query_start[s], query_start[s + 1]
        in_seq = (rows >= qs) & (rows < qe)
        pos = seq_lens[s] - (qe - qs) + (rows - qs)
        mask = in_seq[:, None] & (jnp.arange(k.shape[0])[None, :] <= pos[:, None])
        o = _attend(q, k, v, mask)
        return jnp.where(in_seq[:, None, None], o, out)
    out = jax.lax.fori_loop(0, jnp.reshape(num_seqs, ()), body, jnp.zeros(q.shape, jnp.float32))
    return out.astype(q.dtype)

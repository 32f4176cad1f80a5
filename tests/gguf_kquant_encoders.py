"""Test helper: simple Q4_K and Q6_K encoders (the `gguf` package decodes K-quants but cannot encode them).

Round-to-nearest per sub-block, not llama.cpp's search for the best scales: good enough to build
realistic K-quant files from real weights. Each encoder's output is checked against
`gguf.quants.dequantize` in tests/test_gguf_blocks.py, so these follow ggml's layouts, not the loader's.
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[...] float -> [..., 2] uint8 little-endian fp16."""
    return x.astype(np.float16)[..., None].view(np.uint8)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """w [N, K] (K a multiple of 256) -> [N, K / 256 * 144] uint8 Q4_K blocks: per sub-block of 32,
    w ~ d*sc*q - dmin*m with q in 0..15 and 6-bit sc, m."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // QK_K, 8, 32)
    low = np.minimum(x.min(-1), 0.0)                       # mins are subtracted: m >= 0
    scale = (x.max(-1) - low) / 15
    d = (np.maximum(scale.max(-1), 1e-10) / 63).astype(np.float16).astype(np.float32)
    dmin = (np.maximum(-low.min(-1), 1e-10) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.rint((x + (dmin[..., None] * m)[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)                 # [N, S, 8, 32]
    packed = np.empty((n, k // QK_K, 12), np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // QK_K, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)
    return blocks.reshape(n, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """w [N, K] (K a multiple of 256) -> [N, K / 256 * 210] uint8 Q6_K blocks: per sub-block of 16,
    w ~ d*sc*(q - 32) with q in 0..63 and an int8 sc."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // QK_K, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (np.maximum(scale.max(-1), 1e-10) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 0, 127).astype(np.int8)
    step = d[..., None] * sc
    q = np.clip(np.rint(x / np.where(step == 0, 1, step)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, k // QK_K, 2, 4, 32)      # [half, quarter j, l]: value 128h + 32j + l
    ql = (np.concatenate([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                          (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], axis=-1))   # [N, S, 2, 64]
    qh = sum(((q[:, :, :, j] >> 4) & 3) << (2 * j) for j in range(4)).astype(np.uint8)  # [N, S, 2, 32]
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8),
                             _f16_bytes(d)], axis=-1)
    return blocks.reshape(n, -1)

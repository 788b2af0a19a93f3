"""Partial softmax attention and its exact merge (docs/decoder.md).

Each side of a decode step attends over its own set of keys and returns ``(output, max
logit, normaliser)``: ``o = Σ e^{l_i−m} v_i / Z`` with ``m = max l_i`` and ``Z = Σ e^{l_i−m}``.
Two such partial results over disjoint sets merge into softmax attention over their union:
with ``m = max(m_W, m_Ω)`` and ``w_S = e^{m_S−m} Z_S``, ``o = (w_W o_W + w_Ω o_Ω) / (w_W + w_Ω)``.
An empty set has ``m = −inf`` and ``Z = 0`` and drops out of the merge.

- :func:`attend_rows_and_range` is the CPU side: a numba kernel (``nogil=True``, so it runs
  beside the accelerator's work in another thread) over each head's retrieved rows of the CPU
  key/value store plus the side-buffer range (:func:`attend_rows`: the rows alone).
- :func:`attend_window` is the accelerator side: plain torch on whatever device the cache is.
- :func:`merge` works on numpy arrays and torch tensors alike.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from anns_lab.kernel_cache import install

install()  # numba's cache keyed on every kernel source, before the first kernel is defined


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _logit(q, key, scaling):
    """q · key in float64 (SIMD: reassociated sum, far below the 1e-9 the exactness tests ask), times ``scaling``."""
    s = 0.0
    for c in range(q.shape[0]):
        s += q[c] * np.float64(key[c])
    return s * scaling


@njit(cache=True, nogil=True)
def attend_rows_and_range(q, keys, values, rows, lo, hi, scaling):
    """Attention of each query head over its own rows of the CPU store plus the rows ``[lo, hi)`` shared by all heads.

    q (H, d) float32; keys, values (G, cap, d) float32 (query head h reads KV head h // (H/G));
    rows (H, r) int64 row numbers, ``-1`` = no key; ``[lo, hi)`` the side-buffer (every head
    attends to all of it; empty when lo ≥ hi). Returns output (H, d), max logit (H,) and
    normaliser (H,), all float64. A head with no key gets output 0, max −inf, normaliser 0.
    """
    n_heads, d = q.shape
    group = n_heads // keys.shape[0]
    r = rows.shape[1]
    n_side = max(hi - lo, 0)
    out = np.zeros((n_heads, d), np.float64)
    mx = np.full(n_heads, -np.inf)
    zs = np.zeros(n_heads, np.float64)
    logits = np.empty(r + n_side, np.float64)
    qh = np.empty(d, np.float64)
    for h in range(n_heads):
        g = h // group
        for c in range(d):
            qh[c] = q[h, c]
        m = -np.inf
        for j in range(r + n_side):
            row = rows[h, j] if j < r else lo + (j - r)
            if row < 0:
                logits[j] = -np.inf
                continue
            s = _logit(qh, keys[g, row], scaling)
            logits[j] = s
            if s > m:
                m = s
        if m == -np.inf:
            continue
        z = 0.0
        acc = out[h]
        for j in range(r + n_side):
            row = rows[h, j] if j < r else lo + (j - r)
            if row < 0:
                continue
            w = math.exp(logits[j] - m)
            z += w
            v = values[g, row]
            for c in range(d):
                acc[c] += w * v[c]
        for c in range(d):
            acc[c] /= z
        mx[h] = m
        zs[h] = z
    return out, mx, zs


@njit(cache=True, nogil=True)
def attend_rows(q, keys, values, rows, scaling):
    """Attention of each query head over its own rows of the CPU store (:func:`attend_rows_and_range` without a range).

    q (H, d) float32; keys, values (G, cap, d) float32 (query head h reads KV head h // (H/G));
    rows (H, r) int64 row numbers, ``-1`` = no key; returns output (H, d), max logit (H,) and
    normaliser (H,), all float64. A head with no rows gets output 0, max −inf, normaliser 0.
    """
    return attend_rows_and_range(q, keys, values, rows, 0, 0, scaling)


def warmup() -> None:
    """Compile (or load from numba's cache) the CPU kernel before anything is timed."""
    q, kv, rows = np.zeros((2, 4), np.float32), np.zeros((1, 3, 4), np.float32), np.zeros((2, 2), np.int64)
    attend_rows(q, kv, kv, rows, 1.0)
    attend_rows_and_range(q, kv, kv, rows, 0, 1, 1.0)
    o, m = np.zeros((2, 4)), np.zeros(2)
    _merge_np(o, m, m + 1, o, m, m + 1)


def attend_window(q, keys, values, scaling: float):
    """Torch attention of q (H, d) over keys/values (G, w, d) with GQA; returns (output (H, d), max (H,), normaliser (H,))."""
    n_heads, d = q.shape
    g = keys.shape[0]
    qg = q.reshape(g, n_heads // g, d)
    logits = (qg @ keys.transpose(1, 2)) * scaling  # (G, group, w)
    m = logits.amax(dim=-1, keepdim=True)
    p = (logits - m).exp()
    z = p.sum(dim=-1, keepdim=True)
    out = (p @ values) / z
    return out.reshape(n_heads, d), m.reshape(n_heads), z.reshape(n_heads)


@njit(cache=True, nogil=True, error_model="numpy")
def _merge_np(o_a, m_a, z_a, o_b, m_b, z_b):
    """:func:`merge` of float64 arrays in one pass (the CPU path: a dozen small torch ops cost ~10x more)."""
    n_heads, d = o_a.shape
    out = np.empty((n_heads, d), np.float64)
    for h in range(n_heads):
        m = max(m_a[h], m_b[h])
        w_a = math.exp(m_a[h] - m) * z_a[h] if z_a[h] > 0 else 0.0
        w_b = math.exp(m_b[h] - m) * z_b[h] if z_b[h] > 0 else 0.0
        t = w_a + w_b
        for c in range(d):
            out[h, c] = (w_a * o_a[h, c] + w_b * o_b[h, c]) / t
    return out


def merge(o_a, m_a, z_a, o_b, m_b, z_b):
    """Exact merge of two partial attentions over disjoint key sets (numpy or torch, shapes (H, d), (H,), (H,)).

    Torch tensors on the CPU, all float64, are merged by the numba kernel (a torch tensor comes
    back); on another device, with plain torch ops.
    """
    if isinstance(o_a, np.ndarray):
        m = np.maximum(m_a, m_b)
        w_a = np.where(z_a > 0, np.exp(np.where(z_a > 0, m_a - m, 0.0)) * z_a, 0.0)
        w_b = np.where(z_b > 0, np.exp(np.where(z_b > 0, m_b - m, 0.0)) * z_b, 0.0)
        return (w_a[:, None] * o_a + w_b[:, None] * o_b) / (w_a + w_b)[:, None]
    import torch

    parts = (o_a, m_a, z_a, o_b, m_b, z_b)
    if all(t.device.type == "cpu" and t.dtype == torch.float64 for t in parts):
        return torch.from_numpy(_merge_np(*(np.ascontiguousarray(t.numpy()) for t in parts)))
    m = torch.maximum(m_a, m_b)
    w_a = torch.where(z_a > 0, torch.exp(torch.where(z_a > 0, m_a - m, 0.0)) * z_a, 0.0)
    w_b = torch.where(z_b > 0, torch.exp(torch.where(z_b > 0, m_b - m, 0.0)) * z_b, 0.0)
    return (w_a[:, None] * o_a + w_b[:, None] * o_b) / (w_a + w_b)[:, None]

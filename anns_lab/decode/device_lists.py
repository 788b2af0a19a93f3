"""The attention-aware indexes' training lists computed on the accelerator, against the keys the prefill left there.

Each training query's top keys by inner product (``Index.build(..., train_topk=)``) are the quadratic part of
a roargraph build: m × n products, seconds per head on a CPU core at 32K. On a GPU the same products are a
few milliseconds of blocked matmul and ``torch.topk`` on the keys already in the prefill's cache, so the CPU
build starts from them and does only its linear parts. The queries come from the CPU (the prefill kept them there and
moved them by RoPE to the positions the index serves): one copy per block and layer, none per token.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 4096  # queries per matmul: (BLOCK × n) float32 scores at a time


def train_topk(queries: np.ndarray, keys: torch.Tensor, k: int, group: int) -> np.ndarray:
    """(H, m, k) int32: for query head h, the ids of the top-``k`` rows of ``keys[h // group]`` by inner product
    with each of ``queries[h]`` (H, m, d), best first, computed on ``keys``' device (keys: (G, n, d))."""
    dev = keys.device
    H, m, _ = queries.shape
    k = min(k, keys.shape[1])
    out = np.empty((H, m, k), np.int32)
    kf = keys.to(torch.float32)
    with torch.inference_mode():
        for h in range(H):
            kh = kf[h // group]
            for s in range(0, m, BLOCK):
                q = torch.from_numpy(np.ascontiguousarray(queries[h, s:s + BLOCK])).to(dev)
                ids = torch.topk(q @ kh.T, k, dim=1, sorted=True).indices
                out[h, s:s + len(q)] = ids.to("cpu", torch.int32).numpy()
    return out

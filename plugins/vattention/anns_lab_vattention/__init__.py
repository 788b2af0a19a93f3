"""vAttention-style estimator (ICLR 2026): an exact heavy set plus a uniform sample of the rest, budget from (ε, δ).

The exact part is a heavy set from the lab's IVF index (``nprobe`` lists): its ``heavy`` share of the keys, best
first (vAttention's heavy set, 2% in its authors' benchmark configuration), or the top-k where that is more; the top-k
of it are the ids, the rest of it weight-1 samples. It comes from the keys of the probed lists, so it is short where
they hold fewer (Gemma-3 32K at nprobe 4: ~360 of 642 keys; the sweep's cheapest points). The rest R (every key not
in the heavy set) is estimated from a uniform sample without replacement, each sampled key weighted ``|R|/b``:
unbiased for R's share of the softmax numerator and normaliser.

Budget. With ``m`` the largest logit seen, the normaliser is ``D = D_top + D_R``, ``D_R = Σ_R
e^{τ(l−m)}`` (τ = ``temperature``, the softmax scale: the sweep and the decoder give the layer's; alone, 0 means 1/√dim).
A pilot of ``pilot_share`` of R's keys (vAttention's base sampling rate, 1% in its authors' benchmark), at least
``pilot``, uniform and drawn independently of the sample, gives the mean μ̂ and standard deviation
σ̂ of ``e^{τ(l−m)}`` over R. By the central limit theorem with the finite-population
correction, ``P(|D̂_R − D_R| > ε·D) ≤ δ`` when ``b ≥ n₀ / (1 + (n₀ − 1)/|R|)`` with
``n₀ = (z_{1−δ/2} · |R| · σ̂ / (ε · (D_top + |R|·μ̂)))²``: the CLT-based budget of vAttention, on
the normaliser (an approximation: σ̂ and μ̂ are estimates, and the CLT is asymptotic; on real heads, whose weights over R
are heavy-tailed, a small pilot's σ̂ runs low and the error exceeds ε more often than δ: the README's measured rates).
b is at least the pilot's size and at most ``|R|`` (then every weight is 1 and the result is exact). The authors'
code (xAlg-ai/sparse-attention-hub) bounds the normaliser alike, with a one-sided z_{1−δ} and no finite-population
correction, and samples over every key with replacement (the heavy set's included, σ̂ over them all): the same (ε, δ)
buys another sample size there; here only R is sampled, the residual that the heavy set leaves. Until session 48 the heavy set was the top-k alone and the
pilot 32 keys (``heavy`` 0 and ``pilot_share`` 0, what tables swept before it measured).

Sampling is seeded by ``seed`` and the query's bytes, so a search is deterministic; over seeds it
is unbiased. Counting: ``n_scanned`` = IVF's + pilot + sample keys; ``bytes_read`` = IVF's + 4·dim for each
of those keys and each sampled key's value, and for each heavy key beyond the top-k its value.
"""

from __future__ import annotations

import math
import zlib
from statistics import NormalDist

import numpy as np

from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.estimate import Estimate
from anns_lab.indexes.ivf import IVFIndex, check_nlist


def query_rng(seed: int, q: np.ndarray) -> np.random.Generator:
    """A generator seeded by ``seed`` and the query's bytes: the same query draws the same sample in any batch."""
    return np.random.default_rng([seed, zlib.crc32(np.ascontiguousarray(q).tobytes())])


def budget(rest_logits: np.ndarray, top_logits: np.ndarray, n_rest: int, epsilon: float, delta: float,
           floor: int) -> int:
    """Sample size for relative error ε of the normaliser with probability 1 − δ (CLT bound; module doc)."""
    if n_rest == 0:
        return 0
    m = max(rest_logits.max(initial=-np.inf), top_logits.max(initial=-np.inf))
    e = np.exp(rest_logits - m)
    mu, sigma = float(e.mean()), float(e.std(ddof=1)) if len(e) > 1 else 0.0
    total = float(np.exp(top_logits - m).sum()) + n_rest * mu
    z = NormalDist().inv_cdf(1 - delta / 2)
    n0 = (z * n_rest * sigma / (epsilon * total)) ** 2
    b = math.ceil(n0 / (1 + (n0 - 1) / n_rest)) if n0 > 0 else 0
    return int(min(n_rest, max(b, floor)))


class VAttention(KeyRowsIndex):
    """Exact heavy set (IVF, a share of the keys) + a uniform sample of the rest weighted |R|/b; b from (ε, δ) by CLT."""

    build_params = {
        "nlist": Param(0, 0, 1 << 20, help="IVF lists for the heavy set; 0 = auto (2·√n)"),
        "seed": Param(1234, 0, 2**31 - 1, help="k-means and sampling seed"),
        "heavy": Param(0.02, 0.0, 1.0, help="share of the keys attended exactly, best first from the IVF (vAttention's "
                                            "heavy set; its authors' benchmark: 0.02); the top-k where that is more"),
        "pilot_share": Param(0.01, 0.0, 1.0, help="share of the rest scored to size the sample (vAttention's base "
                                                  "sampling rate; its authors' benchmark: 0.01), at least `pilot` keys"),
    }
    search_params = {
        "nprobe": Param(16, 1, 1 << 20, help="IVF lists probed for the heavy set"),
        "epsilon": Param(0.1, 1e-9, 10.0, help="relative error of the softmax normaliser"),
        "delta": Param(0.05, 1e-9, 0.999, help="nominal probability that the error exceeds ε (CLT bound with the "
                                               "pilot's σ̂; real heads exceed it: README)"),
        "pilot": Param(32, 2, 1 << 20, help="the fewest uniform keys scored to estimate the budget"),
        "temperature": Param(0.0, 0.0, 1e6, help="softmax scale of q·k; 0 = the layer's (the sweep and the decoder give "
                                                  "it), else 1/√dim"),
    }
    search_grid = {"nprobe": (4, 16, 64), "epsilon": (0.3, 0.1, 0.03)}
    calibrated_by = "epsilon"  # the decoder tightens the estimate's error bound, the heavy set probed as given
    build_params_before = {"heavy": 0.0, "pilot_share": 0.0}  # tables swept before session 48: the top-k, 32 keys
    auto_rules = {"nlist": IVFIndex.auto_rules["nlist"]}  # its top-k is an IVFIndex: its rule
    scale_param = "temperature"  # the sweep and the decoder give it the layer's softmax scale
    estimates = True
    unbiased = True

    def check_keys(self, n_keys: int) -> None:
        check_nlist(self._owner(), self.params["nlist"], n_keys)

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        self._ivf = IVFIndex(nlist=self.params["nlist"], seed=self.params["seed"]).build(keys)
        self._hold_keys(keys)

    def _search(self, queries: np.ndarray, k: int, nprobe: int, epsilon: float, delta: float, pilot: int,
                temperature: float):
        tau = temperature or 1 / math.sqrt(queries.shape[1])
        n = len(self._keys)
        top = self._ivf.search(queries, min(n, max(k, math.ceil(self.params["heavy"] * n))), nprobe=nprobe)
        samples, weights = [], []
        extra = np.zeros(len(queries), np.int64)
        for row, q in enumerate(queries):
            found = top.ids[row] >= 0
            exact = top.ids[row][found]  # best first: the top-k, then the rest of the heavy set
            outside = np.ones(n, bool)
            outside[exact] = False
            rest = np.flatnonzero(outside)
            rng = query_rng(self.params["seed"], q)
            size = min(len(rest), max(pilot, math.ceil(self.params["pilot_share"] * len(rest))))
            probe = rest[rng.choice(len(rest), size, replace=False)]
            b = budget(tau * (self._keys[probe] @ q), tau * top.scores[row][found].astype(np.float64),
                       len(rest), epsilon, delta, size)
            pick = rest[np.sort(rng.choice(len(rest), b, replace=False))]
            samples.append(np.concatenate([exact[k:], pick]))
            weights.append(np.concatenate([np.ones(len(exact[k:])), np.full(b, len(rest) / b) if b else np.zeros(0)]))
            extra[row] = len(probe) + b
        estimate = Estimate.make(samples, weights, nq=len(queries))
        n_scanned = top.n_scanned + extra
        bytes_read = top.bytes_read + (extra + estimate.n_terms()) * 4 * queries.shape[1]
        return top.ids[:, :k], top.scores[:, :k], n_scanned, bytes_read, estimate

    def max_scanned(self) -> int:
        return self._ivf.max_scanned() + 2 * self.n_keys

    def grid(self) -> list[dict]:
        points = {(min(p, self._ivf.nlist), e): None for p in self.search_grid["nprobe"] for e in self.search_grid["epsilon"]}
        return [{"nprobe": p, "epsilon": e} for p, e in points]

    @property
    def nbytes(self) -> int:
        return self._ivf.nbytes + self._rows.held(self.n_keys).nbytes  # the rows' store, spare ones included

    def _add(self, keys: np.ndarray) -> None:
        self._ivf.add(keys)
        self._append_keys(keys)

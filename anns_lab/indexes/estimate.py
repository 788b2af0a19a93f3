"""The estimator part of the index protocol: an estimate of the softmax over the keys outside the exact ids.

An index whose class sets ``estimates = True`` returns, beside its exact ids, an
:class:`Estimate` per query (``SearchResult.estimate``), made of two kinds of terms:

- **weighted samples**: key ids with importance weights (``1/p`` for a key sampled with
  probability ``p``; ``1.0`` for a key attended exactly beyond the first ``k``). A sample
  contributes ``w·e^{l}·v`` to the numerator and ``w·e^{l}`` to the normaliser;
- **summaries**: rows of the index's :class:`Summaries` (a centroid key standing for a group
  of member keys). Summary ``c`` contributes ``e^{l_c}·Σ_{i∈c} v_i`` and ``n_c·e^{l_c}``,
  with ``l_c`` the centroid's logit and ``n_c`` its member count.

Values: the index holds keys only. A summary reports its members (ids, grouped by summary);
the consumer, which owns the values, turns them into value sums once per build
(:meth:`Summaries.value_sums`, again after ``add``). Every key is counted once: sample ids,
the members of the summaries used and the exact ids are disjoint (the conformance kit checks it).

Cost: the estimate's inner products count in ``n_scanned`` (sampled keys, centroids) and its reads in
``bytes_read``: the keys scored plus one value vector per term (a sampled key's value, a summary's
value sum, 4·dim bytes each, :meth:`Estimate.n_terms`), which the consumer reads on the index's
behalf. The values of the exact ids are the consumer's fixed cost for any index and count for none.

:func:`weighted_partial` is the one computation of a weighted partial softmax
``(output, max logit, normaliser)``, shared by the sweep's metrics and the decoder's CPU side.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit

from anns_lab.kernel_cache import install

install()  # numba's cache keyed on every kernel source, before the first kernel is defined


@dataclass(frozen=True)
class Summaries:
    """Summary terms an index offers: centroid keys (C, d) float32 and their members, CSR-grouped.

    ``members[offsets[c]:offsets[c + 1]]`` are the key ids summary ``c`` stands for.
    """

    keys: np.ndarray
    offsets: np.ndarray
    members: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """Members per summary (C,) int64."""
        return np.diff(self.offsets)

    @cached_property
    def owner(self) -> np.ndarray:
        """The summary of each key id, int64 of length max(member) + 2: -1 for a key in none, and in the last slot,
        which every id above the members' (and the -1 padding) reads. Valid once the members are distinct key ids (the
        protocol's rule); made on first use (the decoder's every-step check)."""
        out = np.full(int(self.members.max(initial=-1)) + 2, -1, np.int64)
        out[self.members] = np.repeat(np.arange(len(self.keys)), self.counts)
        out[-1] = -1
        return out

    def value_sums(self, values: np.ndarray) -> np.ndarray:
        """Σ of the members' ``values`` (rows = key ids) per summary, (C, dv) float64; 0 for an empty summary."""
        out = np.zeros((len(self.keys), values.shape[1]), np.float64)
        counts = self.counts
        full = np.flatnonzero(counts > 0)
        if len(full):
            out[full] = np.add.reduceat(np.asarray(values, np.float64)[self.members], self.offsets[full], axis=0)
        return out


@dataclass(frozen=True)
class Estimate:
    """Per query: sample ids (nq, s) int64 with weights (nq, s) float64, summary ids (nq, c) int64; -1 = none."""

    sample_ids: np.ndarray
    sample_weights: np.ndarray
    summary_ids: np.ndarray

    @classmethod
    def make(cls, sample_ids=None, sample_weights=None, summary_ids=None, nq: int | None = None) -> "Estimate":
        """An Estimate with the given parts (lists of per-query arrays or padded arrays); missing parts are empty."""
        def pad(rows, fill, dtype):
            if rows is None:
                return np.full((nq, 0), fill, dtype)
            if isinstance(rows, np.ndarray):
                return np.ascontiguousarray(rows, dtype=dtype)
            width = max((len(r) for r in rows), default=0)
            out = np.full((len(rows), width), fill, dtype)
            for i, r in enumerate(rows):
                out[i, : len(r)] = r
            return out

        if nq is None:
            nq = len(next(p for p in (sample_ids, summary_ids) if p is not None))
        return cls(pad(sample_ids, -1, np.int64), pad(sample_weights, 0.0, np.float64), pad(summary_ids, -1, np.int64))

    @property
    def is_empty(self) -> bool:
        return not ((self.sample_ids >= 0).any() or (self.summary_ids >= 0).any())

    def n_terms(self) -> np.ndarray:
        """Sample and summary terms per query (nq,) int64: each makes the consumer read one value vector."""
        return (self.sample_ids >= 0).sum(axis=1) + (self.summary_ids >= 0).sum(axis=1)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Query ``i``'s sample ids, their weights and its summary ids, padding dropped."""
        s = self.sample_ids[i] >= 0
        return self.sample_ids[i, s], self.sample_weights[i, s], self.summary_ids[i][self.summary_ids[i] >= 0]

    def rows(self, which) -> "Estimate":
        """The Estimate of queries ``which`` (a list of row numbers)."""
        return Estimate(self.sample_ids[which], self.sample_weights[which], self.summary_ids[which])

    @classmethod
    def concat(cls, parts: list["Estimate"]) -> "Estimate":
        """Rows of ``parts`` one after another, as they are (dtypes kept, widths padded to the widest with -1 / 0): the
        protocol's checks then see what each index returned (a negative id is not taken for padding)."""
        def stack(arrays: list[np.ndarray], fill: float) -> np.ndarray:
            width = max(a.shape[1] for a in arrays)
            return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill) for a in arrays])

        return cls(stack([p.sample_ids for p in parts], -1), stack([p.sample_weights for p in parts], 0),
                   stack([p.summary_ids for p in parts], -1))


def weighted_partial(logits: np.ndarray, weights: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Partial softmax of a weighted set in float64: ``o = Σ w e^{l−m} v / Z``, ``m = max l``, ``Z = Σ w e^{l−m}``.

    logits (r,), weights (r,) > 0, values (r, dv). An empty set gives output 0, ``m = −inf``, ``Z = 0``.
    """
    logits = np.asarray(logits, np.float64)
    if len(logits) == 0:
        return np.zeros(values.shape[1], np.float64), -np.inf, 0.0
    m = float(logits.max())
    p = np.asarray(weights, np.float64) * np.exp(logits - m)
    z = float(p.sum())
    return (p @ np.asarray(values, np.float64)) / z, m, z


def estimate_terms(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scaling: float, sample_ids: np.ndarray,
                   sample_weights: np.ndarray, summary_ids: np.ndarray, summaries: Summaries | None,
                   value_sums: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One query's estimate as a weighted set (logits, weights, values): samples, then summaries (value = mean).

    ``keys``/``values`` are indexed by key id; summary values are their members' mean, so ``w·e^l·v``
    with ``w = n_c`` is the summary's ``e^{l_c}·Σ v``.
    """
    q64 = np.asarray(q, np.float64)
    logit = [(np.asarray(keys[sample_ids], np.float64) @ q64) * scaling]
    weight = [np.asarray(sample_weights, np.float64)]
    vals = [np.asarray(values[sample_ids], np.float64)]
    if len(summary_ids):
        counts = summaries.counts[summary_ids].astype(np.float64)
        logit.append((np.asarray(summaries.keys[summary_ids], np.float64) @ q64) * scaling)
        weight.append(counts)
        vals.append(value_sums[summary_ids] / counts[:, None])
    return np.concatenate(logit), np.concatenate(weight), np.concatenate(vals)


def estimate_problem(res, estimates: bool, summaries: Summaries | None, n_keys: int, dim: int,
                     summaries_checked: bool = False) -> str | None:
    """The first estimator rule a search result breaks, in words, or None (docs/estimators.md lists them).

    ``res`` is a SearchResult of an index whose class declares ``estimates``, holding ``n_keys`` keys
    of dimension ``dim``; ``summaries`` is what its ``summaries()`` returns (``summaries_checked``: their own
    rules already passed since they last changed, as the decoder's later steps know). The per-query rules run
    in one compiled pass (the whole check ~40-55 µs per index at 8K keys: cheap enough for every decode step); a
    row is walked in Python only to name what it breaks.
    """
    est = res.estimate
    if not estimates:
        return None if est is None else "a top-k index (estimates = False) returned an Estimate"
    if est is None:
        return "an estimator (estimates = True) must return an Estimate"
    nq = len(res.ids)
    if np.shape(res.n_scanned) != (nq,):  # the compiled pass reads one count per query, unchecked
        return f"n_scanned has shape {np.shape(res.n_scanned)}, not one count per query ({nq})"
    s_ids, s_w, c_ids = est.sample_ids, est.sample_weights, est.summary_ids
    if s_ids.dtype != np.int64 or s_ids.ndim != 2 or len(s_ids) != nq:
        return "sample_ids must be int64 (nq, s)"
    if s_w.dtype != np.float64 or s_w.shape != s_ids.shape:
        return "sample_weights must be float64 of the shape of sample_ids"
    if c_ids.dtype != np.int64 or c_ids.ndim != 2 or len(c_ids) != nq:
        return "summary_ids must be int64 (nq, c)"
    if not ((s_ids >= -1) & (s_ids < n_keys)).all():
        return f"sample ids outside [0, {n_keys}) that are not the -1 padding"
    valid = s_ids >= 0
    if not (np.isfinite(s_w) & (s_w > 0))[valid].all():
        return "sample weights must be positive and finite"
    if (s_w[~valid] != 0).any():
        return "padded sample slots must have weight 0"
    if (c_ids >= 0).any() and summaries is None:
        return "summary ids given but summaries() is None"
    if summaries is not None:
        problem = None if summaries_checked else _summaries_problem(summaries, n_keys, dim)
        if problem is not None:
            return problem
        if not ((c_ids >= -1) & (c_ids < len(summaries.keys))).all():
            return f"summary ids outside [0, {len(summaries.keys)}) that are not -1"
    none = np.full(1, -1, np.int64)
    counts, owner = (none, none) if summaries is None else (np.asarray(summaries.counts, np.int64), summaries.owner)
    first = _first_row_breaking(np.asarray(res.ids, np.int64), s_ids, c_ids, np.asarray(res.n_scanned, np.int64),
                                counts, owner)
    return None if first < 0 else _row_problem(res, est, summaries, first)


@njit(cache=True, nogil=True)
def _first_row_breaking(ids, s_ids, c_ids, n_scanned, counts, owner):
    """The first query whose exact and sample ids are not all distinct, which uses a summary twice or an empty one,
    counts a member of a summary it uses as an exact or sampled id, or scans fewer keys than its terms; -1 for none.
    ``owner``: each key's summary (:attr:`Summaries.owner`); ~10-25 µs for a GQA group's heads at 8K keys."""
    top = owner.shape[0] - 1
    for row in range(ids.shape[0]):
        terms = np.concatenate((ids[row], s_ids[row]))
        terms = np.sort(terms[terms >= 0])
        used = c_ids[row]
        used = np.sort(used[used >= 0])
        if n_scanned[row] < terms.shape[0] + used.shape[0]:
            return row
        for j in range(1, terms.shape[0]):
            if terms[j] == terms[j - 1]:
                return row
        for j in range(used.shape[0]):
            if (j > 0 and used[j] == used[j - 1]) or counts[used[j]] <= 0:
                return row
        if used.shape[0] > 0:
            for t in terms:
                o = owner[min(t, top)]
                if o >= 0:
                    at = np.searchsorted(used, o)
                    if at < used.shape[0] and used[at] == o:
                        return row
    return -1


def _row_problem(res, est: Estimate, summaries: Summaries | None, start: int = 0) -> str | None:
    """The per-row rule the first offending query from ``start`` on breaks, in words (None: only exact ids repeat,
    which the protocol's own check names)."""
    for row in range(start, len(res.ids)):
        exact = res.ids[row][res.ids[row] >= 0]
        sample, _, used = est.row(row)
        if len(np.unique(sample)) != len(sample):
            return f"query {row} samples an id twice"
        if np.isin(sample, exact).any():
            return f"query {row} samples an id that is also exact"
        counted = len(exact) + len(sample) + len(used)
        if res.n_scanned[row] < counted:
            return f"n_scanned {res.n_scanned[row]} of query {row} is below its {counted} exact, sampled and summary terms"
        if len(used):
            if len(np.unique(used)) != len(used):
                return f"query {row} uses a summary twice"
            if (summaries.counts[used] <= 0).any():
                return f"query {row} uses an empty summary"
            inside = np.concatenate([summaries.members[summaries.offsets[c]: summaries.offsets[c + 1]] for c in used])
            if np.isin(inside, np.concatenate([exact, sample])).any():
                return f"query {row} counts a key both in a summary and as an exact or sampled id"
    return None


def _summaries_problem(summ: Summaries, n_keys: int, dim: int) -> str | None:
    n_c = len(summ.keys)
    if summ.keys.shape != (n_c, dim) or not np.isfinite(summ.keys).all():
        return "summary keys must be finite, of shape (C, dim)"
    if summ.offsets.shape != (n_c + 1,) or summ.offsets[0] != 0:
        return "summary offsets must have shape (C + 1,) and start at 0"
    if (np.diff(summ.offsets) < 0).any() or summ.offsets[-1] != len(summ.members):
        return "summary offsets must rise to len(members)"
    m = summ.members
    if not ((m >= 0) & (m < n_keys)).all() or len(np.unique(m)) != len(m):
        return "summary members must be distinct key ids"
    return None

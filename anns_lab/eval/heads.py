"""What one (layer, query head) of a dump gives the evaluation (docs/metrics.md).

Test queries are the decode queries, topped up with held-out final prefill queries when the
dump has fewer than ``min_test``; training queries are the prefill queries before the first
test query (never a test query). For K→K (paper Fig. 3a) a random sample of index keys is held
out of the index and used as queries, so no query ever finds itself.

Causality rule: a query is only ever scored against keys at or before its own position. Index
keys are the prefill positions ``[w0, end)`` with ``end = min(n_prefill − w1, first test
position)``: the first ``w0`` and last ``w1`` prefill positions stay on the accelerator in the
decoder (the static window), and the held-out test positions never enter the index. So every
index key precedes every test query, and the ground truth (exact search over the index keys,
used by the sweep, ``--quick`` and ``export``) is causal for any window, ``0,0`` included. The
keys from ``end`` up to a query's own position are the recent side of its window, attended
exactly (as the decoder attends tokens not yet in its index). K→K queries are keys, not
attention queries: they are scored against every index key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anns_lab.dumps import rope
from anns_lab.dumps.store import Dump
from anns_lab.errors import AnnsLabError, DumpError
from anns_lab.eval import metrics
from anns_lab.indexes import group_queries
from anns_lab.indexes.estimate import Estimate, Summaries, estimate_terms, weighted_partial
from anns_lab.window import Window


@dataclass
class HeadData:
    """Keys, queries and exact scores of one (layer, head), ready for any index."""

    layer: int
    head: int
    kv_head: int
    keys: np.ndarray            # (n, d) index keys
    key_pos: np.ndarray         # (n,) their token positions
    train_queries: np.ndarray   # (m, d)
    test_queries: np.ndarray    # (t, d) Q→K queries
    test_pos: np.ndarray        # (t,) their positions
    k2k_queries: np.ndarray     # (h, d) held-out keys
    all_keys: np.ndarray        # every key of the KV head, by position (for attention mass and output)
    all_values: np.ndarray
    scaling: float
    window: Window
    n_prefill: int
    index_end: int              # first position after the index keys: keys from here on are in the recent window
    group_queries: np.ndarray | None = None  # train_group "unlisted": the GQA group's other heads' newest prefill queries
    own_train_queries: np.ndarray | None = None  # train_queries at their prefill positions (None: moved, not kept)
    own_train_pos: np.ndarray | None = None  # their positions, where one head's (None: a group's rows interleaved)

    def train_queries_for(self, cls) -> np.ndarray:
        """The training queries index class ``cls`` learns from: where the prefill had them for one that asks
        (``Index.own_positions``), else as the sweep placed them."""
        if not cls.own_positions:
            return self.train_queries
        if self.own_train_queries is None:  # never the moved ones in their place
            raise AnnsLabError(f"{cls.name or cls.__name__} reads the training queries at their own positions, and this "
                               f"head ({self.layer}, {self.head}) was loaded without them (load_head(keep_own=True))")
        return self.own_train_queries

    def positions_for(self, cls) -> dict[str, np.ndarray]:
        """``build``'s position arguments for index class ``cls`` (``Index.reads_positions``; none for others)."""
        if not cls.reads_positions:
            return {}
        if self.own_train_pos is None:
            raise AnnsLabError(f"{cls.name or cls.__name__} reads each training query's position; a GQA group's queries "
                               "interleaved (--train-group group or strided) have none of their own: sweep it with "
                               "--train-group head or unlisted")
        return {"key_positions": self.key_pos, "train_positions": self.own_train_pos}

    def exact(self, direction: str) -> np.ndarray:
        """Exact scores (nq, n) of the direction's queries against the index keys (computed once)."""
        cache = self.__dict__.setdefault("_exact", {})
        if direction not in cache:
            q = self.test_queries if direction == "q2k" else self.k2k_queries
            cache[direction] = metrics.exact_scores(q, self.keys)
        return cache[direction]

    def window_positions(self, pos: int) -> np.ndarray:
        """Positions attended exactly for a query at ``pos``: the sinks and the recent side, ``[index_end, pos]``."""
        return self.window.positions(pos, self.index_end)

    def attention_quality(self, ids: np.ndarray, estimate: Estimate | None = None,
                          summaries: Summaries | None = None) -> tuple[float, float]:
        """Mean attention mass kept and mean output relative error of retrieved ``ids`` ∪ window, over test queries.

        The reference is full causal attention over every key. The K→K held-out keys are in neither the
        index nor the window, so their weight always counts as lost: a small downward bias (64 of ~n keys).
        With an ``estimate`` (an estimator's), output and mass come from the exact part plus the estimate
        (:meth:`estimated_quality`); without one, from the exact set alone.
        """
        if estimate is not None:
            return self.estimated_quality(ids, estimate, summaries)
        mass, err = [], []
        for i, pos in enumerate(self.test_pos):
            logits, values, full = self.reference(i)
            row = ids[i][ids[i] >= 0]
            subset = np.concatenate([self.window_positions(int(pos)), self.key_pos[row]])
            mass.append(metrics.mass_recovered(logits, subset))
            err.append(metrics.output_rel_error(logits, values, subset, full))
        return float(np.mean(mass)), float(np.mean(err))

    def reference(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Full causal attention of test query ``i``: its logits and values (float64) and output (computed once).

        Cached because every grid point of every index is scored against the same reference: recomputing
        it cost ~20 ms per query at 32K keys (a float64 copy of the values), most of a Gemma sweep's time.
        """
        cache = self.__dict__.setdefault("_reference", {})
        if i not in cache:
            if "_values64" not in self.__dict__:
                self.__dict__["_values64"] = self.all_values.astype(np.float64)
            pos = int(self.test_pos[i])
            logits = (self.all_keys[: pos + 1] @ self.test_queries[i]).astype(np.float64) * self.scaling
            values = self.__dict__["_values64"][: pos + 1]
            cache[i] = (logits, values, metrics.attention_over(logits, values))
        return cache[i]

    def estimated_quality(self, ids: np.ndarray, estimate: Estimate,
                          summaries: Summaries | None) -> tuple[float, float]:
        """:meth:`attention_quality` of exact ``ids`` ∪ window plus the weighted ``estimate`` (ids = index rows).

        Mass is the estimated normaliser over the full one: the kept share for exact sets, an estimate
        of 1 (above 1 when it overestimates) for an estimator; the error is the estimated output's.
        """
        key_values = self.all_values[self.key_pos]  # values by index row, as the index's ids count
        sums = summaries.value_sums(key_values) if summaries is not None else None
        mass, err = [], []
        for i, pos in enumerate(self.test_pos):
            logits, values, full = self.reference(i)
            row = ids[i][ids[i] >= 0]
            exact = np.unique(np.concatenate([self.window_positions(int(pos)), self.key_pos[row]]))
            l, w, v = estimate_terms(self.test_queries[i], self.keys, key_values, self.scaling, *estimate.row(i),
                                     summaries, sums)
            o, m, z = weighted_partial(np.concatenate([logits[exact], l]), np.concatenate([np.ones(len(exact)), w]),
                                       np.concatenate([values[exact], v]))
            top = logits.max()
            mass.append(float(z * np.exp(m - top) / np.exp(logits - top).sum()))
            err.append(float(np.linalg.norm(o - full) / np.linalg.norm(full)))
        return float(np.mean(mass)), float(np.mean(err))


def default_layers(layers: list[int]) -> list[int]:
    """Three layers spread over the depth (2, 15, 28 on a 30-layer dump), or all when there are few."""
    if len(layers) <= 3:
        return list(layers)
    return sorted({layers[min(2, len(layers) - 1)], layers[len(layers) // 2], layers[max(len(layers) - 2, 0)]})


def sliding_layers(dump: Dump) -> dict[int, int]:
    """The dump's layers whose sliding window is shorter than its positions, with their window: their later queries
    never attend its oldest keys, so neither an exact top-k over the keys outside the static window nor full causal
    attention (what an evaluation compares with) is such a layer's attention. A window as long as the dump binds
    nowhere in it."""
    n = _positions(dump)
    return {layer: w for layer in dump.layers if (w := dump.sliding_window(layer)) is not None and w < n}


def _positions(dump: Dump) -> int:
    return sum(int(v) for v in dump.manifest["n_tokens"].values())


def evaluable_layers(dump: Dump) -> list[int]:
    """The dump's layers whose queries attend every earlier key (``sweep --layers all``); one error where none do."""
    sliding = sliding_layers(dump)
    if full := [layer for layer in dump.layers if layer not in sliding]:
        return full
    raise AnnsLabError(f"every layer of dump {dump.path} attends within a sliding window ({_windows(sliding)}) shorter "
                       f"than its {_positions(dump):,} positions, so none attends the keys an index would hold as an evaluation "
                       "compares them; dump a model's full-attention layers, or at most as many tokens as the window")


def check_full_attention(dump: Dump, layers: list[int]) -> None:
    """Refuses, before any work, a layer whose sliding window is shorter than the dump (:func:`sliding_layers`)."""
    sliding = sliding_layers(dump)
    if bad := [layer for layer in layers if layer in sliding]:
        full = evaluable_layers(dump)  # raises where the dump has none
        raise AnnsLabError(f"{'layer' if len(bad) == 1 else 'layers'} {', '.join(map(str, bad))} of dump {dump.path} "
                           f"{'attends' if len(bad) == 1 else 'attend'} within a sliding window "
                           f"({_windows({layer: sliding[layer] for layer in bad})}) shorter than the dump: the keys an "
                           "index would hold lie mostly outside it, and the evaluation's references (exact top-k, full "
                           f"causal attention) are not that attention; evaluate its full-attention layers "
                           f"({', '.join(map(str, full))})")


def _windows(sliding: dict[int, int]) -> str:
    sizes = sorted(set(sliding.values()))
    return f"{sizes[0]:,} tokens" if len(sizes) == 1 else "of " + ", ".join(f"{w:,}" for w in sizes) + " tokens"


def index_range(dump: Dump, window: Window | tuple[int, int] = Window(), min_test: int = 64,
                n_k2k: int = 64) -> tuple[int, int, int]:
    """``(lo, hi, extra)``: index keys (and K→K hold-outs) come from prefill positions ``[lo, hi)``; the last
    ``extra`` prefill positions are test queries. Raises when too few keys are left (checked before any work)."""
    n = int(dump.manifest["n_tokens"]["prefill"])
    window = Window(*window)
    extra = max(0, min_test - int(dump.manifest["n_tokens"]["decode"]))  # held-out last prefill queries
    lo, hi = window.outside(n)
    hi = min(hi, n - extra)  # causality: no index key at or after the first test query
    if hi - lo < (need := max(200, n_k2k + 2)):
        what = (f"the static window {window} and the last {extra} held out as test queries leave" if extra > window.recent
                else f"the static window {window} leaves")
        raise AnnsLabError(f"{what} {max(hi - lo, 0)} of {n} prefill keys to index, fewer than the {need} an evaluation "
                           "needs; use a longer dump or a smaller --window")
    return lo, hi, extra


def check_k(dump: Dump, window: Window | tuple[int, int], k: int, n_k2k: int = 64) -> int:
    """The number of keys each index of this dump and window holds; refuses ``k`` below 1 or above it (before any
    work)."""
    lo, hi, _ = index_range(dump, window, n_k2k=n_k2k)
    if not 1 <= k <= hi - lo - n_k2k:
        raise AnnsLabError(f"--k {k} must be between 1 and {hi - lo - n_k2k}, the number of keys each index holds "
                           f"with this dump and --window {Window(*window)}")
    return hi - lo - n_k2k


def load_head(dump: Dump, layer: int, head: int, window: Window | tuple[int, int] = Window(), min_test: int = 64,
              n_k2k: int = 64, seed: int = 0, train_group: str = group_queries.DEFAULT,
              train_positions: str = rope.DEFAULT, held_out: np.ndarray | None = None, keep_own: bool = False) -> HeadData:
    """Assemble :class:`HeadData` for one (layer, head) of ``dump``; ``train_group`` picks the training queries
    (:mod:`indexes.group_queries`: the head's own, or its GQA group's, each before the first test position) and
    ``train_positions`` where they sit: ``serving`` moves each to a position drawn from the test queries' span
    (:mod:`dumps.rope`: the positions a decoder's index serves), ``mix`` moves a random half, ``own`` keeps
    each at its prefill position. ``held_out``: prefill positions whose queries (every head's) are left out of the
    training (``benchmarks/diag_calibration_metric.py --hold-out``: how the queries a calibration reads would read out of
    the training set; BENCHMARKS "A target of 0.95"). ``keep_own``: where ``train_positions`` moves the training
    queries, keep them also where they were (``own_train_queries``, for an index with ``own_positions``)."""
    n = int(dump.manifest["n_tokens"]["prefill"])
    window = Window(*window)
    lo, hi, extra = index_range(dump, window, min_test, n_k2k)
    g = dump.kv_head_of(head)
    all_keys = dump.keys(layer, g, "all")
    prefill_q = dump.queries(layer, head, "prefill")
    decode_q = dump.queries(layer, head, "decode")
    test_q = np.concatenate([prefill_q[n - extra:], decode_q]) if extra else decode_q
    test_pos = np.concatenate([np.arange(n - extra, n), dump.positions("decode")]) if extra else dump.positions("decode")
    rng = np.random.default_rng(seed + 1000 * layer + head)
    held = np.sort(rng.choice(np.arange(lo, hi), size=n_k2k, replace=False))
    key_pos = np.setdiff1d(np.arange(lo, hi), held)
    # The group's heads in id order, whichever of them is evaluated: every head of a KV head gets the same graph
    # (group, strided); the per-head modes train on the head's own queries, put first.
    group = [h for h in range(dump.n_heads) if dump.kv_head_of(h) == g] if train_group != "head" else [head]
    if train_group in group_queries.PER_HEAD:
        group.remove(head)
        group.insert(0, head)
    rows = np.arange(n - extra)
    if held_out is not None:
        if len(held_out) and (np.min(held_out) < 0 or np.max(held_out) >= n - extra):
            raise ValueError(f"held-out positions must lie among the {n - extra} prefill queries before the test ones")
        rows = np.setdiff1d(rows, held_out)
    per_head = [(prefill_q if h == head else dump.queries(layer, h, "prefill"))[rows] for h in group]
    where = f"layer {layer}, kv head {g}"
    for h, q in zip(group, per_head):  # the training queries, every head's of the group it uses
        if not np.isfinite(q).all():
            raise DumpError(f"{dump.path}: the prefill queries of {where}, query head {h} hold NaN or inf; make the dump again")
    moved = rope.check_place(train_positions) != "own"
    own_q = group_queries.group_queries(per_head, train_group) if moved and keep_own else None
    if moved:
        freqs = rope.dump_inv_freq(dump.manifest, layer)
        first, last = int(test_pos.min()), int(test_pos.max())
        per_head = [rope.placed(q, rows, first, last, freqs, train_positions) for q in per_head]
    train_q = group_queries.group_queries(per_head, train_group)
    if not moved:
        own_q = train_q  # the same array: at their own positions already
    others = group_queries.other_heads(per_head, 0) if train_group == "unlisted" else None
    values = dump.values(layer, g, "all")
    for name, arr in (("keys", all_keys), ("values", values), ("test queries", test_q)):
        if not np.isfinite(arr).all():  # a NaN in the window's keys or in the values would reach the table as a NaN figure
            raise DumpError(f"{dump.path}: the {name} of {where}, query head {head} hold NaN or inf; make the dump again")
    return HeadData(layer, head, g, np.ascontiguousarray(all_keys[key_pos]), key_pos, train_q,
                    np.ascontiguousarray(test_q), test_pos, np.ascontiguousarray(all_keys[held]), all_keys,
                    values, dump.scaling(layer), window, n, hi, others, own_q,
                    rows if train_group in group_queries.PER_HEAD else None)

"""Search calibration of a layer's indexes at build time, on the newest prefill queries (``--calibrate``).

A fixed beam (roargraph's ``L`` 100) is short where a context is long or a head is hard (Gemma-3 at 128K: recall@100
0.45-0.85 on the decode steps of a needle task). A sweep measures the right value offline (``--from-sweep``); this
measures it on the prompt being decoded: the layer's newest prefill queries, at their own positions (the decode steps
come right after them), get their exact top-k over the keys the indexes hold, and where the layer's search (the
index's default, or the value ``--param`` / ``--from-sweep`` gave) does not reach the target mean weight recall@k over
the layer's heads, the search is raised to the cheapest value of its index's grid parameter that does (``Index.grid``
of the built indexes, the union over the layer's heads where they differ: roargraph ``L``, IVF ``nprobe``, HNSW ``ef``;
of a grid of several, the one its class names, ``Index.calibrated_by``, as sparq's ``budget``; ordered cheapest
first; the most thorough one when none does). A raise never goes past an exact scan's bytes: where the first value
that reaches the target, or any on the way to it, reads more index data than a scan of the layer's keys (MagicPIG at
``min_collisions`` 0 samples every key and reads its hash codes too: 2.1x a scan on Gemma-3's layers), the layer is
served by an exact scan (``flat``: the exact top-k, weight recall 1, for those bytes; :meth:`LayerStore.scan_exactly`;
a search given that falls short and reads more already is scanned at once) and the note says so, with the exact
top-k's reading. A search given that already reads more (``--param``, ``--from-sweep``, an index's default) and
reaches the target is kept: it is what was asked. It is never lowered: the default search is the one whose fidelity
was measured, and at 8K the newest prefill queries read below the decode steps (BENCHMARKS "Which target"), so a cut
on their word would go below what was validated; and where the search given suffices, one probe settles it. Every
index mode is calibrated alike, so the modes of a run are compared at the same least fidelity (an estimator read by its
output, below).

Weight recall (:func:`metrics.weight_recall_at_k`) counts each exact top-k key by its softmax weight at the layer's
scale, not as one of k: attention loses a missed key's weight, so a key swapped for a near-tie just outside the top-k
costs almost nothing. Set recall counts that swap a miss, and on a repetitive prompt (a passkey's filler: the same
sentence at hundreds of positions, so a query's top-100 is a few keys among many near-equal ones) it raised the
beam up to 12x for no change in the output (BENCHMARKS "Calibration on attention weight").

An estimator (``Index.estimates``: an exact part plus an estimate of the rest, as RetroInfer's clusters or MagicPIG's
samples) is read by what it returns, the attention output: its output over the layer's indexed keys (the exact part
and the weighted estimate merged, as the decoder merges them) against exact attention over those keys, ‖o − o*‖ / ‖o*‖,
and a value reaches the target where that error, the mean over the layer's heads and queries, is at most the error of
the exact top-k cut to the target's weight (the fewest best keys of each query's exact top-k holding ``target`` of its
weight: what a top-k index at that weight recall gives where it misses only the lightest keys). The weight recall of an
estimator's exact hits undersold it (the estimate carries the rest of the softmax: RetroInfer at 0.8 of the weight
can have a smaller output error than the whole exact top-k) and could not read MagicPIG at all (no exact ids).

The target (``auto``, the default): 0.95 up to 32K keys, 0.01 more per doubling above (0.97 at 128K;
:func:`auto_target`). On the 128K needles at rows of 40 the newest prefill queries read a few hundredths above the
decode steps on the needle's hardest layer: 0.9 left seed 0's needle (layer 11 at L 100, 0.904) or seed 2's (when they
were held out of the training, L 150) lost, where 0.95 answers both, and 0.95 left seed 5's lost where 0.97 answers
it (BENCHMARKS "A target that grows with the context"). At 8K they read below the decode steps: 0.95 costs there what
BENCHMARKS "A target of 0.95" shows, and 0.97 would cost 1.3x the retrieval time per token again (the index then barely
faster than an exact scan), which is why the margin grows with the keys rather than everywhere. Held out of an attention-aware index's training set (its
``keep_queries``, with exact lists), they read ~0.04 lower at 128K (~0.002 at 8K), but the index built without them serves
the decode steps about as much worse (their lists are the ones the decode steps need most): they stay in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from anns_lab.decode.options import CALIBRATE_AUTO
from anns_lab.eval.metrics import softmax_weights, topk_weight, weight_recall_at_k
from anns_lab.indexes import protocol
from anns_lab.indexes.threads import map_one_thread

QUERIES = 64  # newest prefill queries per head: ~6,400 (query, key) pairs per head at top-100
AUTO = CALIBRATE_AUTO  # the decoder's default target, and a bare ``--calibrate``'s: :func:`auto_target` of the layer's keys
TARGET = 0.95  # the auto target up to BASE_KEYS keys (BENCHMARKS "A target of 0.95")
BASE_KEYS = 32768  # above it the auto target grows by PER_DOUBLING per doubling of the keys (BENCHMARKS "A target that grows with the context")
PER_DOUBLING = 0.01
MAX_TARGET = 0.99


def auto_target(n_keys: int) -> float:
    """The least mean weight recall@k an auto calibration asks of a layer holding ``n_keys`` keys: :data:`TARGET` up to
    :data:`BASE_KEYS`, :data:`PER_DOUBLING` more per doubling above (0.97 at 128K), at most :data:`MAX_TARGET`. The newest
    prefill queries read below the decode steps at 8K and a few hundredths above them on the 128K needles' hardest
    layers: the margin a reading needs grows with the context."""
    return float(min(MAX_TARGET, TARGET + PER_DOUBLING * max(0.0, np.log2(max(n_keys, 1) / BASE_KEYS))))


def layer_target(target: float | str, n_keys: int) -> float:
    """A setting's target for a layer of ``n_keys`` keys: :func:`auto_target` for :data:`AUTO`, else the number given."""
    return auto_target(n_keys) if target == AUTO else float(target)


@dataclass(frozen=True)
class Calibration:
    """A layer's calibrated search: the grid parameter, its value, the reading there (the mean over the layer's heads,
    and each head's: the mean can hide one head far below the others) and the values tried (value -> reading). The
    reading is the weight recall (``weight_recall``), or for an estimator the output error (``output_error``, to reach
    ``bound``: the error of the exact top-k cut to the target's weight; ``weight_recall`` is then None)."""

    layer: int
    param: str
    value: object
    weight_recall: float | None
    tried: dict
    per_head: tuple = ()
    target: float = TARGET
    output_error: float | None = None
    bound: float | None = None
    exact_scan: float | None = None  # the layer scanned exactly instead: ``value``'s bytes read over a scan's (the
    # readings are then the exact top-k's: weight recall 1, or its output error against the layer's exact attention)

    @property
    def reached(self) -> bool:
        """Whether the value set reaches the target (the most thorough value tried is set where none does; an exact
        scan, the exact top-k, does)."""
        if self.exact_scan is not None:
            return True
        if self.output_error is not None:
            return self.output_error <= self.bound
        return self.weight_recall >= self.target

    def describe(self) -> str:
        digits = 4 if self.output_error is not None else 3  # errors of a few thousandths, recalls near 1
        heads = f"; heads {min(self.per_head):.{digits}f}-{max(self.per_head):.{digits}f}" if len(self.per_head) > 1 else ""
        if self.exact_scan is not None:  # its readings are the exact top-k's
            reading = (f"output error {self.output_error:.4f} {'<=' if self.output_error <= self.bound else '>'} "
                       f"{self.bound:.4f}" if self.output_error is not None else "weight recall 1")
            return (f"{self.layer}: exact scan ({self.param}={self.value} read {self.exact_scan:.2f}x a scan's bytes; "
                    f"the exact top-k: {reading})")
        if self.output_error is not None:
            return (f"{self.layer}: {self.param}={self.value} (output error {self.output_error:.4f} "
                    f"{'<=' if self.reached else '>'} {self.bound:.4f}{heads})")
        return f"{self.layer}: {self.param}={self.value} ({self.weight_recall:.3f}{heads})"


def built_grid(index) -> tuple[str, list] | None:
    """The built index's grid parameter that calibration raises and its values, cheapest first, as its
    :meth:`Index.grid` gives them (only values valid for this index: simhash's ``min_collisions`` at most its ``L``,
    IVF's ``nprobe`` up to its ``nlist``): its one parameter, or where it has several the one it names
    (``Index.calibrated_by``: sparq's ``budget``, the others searched as given); else None."""
    grid = index.grid()
    names = {tuple(point) for point in grid}
    if len(names) != 1:
        return None
    params = next(iter(names))
    param = params[0] if len(params) == 1 else type(index).calibrated_by
    if param not in params:
        return None
    return param, list(dict.fromkeys(point[param] for point in grid))


def store_grid(indexes) -> tuple[str, list] | None:
    """The grid parameter of a layer's ``indexes`` (:func:`built_grid`) and the union of their built grids' values,
    cheapest first: an index's grid may depend on what it holds (RetroInfer's ``nprobe`` ends at its head's non-empty
    clusters), and the one value calibration sets must reach the most thorough point of every head's (a head clips a
    value past its own end). None when an index has no such parameter, or two name different ones."""
    grids = [built_grid(index) for index in {id(ix): ix for ix in indexes}.values()]
    if not grids or any(g is None for g in grids) or len({param for param, _ in grids}) != 1:
        return None
    param, values = grids[0]
    if all(v == values for _, v in grids):
        return param, values
    longest = max((v for _, v in grids), key=len)  # its ends give the grid's direction
    descending = len(longest) > 1 and longest[-1] < longest[0]  # simhash's min_collisions: fewest is most thorough
    return param, sorted({v for _, vs in grids for v in vs}, reverse=descending)


def calibrate(store, queries: np.ndarray, target: float | str, scaling: float,
              beside: bool = False, change_store: bool = True) -> Calibration | None:
    """Raise ``store``'s (a built :class:`placement.LayerStore`) search to the cheapest grid value reaching ``target``
    (:data:`AUTO`: :func:`auto_target` of its keys) on ``queries`` (H, c, d), its newest prefill queries at their own
    positions, where its present search (:func:`with_present`) falls short: mean weight recall@k
    (:func:`metrics.weight_recall_at_k`, softmax weights at the layer's ``scaling``), or for an estimator the output
    error of the exact top-k cut to the target's weight (:func:`_estimate_errors`); None when its index has no grid
    parameter to raise (:func:`built_grid`) or nothing is indexed. The layer's indexes are read side by side, one per
    one-thread worker (:func:`threads.map_one_thread`; ``beside``: other work runs, as the prefill or another layer's
    builds). ``change_store``: the store searches as found from now on (:func:`apply`); else a reading only (a worker's,
    applied in the decoding process; a benchmark's)."""
    if not store.indexes or not store.n_indexed:
        return None
    target = layer_target(target, store.n_indexed)
    found = store_grid(store.indexes)
    if found is None:
        return None
    param, values = found
    k = min(store.topk, store.n_indexed)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    groups = store._groups()
    heads = [np.concatenate([queries[h] for h in hs]) for hs in groups]
    estimator = type(store.indexes[0]).estimates

    def reference(g: int):  # each probe's: the same exact top-k (and for an estimator its output) every time
        if estimator:
            return _exact_outputs(store, groups[g][0], heads[g], k, target, scaling)
        w = softmax_weights(_scores(heads[g], store.keys[groups[g][0] // store.group, : store.n_indexed]), scaling)
        return w, topk_weight(w, k)

    # A layer's probes on one thread were the serial tail of its build on a many-core host (an H200's 16 cores:
    # SmolLM2 8K's layer 11, seven probes up to L 1200, 1.25 s against 0.3 s for a layer probed once).
    refs = map_one_thread(reference, range(len(groups)), beside)
    bound = float(np.concatenate([r[3] for r in refs]).mean()) if estimator else None

    def read(g: int, search: dict) -> tuple[np.ndarray, np.ndarray]:
        """Per query of the group: its weight recall, or its output error, and the bytes its search read."""
        res = _checked(store, groups[g][0], heads[g], k, type(store.indexes[0]).scaled(search, scaling))
        if estimator:
            return _estimate_errors(store, groups[g][0], heads[g], res, refs[g], scaling), res.bytes_read
        return weight_recall_at_k(res.ids, refs[g][0], k, refs[g][1]), res.bytes_read

    tried: dict = {}
    per_head: dict = {}  # value -> each query head's mean reading there
    over_scan: dict = {}  # value -> its mean bytes read per query over an exact scan's
    scan_bytes = store.n_indexed * store.indexes[0].key_bytes()  # flat's per query: every indexed key

    def reading(i: int) -> float:
        if values[i] not in tried:
            search = {**store.plan.search_params, param: values[i]}
            got = map_one_thread(lambda g: read(g, search), range(len(groups)), beside)
            tried[values[i]] = float(np.concatenate([r for r, _ in got]).mean())
            over_scan[values[i]] = float(np.concatenate([b for _, b in got]).mean()) / scan_bytes
            per_head[values[i]] = _per_head([r for r, _ in got], groups)
        return tried[values[i]]

    def reaches(i: int) -> bool:
        return reading(i) <= bound if estimator else reading(i) >= target

    def settled(i: int) -> bool:  # a raise stops where it reaches the target or reads more than a scan
        return reaches(i) or over_scan[values[i]] > 1.0

    values, pick = with_present(store, param, values)
    raised = not reaches(pick)
    if raised and over_scan[values[pick]] <= 1.0:  # a search given that falls short and reads more is scanned at once
        pick = first_reaching(settled, pick, len(values) - 1)
    value = values[pick]
    if raised and over_scan[value] > 1.0:  # told by what serves the layer: the exact top-k, not the value left
        if estimator:
            errors = [r[4] for r in refs]
            scan, heads_read = float(np.concatenate(errors).mean()), _per_head(errors, groups)
        else:
            scan, heads_read = 1.0, (1.0,) * store.n_heads
        found = Calibration(store.layer, param, value, None if estimator else scan, dict(sorted(tried.items())),
                            heads_read, target, scan if estimator else None, bound, over_scan[value])
    else:
        found = Calibration(store.layer, param, value, None if estimator else tried[value], dict(sorted(tried.items())),
                            per_head[value], target, tried[value] if estimator else None, bound)
    if change_store:
        apply(store, found)
    return found


def _per_head(readings: list[np.ndarray], groups: list[list[int]]) -> tuple:
    """Each query head's mean reading, from each group's readings (its heads' queries in turn, as many each)."""
    heads_of = [h for hs in groups for h in hs]
    means = [float(part.mean()) for r, hs in zip(readings, groups) for part in np.split(r, len(hs))]
    return tuple(m for _, m in sorted(zip(heads_of, means)))


def apply(store, found: "Calibration") -> None:
    """Search ``store``'s indexes at the calibrated value from now on, or scan its keys exactly where calibration says
    so (a calibration in a worker is applied here)."""
    if found.exact_scan is not None:
        store.scan_exactly()
    else:
        store.plan = replace(store.plan, search_params={**store.plan.search_params, found.param: found.value})


def _checked(store, head: int, queries: np.ndarray, k: int, search: dict):
    """Query head ``head``'s index searched with ``search``, its result held to the index protocol's id and count rules
    and an estimator's to the estimate's (as the decoder's steps hold theirs): the reading taken from it picks the
    value, and an id past the keys would index the weights."""
    index = store.indexes[head]
    res = index.search(queries, k, **search)
    owner = f"{store.plan.name} (layer {store.layer}) at {search}"
    protocol.check_result(owner, res, len(queries), k, store.n_indexed, index.max_scanned(), check_scores=False)
    if index.estimates:
        protocol.check_estimate(owner, res, index)
    return res


ROWS = 64  # queries per block of an estimator's dense readings: 64 × n float64 (64 MiB at 128K keys)


def _exact_outputs(store, head: int, queries: np.ndarray, k: int, target: float,
                   scaling: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For an estimator's calibration, per query of ``head``'s index: its scaled logits over the indexed keys less
    the row's largest (r, n) float32 and that largest (r,), exact attention over the keys (r, dv) in float64, the
    output error of its exact top-k cut to ``target`` of the top-k's weight (its fewest heaviest keys holding that
    share): the error a top-k index at weight recall ``target`` would have if it missed only the lightest keys, the
    bound an estimator's must not exceed; and the whole exact top-k's output error (a layer scanned instead)."""
    keys = store.keys[head // store.group, : store.n_indexed]
    values = store.values[head // store.group, : store.n_indexed].astype(np.float64)
    logits = _scores(queries, keys)
    top_logit = logits.max(axis=1)
    logits -= top_logit[:, None]
    logits *= np.float32(scaling)
    full = np.empty((len(queries), values.shape[1]))
    cut_errors, topk_errors = np.empty(len(queries)), np.empty(len(queries))
    for lo in range(0, len(queries), ROWS):
        w = np.exp(logits[lo:lo + ROWS].astype(np.float64))
        full[lo:lo + ROWS] = (w @ values) / w.sum(axis=1, keepdims=True)
        top = np.argpartition(-w, k - 1, axis=1)[:, :k] if k < w.shape[1] else np.tile(np.arange(w.shape[1]), (len(w), 1))
        top_w = np.take_along_axis(w, top, axis=1)
        order = np.argsort(-top_w, axis=1, kind="stable")  # heaviest first
        top, top_w = np.take_along_axis(top, order, axis=1), np.take_along_axis(top_w, order, axis=1)
        share = np.cumsum(top_w, axis=1)
        kept = np.arange(top.shape[1]) <= np.argmax(share >= target * share[:, -1:], axis=1)[:, None]  # fewest reaching
        kept_w = np.where(kept, top_w, 0.0)
        cut = np.einsum("rk,rkd->rd", kept_w, values[top]) / kept_w.sum(axis=1, keepdims=True)
        cut_errors[lo:lo + ROWS] = _relative(cut, full[lo:lo + ROWS])
        whole = np.einsum("rk,rkd->rd", top_w, values[top]) / top_w.sum(axis=1, keepdims=True)
        topk_errors[lo:lo + ROWS] = _relative(whole, full[lo:lo + ROWS])
    return logits, top_logit, full, cut_errors, topk_errors


def _estimate_errors(store, head: int, queries: np.ndarray, res, ref: tuple, scaling: float) -> np.ndarray:
    """Per query, the output error of an estimator's result ``res`` (``head``'s index) against exact attention over the
    indexed keys (``ref``: :func:`_exact_outputs`'): its exact ids (weight 1), its samples (their weights) and its
    summaries (their members' count, the members' mean value) in one partial softmax, as a decode step merges them
    (:func:`estimate.estimate_terms`), each block of queries as a dense weighted product over the keys (a loop over
    :func:`estimate.estimate_terms` per query took minutes on a sampled estimator; tests/test_decode_calibrate.py holds
    these errors to the decoder's own step output, :meth:`LayerStore.side`)."""
    logits, top_logit, full = ref[:3]
    values = store.values[head // store.group, : store.n_indexed].astype(np.float64)
    summ, sums = store._summaries.get(head, (None, None))
    errors = np.empty(len(queries))
    for lo in range(0, len(queries), ROWS):
        rows = slice(lo, min(lo + ROWS, len(queries)))
        n_rows = rows.stop - rows.start
        chosen = np.zeros((n_rows, logits.shape[1]))  # each key's weight in the estimate: 1 exact, 1/p sampled
        r, c = np.nonzero(res.ids[rows] >= 0)
        chosen[r, res.ids[rows][r, c]] = 1.0
        if res.estimate is not None:
            r, c = np.nonzero(res.estimate.sample_ids[rows] >= 0)
            np.add.at(chosen, (r, res.estimate.sample_ids[rows][r, c]), res.estimate.sample_weights[rows][r, c])
        p = chosen * np.exp(logits[rows].astype(np.float64))
        num, z = p @ values, p.sum(axis=1)
        if res.estimate is not None and summ is not None and (res.estimate.summary_ids[rows] >= 0).any():
            # a centroid's logit on the rows' scale: its score less the row's best key's, scaled
            s_logits = (queries[rows].astype(np.float64) @ summ.keys.T.astype(np.float64) - top_logit[rows, None]) * scaling
            picked = np.zeros(s_logits.shape)
            r, c = np.nonzero(res.estimate.summary_ids[rows] >= 0)
            picked[r, res.estimate.summary_ids[rows][r, c]] = summ.counts[res.estimate.summary_ids[rows][r, c]]
            ps = picked * np.exp(s_logits)
            counts = np.maximum(summ.counts, 1).astype(np.float64)
            num += ps @ (sums / counts[:, None])
            z += ps.sum(axis=1)
        out = np.divide(num, z[:, None], out=np.zeros_like(num), where=z[:, None] > 0)  # nothing returned: output 0
        errors[rows] = _relative(out, full[rows])
    return errors


def _relative(out: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Per row, ‖out − exact‖ / ‖exact‖."""
    return np.linalg.norm(out - exact, axis=1) / np.linalg.norm(exact, axis=1)


def _scores(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """:func:`metrics.exact_scores` through torch: its thread team is the calling thread's (one on a build worker,
    :func:`indexes.threads.one_thread`), where numpy's BLAS wakes a team of its own that spins beside the prefill and the
    other layer's build (SmolLM2 8K: a layer's build and calibration 0.794 -> 0.735 CPU s; BENCHMARKS "Scale")."""
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    return (q @ torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).T).numpy()


def first_reaching(reaches, short: int, last: int) -> int:
    """The least index in (``short``, ``last``] where ``reaches`` holds (it holds from some index on: recall grows along
    the grid), else ``last``: galloping up from ``short`` (1, 2, 4, ... steps), then bisecting the last step. A probe costs
    about its value (a beam of L), so the thorough end of the grid is searched only where nothing cheaper reaches."""
    step = 1
    while True:
        probe = min(short + step, last)
        if reaches(probe):
            break
        if probe == last:
            return last
        short, step = probe, 2 * step
    while short + 1 < probe:  # short falls short, probe reaches
        mid = (short + probe) // 2
        short, probe = (short, mid) if reaches(mid) else (mid, probe)
    return probe


def with_present(store, param: str, values: list) -> tuple[list, int]:
    """``values`` (the built grid, cheapest first) with the layer's present search in it (the plan's ``param``, else the
    index's declared default, else the grid's cheapest), and its index there: calibration starts at it and only goes
    up. A present value off the grid is probed itself, in its place by the grid's order (ascending values, or descending
    as simhash's ``min_collisions``): one between two values is not raised where it suffices, one beyond the most
    thorough is not lowered to it."""
    declared = store.indexes[0].search_params.get(param)
    present = store.plan.search_params.get(param, declared.default if declared is not None else values[0])
    if present in values:
        return values, values.index(present)
    descending = len(values) > 1 and values[-1] < values[0]
    at = next((i for i, v in enumerate(values) if (v < present if descending else v > present)), len(values))
    return [*values[:at], present, *values[at:]], at


def describe(calibrations: list[Calibration], setting: float | str = AUTO,
             probes: str = f"the newest {QUERIES} prefill queries") -> str:
    """One line for a mode's notes: the target (``setting``: :data:`AUTO`, each layer's by its keys, or the one given),
    the queries read (``probes``), each layer's calibrated value and weight recall, and the layers whose most thorough
    value tried (the grid's, or a ``--param`` value beyond it, probed itself) fell short of their target (a weight
    recall of 0.9496 prints as 0.950 beside a target of 0.95)."""
    params = " / ".join(dict.fromkeys(x.param for x in calibrations))  # a --from-sweep mode's layers may differ in index
    short = [str(x.layer) for x in calibrations if not x.reached]
    targets = sorted({round(x.target, 3) for x in calibrations})
    said = " / ".join(f"{t:g}" for t in targets) + (f" ({AUTO}: by the keys held)" if setting == AUTO else "")
    rule = (f"output error <= the exact top-k's cut to weight {said} (an estimator)"
            if any(x.output_error is not None for x in calibrations) else f"weight recall@k >= {said}")
    return (f"calibrated {params} per layer to {rule} on {probes} (raised "
            "from the search given where that fell below): "
            + ", ".join(x.describe() for x in calibrations)
            + (f"; short of the target at the most thorough value tried: layer {', '.join(short)}" if short else ""))

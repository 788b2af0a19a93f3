"""CPU side of one decode step, per layer: ``LayerStore.side`` (search + gather + attention) in µs per call.

    .venv/bin/python benchmarks/bench_cpu_side.py --dump dumps/smollm2-text-8192 --layers 2,15,28

For each layer it builds, on the dump's real prefill keys outside the static window (128 + 512),
one :class:`LayerStore` per mode (``flat``, ``ivf``, ``roargraph`` with ``--train-queries``
evenly strided prefill queries, as ``bench_decode.py --train-queries`` does), puts ``--pending``
decode-phase keys in the side-buffer (tokens that left the window, not yet added), and calls
``side()`` with the dump's decode-phase queries (one query per head per call, as the decoder does).
Modes are interleaved round by round and the median over rounds is reported, so a shared, noisy
machine slows every mode alike; ratios within one run are the useful numbers. By default each
layer is timed on its own (its data stay in cache: a lower bound); with ``--cycle`` every call
visits all the listed layers in turn, as a decode step does, so each layer's keys and graphs come
back cold from memory — the graph searches' case in the decoder (``--layers 0-29:3 --cycle``).

``--legacy`` adds ``<mode>-legacy`` rows: the side() of commit 3d8cf12 (per-head kernel calls for
graph indexes, side-buffer rows materialised and concatenated, then ``attend_rows``), copied below,
on the same stores — the before/after ratio of this rewrite measured in one run. Its graph searches read full
rows (3d8cf12 predates the row stop): compare them with the ``--full-rows`` rows (their outputs are checked
against those where both run), not with the default search's. ``--held`` adds
``<mode>-held`` rows for per-head graph indexes: the side() of commit ae1a1ea, whose store held a
``GraphGroup`` and called its kernel directly, where side() now goes through the index protocol's
``search_group`` (which finds the cached group itself) — the cost of that hook, in one run. ``--full-rows`` adds
``<mode>-fullrows`` rows: the same indexes searched with full rows (``row_misses=0``). ``--stats`` first
decomposes each mode's retrieval per query head and step (keys scanned, graph nodes expanded, adjacency words, KiB
read, from one pass over the same calls) and then prints µs per scanned key and per expanded node next to the
times; every round's thread CPU time is reported beside its wall time.

Threads as in the decoder's CPU worker: numba and faiss on one thread.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import statistics
import time

import numpy as np


def _legacy_kernels():
    """The search and attention kernels of commit 3d8cf12, copied: sorted-list beam search with the sequential
    inner product, its parallel batch wrapper (one call per head), scalar attention."""
    import math

    from numba import njit, prange

    @njit(nogil=True, inline="always")
    def dot(a, b):  # the sequential sum of 3d8cf12 (graph_search.dot is explicit SIMD since)
        s = np.float32(0.0)
        for i in range(a.shape[0]):
            s += a[i] * b[i]
        return s

    @njit(nogil=True)
    def _insert(ids, scores, done, size, cap, node, score):
        pos = size
        while pos > 0 and scores[pos - 1] < score:
            pos -= 1
        if pos >= cap:
            return size, pos
        last = min(size, cap - 1)
        for i in range(last, pos, -1):
            ids[i] = ids[i - 1]
            scores[i] = scores[i - 1]
            done[i] = done[i - 1]
        ids[pos] = node
        scores[pos] = score
        done[pos] = False
        return min(size + 1, cap), pos

    @njit(nogil=True)
    def beam_search(data, nbrs, degree, query, entries, L, visited, epoch):
        ids = np.empty(L, np.int64)
        scores = np.empty(L, np.float32)
        done = np.zeros(L, np.bool_)
        size = 0
        n_scanned = 0
        for e in entries:
            if visited[e] == epoch:
                continue
            visited[e] = epoch
            n_scanned += 1
            size, _ = _insert(ids, scores, done, size, L, e, dot(data[e], query))
        cur = 0
        while cur < size:
            if done[cur]:
                cur += 1
                continue
            done[cur] = True
            node = ids[cur]
            best = size
            for j in range(degree[node]):
                nb = nbrs[node, j]
                if visited[nb] == epoch:
                    continue
                visited[nb] = epoch
                n_scanned += 1
                s = dot(data[nb], query)
                if size < L or s > scores[size - 1]:
                    size, pos = _insert(ids, scores, done, size, L, nb, s)
                    best = min(best, pos)
            cur = min(cur + 1, best)
        return ids, scores, size, n_scanned

    @njit(nogil=True, parallel=True)
    def beam_search_batch(data, nbrs, degree, queries, entries, L, k, n_threads):
        nq = queries.shape[0]
        out_ids = np.full((nq, k), -1, np.int64)
        out_scores = np.full((nq, k), -np.inf, np.float32)
        n_scanned = np.zeros(nq, np.int64)
        n_chunks = max(1, min(nq, n_threads))
        for c in prange(n_chunks):
            visited = np.zeros(data.shape[0], np.int32)
            lo = c * nq // n_chunks
            hi = (c + 1) * nq // n_chunks
            for qi in range(lo, hi):
                ids, scores, size, scanned = beam_search(data, nbrs, degree, queries[qi], entries[qi], L, visited, qi - lo + 1)
                m = min(size, k)
                out_ids[qi, :m] = ids[:m]
                out_scores[qi, :m] = scores[:m]
                n_scanned[qi] = scanned
        return out_ids, out_scores, n_scanned

    @njit(nogil=True)
    def attend_rows(q, keys, values, rows, scaling):
        n_heads, d = q.shape
        group = n_heads // keys.shape[0]
        r = rows.shape[1]
        out = np.zeros((n_heads, d), np.float64)
        mx = np.full(n_heads, -np.inf)
        zs = np.zeros(n_heads, np.float64)
        logits = np.empty(r, np.float64)
        for h in range(n_heads):
            g = h // group
            m = -np.inf
            for j in range(r):
                row = rows[h, j]
                if row < 0:
                    logits[j] = -np.inf
                    continue
                s = 0.0
                for c in range(d):
                    s += np.float64(q[h, c]) * np.float64(keys[g, row, c])
                s *= scaling
                logits[j] = s
                if s > m:
                    m = s
            if m == -np.inf:
                continue
            z = 0.0
            for j in range(r):
                row = rows[h, j]
                if row < 0:
                    continue
                w = math.exp(logits[j] - m)
                z += w
                for c in range(d):
                    out[h, c] += w * values[g, row, c]
            for c in range(d):
                out[h, c] /= z
            mx[h] = m
            zs[h] = z
        return out, mx, zs

    return beam_search_batch, attend_rows


_LEGACY = None


def legacy_side(store, q: np.ndarray, scaling: float):
    """``LayerStore.side`` as of commit 3d8cf12: per-head kernel calls, side-buffer rows materialised and concatenated."""
    global _LEGACY
    if _LEGACY is None:
        _LEGACY = _legacy_kernels()
    beam_search_batch, attend_rows = _LEGACY
    t0 = time.perf_counter()
    parts, scanned = [], []
    if store.indexes and store.n_indexed:
        k = min(store.topk, store.n_indexed)
        rows = np.empty((store.n_heads, k), np.int64)
        groups: dict[int, list[int]] = {}
        for h, index in enumerate(store.indexes):
            groups.setdefault(id(index), []).append(h)
        if len(groups) == store.n_heads:
            L = store.plan.search_params.get("L", 100)
            qq = np.ascontiguousarray(q, dtype=np.float32)
            out = [beam_search_batch(*index.graph_arrays(), qq[i: i + 1], index.entries_for(qq[i: i + 1]), max(L, k), k, 1)
                   for i, index in enumerate(store.indexes)]
            ids, n_scanned = (np.concatenate(column) for column in list(zip(*out))[::2])  # the legacy kernel: no bytes
            rows[:] = ids
            scanned.extend((n_scanned / store.n_indexed).tolist())
        else:
            for heads in groups.values():
                res = store.indexes[heads[0]].search(q[heads], k, **store.plan.search_params)
                rows[heads] = res.ids
                scanned.extend((res.n_scanned / store.n_indexed).tolist())
        parts.append(rows)
    if store.n_rows > store.n_indexed:
        pending = np.arange(store.n_indexed, store.n_rows, dtype=np.int64)
        parts.append(np.broadcast_to(pending, (store.n_heads, len(pending))))
    t1 = time.perf_counter()
    rows = np.ascontiguousarray(np.concatenate(parts, axis=1)) if parts else np.full((store.n_heads, 1), -1, np.int64)
    out, m, z = attend_rows(np.ascontiguousarray(q, dtype=np.float32), store.keys, store.values, rows, float(scaling))
    t2 = time.perf_counter()
    return out, m, z, t1 - t0, t2 - t1


def held_side(store, group, L: int, stop: tuple, q: np.ndarray, scaling: float):
    """``LayerStore.side`` of commit ae1a1ea: the store's own ``GraphGroup``, searched directly (no protocol hook), with
    the row stop ``stop`` the hook uses."""
    from anns_lab.decode.kernels import attend_rows_and_range

    t0 = time.perf_counter()
    q = np.ascontiguousarray(q, dtype=np.float32)
    k = min(store.topk, store.n_indexed)
    res = group.search(q, k, L, stop)
    store._check(res, q, k)
    t1 = time.perf_counter()
    out, m, z = attend_rows_and_range(q, store.keys, store.values, np.ascontiguousarray(res.ids), store.n_indexed,
                                      store.n_rows, float(scaling))
    return out, m, z, t1 - t0, time.perf_counter() - t1


def graph_counts(store, q: np.ndarray) -> np.ndarray | None:
    """Per query head, (scanned, expanded, adjacency words) of the head's own search (``graph.search.search_one``,
    the search ``search_group`` interleaves) for the query ``q[h]``; None for an index without graph arrays."""
    from anns_lab.indexes.graph.search import search_one, typed_stop
    from anns_lab.indexes.graph.utils import workspace

    if not store.indexes or not hasattr(store.indexes[0], "graph_arrays"):
        return None
    k = min(store.topk, store.n_indexed)
    out = np.empty((store.n_heads, 3), np.int64)
    for h, index in enumerate(store.indexes):
        p = index._search_params_for(store.plan.search_params)
        g = tuple(index.graph_arrays())
        ws = workspace(len(g[0]), p["L"], k, expanded=len(g[0]))
        stop = typed_stop((p.get("row_misses", 0), p.get("row_credit", 0.0), getattr(index, "n_built", len(g[0]))))
        ids, scores = np.empty(k, np.int64), np.empty(k, np.float32)
        n, words, n_exp = search_one(g, np.ascontiguousarray(q[h], np.float32), index.entries(), p["L"], ws, 1, ids, scores,
                                     stop)
        out[h] = n, n_exp, words
    return out


def _stats(store, qs: list) -> dict:
    """Means per query head and step over the calls ``qs``: keys scanned and KiB read (from side()), graph nodes
    expanded and adjacency words (:func:`graph_counts`; nan for other indexes)."""
    scanned, kib, exp, words = [], [], [], []
    for q in qs:
        res = store.side(q, 1.0)
        scanned.append(res.scanned * store.n_indexed)
        kib.append(res.bytes_read / store.n_heads / 1024)
        c = graph_counts(store, q)
        if c is not None:
            assert abs(c[:, 0].mean() - scanned[-1]) < 1e-6 * max(1.0, scanned[-1]), "graph_counts is not side()'s search"
        exp.append(np.nan if c is None else c[:, 1].mean())
        words.append(np.nan if c is None else c[:, 2].mean())
    return {"scanned": float(np.mean(scanned)), "expanded": float(np.mean(exp)), "words": float(np.mean(words)),
            "kib": float(np.mean(kib))}


def _split(res):
    """SideResult → (out, m, z, retrieval s, attention s), the shape legacy_side returns."""
    return res.out, res.m, res.z, res.retrieval_s, res.attention_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", default="dumps/smollm2-text-8192")
    ap.add_argument("--layers", default="15", help="layers of the dump: 2,15,28 or 0-29 or 0-29:3")
    ap.add_argument("--cycle", action="store_true",
                    help="each call visits every layer in turn, as a decode step does (cold caches); else layer by layer")
    ap.add_argument("--modes", default="flat,ivf,roargraph")
    ap.add_argument("--param", action="append", default=[], help="search parameter NAME=VALUE (to every index declaring it)")
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--window", default="128,512")
    ap.add_argument("--train-queries", type=int, default=1024)
    ap.add_argument("--pending", type=int, default=16, help="decode keys in the side-buffer (left the window, not added)")
    ap.add_argument("--calls", type=int, default=32, help="decode queries per round (one side() call each)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--legacy", action="store_true", help="also time the pre-rewrite side() on the same stores")
    ap.add_argument("--held", action="store_true", help="also time side() with a held GraphGroup (per-head graph modes)")
    ap.add_argument("--full-rows", action="store_true",
                    help="also time each mode with a row stop with full rows (row_misses=0) on the same stores")
    ap.add_argument("--stats", action="store_true",
                    help="decompose retrieval: scanned, expanded, adjacency words, KiB read per head and step; µs per key")
    a = ap.parse_args()

    import faiss
    import numba

    from anns_lab.decode.builds import subsample
    from anns_lab.decode.kernels import warmup
    from anns_lab.cli_types import parse_params
    from anns_lab.decode.modes import parse_modes
    from anns_lab.decode.placement import LayerStore
    from anns_lab.dumps.store import open_dump

    numba.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    warmup()
    dump = open_dump(a.dump)
    sink, recent = (int(x) for x in a.window.split(","))
    n_pre = int(dump.manifest["n_tokens"]["prefill"])
    H, G = dump.n_heads, dump.n_kv_heads
    modes = parse_modes(a.modes, parse_params(a.param), {})
    print(f"{dump!r}\nwindow {sink}+{recent}, top-{a.topk}, {a.pending} side-buffer rows, {a.train_queries} train queries; "
          f"{platform.processor() or platform.machine()}, median of {a.rounds} rounds x {a.calls} calls")
    layers = _parse_layers(a.layers)
    runs, queries, n_keys, stores = {}, {}, 0, {}
    for layer in layers:
        keys = np.stack([dump.keys(layer, g, "all") for g in range(G)])
        values = np.stack([dump.values(layer, g, "all") for g in range(G)])
        prefill_q = np.stack([dump.queries(layer, h, "prefill") for h in range(H)])
        decode_q = np.stack([dump.queries(layer, h, "decode") for h in range(H)])  # (H, t, d)
        scaling = dump.scaling(layer)
        lo, hi = sink, n_pre - recent
        n_keys = hi - lo
        pend = keys[:, n_pre: n_pre + a.pending]  # the first decode keys stand in for tokens that left the window
        runs[layer] = {}
        for mode in modes:
            store = LayerStore(layer, H, keys[:, lo:hi], values[:, lo:hi], a.topk, mode.plan, add_batch=1 << 30)
            store.build(subsample(prefill_q, a.train_queries))
            if a.pending:
                store.extend(pend, values[:, n_pre: n_pre + a.pending])
            runs[layer][mode.name] = (lambda s, c: (lambda q: _split(s.side(q, c))))(store, scaling)
            stores[layer, mode.name] = store
            if a.full_rows and "row_misses" in store.indexes[0].search_params:  # the same indexes, searched with full rows
                full = copy.copy(store)
                full.plan = dataclasses.replace(mode.plan, search_params={**mode.plan.search_params, "row_misses": 0})
                runs[layer][mode.name + "-fullrows"] = (lambda s, c: (lambda q: _split(s.side(q, c))))(full, scaling)
                stores[layer, mode.name + "-fullrows"] = full
            if a.legacy:
                runs[layer][mode.name + "-legacy"] = (lambda s, c: (lambda q: legacy_side(s, q, c)))(store, scaling)
            if a.held and len({id(ix) for ix in store.indexes}) == H:
                from anns_lab.indexes.graph.multi import GraphGroup

                sp = store.indexes[0]._search_params_for(mode.plan.search_params)  # what search_group searches with
                group, L, stop = GraphGroup(store.indexes), sp["L"], (sp.get("row_misses", 0), sp.get("row_credit", 0.0))
                runs[layer][mode.name + "-held"] = (lambda s, g, c: (lambda q: held_side(s, g, L, stop, q, c)))(store, group,
                                                                                                                   scaling)
            print(f"layer {layer} {mode.plan.describe()}: built in {store.build_s:.1f} s", flush=True)
        nq = decode_q.shape[1]
        queries[layer] = [np.ascontiguousarray(decode_q[:, i % nq]) for i in range(a.calls)]
        first = {name: fn(queries[layer][0]) for name, fn in runs[layer].items()}  # compile / load every kernel
        for name in runs[layer]:
            if name.endswith(("-legacy", "-held")):
                base = name.rsplit("-", 1)[0]
                if name.endswith("-legacy") and base + "-fullrows" in first:  # the legacy search reads full rows
                    base += "-fullrows"
                diff = np.abs(first[name][0] - first[base][0]).max()
                print(f"{name}: max |output − {base} output| = {diff:.2e}")
    names = list(runs[layers[0]])
    stats, per_layer = None, {}
    if a.stats:  # one untimed pass over the same calls: what each mode's retrieval does per head and step
        stats = {}
        for name in names:
            if (layers[0], name) in stores:
                per = [_stats(stores[layer, name], queries[layer]) for layer in layers]
                stats[name] = {key: float(np.mean([p[key] for p in per])) for key in per[0]}
                for layer, one in zip(layers, per):
                    per_layer.setdefault(layer, {})[name] = one
    if a.cycle:  # every call visits each layer in turn, as a decode step does: the layers' data are cold
        wall, split, cpu = {n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}
        for r in range(a.rounds):
            for name in names[:: 1 - 2 * (r % 2)]:  # the order flips every round: a mode's caches are not always warmed by the one before
                parts = []
                t0, c0 = time.perf_counter(), time.thread_time()
                for i in range(a.calls):
                    for layer in layers:
                        parts.append(runs[layer][name](queries[layer][i])[3:5])
                cpu[name].append((time.thread_time() - c0) / (a.calls * len(layers)))
                wall[name].append((time.perf_counter() - t0) / (a.calls * len(layers)))
                split[name].append(np.mean(parts, axis=0))
        _report(f"cycling {len(layers)} layers {a.layers} (µs per layer and step)", n_keys, H, G, wall, split, cpu, stats)
        return
    results = {}
    for layer in layers:
        wall, split, cpu = {n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}
        for _ in range(a.rounds):
            for name, fn in runs[layer].items():
                parts = []
                t0, c0 = time.perf_counter(), time.thread_time()
                for q in queries[layer]:
                    parts.append(fn(q)[3:5])
                cpu[name].append((time.thread_time() - c0) / len(queries[layer]))
                wall[name].append((time.perf_counter() - t0) / len(queries[layer]))
                split[name].append(np.mean(parts, axis=0))
        results[layer] = _report(f"layer {layer}", n_keys, H, G, wall, split, cpu, per_layer.get(layer))
    if len(results) > 1:
        for part in ("side", "retrieval"):
            print(f"\nsum over layers, {part} µs: " + ", ".join(f"{n} {sum(r[part][n] for r in results.values()):.0f}" for n in names))


def _parse_layers(text: str) -> list[int]:
    """``2,15,28`` or a range ``0-29`` or a strided range ``0-29:3``."""
    out = []
    for part in text.split(","):
        if "-" in part:
            span, _, step = part.partition(":")
            lo, hi = (int(x) for x in span.split("-"))
            out.extend(range(lo, hi + 1, int(step or 1)))
        else:
            out.append(int(part))
    return out


def _report(title, n_keys, H, G, wall, split, cpu, stats=None) -> dict:
    """Print the medians over rounds (side() wall and thread CPU, its retrieval and attention parts) and, with
    ``stats``, the retrieval's decomposition per query head and step; return the medians."""
    print(f"\n{title}: {n_keys} indexed keys, H={H}, G={G}")
    print("| mode | side() µs | side() CPU µs | retrieval µs | attention µs | retrieval × flat | retrieval × ivf |")
    print("|---|---|---|---|---|---|---|")
    med = {name: statistics.median(v) * 1e6 for name, v in wall.items()}
    med_cpu = {name: statistics.median(v) * 1e6 for name, v in cpu.items()}
    ret = {name: float(np.median([p[0] for p in v])) * 1e6 for name, v in split.items()}
    att = {name: float(np.median([p[1] for p in v])) * 1e6 for name, v in split.items()}
    for name in wall:
        rel = [f"{ret[name] / ret[ref]:.2f}" if ref in ret else "–" for ref in ("flat", "ivf")]
        print(f"| {name} | {med[name]:.0f} | {med_cpu[name]:.0f} | {ret[name]:.0f} | {att[name]:.0f} | {rel[0]} | {rel[1]} |")
    if stats:
        print("\nper query head and step (retrieval µs / (H × scanned), / (H × expanded)):")
        print("| mode | scanned | expanded | adjacency words | KiB read | retrieval µs | ns per scanned key | ns per expanded node |")
        print("|---|---|---|---|---|---|---|---|")
        for name, s in stats.items():
            per_key = ret[name] * 1e3 / (H * s["scanned"])
            per_node = ret[name] * 1e3 / (H * s["expanded"]) if s["expanded"] == s["expanded"] else float("nan")
            print(f"| {name} | {s['scanned']:.1f} | {s['expanded']:.1f} | {s['words']:.1f} | {s['kib']:.1f} | {ret[name]:.0f} | "
                  f"{per_key:.1f} | {per_node:.1f} |")
    return {"side": med, "cpu": med_cpu, "retrieval": ret, "attention": att}

if __name__ == "__main__":
    main()

"""``hnsw``: HNSW graph built by hnswlib (space ``ip``), searched by our counted traversal of it.

hnswlib builds fast but does not count distance computations. So after each build or add the
graph is exported from hnswlib's own state (``__getstate__``: its level-0 and upper-level link
lists) and ``search`` runs a numba re-implementation of hnswlib's ``searchKnn`` over that very
graph: greedy descent from hnswlib's entry point through the upper layers, then beam search
with ``max(ef, k)`` on layer 0. Results and counts therefore come from the same graph and the
same algorithm (the tests check the ids against ``hnswlib.knn_query``). ``n_scanned`` counts
every inner product computed: each neighbour evaluated during the descent (a node may be
evaluated again on a lower layer, and then counts again) plus each node evaluated on layer 0.
``bytes_read`` (``graph.search.bytes_read``): every scanned node's vector (4·dim bytes, repeats
included), every neighbour list read at every layer (hnswlib's count word plus its ids, 4 bytes
each: each time the descent scans a node's upper-layer list, and each node expanded on layer 0)
and the entry point's id (8 bytes).

hnswlib inserts with one thread so that a seeded build is deterministic.
"""

from __future__ import annotations

import os
import tempfile

import hnswlib
import numba
import numpy as np
from numba import njit, prange

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import KeyRowsIndex, Param
from anns_lab.indexes.graph import Graph
from anns_lab.indexes.graph.search import bytes_read, search_batch
from anns_lab.indexes.graph.simd import dot
from anns_lab.indexes.held_memory import filled_one_by_one, mutex_bytes
from anns_lab.indexes.persist import expect, expect_ids


def level0_records(st: dict) -> tuple[np.ndarray, np.ndarray]:
    """(records, labels) of an hnswlib state: each element's layer-0 record as bytes (links, vector, label) and its
    label (our key id)."""
    n = st["cur_element_count"]
    rec = np.asarray(st["data_level0"]).view(np.uint8)[: n * st["size_data_per_element"]]  # a view of the state
    rec = rec.reshape(n, st["size_data_per_element"])
    return rec, rec[:, st["label_offset"] : st["label_offset"] + 8].copy().view(np.uint64).ravel().astype(np.int64)


_HEADER = np.dtype([("offset_level0", "<u8"), ("max_elements", "<u8"), ("count", "<u8"), ("per_element", "<u8"),
                    ("label_offset", "<u8"), ("offset_data", "<u8"), ("max_level", "<i4"), ("entry", "<u4"),
                    ("max_M", "<u8"), ("max_M0", "<u8"), ("M", "<u8"), ("mult", "<f8"), ("ef_construction", "<u8")])


def check_hnswlib_file(blob: np.ndarray, n_keys: int, dim: int) -> None:
    """Raise IndexConfigError unless ``blob`` (uint8) is an hnswlib inner-product file of ``n_keys`` keys × ``dim``
    whose every size, offset, count and neighbour id hnswlib's reader and our graph would use is in range.

    hnswlib's ``load_index`` trusts the file (its header's sizes become allocations and offsets, its link counts
    loop bounds) and a saved index is a file people exchange, so its format is read here first: the header
    (:data:`_HEADER`, as ``saveIndex`` writes it), then ``count`` layer-0 records (link count word, ``max_M0`` ids,
    the vector, the label), then per element a byte count and that many bytes of upper-layer rows (count word,
    ``max_M`` ids each)."""
    def bad(problem: str) -> IndexConfigError:
        return IndexConfigError(f"array 'hnswlib_index' is not an hnswlib file of {n_keys} keys × {dim}: {problem}")

    if len(blob) < _HEADER.itemsize:
        raise bad(f"{len(blob)} bytes, shorter than its header")
    h = {k: v.item() for k, v in zip(_HEADER.names, blob[:_HEADER.itemsize].view(_HEADER)[0])}
    m, m0 = h["max_M"], h["max_M0"]
    if not (1 <= h["M"] == m <= m0 <= 0xFFFF):
        raise bad(f"link widths M {h['M']}, max_M {m}, max_M0 {m0}")
    links0 = 4 * (m0 + 1)
    layout = {"offset_level0": 0, "count": n_keys, "offset_data": links0, "label_offset": links0 + 4 * dim,
              "per_element": links0 + 4 * dim + 8}
    for field, want in layout.items():
        if h[field] != want:
            raise bad(f"header {field} {h[field]}, expected {want}")
    if not (n_keys <= h["max_elements"] and 0 <= h["max_level"] < 64 and h["entry"] < n_keys
            and np.isfinite(h["mult"]) and h["mult"] > 0 and h["ef_construction"] >= 1):
        raise bad("header max_elements, max_level, entry point, mult or ef_construction out of range")
    body = _HEADER.itemsize + n_keys * h["per_element"]
    if len(blob) < body:
        raise bad(f"{len(blob)} bytes, too short for {n_keys} layer-0 records")
    rec = blob[_HEADER.itemsize:body].reshape(n_keys, h["per_element"])
    _check_rows(rec[:, :links0].copy().view("<u4"), m0, n_keys, bad, "layer 0")
    row_bytes = 4 * (m + 1)
    at, rows, levels = body, [], np.zeros(n_keys, np.int64)
    for i in range(n_keys):  # each element: a byte count, then its rows of levels 1..l
        if at + 4 > len(blob):
            raise bad("the upper layers' lists end early")
        size = int(blob[at:at + 4].view("<u4")[0])
        at += 4
        if size % row_bytes or size // row_bytes > h["max_level"] or at + size > len(blob):
            raise bad(f"an upper-layer list of {size} bytes (rows of {row_bytes}, at most {h['max_level']} levels)")
        levels[i] = size // row_bytes
        if size:
            rows.append(blob[at:at + size])
        at += size
    if at != len(blob):
        raise bad(f"{len(blob) - at} bytes after the last list")
    # hnswlib's search and add walk from the entry point down through levels max_level..1 without checking that a
    # node has the level they read (a missing one is a null list): the entry point must be on the top level, and a
    # neighbour listed at level l must have a list there.
    if levels.max(initial=0) != h["max_level"] or levels[h["entry"]] != h["max_level"]:
        raise bad(f"the entry point's level {levels[h['entry']]} or the highest element level {levels.max(initial=0)} "
                  f"is not the header's max_level {h['max_level']}")
    if rows:
        words = np.concatenate(rows).reshape(-1, row_bytes).view("<u4")
        used = _check_rows(words, m, n_keys, bad, "upper layers")
        level = np.concatenate([np.arange(1, lv + 1) for lv in levels[levels > 0]])  # each row's level
        if (levels[np.minimum(words[:, 1:], n_keys - 1).astype(np.int64)][used] < np.repeat(level, used.sum(1))).any():
            raise bad("an upper-layer neighbour without a list at that level")


def _check_rows(words: np.ndarray, width: int, n_keys: int, bad, where: str) -> np.ndarray:
    """Link rows (count word, ``width`` ids): a count within the width, no flag bits (hnswlib marks a deleted
    element in the count word's third byte: the lab never deletes), and every id in use a key. Returns the mask of
    the slots in use (rows, width)."""
    count = words[:, 0]
    if (count > width).any():
        raise bad(f"{where}: a link count past the row width {width} (or a deletion mark)")
    used = np.arange(width) < count[:, None].astype(np.int64)
    if (words[:, 1:][used] >= n_keys).any():
        raise bad(f"{where}: a neighbour id past the {n_keys} keys")
    return used


LABEL_OP_LOCKS = 65536  # hnswlib's MAX_LABEL_OPERATION_LOCKS: mutexes every index holds, whatever its size
LABEL_NODE = 32  # a label map entry: libstdc++'s hash node (next pointer, 8-byte label, 4-byte id) in glibc's 32-byte chunk


def hnswlib_bytes(st: dict, levels: np.ndarray) -> int:
    """The bytes hnswlib's ``HierarchicalNSW`` holds for a state ``st`` (``__getstate__``'s) whose elements have
    ``levels``: per slot of ``max_elements`` its layer-0 record (links, vector, label), upper-list pointer, level and
    link lock; per element its label map entry and bucket (the buckets counted as the power of two at or above the
    count: libstdc++ doubles them) and its upper lists; the label locks and one visited list (2 bytes a slot; a search
    on t threads at once adds t - 1). Its allocations as hnswlib 0.8.0's ``hnswalg.h`` makes them: the allocator's count
    agrees within ~1% (tests/test_index_memory.py), where counting the records alone left out 441 of 1,251 B per key at
    7.5K keys."""
    slots, count = int(st["max_elements"]), int(st["cur_element_count"])
    mutex = mutex_bytes()
    per_slot = st["size_data_per_element"] + 8 + 4 + mutex + 2
    buckets = int(filled_one_by_one(count))
    upper = int(levels.sum()) * st["size_links_per_element"] + int((levels > 0).sum())  # each list's +1 byte
    return slots * per_slot + count * LABEL_NODE + 8 * buckets + upper + LABEL_OP_LOCKS * mutex


class HNSWGraph:
    """hnswlib's graph as arrays indexed by key id (label): layer 0 plus the upper layers."""

    def __init__(self, p: hnswlib.Index) -> None:
        st = p.__getstate__()[0]
        n, M, M0 = st["cur_element_count"], st["max_M"], st["max_M0"]
        rec, label = level0_records(st)
        links0 = rec[:, : 4 * (M0 + 1)].copy().view(np.uint32)  # header word, then M0 neighbour slots
        deg0 = (links0[:, 0] & 0xFFFF).astype(np.int32)  # hnswlib keeps the count in the low 16 bits
        levels = np.asarray(st["element_levels"], np.int64)[:n]
        self.max_level = int(st["max_level"])
        row_bytes = st["size_links_per_element"]
        # link_lists: the nodes above layer 0 in id order, each with its rows of levels 1..L, one after another
        up_nodes = np.flatnonzero(levels > 0)
        lv = levels[up_nodes]
        n_upper, n_rows = len(up_nodes), int(lv.sum())
        rows = np.asarray(st["link_lists"]).view(np.uint8)[: row_bytes * n_rows].reshape(n_rows, row_bytes)
        rows = rows.copy().view(np.uint32)  # aligned words
        owner = np.repeat(np.arange(n_upper), lv)
        level = np.arange(n_rows) - np.repeat(np.cumsum(lv) - lv, lv)  # 0 for level 1
        up_nbrs = np.full((n_upper, max(self.max_level, 1), M), -1, np.int64)
        up_deg = np.zeros((n_upper, max(self.max_level, 1)), np.int32)
        up_deg[owner, level] = rows[:, 0] & 0xFFFF
        up_nbrs[owner, level] = rows[:, 1 : M + 1]
        up_row = np.full(n, -1, np.int32)
        up_row[up_nodes] = np.arange(n_upper)
        up_nbrs[np.arange(M) >= up_deg[..., None]] = -1  # slots past a count hold stale words (any value in a file)
        # Re-index internal ids by label, so that graph rows are key ids.
        to_label = label
        perm = np.argsort(label)
        # Slots past a node's degree hold stale words (any value): kept out of the lookup, then masked.
        used = np.arange(M0) < deg0[:, None]
        ids = np.where(used, links0[:, 1:].view(np.int32), 0)
        if np.array_equal(label, np.arange(n)):  # added one at a time in id order: internal ids are the labels
            self.nbrs = np.where(used, ids, np.int32(-1))
        else:
            self.nbrs = np.where(used, to_label[ids], -1)[perm].astype(np.int32)
        self.degree = deg0[perm]
        self.up_nbrs = np.where(up_nbrs >= 0, to_label[up_nbrs.clip(0)], -1).astype(np.int32)
        self.up_deg = up_deg
        self.up_row = up_row[perm]
        self.entry = int(to_label[st["enterpoint_node"]])
        self.maxM = M
        self.library_bytes = hnswlib_bytes(st, levels)

    def max_descent(self) -> int:
        """Upper bound on inner products in the upper-layer descent (each node current at most once per layer)."""
        return 1 + self.maxM * int(self.up_deg.astype(bool).sum())


@njit(cache=True, nogil=True, parallel=True)
def descend_batch(data, up_row, up_nbrs, up_deg, entry, max_level, queries):
    """hnswlib's greedy descent through layers max_level..1 per query: (layer-0 entry, inner products computed,
    adjacency words read: count word + ids of each list scanned)."""
    nq = queries.shape[0]
    entries = np.empty((nq, 1), np.int64)
    counts = np.zeros(nq, np.int64)
    words = np.zeros(nq, np.int64)
    for qi in prange(nq):
        q = queries[qi]
        cur = entry
        best = dot(data[cur], q)
        cnt = 1
        w = 0
        for level in range(max_level, 0, -1):
            changed = True
            while changed:
                changed = False
                r = up_row[cur]
                node = cur  # keep scanning the old node's list after moving, as hnswlib does
                w += 1 + up_deg[r, level - 1]
                for j in range(up_deg[r, level - 1]):
                    nb = up_nbrs[r, level - 1, j]
                    s = dot(data[nb], q)
                    cnt += 1
                    if s > best:
                        best = s
                        cur = nb
                        changed = True
                if node == cur:
                    changed = False
        entries[qi, 0] = cur
        counts[qi] = cnt
        words[qi] = w
    return entries, counts, words


class HNSWIndex(KeyRowsIndex):
    """HNSW for maximum inner product: hnswlib builds, a counted numba traversal of hnswlib's graph searches."""

    name = "hnsw"
    build_params = {
        "M": Param(16, 2, 128, help="links per node on upper layers (2·M on layer 0)"),
        "ef_construction": Param(200, 1, 4096, help="beam width while building"),
        "seed": Param(100, 0, 2**31 - 1, help="hnswlib's random_seed (level assignment)"),
    }
    search_params = {"ef": Param(100, 1, 1 << 16, help="layer-0 beam width (the search uses max(ef, k))")}
    search_grid = {"ef": (100, 150, 200, 300, 400, 600, 800, 1200, 1600)}

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        p = hnswlib.Index(space="ip", dim=keys.shape[1])
        p.init_index(max_elements=len(keys), M=self.params["M"], ef_construction=self.params["ef_construction"], random_seed=self.params["seed"])
        p.set_num_threads(1)
        p.add_items(keys, np.arange(len(keys)))
        self._hold_keys(keys)
        self._set(p)

    def _set(self, p: hnswlib.Index) -> None:
        self.hnswlib_index = p  # kept for add(), save() and the tests' cross-check
        self.graph = HNSWGraph(p)

    def _add(self, keys: np.ndarray) -> None:
        p = self.hnswlib_index
        n0 = p.get_current_count()
        p.resize_index(n0 + len(keys))
        p.add_items(keys, np.arange(n0, n0 + len(keys)))
        self._append_keys(keys)
        self._set(p)

    def _search(self, queries: np.ndarray, k: int, ef: int):
        g = self.graph
        entries, descent, descent_words = descend_batch(self._keys, g.up_row, g.up_nbrs, g.up_deg, g.entry, g.max_level,
                                                        queries)
        ids, scores, scanned, words = search_batch(Graph(self._keys, g.nbrs, g.degree), queries, entries, max(ef, k), k,
                                                   numba.get_num_threads())
        scanned = scanned + descent
        return ids, scores, scanned, bytes_read(self.dim, scanned, words + descent_words, 1)

    def max_scanned(self) -> int:
        return self.n_keys + self.graph.max_descent()

    @property
    def nbytes(self) -> int:
        """The searched graph and keys, and the hnswlib index kept beside them for ``add`` and ``save`` (a second
        copy of the vectors with their links)."""
        g = self.graph
        keys = self._rows.held(self.n_keys)  # the rows' store, spare rows included where it is the index's own
        return sum(a.nbytes for a in (keys, g.nbrs, g.degree, g.up_nbrs, g.up_deg, g.up_row)) + g.library_bytes

    def _arrays(self) -> dict[str, np.ndarray]:
        # hnswlib's own file format, carried as bytes in an .npy (no pickle).
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "hnsw.bin")
            self.hnswlib_index.save_index(path)
            return {"hnswlib_index": np.fromfile(path, np.uint8), "keys": self._keys}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys = expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True)
        blob = expect(arrays, "hnswlib_index", np.uint8, (None,))
        check_hnswlib_file(blob, self.n_keys, self.dim)  # before hnswlib's reader, which trusts it
        p = hnswlib.Index(space="ip", dim=self.dim)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "hnsw.bin")
            blob.tofile(path)
            p.load_index(path, max_elements=len(keys))  # RuntimeError on a malformed file: load says so
        if p.get_current_count() != len(keys) or p.dim != self.dim:
            raise IndexConfigError(f"array 'hnswlib_index' holds {p.get_current_count()} keys of dimension {p.dim}, "
                                   f"not {len(keys)} × {self.dim}")
        # A graph over other vectors, or with a label twice, would search and count validly and find other neighbours.
        st = p.__getstate__()[0]
        rec, labels = level0_records(st)
        if not np.array_equal(np.sort(labels), np.arange(len(keys))):
            raise IndexConfigError("array 'hnswlib_index' does not label every key exactly once")
        stored = rec[:, st["offset_data"] : st["offset_data"] + 4 * self.dim].copy().view(np.float32)
        if not np.array_equal(stored[np.argsort(labels)], keys):
            raise IndexConfigError("array 'hnswlib_index' was built over other vectors than array 'keys'")
        del st, rec, stored
        p.set_num_threads(1)
        self._hold_keys(keys)
        self._set(p)
        g, n = self.graph, len(keys)
        # hnswlib's loader leaves each list's count (16 bits) unchecked; the numba descent reads up to it unchecked
        for name, deg, width in (("layer 0", g.degree, g.nbrs.shape[1]), ("upper layers", g.up_deg, g.up_nbrs.shape[2])):
            expect_ids(f"hnswlib_index ({name} degrees)", deg, 0, width + 1)
        for name, ids in (("layer 0", g.nbrs), ("upper layers", g.up_nbrs)):
            expect_ids(f"hnswlib_index ({name})", ids[ids >= 0], 0, n)
        expect_ids("hnswlib_index (entry point)", np.array([g.entry]), 0, n)

"""Fuzz one saved index (``python load_fuzz_worker.py INDEX FOLDER``): random edits of index.json fields, array
shapes, dtypes, ids and bytes, each loaded and searched. Prints one JSON line per case and ``done`` at the end,
so a crash (the process dies) names the case it died in. Used by ``test_index_load_fuzz.py``."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import registry
from anns_lab.testing import positions

N, DIM, K = 300, 16, 10
BUILD = {"vamana": {"R": 8, "L": 16}, "robust-vamana": {"R": 8, "L": 16, "n_queries": 50},
         "roargraph": {"M": 6, "R": 12, "keep_queries": 20, "n_hubs": 4}, "hnsw": {"M": 8, "ef_construction": 32},
         "ivf": {"nlist": 4}, "flat": {}, "simhash": {"K": 4, "L": 8},
         # the plugins that save (make test installs them)
         "pqcache": {"M": 2, "nbits": 4}, "clusterkv": {"nlist": 8}, "squeezed": {"nlist": 8, "n_coarse": 2},
         "quest": {"page_size": 16}, "shadowkv": {"chunk_size": 8, "outliers": 0.05}, "retroinfer": {"nlist": 8},
         "magicpig": {"K": 4, "L": 8}, "ngfix": {"M": 8, "ef_construction": 32, "MEX": 8, "fix_lists": 20, "rfix_ef": 40},
         "sparq": {}, "loki": {}, "snapkv": {"window": 16}, "infllm": {"block": 32}}
OPAQUE = {"hnswlib_index"}  # hnswlib's file: edited whole by hnswlib_bytes below, not an element at a time
JUNK = [None, -1, 0, 10**12, "x", [], {}, 1.5, True, -(2**63)]


def _rehash(folder: Path) -> None:
    """Make index.json's checksums match the files again (a hostile, consistent edit)."""
    meta = json.loads((folder / "index.json").read_text())
    meta["sha256"] = {a: hashlib.sha256((folder / f"{a}.npy").read_bytes()).hexdigest()
                      for a in meta["arrays"] if (folder / f"{a}.npy").is_file()}
    (folder / "index.json").write_text(json.dumps(meta))


def _edit_meta(folder: Path, rng, cls) -> tuple[str, bool]:
    meta = json.loads((folder / "index.json").read_text())
    kind = rng.integers(4)
    if kind == 0:
        field = str(rng.choice(sorted(meta)))
        meta[field] = JUNK[rng.integers(len(JUNK))]
        what, may_differ = f"index.json {field} = {meta[field]!r}", False
    elif kind == 1:
        field = str(rng.choice(sorted(meta)))
        del meta[field]
        what, may_differ = f"index.json without {field}", False
    elif kind == 2 and cls.build_params:
        name = str(rng.choice(sorted(cls.build_params)))
        meta["params"][name] = [-1, 0, 1, 2, 7, 10**9, "x", None, 1.5][rng.integers(9)]
        what, may_differ = f"param {name} = {meta['params'][name]!r}", True
    else:
        meta["params"]["no_such_param"] = 3
        what, may_differ = "unknown param", False
    (folder / "index.json").write_text(json.dumps(meta))
    return what, may_differ


def _edit_array(folder: Path, rng, meta) -> tuple[str, bool]:
    names = [a for a in meta["arrays"] if a not in OPAQUE]
    name = str(rng.choice(names or meta["arrays"]))
    file = folder / f"{name}.npy"
    a = np.load(file)
    kind = rng.integers(5) if a.size else 0
    if name in OPAQUE and kind in (2, 3):  # a payload's own bytes: only its checksum protects them
        kind = 1
    if kind == 0:
        a = a.astype([np.float64, np.int64, np.int16, np.uint8, np.float32, np.int32][rng.integers(6)])
        what = f"{name} as {a.dtype}"
    elif kind == 1:
        a = [a[:-1], np.concatenate([a, a[:1]]), a.ravel(), a[None], a[:0]][rng.integers(5)]
        what = f"{name} reshaped to {a.shape}"
    elif kind == 4:
        file.unlink()
        _rehash(folder)
        return f"{name}.npy deleted", True
    else:
        i = tuple(rng.integers(s) for s in a.shape)
        if a.dtype.kind == "f":
            v = [np.nan, np.inf, -np.inf, 1e30, 0.0][rng.integers(5)]
        else:
            v = [-2, -1, N, N + 7, 2**31 - 1, -(2**31)][rng.integers(6)] if a.dtype.itemsize >= 4 else np.iinfo(a.dtype).max
        a = a.copy()
        a[i] = v
        what = f"{name}{list(i)} = {v}"
    np.save(file, a, allow_pickle=False)
    _rehash(folder)
    return what, True  # checksums redone: a deliberate edit may be a different valid index (one hub fewer, a key moved)


def _flip_bytes(folder: Path, rng, meta) -> str:
    file = folder / f"{rng.choice(meta['arrays'])}.npy"
    data = bytearray(file.read_bytes())
    at = int(rng.integers(len(data)))
    data[at] ^= 1 << int(rng.integers(8))
    file.write_bytes(bytes(data))
    return f"bit flipped in {file.name} at byte {at}"


def _valid(res, keys: np.ndarray, queries: np.ndarray) -> bool:
    """The protocol of a correct search over ``keys``: ids in range, unique per row, scores their inner products."""
    for ids, scores, q in zip(res.ids, res.scores, queries):
        found = ids[ids >= 0]
        if (ids >= len(keys)).any() or len(set(found.tolist())) != len(found):
            return False
        if not np.allclose(scores[ids >= 0], keys[found] @ q, rtol=1e-4, atol=1e-4):
            return False
    return True


def main(name: str, root: Path, n_cases: int = 36) -> None:
    rng = np.random.default_rng(sum(map(ord, name)))  # fixed per index
    keys = rng.standard_normal((N, DIM)).astype(np.float32)
    train = (rng.standard_normal((200, DIM)) + 0.3).astype(np.float32)
    queries = (rng.standard_normal((8, DIM)) + 0.3).astype(np.float32)
    cls = registry.get(name)
    index = cls(**BUILD[name]).build(keys, train, **positions(cls, len(keys), len(train)))
    saved = root / "saved"
    index.save(saved)
    grid = index.grid()[:2]
    want = [index.search(queries, K, **g) for g in grid]
    for case in range(n_cases):
        folder = root / f"case{case}"
        shutil.copytree(saved, folder)
        meta = json.loads((saved / "index.json").read_text())
        kind = case % 3
        may_differ = False
        if kind == 0:
            what, may_differ = _edit_meta(folder, rng, cls)
        elif kind == 1:
            what, may_differ = _edit_array(folder, rng, meta)
        else:
            what = _flip_bytes(folder, rng, meta)
        print(json.dumps({"case": case, "edit": what, "outcome": "started"}), flush=True)
        try:
            loaded = cls.load(folder)
        except IndexConfigError as e:
            outcome = f"refused: {e}"
        else:
            try:
                got = [loaded.search(queries, K, **g) for g in grid]
            except IndexConfigError as e:  # e.g. a search parameter the edited build parameters no longer allow
                print(json.dumps({"case": case, "edit": what, "outcome": f"refused at search: {e}"}), flush=True)
                shutil.rmtree(folder)
                continue
            same = all(np.array_equal(a.ids, b.ids) and np.array_equal(a.scores, b.scores)
                       and np.array_equal(a.n_scanned, b.n_scanned) for a, b in zip(want, got))
            file = folder / "keys.npy"
            loaded_keys = np.load(file) if file.is_file() else keys
            outcome = "same" if same else ("valid" if may_differ and all(_valid(r, loaded_keys, queries) for r in got)
                                           else "WRONG: loaded and searched differently")
        print(json.dumps({"case": case, "edit": what, "outcome": outcome}), flush=True)
        shutil.rmtree(folder)
    print("done", flush=True)


def hnswlib_bytes(root: Path, n_cases: int = 600) -> None:
    """``python load_fuzz_worker.py --hnswlib-bytes FOLDER``: an HNSW index's hnswlib file with one byte set to
    0, 255 or a random value (its checksum redone: a hostile, consistent edit), every header byte and a sample of
    the rest, each loaded and searched: refused, the same search, or a valid one (a byte of a vector or of the build
    parameters may change what a valid index finds)."""
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((N, DIM)).astype(np.float32)
    queries = rng.standard_normal((8, DIM)).astype(np.float32)
    cls = registry.get("hnsw")
    index = cls(**BUILD["hnsw"]).build(keys)
    index.add(rng.standard_normal((40, DIM)).astype(np.float32))  # a resized file, as a saved decode store's
    keys = np.concatenate([keys, index._keys[N:]])
    saved = root / "saved"
    index.save(saved)
    want = index.search(queries, K)
    extra = rng.standard_normal((5, DIM)).astype(np.float32)
    blob = np.load(saved / "hnswlib_index.npy")
    spots = np.r_[np.arange(96), rng.choice(np.arange(96, len(blob)), n_cases - 96, replace=False)]
    for case, at in enumerate(spots):
        value = [0, 255, int(rng.integers(256))][case % 3]
        edited = blob.copy()
        edited[at] = value
        what = f"hnswlib_index byte {at} = {value}"
        print(json.dumps({"case": case, "edit": what, "outcome": "started"}), flush=True)
        np.save(saved / "hnswlib_index.npy", edited, allow_pickle=False)
        _rehash(saved)
        try:
            loaded = cls.load(saved)
        except IndexConfigError as e:
            outcome = f"refused: {e}"
        else:
            got = loaded.search(queries, K)
            same = np.array_equal(got.ids, want.ids) and np.array_equal(got.n_scanned, want.n_scanned)
            outcome = "same" if same else ("valid" if _valid(got, keys, queries) else "WRONG: loaded and searched badly")
            loaded.add(extra)  # hnswlib's insert walks the loaded graph from its entry point, as its search does
            if not _valid(loaded.search(queries, K), np.concatenate([keys, extra]), queries):
                outcome = "WRONG: searched badly after an add"
        print(json.dumps({"case": case, "edit": what, "outcome": outcome}), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--hnswlib-bytes":
        hnswlib_bytes(Path(sys.argv[2]))
    else:
        main(sys.argv[1], Path(sys.argv[2]))

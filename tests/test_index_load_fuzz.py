"""Loading a saved index trusts nothing: random edits of index.json fields, array shapes, dtypes, ids and
flipped bytes (fixed seeds, 36 cases per index) each end in one IndexConfigError or a correct load: the same
search as the saved index, or, for a deliberate edit (a build parameter, or an array with its checksum redone),
a valid search of what the edited files say (ids in range and unique, scores their inner products).
Every case runs in a subprocess per index, so a crash is a failing test that names the case."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("load_fuzz_worker.py")


@pytest.mark.parametrize("name", ["flat", "ivf", "hnsw", "vamana", "robust-vamana", "roargraph", "simhash",
                                  "pqcache", "clusterkv", "squeezed", "quest", "shadowkv", "retroinfer",
                                  "magicpig", "ngfix", "sparq", "loki", "snapkv", "infllm"])
def test_every_edit_of_a_saved_index_is_refused_or_loads_correctly(name, tmp_path):
    from anns_lab.indexes import registry

    if name not in registry.available():
        pytest.skip(f"the {name} plugin is not installed (make test installs it)")
    proc = subprocess.run([sys.executable, str(WORKER), name, str(tmp_path)], capture_output=True, text=True, timeout=600)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    last = lines[-1] if lines else None
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), (
        f"{name}: the worker died (exit {proc.returncode}) in {last}\n{proc.stderr[-2000:]}")
    done = [x for x in lines if x["outcome"] != "started"]
    wrong = [x for x in done if not x["outcome"].startswith(("refused", "same", "valid"))]
    assert not wrong, wrong
    assert len(done) == 36 and sum(x["outcome"].startswith("refused") for x in done) >= 18  # the edits bite
    assert all("cannot load" in x["outcome"] for x in done if x["outcome"].startswith("refused:"))  # names the folder


def test_every_byte_of_an_hnswlib_file_is_refused_or_loads_correctly(tmp_path):
    """hnswlib's reader trusts its file (sizes become allocations, counts loop bounds), so the lab reads the format
    first (``hnsw.check_hnswlib_file``): a byte edit with its checksum redone never crashes the process or loads
    into a search that returns bad ids."""
    proc = subprocess.run([sys.executable, str(WORKER), "--hnswlib-bytes", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), (
        f"the worker died (exit {proc.returncode}) in {lines[-1] if lines else None}\n{proc.stderr[-2000:]}")
    done = [x for x in lines if x["outcome"] != "started"]
    assert len(done) == 600 and not [x for x in done if x["outcome"].startswith("WRONG")]
    header = [x for x in done[:96] if x["outcome"].startswith("refused")]
    assert len(header) >= 40 and all("not an hnswlib file" in x["outcome"] for x in header)  # the reader's checks bite


# Small builds of every index that saves (plugins included: anns-lab loads their saves as it loads its own).
SMALL = {"vamana": {"R": 8, "L": 16}, "robust-vamana": {"R": 8, "L": 16, "n_queries": 50},
         "roargraph": {"M": 6, "R": 12, "keep_queries": 20, "n_hubs": 4}, "hnsw": {"M": 8, "ef_construction": 32},
         "ivf": {"nlist": 4}, "simhash": {"K": 4, "L": 8}, "magicpig": {"K": 4, "L": 8}, "retroinfer": {"nlist": 16},
         "pqcache": {"M": 2, "nbits": 4}, "clusterkv": {"nlist": 8, "niter": 5},
         "squeezed": {"nlist": 16, "n_coarse": 4, "niter": 5},
         "ngfix": {"M": 8, "ef_construction": 32, "MEX": 8, "fix_lists": 20, "rfix_ef": 40}, "infllm": {"block": 32}}


def _saving_indexes() -> list[str]:
    from anns_lab.indexes import Index, registry

    return sorted(n for n, c in registry.available().items() if c._arrays is not Index._arrays)


def _hostile_edits(a: np.ndarray, name: str, n_keys: int) -> list[tuple[str, np.ndarray]]:
    """Edits of one saved array that no correct save holds: NaN or float64 in a float array, keys with a row more or
    fewer than index.json's n_keys, an integer (id, count, size) far past the keys."""
    if a.dtype == np.uint8:  # hnswlib's file (its bytes: test_every_byte_of_an_hnswlib_file...) or PQ codes (any byte decodes)
        return []
    if a.dtype.kind == "f" and a.size:
        nan = a.copy()
        nan.flat[0] = np.nan
        edits = [("NaN", nan), ("float64", a.astype(np.float64))]
        if name == "keys":
            edits += [("a row more", np.concatenate([a, a[:1]])), ("a row fewer", a[:-1])]
        return edits
    if a.dtype.kind == "i" and a.size:
        far = a.copy()
        far.flat[0] = n_keys + 7
        return [(f"{n_keys + 7}", far)]
    return []


@pytest.mark.parametrize("name", _saving_indexes())
def test_a_hostile_edit_with_its_checksum_redone_is_refused_by_every_index(name, tmp_path):
    """The checksums catch corruption, not an edit that rewrites them: each index's ``_restore`` must check every
    array (``persist.expect``/``expect_ids``), or a NaN, a float64 array, keys of another count than index.json says
    or an id past the keys loads and reaches the search (numba and faiss read out of bounds, results go wrong)."""
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes import registry

    rng = np.random.default_rng(0)
    keys, train = (rng.standard_normal((n, 16)).astype(np.float32) for n in (300, 100))
    cls = registry.get(name)
    from anns_lab.testing import positions

    cls(**SMALL.get(name, {})).build(keys, train, **positions(cls, len(keys), len(train))).save(tmp_path / "saved")
    meta = json.loads((tmp_path / "saved" / "index.json").read_text())
    more = np.concatenate([keys, keys[:1] + 1])  # a library's payload (faiss, hnswlib) of a build on one key more
    cls(**SMALL.get(name, {})).build(more, train, **positions(cls, len(more), len(train))).save(tmp_path / "more")
    loaded = []
    for array in meta["arrays"]:
        a = np.load(tmp_path / "saved" / f"{array}.npy")
        other = [("a build on other keys", np.load(tmp_path / "more" / f"{array}.npy"))] if a.dtype == np.uint8 else []
        for what, bad in _hostile_edits(a, array, len(keys)) + other:
            folder = tmp_path / f"{array}-{what}"
            shutil.copytree(tmp_path / "saved", folder)
            np.save(folder / f"{array}.npy", bad, allow_pickle=False)
            sums = {**meta["sha256"], array: hashlib.sha256((folder / f"{array}.npy").read_bytes()).hexdigest()}
            (folder / "index.json").write_text(json.dumps({**meta, "sha256": sums}))
            try:
                cls.load(folder)
            except IndexConfigError:
                continue
            loaded.append(f"{array}: {what}")
    assert not loaded, f"{name} loaded hostile edits: {loaded}"


def _resave(folder: Path, name: str, a: np.ndarray) -> None:
    """Write array ``name`` into a saved index with its checksum redone (a hostile, consistent edit)."""
    np.save(folder / f"{name}.npy", a, allow_pickle=False)
    meta = json.loads((folder / "index.json").read_text())
    meta["sha256"][name] = hashlib.sha256((folder / f"{name}.npy").read_bytes()).hexdigest()
    (folder / "index.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("layer", ["layer 0", "upper layers"])
def test_hnswlib_degrees_past_the_row_width_are_refused(layer, tmp_path):
    """hnswlib's loader does not check a node's link count (the low 16 bits of its list's first word) against the
    list's width: the counted descent walks ``up_nbrs[r, level, :up_deg]`` unchecked (numba), so a count past M read
    beyond the array and crashed the process (a segfault) at the first search; past M0 on layer 0, stale slots became
    edges. Such a payload is refused at load."""
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes.hnsw import HNSWIndex

    keys = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    index = HNSWIndex(M=8, ef_construction=32).build(keys)
    index.save(tmp_path)
    st = index.hnswlib_index.__getstate__()[0]
    blob = np.load(tmp_path / "hnswlib_index.npy")
    n, per_node, per_level = len(keys), st["size_data_per_element"], st["size_links_per_element"]
    levels = np.asarray(st["element_levels"])[:n]
    at = len(blob) - n * per_node - int((4 + per_level * levels).sum())  # hnswlib's header, then layer 0's records
    if layer == "layer 0":
        blob[at:at + 2] = 0xFF  # node 0's count: 65535
    else:  # after layer 0: each node's uint32 byte count, then one row per level above 0 (count word first)
        at += n * per_node
        for level in levels:
            if level:
                blob[at + 4:at + 6] = 0xFF
            at += 4 + per_level * level
    _resave(tmp_path, "hnswlib_index", blob)
    with pytest.raises(IndexConfigError, match="hnswlib_index"):
        HNSWIndex.load(tmp_path)


@pytest.mark.parametrize("name", ["ivf", "pqcache"])
def test_a_faiss_index_is_saved_as_plain_arrays_and_an_old_faiss_payload_is_refused(name, tmp_path):
    """faiss's own binary format is parsed by its C++ reader, which trusts the file: the faiss indexes save plain
    arrays (IVF: centroids, keys, each key's list; PQ: codebooks and codes) and load them into a new faiss index
    that searches, counts and adds as the saved one; a save in the old format is refused with what to do."""
    import faiss

    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes import registry

    if name not in registry.available():
        pytest.skip(f"{name} is not installed")
    cls = registry.get(name)
    rng = np.random.default_rng(0)
    keys, queries = rng.standard_normal((300, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    index = cls(**SMALL[name]).build(keys)
    index.add(rng.standard_normal((20, 16)).astype(np.float32))
    index.save(tmp_path / "a")
    assert all(np.load(f).dtype != np.uint8 or f.stem == "codes" for f in (tmp_path / "a").glob("*.npy"))
    loaded = cls.load(tmp_path / "a")
    for params in index.grid()[:3]:
        want, got = index.search(queries, 10, **params), loaded.search(queries, 10, **params)
        assert np.array_equal(want.ids, got.ids) and np.array_equal(want.scores, got.scores)
        assert np.array_equal(want.n_scanned, got.n_scanned) and np.array_equal(want.bytes_read, got.bytes_read)
    more = rng.standard_normal((30, 16)).astype(np.float32)
    index.add(more)
    loaded.add(more)
    assert np.array_equal(index.search(queries, 10).ids, loaded.search(queries, 10).ids)
    old = tmp_path / "a"  # the old format's array name, a valid faiss payload in it
    inner = index._index if name == "ivf" else index._pq
    _resave(old, "faiss_index", faiss.serialize_index(inner))
    meta = json.loads((old / "index.json").read_text())
    (old / "index.json").write_text(json.dumps(meta | {"arrays": sorted(set(meta["arrays"]) | {"faiss_index"})}))
    with pytest.raises(IndexConfigError, match="no longer reads.*build and save the index again"):
        cls.load(old)


def test_ivf_lists_past_the_centroids_are_refused(tmp_path):
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes.ivf import IVFIndex

    keys = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    IVFIndex(nlist=4).build(keys).save(tmp_path)
    lists = np.load(tmp_path / "lists.npy")
    lists[5] = 4
    _resave(tmp_path, "lists", lists)
    with pytest.raises(IndexConfigError, match="'lists' holds values outside"):
        IVFIndex.load(tmp_path)
    _resave(tmp_path, "lists", lists % 4)
    _resave(tmp_path, "centroids", np.zeros((301, 16), np.float32))
    with pytest.raises(IndexConfigError, match="301 lists for 300 keys"):
        IVFIndex.load(tmp_path)


def test_a_plugins_init_refusing_the_saved_parameters_is_one_load_error(tmp_path):
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes.flat import FlatIndex
    from anns_lab.indexes.persist import load_index, save_index

    class Picky(FlatIndex):  # a plugin that checks its parameters in its own __init__, with its own exception
        def __init__(self, **params):
            if params.get("strict"):
                raise ValueError("strict mode needs a licence file")
            super().__init__()

    index = Picky().build(np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32))
    save_index(index, tmp_path / "i")
    meta = json.loads((tmp_path / "i" / "index.json").read_text())
    (tmp_path / "i" / "index.json").write_text(json.dumps(meta | {"params": {"strict": True}}))
    with pytest.raises(IndexConfigError, match="saved parameters do not make an index.*ValueError: strict mode"):
        load_index(Picky, tmp_path / "i")


@pytest.mark.parametrize("edit", ["built over other keys", "a label twice"])
def test_an_hnswlib_payload_of_other_keys_or_labels_is_refused(edit, tmp_path):
    """A payload of the right size whose graph is over other vectors, or labels a key twice, searched and counted
    validly and returned other neighbours than its keys have: refused at load."""
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes.hnsw import HNSWIndex

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((300, 16)).astype(np.float32)
    index = HNSWIndex(M=8, ef_construction=32).build(keys)
    index.save(tmp_path / "a")
    if edit == "built over other keys":
        HNSWIndex(M=8, ef_construction=32).build(rng.standard_normal((300, 16)).astype(np.float32)).save(tmp_path / "b")
        blob = np.load(tmp_path / "b" / "hnswlib_index.npy")
        match = "other vectors"
    else:
        st = index.hnswlib_index.__getstate__()[0]
        blob = np.load(tmp_path / "a" / "hnswlib_index.npy")
        n, per_node, per_level = len(keys), st["size_data_per_element"], st["size_links_per_element"]
        levels = np.asarray(st["element_levels"])[:n]
        at = len(blob) - n * per_node - int((4 + per_level * levels).sum())  # layer 0's records
        label = slice(at + st["label_offset"], at + st["label_offset"] + 8)
        second = slice(label.start + per_node, label.stop + per_node)
        blob[second] = blob[label]  # node 1 labelled as node 0
        match = "exactly once"
    _resave(tmp_path / "a", "hnswlib_index", blob)
    with pytest.raises(IndexConfigError, match=match):
        HNSWIndex.load(tmp_path / "a")


def test_an_hnswlib_file_whose_levels_disagree_is_refused(tmp_path):
    """hnswlib's search and add walk from the entry point down through the upper levels without checking that a
    node has a list at the level they read: an entry point below the top level (one header field) or a max_level
    above every element's would send them through a null list. Refused at load."""
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes.hnsw import _HEADER, HNSWIndex, check_hnswlib_file

    keys = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    index = HNSWIndex(M=8, ef_construction=32).build(keys)
    index.save(tmp_path)
    blob = np.load(tmp_path / "hnswlib_index.npy")
    check_hnswlib_file(blob, 300, 16)
    levels = np.asarray(index.hnswlib_index.__getstate__()[0]["element_levels"])[:300]
    header = blob[:_HEADER.itemsize].view(_HEADER).copy()
    for field, value in (("entry", int(np.flatnonzero(levels == 0)[0])), ("max_level", int(levels.max()) + 1)):
        edited = header.copy()
        edited[field] = value
        _resave(tmp_path, "hnswlib_index", np.concatenate([edited.view(np.uint8), blob[_HEADER.itemsize:]]))
        with pytest.raises(IndexConfigError, match="max_level"):
            HNSWIndex.load(tmp_path)


@pytest.mark.parametrize("shape", [(1 << 40, 16), (3, 16)])
def test_an_npy_header_of_another_size_than_its_data_is_refused_before_it_is_read(shape, tmp_path):
    """A forged header (64 TiB of float32) with its checksum redone was a MemoryError from numpy's allocation; a header
    smaller than the data it precedes (the rest ignored by numpy) loads no more."""
    from anns_lab.errors import IndexConfigError
    from anns_lab.indexes.flat import FlatIndex

    keys = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    FlatIndex().build(keys).save(tmp_path / "saved")
    file = tmp_path / "saved" / "keys.npy"
    data = file.read_bytes()
    old, new = (f"'shape': {s}".encode() for s in (keys.shape, shape))
    assert old in data[:128]
    header = data[:128].rstrip(b"\n").rstrip(b" ").replace(old, new).ljust(127) + b"\n"  # its length field holds
    _resave_bytes(tmp_path / "saved", "keys", header + data[128:])
    with pytest.raises(IndexConfigError, match="keys.npy is not a readable .npy array .its header says"):
        FlatIndex.load(tmp_path / "saved")


def _resave_bytes(folder: Path, name: str, data: bytes) -> None:
    (folder / f"{name}.npy").write_bytes(data)
    meta = json.loads((folder / "index.json").read_text())
    meta["sha256"][name] = hashlib.sha256(data).hexdigest()
    (folder / "index.json").write_text(json.dumps(meta))

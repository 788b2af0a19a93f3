"""Saved indexes: a folder of ``.npy`` arrays and ``index.json``, written last, with a sha256 of every array.

A saved index is a file people exchange, and the kernels that search it trust their arrays (numba
does not check bounds): so ``load`` trusts nothing. It refuses, with one :class:`IndexConfigError`
naming the folder and the problem, a missing or unreadable ``index.json``, another format or class,
parameters out of range or missing (a save from before a parameter existed), an array whose bytes do not match their checksum, and, through each index's
``_restore`` and the checks here, an array of the wrong dtype or shape, non-finite keys, or an id outside its
range. No pickle: ``allow_pickle=False``; no library's own binary reader on an unread file (faiss indexes save
plain arrays; hnswlib's file is read by ``hnsw.check_hnswlib_file`` before hnswlib reads it)."""

from __future__ import annotations

import hashlib
import math
import re
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.io import atomic_folder, atomic_write_json, read_json

if TYPE_CHECKING:
    from anns_lab.indexes.base import Index

FORMAT_VERSION = 2  # 2: sha256 of every array in index.json, every array validated on load
_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")  # array names become file names: no paths


def save_index(index: "Index", path: str | Path) -> None:
    """Write ``index`` to folder ``path``: one ``.npy`` per array and ``index.json``, filled beside it and put in its
    place whole (:func:`io.atomic_folder`), so a failed save leaves an earlier one as it was and a save over another
    index's keeps none of its arrays. A folder holding anything but a saved index is refused."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise IndexConfigError(f"{index._owner()}: cannot save into {folder}: it is a file")
    if folder.is_dir() and (other := _not_a_save(folder)):
        raise IndexConfigError(f"{index._owner()}: cannot save into {folder}: it holds {other}, which is not a saved "
                               "index; choose another folder")
    arrays, sums = index._arrays(), {}
    for key in arrays:
        if not _NAME.fullmatch(key):
            raise IndexConfigError(f"{index._owner()}: array name {key!r} is not a plain name ([A-Za-z0-9_])")
    with atomic_folder(folder) as tmp:
        for key, arr in arrays.items():
            buf = BytesIO()
            np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
            (tmp / f"{key}.npy").write_bytes(buf.getvalue())
            sums[key] = hashlib.sha256(buf.getvalue()).hexdigest()
        meta = {"format": FORMAT_VERSION, "class": _class_name(type(index)), "params": index.params,
                "n_keys": index.n_keys, "dim": index.dim, "arrays": sorted(arrays), "sha256": sums}
        atomic_write_json(tmp / "index.json", meta)


def _not_a_save(folder: Path) -> str | None:
    """What in ``folder`` shows it is not a saved index (no index.json, another file, another index.json), or None for
    an empty folder or a save."""
    entries = sorted(folder.iterdir())
    if entries and not (folder / "index.json").is_file():  # someone's own arrays: .npy files are not ours by name alone
        return repr(entries[0].name)
    for f in entries:
        if f.name == "index.json":
            try:
                meta = read_json(f)
            except (OSError, ValueError):
                continue  # a save cut short or damaged: replacing it loses nothing
            if not (isinstance(meta, dict) and "format" in meta and "class" in meta):
                return "an index.json of something else"
        elif not (f.is_file() and f.suffix == ".npy"):
            return repr(f.name)
    return None


def load_index(cls: type["Index"], path: str | Path) -> "Index":
    """Read an index of class ``cls`` written by :func:`save_index`, or raise one IndexConfigError."""
    folder = Path(path)

    def bad(problem: str) -> IndexConfigError:
        return IndexConfigError(f"{cls.__name__}: cannot load {folder}: {problem}")

    meta = _read_meta(folder, bad)
    if meta.get("format") != FORMAT_VERSION:
        raise bad(f"it was saved in format {meta.get('format')!r}, this version reads format {FORMAT_VERSION} only; "
                  "build and save the index again")
    if meta.get("class") != _class_name(cls):
        raise bad(f"it holds {meta.get('class')!r}, not {_class_name(cls)}")
    params, n_keys, dim = meta.get("params"), meta.get("n_keys"), meta.get("dim")
    if not isinstance(params, dict):
        raise bad("index.json 'params' is not an object")
    params = dict(cls.build_params_before) | params  # one saved before a parameter existed was built as with this
    missing = sorted(set(cls.build_params) - set(params))  # a save holds every parameter its class had then
    if missing:
        raise bad(f"index.json has no value for {', '.join(missing)}: saved before {'it' if len(missing) == 1 else 'they'} "
                  "existed (or edited), so today's default would describe an index it was not built as; build and save "
                  "the index again")
    for field, value in (("n_keys", n_keys), ("dim", dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad(f"index.json {field!r} is {value!r}, not a positive integer")
    try:
        index = cls(**params)
    except IndexConfigError as e:
        raise bad(str(e)) from None
    except (TypeError, ValueError) as e:  # a plugin's own __init__ refusing the saved parameters its own way
        raise bad(f"its saved parameters do not make an index of this class ({type(e).__name__}: {e})") from None
    arrays = _read_arrays(folder, meta, bad)
    try:
        index.restored_on(None, arrays, n_keys, dim)
    except IndexConfigError as e:
        raise bad(str(e)) from None
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError, MemoryError) as e:  # a payload library's own
        raise bad(f"its arrays do not make an index of this class ({type(e).__name__}: {e})") from None
    return index


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _read_meta(folder: Path, bad) -> dict[str, Any]:
    meta_file = folder / "index.json"
    if not meta_file.is_file():
        raise bad("no saved index there (index.json missing)")
    try:
        meta = read_json(meta_file)
    except (ValueError, OSError) as e:
        raise bad(f"index.json is not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise bad("index.json is not a JSON object")
    return meta


def _read_arrays(folder: Path, meta: dict, bad) -> dict[str, np.ndarray]:
    names, sums = meta.get("arrays"), meta.get("sha256")
    if not isinstance(names, list) or not all(isinstance(n, str) and _NAME.fullmatch(n) for n in names):
        raise bad("index.json 'arrays' is not a list of plain array names")
    if not isinstance(sums, dict) or len(set(names)) != len(names):
        raise bad("index.json 'sha256' is not an object of one checksum per array")
    arrays = {}
    for name in names:
        file = folder / f"{name}.npy"
        if not file.is_file():
            raise bad(f"{file.name} is missing")
        data = file.read_bytes()
        if hashlib.sha256(data).hexdigest() != sums.get(name):
            raise bad(f"{file.name} does not match its sha256 in index.json (corrupt or edited)")
        try:
            arrays[name] = _npy(data)
        except (ValueError, OSError, EOFError) as e:
            raise bad(f"{file.name} is not a readable .npy array ({e})") from None
    return arrays


def _npy(data: bytes) -> np.ndarray:
    """The array of one ``.npy`` file's bytes, its header's size checked against them before numpy allocates it (a
    forged header of 64 TiB was a MemoryError)."""
    f = BytesIO(data)
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):  # np.save writes 3.0 only for non-Latin-1 field names: no index array has any
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not one np.save writes for these arrays")
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(f)
    if not dtype.hasobject and (held := len(data) - f.tell()) != (said := math.prod(shape) * dtype.itemsize):
        raise ValueError(f"its header says {said:,} bytes of data, the file holds {held:,}")
    return np.load(BytesIO(data), allow_pickle=False)


def expect(arrays: dict[str, np.ndarray], name: str, dtype, shape: tuple, finite: bool = False) -> np.ndarray:
    """``arrays[name]`` as a C-contiguous array if it has this dtype and shape (``None``: any length) and,
    with ``finite``, only values within ±``base.MAX_ABS`` (what build accepts); else IndexConfigError naming it."""
    from anns_lab.indexes.base import MAX_ABS  # base imports this module
    a = arrays.get(name)
    if not isinstance(a, np.ndarray):
        raise IndexConfigError(f"array {name!r} is missing")
    want = "(" + ", ".join("n" if s is None else str(s) for s in shape) + (",)" if len(shape) == 1 else ")")
    if a.dtype != np.dtype(dtype) or a.ndim != len(shape) or any(
            s is not None and s != t for s, t in zip(shape, a.shape)):
        raise IndexConfigError(f"array {name!r} is {a.dtype} of shape {a.shape}, expected {np.dtype(dtype)} of shape {want}")
    if finite and a.size and not (a.max() <= MAX_ABS and a.min() >= -MAX_ABS):  # NaN fails both
        raise IndexConfigError(f"array {name!r} holds NaN, infinite or values beyond ±{MAX_ABS:.0e}")
    return np.ascontiguousarray(a)


def expect_ids(name: str, ids: np.ndarray, low: int, high: int) -> np.ndarray:
    """``ids`` if every one lies in [low, high), else IndexConfigError naming the array."""
    if ids.size and (ids.min() < low or ids.max() >= high):
        raise IndexConfigError(f"array {name!r} holds values outside [{low}, {high})")
    return ids


def refuse_faiss_payload(arrays: dict[str, np.ndarray]) -> None:
    """IndexConfigError for a save holding faiss's own binary format (array ``faiss_index``, written before
    2026-12-03): faiss's reader trusts the file, so the faiss indexes save plain arrays now."""
    if "faiss_index" in arrays:
        raise IndexConfigError("it holds faiss's own binary format (array 'faiss_index', saved before 2026-12-03), "
                               "which this version no longer reads (faiss's reader trusts the file): build and save "
                               "the index again")

"""The prefill's state on disk at a chunk boundary, so that an interrupted dump resumes its prefill there.

A layer file needs the decode steps' queries, which come after the whole prefill: a dump stopped in its prefill had
kept nothing (57 minutes of Gemma-3 at 128K on two cores). A checkpoint is the model's KV cache after a chunk: each
full-attention layer's rows in a ``.npy`` map that only grows (rows already there never change), each sliding layer's
window in files named for the row they hold. The progress record names the row last, so a kill leaves the previous
checkpoint whole. The capture's own maps (``StagingSink``) hold every captured row before that row already.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from anns_lab.io import new_map

EVERY = 300.0  # seconds between checkpoints: an interrupted prefill loses at most this much
PREFILL_AT = "prefill_at"  # the progress record's key: row, seconds, cpu_seconds, ids, layers, dtype, windows, rows
_BITS = {"bfloat16": "int16"}  # numpy has no bfloat16: its bits are kept as int16


def ids_digest(ids: list[int]) -> str:
    """The prompt's token ids, short: a resume must continue the prompt it began."""
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def well_formed(at) -> bool:
    """Whether a progress record's checkpoint has the shapes :meth:`PrefillCheckpoints.restore` reads."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    return (isinstance(at, dict) and type(at.get("row")) is int and number(at.get("seconds"))
            and number(at.get("cpu_seconds")) and isinstance(at.get("ids"), str) and isinstance(at.get("dtype"), str)
            and isinstance(at.get("layers"), dict)
            and all(isinstance(rec, dict) and isinstance(rec.get("sliding"), bool) and type(rec.get("length")) is int
                    for rec in at["layers"].values()))


def unsupported(cache) -> str | None:
    """Why ``cache`` cannot be saved and restored exactly (a layer kind other than a plain or sliding-window dynamic
    layer), or None."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    kinds = {type(layer).__name__ for layer in cache.layers} - {DynamicLayer.__name__, DynamicSlidingWindowLayer.__name__}
    return f"its cache has {', '.join(sorted(kinds))} layers" if kinds else None


def _sliding(layer) -> bool:
    return getattr(layer, "is_sliding", False)


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _dtype(tensor) -> str:
    return dtype_name(tensor.dtype)


def _to_numpy(tensor) -> np.ndarray:
    """(1, G, t, d) on any device -> (G, t, d) in numpy, bit for bit."""
    import torch

    x = tensor[0].detach().to("cpu")
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


def _from_numpy(a: np.ndarray, dtype: str, device):
    import torch

    x = torch.from_numpy(np.ascontiguousarray(a))
    return (x.view(torch.bfloat16) if dtype == "bfloat16" else x)[None].to(device)


def reopen_map(path: Path) -> np.ndarray:
    """An ``.npy`` map written before, opened to write on; ValueError where the file is shorter than its header says
    (numpy's "r+" would silently extend it with zeros: a restore from it would be wrong, not refused)."""
    from numpy.lib.format import open_memmap

    open_memmap(path, mode="r")  # raises on a file cut short
    return open_memmap(path, mode="r+")


def delete(folder: Path) -> None:
    """Every checkpoint's files in ``folder``."""
    for f in folder.glob("cache_*.npy"):
        f.unlink(missing_ok=True)


class PrefillCheckpoints:
    """Saves the cache of one prefill into ``folder`` (the dump's staging folder) every ``every`` seconds.

    Each save records the sha256 of what it wrote (a sliding window's file; the rows it added to each growing map and to
    each of the capture's maps), so that a restore reads back only what was written: a changed byte there would have
    been resumed from without a word."""

    def __init__(self, folder: Path, n_prefill: int, every: float):
        self.folder, self.n_prefill, self.every = folder, n_prefill, every
        self.last = time.perf_counter()
        self.saved_row = 0
        self.rows: dict[str, list] = {}  # growing map's file name -> [[start, end, sha256], ...] of its saved rows

    def due(self, row: int) -> bool:
        """Whether to save after the chunk that ends at ``row`` (never after the last: the resume needs its logits)."""
        return self.every > 0 and row < self.n_prefill and time.perf_counter() - self.last >= self.every

    def save(self, cache, row: int, state: dict, write_state, sink, seconds: float, cpu_seconds: float, ids) -> None:
        """The cache's rows up to ``row`` on disk, ``sink``'s maps flushed, then ``write_state`` with ``state`` naming
        the row (the checkpoint it replaces is deleted after). A save that fails (a full disk) is said and ends the
        checkpoints, not the dump: the checkpoint before it stays whole (its rows and record untouched)."""
        try:
            self._save(cache, row, state, write_state, sink, seconds, cpu_seconds, ids)
        except OSError as err:
            from tqdm.auto import tqdm

            self.every = 0
            # the maps a first save made hold its space reserved, and no checkpoint: gone, or the dump's own files
            # found the disk full after "the dump goes on" (a diff review)
            for f in self.folder.glob("cache_*.npy" if not self.saved_row else f"cache_*.r{row}.npy"):
                f.unlink(missing_ok=True)
            tqdm.write(f"{self.folder}: no more prefill checkpoints ({err.strerror or err}); the dump goes on")

    def _save(self, cache, row: int, state: dict, write_state, sink, seconds: float, cpu_seconds: float, ids) -> None:
        layers, windows, rows, dtype = {}, {}, {name: list(spans) for name, spans in self.rows.items()}, None
        for i, layer in enumerate(cache.layers):
            if not layer.is_initialized:  # past the deepest layer the capture runs (StopForward)
                continue
            dtype = _dtype(layer.keys)
            for name, t in (("k", layer.keys), ("v", layer.values)):
                if _sliding(layer):
                    window = _to_numpy(t)
                    np.save(self.folder / f"cache_{i:03d}.{name}.r{row}.npy", window, allow_pickle=False)
                    windows[f"cache_{i:03d}.{name}"] = _digest(window)
                    continue
                # opened for each save, not held: a map held open counts its written pages in the process's memory
                path = self.folder / f"cache_{i:03d}.{name}.npy"
                new = _to_numpy(t[:, :, self.saved_row:row])  # the rows since the last save only (off the device)
                m = reopen_map(path) if self.saved_row else new_map(
                    path, new.dtype, (new.shape[0], self.n_prefill, new.shape[2]))
                m[:, self.saved_row:row] = new
                m.flush()
                del m
                rows.setdefault(path.name, []).append([self.saved_row, row, _digest(new)])
            layers[str(i)] = {"sliding": _sliding(layer), "length": layer.get_seq_length()}
        sink.flush()
        for path, a in sink.maps():
            rows.setdefault(path.name, []).append([self.saved_row, row, _digest(a[:, self.saved_row:row])])
        before = state.get(PREFILL_AT)
        state[PREFILL_AT] = {"row": row, "seconds": seconds, "cpu_seconds": cpu_seconds, "ids": ids_digest(ids),
                             "layers": layers, "dtype": dtype, "windows": windows, "rows": rows}
        write_state()
        if before is not None:
            for f in self.folder.glob(f"cache_*.r{before['row']}.npy"):
                f.unlink(missing_ok=True)
        self.saved_row, self.last, self.rows = row, time.perf_counter(), rows

    def restore(self, cache, at: dict, ids, sink, n_layers: int, dtype: str, device) -> None:
        """Fill ``cache`` (new, empty) with the checkpoint ``at`` (the progress record's), checking ``sink``'s maps'
        rows before it too; ValueError where anything is not that checkpoint's (gone, cut short, changed since, of
        another prompt, dtype or model): each layer the forward runs (the first ``n_layers``), at the row, as saved."""
        from numpy.lib.format import open_memmap

        row, rows, windows = at["row"], at.get("rows"), at.get("windows")
        if at["ids"] != ids_digest(ids) or not 0 < row < self.n_prefill:
            raise ValueError("the checkpoint is another prompt's")
        if at["dtype"] != dtype:
            raise ValueError(f"the checkpoint holds a {at['dtype']} cache, the model makes {dtype}")
        if not isinstance(rows, dict) or not isinstance(windows, dict):
            raise ValueError("the checkpoint records no checksums")
        if set(at["layers"]) != {str(i) for i in range(n_layers)}:
            raise ValueError(f"the checkpoint holds layers {sorted(at['layers'])}, the forward runs {n_layers}")
        for path, a in sink.maps():
            _check_rows(path.name, a, rows, row)
        for key, rec in at["layers"].items():
            i, layer = int(key), cache.layers[int(key)]
            if rec["sliding"] != _sliding(layer) or rec["length"] != row:
                raise ValueError(f"layer {i}'s record is not one of this forward at row {row}")
            parts = []
            for name in "kv":
                if rec["sliding"]:
                    a = np.load(self.folder / f"cache_{i:03d}.{name}.r{row}.npy", allow_pickle=False)
                    if (_digest(a) != windows.get(f"cache_{i:03d}.{name}")
                            or a.shape[1] != min(row, layer.sliding_window - 1)):
                        raise ValueError(f"layer {i}'s window changed since it was saved")
                else:
                    m = open_memmap(self.folder / f"cache_{i:03d}.{name}.npy", mode="r")  # raises on a file cut short
                    if m.shape[1] != self.n_prefill or m.dtype != np.dtype(_BITS.get(dtype, dtype)):
                        raise ValueError(f"layer {i}'s map is another capture's")
                    _check_rows(f"cache_{i:03d}.{name}.npy", m, rows, row)
                    a = np.array(m[:, :row])
                    del m
                parts.append(_from_numpy(a, dtype, device))
            layer.update(*parts)
            if rec["sliding"]:  # it held the last rows only: its count of the rows it has seen is the checkpoint's
                layer.cumulative_length = row
            if layer.get_seq_length() != row:
                raise ValueError(f"layer {i} restored {layer.get_seq_length()} rows, not {row}")
        self.saved_row, self.rows = row, rows


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _check_rows(name: str, a: np.ndarray, rows: dict, row: int) -> None:
    """ValueError unless the saves' spans of map ``name`` (``rows[name]``: [start, end, sha256] each) cover its rows
    ``[0, row)`` one after the other and each still has its sha256."""
    covered = 0
    for span in rows.get(name) or [None]:
        if not (isinstance(span, list) and len(span) == 3 and span[0] == covered and covered < span[1] <= row):
            raise ValueError(f"{name}: the checkpoint does not account for its rows")
        if _digest(a[:, span[0]:span[1]]) != span[2]:
            raise ValueError(f"{name}: rows {span[0]}..{span[1] - 1} changed since they were saved")
        covered = span[1]
    if covered != row:
        raise ValueError(f"{name}: the checkpoint does not account for its rows")

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

EVERY = 300.0  # seconds between checkpoints: an interrupted prefill loses at most this much
PREFILL_AT = "prefill_at"  # the progress record's key: {"row", "seconds", "cpu_seconds", "ids", "layers", "dtype"}
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


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


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
    """Saves the cache of one prefill into ``folder`` (the dump's staging folder) every ``every`` seconds."""

    def __init__(self, folder: Path, n_prefill: int, every: float):
        self.folder, self.n_prefill, self.every = folder, n_prefill, every
        self.last = time.perf_counter()
        self.saved_row = 0

    def due(self, row: int) -> bool:
        """Whether to save after the chunk that ends at ``row`` (never after the last: the resume needs its logits)."""
        return self.every > 0 and row < self.n_prefill and time.perf_counter() - self.last >= self.every

    def save(self, cache, row: int, state: dict, write_state, sink, seconds: float, cpu_seconds: float, ids) -> None:
        """The cache's rows up to ``row`` on disk, ``sink``'s maps flushed, then ``write_state`` with ``state`` naming
        the row (the checkpoint it replaces is deleted after)."""
        from numpy.lib.format import open_memmap

        layers, dtype = {}, None
        for i, layer in enumerate(cache.layers):
            if not layer.is_initialized:  # past the deepest layer the capture runs (StopForward)
                continue
            dtype = _dtype(layer.keys)
            for name, t in (("k", layer.keys), ("v", layer.values)):
                a = _to_numpy(t)
                if _sliding(layer):
                    np.save(self.folder / f"cache_{i:03d}.{name}.r{row}.npy", a, allow_pickle=False)
                    continue
                # opened for each save, not held: a map held open counts its written pages in the process's memory
                path = self.folder / f"cache_{i:03d}.{name}.npy"
                m = reopen_map(path) if self.saved_row else open_memmap(
                    path, mode="w+", dtype=a.dtype, shape=(a.shape[0], self.n_prefill, a.shape[2]))
                m[:, self.saved_row:row] = a[:, self.saved_row:row]
                m.flush()
                del m
            layers[str(i)] = {"sliding": _sliding(layer), "length": layer.get_seq_length()}
        sink.flush()
        before = state.get(PREFILL_AT)
        state[PREFILL_AT] = {"row": row, "seconds": seconds, "cpu_seconds": cpu_seconds, "ids": ids_digest(ids),
                             "layers": layers, "dtype": dtype}
        write_state()
        if before is not None:
            for f in self.folder.glob(f"cache_*.r{before['row']}.npy"):
                f.unlink(missing_ok=True)
        self.saved_row, self.last = row, time.perf_counter()

    def restore(self, cache, at: dict, ids, device) -> None:
        """Fill ``cache`` (new, empty) with the checkpoint ``at`` (the progress record's); ValueError where the files
        are not that checkpoint's (gone, cut short, another prompt's)."""
        from numpy.lib.format import open_memmap

        row = at["row"]
        if at["ids"] != ids_digest(ids) or not 0 < row < self.n_prefill:
            raise ValueError("the checkpoint is another prompt's")
        for key, rec in at["layers"].items():
            i, layer = int(key), cache.layers[int(key)]
            if rec["sliding"] != _sliding(layer):
                raise ValueError(f"layer {i}'s kind differs")
            parts = []
            for name in "kv":
                if rec["sliding"]:
                    a = np.load(self.folder / f"cache_{i:03d}.{name}.r{row}.npy", allow_pickle=False)
                else:
                    m = open_memmap(self.folder / f"cache_{i:03d}.{name}.npy", mode="r")  # raises on a file cut short
                    if m.shape[1] != self.n_prefill or m.dtype != np.dtype(_BITS.get(at["dtype"], at["dtype"])):
                        raise ValueError(f"layer {i}'s map is another capture's")
                    a = np.array(m[:, :row])
                    del m
                parts.append(_from_numpy(a, at["dtype"], device))
            layer.update(*parts)
            if rec["sliding"]:  # it held the last rows only: its count of the rows it has seen is the checkpoint's
                layer.cumulative_length = rec["length"]
            if layer.get_seq_length() != rec["length"]:
                raise ValueError(f"layer {i} restored {layer.get_seq_length()} rows, not {rec['length']}")
        self.saved_row = row

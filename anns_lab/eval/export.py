"""big-ann-benchmarks file formats, so external tools (DiskANN, RoarGraph's C++) run on exactly our data.

``.fbin``: uint32 n, uint32 d, then n·d float32 (row-major). Ground truth: uint32 n, uint32 k,
then n·k uint32 ids, then n·k float32 scores (for MIPS the "distances" are inner products, best first).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from anns_lab.dumps import rope
from anns_lab.dumps.store import Dump, dump_stamp
from anns_lab.errors import AnnsLabError
from anns_lab.io import atomic_write_bytes, atomic_write_json, sole_writer
from anns_lab.eval import metrics
from anns_lab.eval.heads import HeadData, check_full_attention, check_k, load_head


EXPORT_FILES = ("base.fbin", "train_queries.fbin", "test_queries.fbin", "k2k_queries.fbin", "gt_q2k.bin", "gt_k2k.bin",
                "export.json")


def fbin_bytes(x: np.ndarray) -> bytes:
    """``x`` (n, d) as an ``.fbin`` file: n and d as uint32, then the float32 rows (big-ann-benchmarks' format)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return np.array(x.shape, dtype=np.uint32).tobytes() + x.tobytes()


def read_fbin(path: str | Path) -> np.ndarray:
    """The (n, d) float32 array of an ``.fbin`` file, its header checked against its size."""
    raw = Path(path).read_bytes()
    n, d = _header(path, raw)
    _expect_size(path, raw, n * d * 4, f"{n} x {d} float32")
    return np.frombuffer(raw[8:], dtype=np.float32).reshape(n, d)


def gt_bytes(ids: np.ndarray, scores: np.ndarray) -> bytes:
    """A ground truth file: n and k as uint32, the ids (n, k) as uint32, then their scores (n, k) as float32."""
    return (np.array(ids.shape, dtype=np.uint32).tobytes() + np.ascontiguousarray(ids, dtype=np.uint32).tobytes()
            + np.ascontiguousarray(scores, dtype=np.float32).tobytes())


def read_gt(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n, k) uint32, scores (n, k) float32) of a ground truth file, its header checked against its size."""
    raw = Path(path).read_bytes()
    n, k = _header(path, raw)
    _expect_size(path, raw, n * k * 8, f"{n} x {k} ids and scores")
    ids = np.frombuffer(raw[8:8 + 4 * n * k], dtype=np.uint32).reshape(n, k)
    scores = np.frombuffer(raw[8 + 4 * n * k:], dtype=np.float32).reshape(n, k)
    return ids, scores


def _header(path, raw: bytes) -> tuple[int, int]:
    if len(raw) < 8:
        raise AnnsLabError(f"{path} is not an export file: {len(raw)} bytes, shorter than its 8-byte header")
    n, width = (int(v) for v in np.frombuffer(raw[:8], dtype=np.uint32))
    return n, width


def _expect_size(path, raw: bytes, body: int, what: str) -> None:
    if len(raw) != 8 + body:  # a file cut short, or another format: numpy's reshape error said neither
        raise AnnsLabError(f"{path} is not a whole export file: its header says {what} ({8 + body:,} bytes), it holds "
                           f"{len(raw):,}")


def export_fbin(dump: Dump, layer: int, head: int, out: str | Path, k: int = 100,
                window: tuple[int, int] = (128, 512), train_positions: str = rope.DEFAULT,
                overwrite: bool = False) -> dict[str, Path]:
    """Write keys, train/test queries, K→K queries and both ground truths of one (layer, head); returns the paths.
    The training queries sit where ``train_positions`` puts them, as the sweep's (:func:`heads.load_head`). ``out``
    must be new or empty, or an earlier export with ``overwrite``: its files are replaced, nothing else is touched."""
    out = Path(out)
    _check_out(out, overwrite)  # before the head is read
    check_full_attention(dump, [layer])  # a sliding layer's exact top-k is not what it attends (as the sweep refuses)
    check_k(dump, window, k)  # before the folder is made: a refused export leaves nothing behind
    data = load_head(dump, layer, head, window, train_positions=train_positions)

    def prepare() -> None:
        _check_out(out, overwrite)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise AnnsLabError(f"cannot write the export into {out}: {err.strerror or err} ({err.filename or out}); "
                               "choose another --out") from None

    with sole_writer(out, prepare):  # two exports into one folder: one's --overwrite unlinked the other's files
        _write(out, data, dump, layer, head, k, window, train_positions)
    return {name: out / name for name in EXPORT_FILES}


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is a file, or a folder holding anything but an earlier export (without ``overwrite``)."""
    if out.exists() and not out.is_dir():
        raise AnnsLabError(f"--out {out} is a file; give a folder for the export")
    if out.is_dir() and any(out.iterdir()):
        # an export's own files (export.json last: an interrupted one has the others, maybe temporaries)
        # files only: a folder named gt_q2k.bin passed by its name and stopped an --overwrite half way
        other = [p for p in sorted(out.iterdir()) if not (p.is_file() and (
            p.name in EXPORT_FILES or (p.name.startswith(".") and p.name.endswith(".tmp"))))]
        if other:
            what = "folder" if other[0].is_dir() else "entry"
            raise AnnsLabError(f"{out} exists and is not an export folder (it holds the {what} {other[0].name!r}); "
                               "choose another --out")
        if not overwrite:
            what = "an earlier export" if (out / "export.json").is_file() else \
                "files of an export's names but no export.json (an export stopped part way, or another tool's)"
            raise AnnsLabError(f"{out} holds {what}; pass --overwrite to replace them or choose another --out")


def _write(out: Path, data: HeadData, dump: Dump, layer: int, head: int, k: int, window: tuple[int, int],
           train_positions: str) -> None:
    # export.json goes first and comes back last: an export stopped part way through replacing an earlier one must not
    # leave that one's description beside its own files (the layer, head and positions of other arrays); nor the
    # earlier one's files beside its own: a tool reading the folder (DiskANN, RoarGraph) scored one head's queries
    # against another's ground truth, the sizes being equal
    (out / "export.json").unlink(missing_ok=True)
    for name in EXPORT_FILES:  # with the temporaries a killed export left (atomic writes remove their own otherwise)
        (out / name).unlink(missing_ok=True)
        for tmp in out.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)
    files = {"base.fbin": data.keys, "train_queries.fbin": data.train_queries,
             "test_queries.fbin": data.test_queries, "k2k_queries.fbin": data.k2k_queries}
    for name, arr in files.items():
        atomic_write_bytes(out / name, fbin_bytes(arr))
    for direction in ("q2k", "k2k"):
        scores = data.exact(direction)
        ids = metrics.exact_topk(scores, k)
        atomic_write_bytes(out / f"gt_{direction}.bin", gt_bytes(ids, np.take_along_axis(scores, ids, axis=1)))
    atomic_write_json(out / "export.json", {
        "dump": str(dump.path.resolve()), "dump_stamp": dump_stamp(dump.manifest), "model": dump.model, "layer": layer,
        "head": head, "kv_head": data.kv_head, "k": k, "window": list(window), "metric": "inner_product", "train_positions": train_positions,
        "key_positions": data.key_pos.tolist(),
        "test_positions": data.test_pos.tolist()})

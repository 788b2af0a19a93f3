"""The dump format: one Parquet file per layer, a tokens file, and ``manifest.json`` written last.

Layout of a dump folder (format version 2)::

    manifest.json        settings, model, prompt, shapes, GQA map, phases, files with sha256, its own sha256
    tokens.parquet       position, token_id, phase
    layer_LLL.parquet    position, q0..q{H-1}, k0..k{G-1}, v0..v{G-1}; one row per position,
                         each head one fixed_size_binary[head_dim · itemsize] column holding the
                         little-endian float16|float32 vector (field metadata: dtype, head_dim);
                         one row group, no compression, no dictionary

One (layer, head) is one column; its data buffer is the row-major ``(n, head_dim)`` array, so a
read is ``np.frombuffer`` on the memory-mapped page, zero-copy. (A fixed_size_list<float> column
would also do, but Parquet then writes and decodes per-value list levels: 30× slower to write
and 15× slower to read a float16 head.) Files are written to a temporary name and renamed; the manifest
comes last, so a folder without one is an unfinished dump and is never read as complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from anns_lab.dumps.prompts import CONTINUATIONS
from anns_lab.errors import DumpError
from anns_lab.io import atomic_path, is_int, read_json

FORMAT = "anns-lab-dump"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
TOKENS_FILE = "tokens.parquet"
PHASES = ("prefill", "decode", "all")
VECTOR_DTYPES = ("float16", "float32")  # how a dump stores Q/K/V (``--dtype``)


def layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.parquet"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_table(path: Path, table: pa.Table) -> dict:
    """Write one Parquet file atomically, as a single row group, each page with its CRC (a results table, which no
    manifest checksums, read with ``page_checksum_verification`` refuses a flipped byte); returns its manifest entry."""
    with atomic_path(path) as tmp:
        # Float columns neither compress nor dictionary-encode usefully; plain pages read fastest.
        pq.write_table(table, tmp, compression="none", use_dictionary=["phase"] if "phase" in table.column_names else False,
                       row_group_size=max(table.num_rows, 1), write_statistics=False, write_page_checksum=True)
        return {"rows": table.num_rows, "bytes": os.path.getsize(tmp), "sha256": sha256_file(tmp)}


def head_field(name: str, dtype: np.dtype, d: int) -> pa.Field:
    dtype = np.dtype(dtype)
    return pa.field(name, pa.binary(d * dtype.itemsize), nullable=False,
                    metadata={"dtype": dtype.name, "head_dim": str(d)})


def head_column(array: np.ndarray) -> pa.FixedSizeBinaryArray:
    """(n, d) array → fixed_size_binary column whose data buffer is the array's own bytes."""
    a = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(a.shape[1] * a.itemsize), a.shape[0], [None, pa.py_buffer(a)])


def layer_table(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> pa.Table:
    """Table of one layer from q (H, n, d), k and v (G, n, d)."""
    fields, cols = [pa.field("position", pa.int32(), nullable=False)], [pa.array(np.arange(q.shape[1], dtype=np.int32))]
    for prefix, arr in (("q", q), ("k", k), ("v", v)):
        for h in range(arr.shape[0]):
            fields.append(head_field(f"{prefix}{h}", arr.dtype, arr.shape[2]))
            cols.append(head_column(arr[h]))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def tokens_table(ids: list[int], n_prefill: int) -> pa.Table:
    n = len(ids)
    return pa.table({
        "position": pa.array(np.arange(n, dtype=np.int32)),
        "token_id": pa.array(np.asarray(ids, dtype=np.int32)),
        "phase": pa.array(["prefill"] * n_prefill + ["decode"] * (n - n_prefill)).dictionary_encode(),
    })


def read_manifest(path: Path) -> dict:
    """The manifest of a finished dump, or a DumpError saying why the folder is not one."""
    path = Path(path)
    if not path.exists():
        raise DumpError(f"dump folder {path} does not exist")
    if not path.is_dir():
        raise DumpError(f"{path} is not a dump folder (a dump is a folder with {MANIFEST})")
    mpath = path / MANIFEST
    if not mpath.is_file():
        if (path / ".staging").is_dir():
            raise DumpError(f"{path} is an unfinished dump (no {MANIFEST}); re-run the same `anns-lab dump` command to resume it")
        raise DumpError(f"{path} is not a dump: it has no {MANIFEST}")
    try:
        manifest = read_json(mpath)
    except ValueError as err:  # not JSON, not UTF-8, or nested past the recursion limit
        raise DumpError(f"{mpath} is corrupt ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DumpError(f"{mpath} is not an anns-lab dump manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DumpError(f"{path} has dump format version {manifest.get('format_version')}; this anns-lab reads version {FORMAT_VERSION}")
    problem = _manifest_problem(manifest)
    if problem:
        raise DumpError(f"{mpath} is corrupt or was edited: {problem}; re-create the dump")
    if "manifest_sha256" in manifest and sealed(manifest)["manifest_sha256"] != manifest["manifest_sha256"]:
        raise DumpError(f"{mpath} fails its own checksum (manifest_sha256): it was edited or is corrupt; re-create the dump")
    if "manifest_sha256" not in manifest and "continuation" in manifest:
        raise DumpError(f"{mpath} has lost its own checksum (manifest_sha256): the anns-lab that made it seals every "
                        "manifest, so it was edited; re-create the dump")
    return manifest


def sealed(manifest: dict) -> dict:
    """``manifest`` with ``manifest_sha256``: the sha256 of its canonical JSON without that field, so any edit
    of a value no file can confirm (a layer's scaling, say) is caught on read. Dumps made before it have none, and
    are read without it; a manifest that records ``continuation`` (written since a little after the seal) must carry
    it. The seal catches accidents, not a deliberate edit (which could recompute it as well)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()
    return body | {"manifest_sha256": digest}


def dump_stamp(manifest: dict) -> str:
    """What tells one dump from another: its manifest's own checksum, or its creation time (to the second) for a dump
    made before manifests carried one."""
    return str(manifest.get("manifest_sha256") or manifest.get("created"))


def _manifest_problem(m: dict) -> str | None:
    """The first field every reader relies on that is missing or inconsistent, in words (None: all present).

    Shapes are checked against the files themselves when a column is read (see ``Dump._read``).
    """
    def count(v, low: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    for key, kind in (("model", dict), ("layers", list), ("gqa", list), ("n_tokens", dict), ("scaling", dict),
                      ("files", dict), ("created", str)):
        if not isinstance(m.get(key), kind):
            return f"{key!r} is missing or not a {kind.__name__}"
    if not isinstance(m["model"].get("name"), str):
        return "model.name is missing"
    for key in ("n_heads", "n_kv_heads", "head_dim"):
        if not count(m.get(key), 1):
            return f"{key!r} must be a positive integer, got {m.get(key)!r}"
    n_tokens = m["n_tokens"]
    if not (count(n_tokens.get("prefill"), 1) and count(n_tokens.get("decode"), 0)):
        return f"n_tokens {n_tokens!r} must hold a positive 'prefill' and a non-negative 'decode' count"
    h, g = m["n_heads"], m["n_kv_heads"]
    # The length first: an edited n_heads of 10**9 would otherwise build a list of a billion entries to compare.
    if h % g or len(m["gqa"]) != h or m["gqa"] != [x // (h // g) for x in range(h)]:
        return f"gqa must map each of the {h} query heads to its KV head (of {g}) in order, got {m['gqa']!r}"
    layers = m["layers"]
    if not layers or not all(count(x, 0) for x in layers) or len(set(layers)) != len(layers):
        return f"layers must be distinct non-negative integers, got {layers!r}"
    if not count(m.get("n_layers"), 1) or max(layers) >= m["n_layers"]:  # --layers is read against it
        return f"n_layers must be a positive integer above every layer ({max(layers)}), got {m.get('n_layers')!r}"
    if m.get("dtype") not in VECTOR_DTYPES:  # the files' own is checked against it when a column is read
        return f"dtype must be one of {', '.join(VECTOR_DTYPES)}, got {m.get('dtype')!r}"
    rows = n_tokens["prefill"] + n_tokens["decode"]
    for name in [TOKENS_FILE] + [layer_file(x) for x in layers]:
        entry = m["files"].get(name)
        if not isinstance(entry, dict) or not count(entry.get("bytes"), 0) or not isinstance(entry.get("sha256"), str):
            return f"files has no valid entry (bytes, sha256) for {name}"
        if entry.get("rows") != rows:
            return f"files[{name!r}] has {entry.get('rows')!r} rows, but n_tokens says {rows}"
    if set(m["files"]) != {TOKENS_FILE, *(layer_file(x) for x in layers)}:
        return f"files lists {sorted(set(m['files']) - {TOKENS_FILE, *(layer_file(x) for x in layers)})}, not files of its layers"
    if m.get("sliding_window") is not None and not isinstance(m["sliding_window"], dict):  # dumps before it: none
        return f"sliding_window must map layers to window sizes, got {m['sliding_window']!r}"
    if m.get("continuation", "greedy") not in CONTINUATIONS:  # dumps made before the field: greedy
        return f"continuation must be one of {', '.join(CONTINUATIONS)}, got {m['continuation']!r}"
    for x in layers:
        v = m["scaling"].get(str(x))
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            return f"scaling of layer {x} must be a positive number, got {v!r}"
    return None


class Dump:
    """A finished dump, read lazily: each array is one Parquet column, float32 ``(n, head_dim)``.

    Files are checked against the manifest's size on open and against its sha256 on first read.
    Float32 dumps come back as read-only zero-copy views of the mapped file; float16 dumps are converted.
    """

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._verify = verify
        self._verified: set[str] = set()
        self._heads_checked: set[str] = set()
        for name, entry in self.manifest["files"].items():
            f = self.path / name
            if not f.is_file():
                raise DumpError(f"dump {self.path} is missing {name}; re-create the dump (`anns-lab dump` with "
                                "--overwrite)")
            if f.stat().st_size != entry["bytes"]:
                raise DumpError(f"dump file {f} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}: it is "
                                "corrupt or was changed; re-create the dump (`anns-lab dump` with --overwrite)")

    def __repr__(self) -> str:
        n = self.manifest["n_tokens"]
        return (f"Dump({str(self.path)!r}, model={self.model!r}, prefill={n['prefill']}, decode={n['decode']}, "
                f"layers={self.layers}, heads={self.n_heads}/{self.n_kv_heads}, d={self.head_dim})")

    @property
    def model(self) -> str:
        return self.manifest["model"]["name"]

    @property
    def continuation(self) -> str:
        """How the decode steps' tokens were chosen: ``greedy`` (the model's argmax; every dump made before the field)
        or ``text`` (the text's own next tokens, teacher-forced)."""
        return self.manifest.get("continuation", "greedy")

    @property
    def layers(self) -> list[int]:
        return list(self.manifest["layers"])

    @property
    def n_heads(self) -> int:
        return int(self.manifest["n_heads"])

    @property
    def n_kv_heads(self) -> int:
        return int(self.manifest["n_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.manifest["head_dim"])

    def scaling(self, layer: int) -> float:
        """The softmax scale the model applies to q·k in ``layer`` (1/√d for most models)."""
        self._check_layer(layer)
        return float(self.manifest["scaling"][str(layer)])

    def sliding_window(self, layer: int) -> int | None:
        """How many of the newest keys each query of ``layer`` attends (itself included), or None where it attends
        every earlier key (a manifest without the field: a dump of before it, full attention throughout)."""
        self._check_layer(layer)
        window = (self.manifest.get("sliding_window") or {}).get(str(layer))
        if window is not None and not (is_int(window) and window >= 1):
            raise DumpError(f"{self.path}'s manifest gives layer {layer} a sliding window of {window!r}, not a count "
                            "of tokens; the manifest is damaged: make the dump again")
        return window

    def kv_head_of(self, head: int) -> int:
        """The KV head that query head ``head`` reads (GQA)."""
        self._check_head(head, self.n_heads, "query")
        return int(self.manifest["gqa"][head])

    def keys(self, layer: int, kv_head: int, phase: str = "all") -> np.ndarray:
        """Post-RoPE keys of one KV head, ``(n, head_dim)`` float32, rows in position order."""
        self._check_head(kv_head, self.n_kv_heads, "KV")
        return self._column(layer, f"k{kv_head}", phase)

    def values(self, layer: int, kv_head: int, phase: str = "all") -> np.ndarray:
        """Values of one KV head, ``(n, head_dim)`` float32."""
        self._check_head(kv_head, self.n_kv_heads, "KV")
        return self._column(layer, f"v{kv_head}", phase)

    def queries(self, layer: int, head: int, phase: str = "prefill") -> np.ndarray:
        """Post-RoPE queries of one query head, ``(n, head_dim)`` float32."""
        self._check_head(head, self.n_heads, "query")
        return self._column(layer, f"q{head}", phase)

    def positions(self, phase: str = "all") -> np.ndarray:
        """Token positions of a phase (prefill first, then decode)."""
        lo, hi = self._rows(phase)
        return np.arange(lo, hi, dtype=np.int64)

    def tokens(self, phase: str = "all") -> np.ndarray:
        """Token ids of a phase: the prompt, then the decode steps' (greedy, or the text's own: the manifest's ``continuation``)."""
        lo, hi = self._rows(phase)
        return self._read(TOKENS_FILE, "token_id")[lo:hi].astype(np.int64)

    def verify(self, layers: list[int] | None = None) -> None:
        """Check every file (or the tokens file and ``layers``') against its sha256 now, and the phases against the
        tokens file (otherwise each is checked on first read)."""
        for name in self.manifest["files"] if layers is None else [TOKENS_FILE, *map(layer_file, layers)]:
            self._check_sha(name)
        self._phase_rows  # reading it checks the phases

    @cached_property
    def _phase_rows(self) -> dict[str, tuple[int, int]]:
        n = self.manifest["n_tokens"]
        p, d = int(n["prefill"]), int(n["decode"])
        # The phases are checked against the tokens file itself (checksummed), not only the manifest.
        phases = self._read(TOKENS_FILE, "phase", rows=p + d)
        if int((phases == "prefill").sum()) != p:
            raise DumpError(f"{self.path / TOKENS_FILE} marks {int((phases == 'prefill').sum())} positions as prefill, "
                            f"the manifest says {p}: the manifest was edited or belongs to other files")
        if not (phases[:p] == "prefill").all():  # counted right, but decode rows among the prefill's
            raise DumpError(f"{self.path / TOKENS_FILE}: its prefill rows do not come first; the file is not one "
                            "anns-lab wrote")
        self._check_order(TOKENS_FILE, p + d)
        return {"prefill": (0, p), "decode": (p, p + d), "all": (0, p + d)}

    def _rows(self, phase: str) -> tuple[int, int]:
        if phase not in PHASES:
            raise DumpError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")
        return self._phase_rows[phase]

    def _check_layer(self, layer: int) -> None:
        if not is_int(layer):  # 1.0 or True passed `in`, then failed as a file name or a manifest key
            raise DumpError(f"layer {layer!r} must be an integer (one of {self.layers})")
        if layer not in self.manifest["layers"]:
            raise DumpError(f"layer {layer} is not in dump {self.path}; it holds layers {self.layers}")

    @staticmethod
    def _check_head(head: int, n: int, kind: str) -> None:
        if not is_int(head):
            raise DumpError(f"{kind} head {head!r} must be an integer in 0..{n - 1}")
        if not 0 <= head < n:
            raise DumpError(f"{kind} head {head} is out of range: this dump has {n} {kind} heads (0..{n - 1})")

    def _check_heads(self, name: str) -> None:
        """The layer file's columns and row order against the manifest (once per file)."""
        if name in self._heads_checked:
            return
        self._check_columns(name)
        self._check_order(name)
        self._heads_checked.add(name)

    def check_columns(self, layer: int) -> None:
        """The layer's file's columns against the manifest's head counts and the format's types, from its schema alone
        (no data read; the checksum only where they fail): what a command checks of every layer it reads, before any
        work."""
        self._check_layer(layer)
        self._check_columns(layer_file(layer))

    def _check_columns(self, name: str) -> None:
        try:
            self._columns_problem(name)
        except DumpError:
            if self._verify:  # a file damaged since the dump says so first (its footer alone was read here)
                self._check_sha(name)
            raise

    def _columns_problem(self, name: str) -> None:
        try:
            schema = pq.read_schema(self.path / name)
        except (pa.ArrowException, OSError) as err:
            raise DumpError(f"cannot read {self.path / name}: {str(err).splitlines()[0]}") from None
        want = {"position"} | {f"q{h}" for h in range(self.n_heads)} | {f"{p}{g}" for p in "kv" for g in range(self.n_kv_heads)}
        if set(schema.names) != want:
            raise DumpError(f"{self.path / name} holds columns for other head counts than the manifest's "
                            f"{self.n_heads} query / {self.n_kv_heads} KV heads: the manifest was edited or belongs to other files")
        for field in schema:  # another tool's binary or list<float> columns failed each part with numpy's words
            vector = field.name != "position"
            if not (pa.types.is_fixed_size_binary(field.type) if vector else pa.types.is_integer(field.type)):
                raise DumpError(f"column {field.name} of {self.path / name} is {field.type}, where a dump holds "
                                f"{'fixed_size_binary[head_dim × itemsize] vectors' if vector else 'integers'}: the "
                                "file is not one anns-lab wrote")
            if vector:
                self._check_vectors(name, field)

    def _check_vectors(self, name: str, field: pa.Field) -> None:
        """A vector column's dtype tag and width against the manifest's dtype and head_dim."""
        kind = (field.metadata or {}).get(b"dtype", b"float32").decode(errors="replace")
        if kind not in VECTOR_DTYPES:  # the format's two; another would be misread or raise in numpy
            raise DumpError(f"column {field.name} of {self.path / name} holds {kind!r} vectors; a dump holds float16 "
                            "or float32: the file is not one anns-lab wrote")
        if kind != self.manifest["dtype"]:
            raise DumpError(f"column {field.name} of {self.path / name} holds {kind} vectors, but the manifest says "
                            f"dtype {self.manifest['dtype']}: the manifest was edited or belongs to other files")
        itemsize, d = np.dtype(kind).itemsize, self.head_dim
        if field.type.byte_width != d * itemsize:  # a remainder too: rows would be read with the wrong stride
            raise DumpError(f"column {field.name} of {self.path / name} holds vectors of dimension "
                            f"{field.type.byte_width / itemsize:g}, but the manifest says head_dim {d}: "
                            "the manifest was edited or belongs to other files")

    def _check_order(self, name: str, rows: int | None = None) -> None:
        """Rows are read by index as positions 0..n-1: a file written in another row order (its checksums redone by
        another tool) swept with exit 0 on keys matched to the wrong queries."""
        position = self._read(name, "position", rows)
        if not np.array_equal(position, np.arange(len(position))):
            raise DumpError(f"{self.path / name}: its rows are not positions 0..{len(position) - 1} in order; the file "
                            "is not one anns-lab wrote")

    def _check_sha(self, name: str) -> None:
        if name in self._verified:
            return
        if sha256_file(self.path / name) != self.manifest["files"][name]["sha256"]:
            raise DumpError(f"dump file {self.path / name} fails its sha256 checksum: it is corrupt; re-create the dump")
        self._verified.add(name)

    def _read(self, name: str, column: str, rows: int | None = None) -> np.ndarray:
        if self._verify:
            self._check_sha(name)
        try:
            table = pq.read_table(self.path / name, columns=[column], memory_map=True)
        except (pa.ArrowException, OSError) as err:
            raise DumpError(f"cannot read column {column} of {self.path / name}: {str(err).splitlines()[0]}") from None
        chunks = table.column(column).chunks
        arr = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
        n = self._phase_rows["all"][1] if rows is None else rows
        if len(arr) != n:
            raise DumpError(f"{self.path / name} has {len(arr)} rows but the manifest's n_tokens add up to {n}: "
                            "the manifest was edited or belongs to other files")
        if arr.null_count:  # a vector's null row would be read as zeros from the buffer below
            raise DumpError(f"column {column} of {self.path / name} has {arr.null_count} null rows: the file is not one "
                            "anns-lab wrote")
        if pa.types.is_fixed_size_binary(arr.type):
            self._check_vectors(name, table.schema.field(column))  # _check_heads did; kept where the bytes are read
            dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
            d = self.head_dim
            flat = np.frombuffer(arr.buffers()[1], dtype=dtype, count=(arr.offset + len(arr)) * d)
            flat.flags.writeable = False  # a view of the mapped file: writing would corrupt or fault
            return flat[arr.offset * d:].reshape(len(arr), d)
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        return arr.to_numpy(zero_copy_only=False)

    def _column(self, layer: int, column: str, phase: str) -> np.ndarray:
        self._check_layer(layer)
        self._check_heads(layer_file(layer))
        lo, hi = self._rows(phase)
        arr = self._read(layer_file(layer), column)[lo:hi]
        return arr if arr.dtype == np.float32 else arr.astype(np.float32)


def open_dump(path: str | Path, verify: bool = True) -> Dump:
    """Open a finished dump folder for reading (raises DumpError for an unfinished or corrupt one)."""
    if not isinstance(path, (str, os.PathLike)):
        raise DumpError(f"a dump is a folder: give its path, not {path!r}")
    check_utf8(path, "a dump")
    return Dump(path, verify=verify)


def check_utf8(path: str | Path, what: str) -> None:
    """Refuse a path that is not UTF-8 (bytes the file system allows, read as surrogates): pyarrow opens files by their
    UTF-8 name, and such a dump failed every read with a UnicodeEncodeError traceback."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise DumpError(f"the path of {what}, {str(path).encode('utf-8', 'backslashreplace').decode()}, is not UTF-8 "
                        "text, which Parquet files cannot be opened under: rename or move it") from None

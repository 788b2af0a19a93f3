"""Fuzz of the dump manifest and files: every random edit ends in one clear DumpError or a correct read.

Seeded edits of a tiny dump: fields deleted or replaced by hostile values, shapes changed, bytes of
the manifest or of a data file flipped, the manifest truncated. Reading everything the lab reads
(every layer, query head, KV head, phase, the tokens and the scaling) must then either raise an
``AnnsLabError`` with a one-line message, or return exactly what the untouched dump returns.
Sealed manifests (with their own sha256) are fuzzed in every field; for dumps made before the seal,
the fields the files can confirm (shapes, head counts, GQA map, layers, file entries) are.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from anns_lab import open_dump
from anns_lab.dumps import store
from anns_lab.dumps.run import run_dump
from anns_lab.errors import AnnsLabError

HOSTILE = [None, -1, 0, 1, 2, 3, 10 ** 9, -(10 ** 12), 1.5, float("nan"), "x", "", True, [], {}, [0], {"a": 1}]
#: Fields that the files confirm: fuzzed even in manifests without their own checksum.
CHECKABLE = ["n_heads", "n_kv_heads", "head_dim", "gqa", "layers", "n_layers", "dtype", "n_tokens", "files", "format",
             "format_version"]


@pytest.fixture(scope="module")
def original(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz") / "d"
    d = run_dump(str(tiny_llama), tokens=40, decode_tokens=3, layers="0,2", dtype="float32", chunk=16, out=out,
                 progress=False).dump
    return d, read_everything(d)


def read_everything(d) -> dict:
    """Every array and number the sweep, export and report read from a dump, by what was asked."""
    out = {"tokens": d.tokens("all"), "prefill": d.positions("prefill"), "decode": d.positions("decode"),
           "shape": (d.layers, d.n_heads, d.n_kv_heads, d.head_dim)}
    for layer in d.layers:
        out[("scaling", layer)] = d.scaling(layer)
        out[("window", layer)] = d.sliding_window(layer)
        for h in range(d.n_heads):
            g = d.kv_head_of(h)
            out[("gqa", h)] = g
            for phase in ("prefill", "decode", "all"):
                out[("q", layer, h, phase)] = d.queries(layer, h, phase)
            out[("k", layer, g)] = d.keys(layer, g, "all")
            out[("v", layer, g)] = d.values(layer, g, "all")
    return out


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _edit_field(m: dict, rng, fields: list[str] | None) -> str:
    paths = [p for p in _paths(m) if p and (fields is None or p[0] in fields)]
    path = paths[rng.integers(len(paths))]
    parent = m
    for key in path[:-1]:
        parent = parent[key]
    old = parent[path[-1]]
    choice = rng.integers(4)
    if choice == 0 and isinstance(parent, dict):
        del parent[path[-1]]
        return f"del {path}"
    if choice == 1 and isinstance(old, int) and not isinstance(old, bool):
        parent[path[-1]] = old + int(rng.choice([-2, -1, 1, 2, old or 1]))
        return f"{path} {old} -> {parent[path[-1]]}"
    if choice == 2 and isinstance(old, list) and old:
        parent[path[-1]] = old[:-1] if rng.integers(2) else old + old[-1:]
        return f"{path} length changed"
    parent[path[-1]] = HOSTILE[rng.integers(len(HOSTILE))]
    return f"{path} = {parent[path[-1]]!r}"


def _mutate(folder, rng, sealed: bool) -> str:
    mpath = folder / store.MANIFEST
    m = json.loads(mpath.read_text())
    if not sealed:  # as made before the seal, and before the field that says a lab seals (greedy where absent)
        m.pop("manifest_sha256")
        if m.get("continuation") == "greedy":
            m.pop("continuation")
    kind = rng.integers(6)
    if kind <= 2:  # field edits, one to three
        what = "; ".join(_edit_field(m, rng, None if sealed else CHECKABLE) for _ in range(1 + kind))
        mpath.write_text(json.dumps(m, indent=1))
        return what
    text = json.dumps(m, indent=1).encode()
    if kind == 3:
        i = int(rng.integers(len(text)))
        mpath.write_bytes(text[:i] + bytes([text[i] ^ (1 << int(rng.integers(8)))]) + text[i + 1:])
        return f"manifest byte {i} flipped"
    if kind == 4:
        i = int(rng.integers(len(text)))
        mpath.write_bytes(text[:i])
        return f"manifest truncated at {i}"
    mpath.write_bytes(text)
    name = sorted(m["files"])[rng.integers(len(m["files"]))]
    data = bytearray((folder / name).read_bytes())
    i = int(rng.integers(len(data)))
    data[i] ^= 1 << int(rng.integers(8))
    (folder / name).write_bytes(bytes(data))
    return f"{name} byte {i} flipped"


def _same(a, b) -> bool:
    return np.array_equal(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else a == b


@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("seed", range(100))
def test_random_edits_end_in_one_clear_error_or_the_same_answers(original, tmp_path, seed, sealed):
    d, expected = original
    rng = np.random.default_rng(1000 * sealed + seed)
    folder = tmp_path / "d"
    shutil.copytree(d.path, folder)
    what = _mutate(folder, rng, sealed)
    try:
        got = read_everything(open_dump(folder))
    except AnnsLabError as err:
        assert "\n" not in str(err) and str(err), f"{what}: error is not one line: {err!r}"
        return
    # No error: every answer must be the untouched dump's (an edit of a field no reader uses changes nothing).
    assert got.keys() == expected.keys(), f"{what}: the dump now answers other questions"
    wrong = [key for key in expected if not _same(got[key], expected[key])]
    assert not wrong, f"{what}: silently wrong answers for {wrong[:3]}"

"""benchmarks/device_payload.py: the model packages and wheels a GPU machine lacks, split to fit its calls and joined
there with their checksum."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _payload():
    spec = importlib.util.spec_from_file_location(
        "device_payload", Path(__file__).resolve().parent.parent / "benchmarks" / "device_payload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_staged_pieces_join_into_the_packages_as_installed(tmp_path):
    payload = _payload()
    import click  # an installed package of ~0.7 MiB: pieces of 200 KB

    folders = payload.stage(tmp_path / "dev", 200_000, packages=("click",), wheels=())
    src = Path(click.__file__).parent
    tar_bytes = sum(p.stat().st_size for f in folders for p in f.glob("piece.*"))
    assert [f.name for f in folders] == [f"c{i}" for i in range(1, len(folders) + 1)]
    assert all(p.stat().st_size <= 200_000 for f in folders for p in f.glob("piece.*"))
    assert len(folders) == -(-tar_bytes // 200_000) > 1
    manifest = payload.unpack(tmp_path / "dev", tmp_path / "out")
    assert manifest["bytes"] == tar_bytes
    got = tmp_path / "out" / "packages" / "click"
    want = {p.relative_to(src) for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert {p.relative_to(got) for p in got.rglob("*") if p.is_file()} == want
    assert all((got / p).read_bytes() == (src / p).read_bytes() for p in want)


def test_a_changed_or_missing_piece_is_refused(tmp_path):
    payload = _payload()
    folders = payload.stage(tmp_path / "dev", 200_000, packages=("click",), wheels=())
    piece = next(folders[-1].glob("piece.*"))
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 1
    piece.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="does not match its manifest"):
        payload.unpack(tmp_path / "dev", tmp_path / "out")
    piece.unlink()
    with pytest.raises(SystemExit, match=f"carry .dev/{folders[-1].name}"):
        payload.unpack(tmp_path / "dev", tmp_path / "out")

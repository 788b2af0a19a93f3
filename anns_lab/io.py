"""Atomic file writing (bottom floor): a reader never sees half a file, a crash leaves the old file or none."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _file_mode() -> int:
    """The mode ``open()`` gives a new file here: 0o666 less the umask."""
    mask = os.umask(0)  # the umask can only be read by setting it; done once, at import, before any thread writes
    os.umask(mask)
    return 0o666 & ~mask


# mkstemp makes its file 0600; renamed as it is, no other user could read a dump, sweep or report.
_FILE_MODE = _file_mode()


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; on leaving the block it is synced and renamed onto ``path``
    (removed instead when the block raises)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON to ``path``, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8"))

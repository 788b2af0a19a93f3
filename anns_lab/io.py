"""Atomic file writing (bottom floor): a reader never sees half a file, a crash leaves the old file or none; one
writer per dump or sweep folder (:func:`sole_writer`); JSON read with one kind of error (:func:`read_json`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from anns_lab.errors import FolderBusy

T = TypeVar("T")


def _umask() -> int:
    """The process's umask (read once, at import: setting it back and forth later could race another thread's file)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_MODE = 0o666 & ~_umask()  # what open() gives a new file: mkstemp's 0600 would keep dumps and results from others
_FOLDER_MODE = 0o777 & ~_umask()  # what mkdir() gives a new folder


def temp_folder(path: Path, suffix: str = "") -> Path:
    """An empty folder beside ``path``, named after it, with a new folder's mode: mkdtemp's 0700 would keep the folder
    it becomes, once renamed into place, from others."""
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix))
    os.chmod(tmp, _FOLDER_MODE)
    return tmp


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; on leaving the block it is synced, given a new file's mode, and
    renamed onto ``path``, the rename synced too (removed instead when the block raises)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """A temporary folder beside ``path`` to fill; on leaving the block it takes ``path``'s place whole (an existing
    folder there is replaced, never mixed with: a failed write leaves it as it was), removed instead when the block
    raises."""
    import shutil

    path = Path(path)
    if path.is_symlink():  # the folder the link names is replaced and the link kept (a link renamed onto a folder fails)
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(path, ".tmp")
    try:
        yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            try:
                os.replace(path, old)  # onto the empty folder just made: the name is ours
            except OSError:
                old.rmdir()
                raise
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a crash right after it could otherwise lose the new file); where a folder
    cannot be opened for it (Windows), the rename stands unsynced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def new_map(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A new ``.npy`` memory map of ``shape`` at ``path``, its disk space reserved: a full disk is an OSError here
    (ENOSPC), not a SIGBUS at a later write into a page the file system cannot back (a sparse file's pages are
    allocated as they are first written; a dump or its checkpoint on a full disk ended with status 135)."""
    from numpy.lib.format import open_memmap

    m = open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    try:
        with open(path, "r+b") as f:
            if hasattr(os, "posix_fallocate"):  # not on macOS: its maps stay sparse
                os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            del m
            path.unlink(missing_ok=True)
            raise
        # a file system without it (EOPNOTSUPP, EINVAL) where glibc does not write the blocks itself (it does on NFSv3
        # and older ZFS: slow for a large checkpoint, but reserved): the map stays sparse, as before
    return m


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` that fails only with ValueError: nesting past Python's recursion limit (the decoder's
    RecursionError, from any file of a few hundred KB of brackets) is the malformed input it is, so one
    ``except ValueError`` in each reader covers every file it may be handed."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def param_value(text: str) -> Any:
    """A command line's NAME=VALUE value: its JSON reading where it has one (a number, true or false, a "quoted" string
    for text that reads as a number), else the text as given (the sweep's and the decoder's --build-param alike)."""
    try:
        return loads_json(text)
    except ValueError:
        return text


def is_int(x) -> bool:
    """An integer (numpy's too), not a bool (True passes isinstance(x, int))."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def read_json(path: Path) -> Any:
    """The JSON value in ``path`` (UTF-8); OSError or ValueError (not JSON, not UTF-8, nested too deeply) otherwise."""
    return loads_json(Path(path).read_text(encoding="utf-8"))


def atomic_write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON to ``path``, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8"))


@contextlib.contextmanager
def sole_writer(folder: Path, prepare: Callable[[], T]) -> Iterator[T]:
    """``prepare()`` (which reads ``folder``'s state and may make it) and the block, run as the only process writing into
    ``folder``, or ``FolderBusy`` at once where another holds it: two dumps, sweeps or exports into one folder mixed
    their files, or one removed what the other was writing. Yields what ``prepare`` returned. The lock is taken before
    ``prepare`` where the folder exists; where ``prepare`` made it, right after, and ``prepare`` runs again as the sole
    writer (a command it refuses then makes nothing, and another process that made the folder too and wrote into it
    between the two is seen: two new exports into one --out both ended with exit 0, one lost)."""
    with contextlib.ExitStack() as held:
        existed = folder.exists()
        if existed:
            held.enter_context(hold_folder(folder))
        prepared = prepare()
        if not existed and folder.exists():
            held.enter_context(hold_folder(folder))
            prepared = prepare()
        yield prepared


@contextlib.contextmanager
def hold_folder(folder: Path) -> Iterator[None]:
    """An advisory lock on the folder itself (no file is added to it), released when the block ends or the process
    dies; where the system or its file system has no such locks, the block runs unguarded."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not readable here: what prepares the folder says why it cannot be used
        yield
        return
    try:
        _lock(fd, f"another anns-lab process is writing into {folder}; wait for it to end, or choose another --out")
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold_file(path: Path) -> Iterator[None]:
    """An advisory lock on writing the file ``path`` (two decodes given one ``--json`` both ran, and the later writer's
    result replaced the other's): a hidden ``.NAME.lock`` beside it, held while the block runs and removed at its end;
    ``FolderBusy`` at once where another process holds it; unguarded where the system or file system has no such locks.
    A lock taken on a file its holder has just removed is taken again on the new one (the inodes are compared). The
    folders on the way that did not exist are made for the lock (without them two runs went unguarded) and removed at
    the end where left empty."""
    made = []
    for folder in reversed(missing_folders(path.parent)):
        try:
            folder.mkdir()
            made.append(folder)
        except FileExistsError:  # another process made it meanwhile: theirs to remove
            continue
        except OSError:  # not writable here: the command's own write says why
            break
    try:
        with _held(path):
            yield
    finally:
        for folder in reversed(made):  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


def missing_folders(folder: Path) -> list[Path]:
    """The folders from ``folder`` up that do not exist, deepest first (the next one up exists, or is the root)."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """:func:`hold_file`'s lock, in a folder that exists where it can."""
    lock = path.parent / f".{path.name}.lock"
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, _MODE)
        except OSError:  # not writable here: the command's own write says why
            yield
            return
        try:
            held = _lock(fd, f"another anns-lab process is writing {path}; wait for it to end, or choose another file")
            same = held and os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FolderBusy:
            os.close(fd)
            raise
        except OSError:  # removed by the holder before us
            held, same = True, False
        if not held or same:
            break
        os.close(fd)
    try:
        yield
    finally:
        if held:
            with contextlib.suppress(OSError):
                os.unlink(lock)  # while held: a process that opened it meanwhile sees another inode and tries again
        os.close(fd)


def _lock(fd: int, busy: str) -> bool:
    """``fd``'s exclusive advisory lock, taken at once: True; False where the system or file system has no such locks
    (the caller runs unguarded); ``FolderBusy(busy)`` where another process holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise FolderBusy(busy) from None
    except OSError:  # a file system without flock (some network mounts)
        return False
    return True


def abandoned(folder: Path, older_than: float = 60.0) -> bool:
    """Whether ``folder`` was left by a writer that is gone: unchanged for ``older_than`` seconds (a writer takes
    :func:`hold_folder` right after making it) and held by no process. False where that cannot be told."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        if time.time() - folder.stat().st_mtime < older_than:
            return False
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held (BlockingIOError), or no locks on this file system: nobody can tell
        return False
    finally:
        os.close(fd)

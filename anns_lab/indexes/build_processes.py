"""Index builds in worker processes, so that no build waits for the GIL of a thread running Python beside it.

A build releases the GIL inside its kernels (numba's ``nogil``, faiss, torch) and takes it back between them: a
roargraph head's build at 8K takes it back about a hundred times. Beside a thread that runs Python (on a GPU, the
thread that launches the prefill's and the decode steps' kernels) each take waits up to the interpreter's switch
interval, 5 ms: a SmolLM2 8K layer's nine builds and its calibration beside such a thread took 9-10x their time alone
on threads of that process, 2x in worker processes (``benchmarks/diag_gil_convoy.py --processes --calibrate``;
BENCHMARKS "Builds in worker processes"). A worker takes only its own GIL; what is left here is the spooling and each
index's restore.

Inputs and results cross as one file each way on a memory-backed file system (``/dev/shm`` where it has room, else
the temporary folder), raw numeric arrays at offsets (:func:`_pack`; no pickle), read through a private mapping
(:func:`_unpack`: no copy, a few system calls): the layer's key rows once per KV head and each build's own arrays in
one file, each built index back as the arrays of its ``save`` (``Index._arrays``), restored here on the caller's key
rows (:meth:`Index.restored_on`) and checked as a load checks a saved index. Not the pool's pipe, nor a file per
array: every system call takes the GIL back (that layer beside the Python thread: 1.9 s through the pipe, whose 64 KiB
chunks each take it, 2.5-2.9 s with a file per array, 0.9-1.6 s with these). So only indexes that save and restore
exactly (:func:`can_build`) build here; the others build on threads (:func:`threads.map_one_thread`).

Workers are spawned (a fork of running OpenMP or numba pools can deadlock), run their kernels on one thread each at the
lowest priority (as the builds' threads beside the prefill do), ignore Ctrl-C (the caller's to handle) and live as
long as the process, shared by every caller (:func:`pool`). A worker that dies (a plugin's abort, the OOM killer)
breaks the pool: the builds waiting fail with the index named by the caller, and the next :func:`pool` starts a new one.
"""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

from anns_lab.errors import error_text
from anns_lab.indexes.base import Index
from anns_lab.indexes.key_store import KeyRows
from anns_lab.indexes.threads import (current_stop, lower_priority, numpy_blas_one_thread, one_thread, settle,
                                     thread_budget)
from anns_lab.processes import die_with

MEMORY_DIR = Path("/dev/shm")  # a tmpfs on Linux: the spool's files are copies in memory
SPOOL_PREFIX = "anns-lab-build-"  # then the owner's PID namespace and process id (:func:`owner_tag`)
SPOOL_MARGIN = 256 * 2**20  # room left in MEMORY_DIR beyond a layer's spool (the workers' results go there too)
START_TASK_S = 0.2  # BuildProcesses.start: long enough that one warm worker does not take every task
POLL_S = 0.05  # how often a caller waiting on its builds looks at its stop (threads.stopping_on)

T = TypeVar("T")

_POOL: dict[str, Any] = {}  # "pool": the process's BuildProcesses (one per process: workers are costly)
_POOL_LOCK = threading.Lock()


class BuildProcesses:
    """``workers`` spawned worker processes that build indexes from spooled arrays (:meth:`build`)."""

    def __init__(self, workers: int, warm: tuple[str, ...] = ()) -> None:
        """``warm``: index names whose kernels each worker loads (numba's cache) as it starts, on tiny data."""
        self.workers = workers
        _remove_stale()
        # the parent-death signal follows the thread that starts a worker (:func:`processes.die_with`): start(), right
        # after this, starts every worker from this thread
        by_main = threading.current_thread() is threading.main_thread()
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_worker_start, initargs=(tuple(warm), os.getpid(), by_main))

    def start(self) -> float:
        """Start every worker now and wait until they have run a task; returns the seconds it took. Otherwise they
        start on the first builds, whose time then counts their start (a second or more each). The pool spawns a
        worker per task submitted while none is idle: ``workers`` short tasks at once start them all."""
        t0 = time.perf_counter()
        for f in [self._pool.submit(time.sleep, START_TASK_S) for _ in range(self.workers)]:
            f.result()
        return time.perf_counter() - t0

    @property
    def broken(self) -> bool:
        """Whether a worker died (the executor's own flag: it then refuses every task)."""
        return bool(getattr(self._pool, "_broken", False))

    def build(self, cls: type[Index], params: dict[str, Any], rows: list[KeyRows],
              items: list[tuple[int, dict[str, np.ndarray]]]) -> list[Index]:
        """``[cls(**params).build(rows[g], **arrays) for g, arrays in items]``, each build in a worker process, the
        indexes restored here on ``rows`` (an index that keeps its key rows reads them from the caller's store, as if
        built here). The calling thread's stop (``threads.stopping_on``) cancels the builds not started; an error of
        one cancels the others not started and is raised once those running have ended."""
        with self.spooled_build(cls, params, rows, items) as (indexes, _):
            return indexes

    @contextmanager
    def spooled_build(self, cls: type[Index], params: dict[str, Any], rows: list[KeyRows],
                      items: list[tuple[int, dict[str, np.ndarray]]]) -> Iterator[tuple[list[Index], Spool]]:
        """:meth:`build`'s indexes, and within the block the :class:`Spool` that holds their arrays and the key rows,
        for a later task in a worker (:meth:`run`, :func:`spooled_indexes`) to read without this process spooling them
        again."""
        inputs = {f"keys{g}": rows[g].view(rows[g].n) for g in sorted({g for g, _ in items})}
        inputs |= {f"{i}.{k}": a for i, (_, arrays) in enumerate(items) for k, a in arrays.items()}
        folder, packed, layout = _spooled(inputs)
        try:
            futures = [self._pool.submit(_build_remote, cls.name, params, packed, layout, f"keys{g}",
                                         [f"{i}.{k}" for k in arrays], str(folder / f"built{i}"))
                       for i, (g, arrays) in enumerate(items)]
            done = _settle_watching(futures)
            yield ([_restored(cls, rows[g], *d) for (g, _), d in zip(items, done)],
                   Spool(cls.name, packed, layout, [g for g, _ in items], done))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker (a module-level function: the worker imports it by name), the calling thread's stop
        respected as :meth:`build` respects it."""
        return _settle_watching([self._pool.submit(fn, *args)])[0]

    def close(self) -> None:
        """End the workers once their running tasks have; the queued ones are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def can_build(cls: type[Index]) -> bool:
    """Whether indexes of ``cls`` can be built here: it saves and restores (``_arrays``, ``_restore``), and says its
    restore gives the index its build gave (``restores_exactly``), said by a class that defines none of the methods
    below it: a subclass that overrides its build, add or save (a plugin's subclass of roargraph) has not said it."""
    if not (cls.restores_exactly and cls.saves() and cls._restore is not Index._restore):
        return False
    said = next(c for c in cls.__mro__ if "restores_exactly" in vars(c))
    return all(issubclass(said, next(c for c in cls.__mro__ if m in vars(c)))
               for m in ("_build", "_add", "_arrays", "_restore"))


@dataclass(frozen=True)
class Spool:
    """Where :meth:`BuildProcesses.spooled_build` left a layer's builds: the index's registry ``name``, the packed
    inputs (``packed``, ``layout``: the key rows as ``keys<g>``), each build's KV head and what its worker returned."""

    name: str
    packed: str
    layout: list
    heads: list[int]
    built: list[tuple]


def spooled_keys(spool: Spool) -> np.ndarray:
    """The spooled key rows (G, n, d) of every KV head built on (in a worker: views of a private mapping)."""
    given = _unpack(spool.packed, spool.layout, {f"keys{g}" for g in spool.heads})
    return np.stack([given[f"keys{g}"] for g in sorted(set(spool.heads))])


def spooled_indexes(spool: Spool, rows: list[KeyRows]) -> list[Index]:
    """The spooled builds' indexes (in a worker), restored on ``rows`` (one per KV head) as :meth:`BuildProcesses.build`
    restores them on the caller's."""
    from anns_lab.indexes import registry

    cls = registry.get(spool.name)
    return [_restored(cls, rows[g], *d) for g, d in zip(spool.heads, spool.built)]


def pool(workers: int | None = None, warm: tuple[str, ...] = ()) -> BuildProcesses:
    """The process's :class:`BuildProcesses`, started (:meth:`BuildProcesses.start`) the first time with ``workers``
    workers (None: :func:`threads.thread_budget`'s) and ``warm``; a new one where the last broke (a worker died) or
    ``workers`` asks for another number."""
    with _POOL_LOCK:
        current = _POOL.get("pool") if _POOL.get("pid") == os.getpid() else None  # a forked child's is its parent's
        if current is None or current.broken or workers not in (None, current.workers):
            if current is not None:
                current.close()
            current = BuildProcesses(workers or thread_budget(), warm)
            try:
                current.start()
            except BaseException:
                current.close()
                raise
            _POOL.update(pool=current, pid=os.getpid())
        return current


def shut_down() -> None:
    """End the process's workers (they end with the process anyway)."""
    with _POOL_LOCK:
        current = _POOL.pop("pool", None)
        if current is not None and _POOL.pop("pid", None) == os.getpid():
            current.close()


def _spool_root(nbytes: int) -> str | None:
    """:data:`MEMORY_DIR` where it exists with room for four times ``nbytes`` and :data:`SPOOL_MARGIN` more (the
    results, and other layers spooling at once), else None: the temporary folder, which may be on disk (a container's
    ``/dev/shm`` is often 64 MiB)."""
    try:
        if (MEMORY_DIR.is_dir() and os.access(MEMORY_DIR, os.W_OK)
                and shutil.disk_usage(MEMORY_DIR).free > 4 * nbytes + SPOOL_MARGIN):
            return str(MEMORY_DIR)
    except OSError:
        pass
    return None


def _spooled(inputs: dict[str, np.ndarray]) -> tuple[Path, str, list]:
    """A new spool folder (its name carries this process's id: :func:`_remove_stale`) with ``inputs`` packed in it:
    (folder, packed file, layout). Where the memory-backed file system fills up meanwhile (layers spooling at once),
    the temporary folder instead."""
    root = _spool_root(sum(a.nbytes for a in inputs.values()))
    while True:
        folder = Path(tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{owner_tag()}-", dir=root))
        try:
            return folder, str(folder / "inputs"), _pack(str(folder / "inputs"), inputs)
        except OSError as err:
            shutil.rmtree(folder, ignore_errors=True)
            if err.errno != errno.ENOSPC or root is None:
                raise
            root = None


def owner_tag(pid: int | None = None) -> str:
    """``<PID namespace>-<pid>`` of this process (or of ``pid`` in its namespace): a spool folder's owner. /tmp and
    /dev/shm may be shared by containers whose processes this one cannot see in /proc; only folders of its own
    namespace are judged by their pid."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: one namespace as far as this process can tell
        ns = 0
    return f"{ns}-{os.getpid() if pid is None else pid}"


def _remove_stale() -> None:
    """Remove the spool folders that processes of this PID namespace no longer running left in :data:`MEMORY_DIR`
    (killed mid-build: their files hold memory until a reboot otherwise) and in the temporary folder (:func:`_spooled`'s
    fallback). Another namespace's folders are left: its live processes are not in this /proc."""
    ns = owner_tag().split("-")[0]
    for root in (MEMORY_DIR, Path(tempfile.gettempdir())):
        for folder in root.glob(f"{SPOOL_PREFIX}{ns}-*-*") if root.is_dir() else []:
            pid = folder.name[len(SPOOL_PREFIX):].split("-")[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(folder, ignore_errors=True)


def _pack(path: str, arrays: dict[str, np.ndarray]) -> list[tuple[str, str, tuple, int]]:
    """Write ``arrays`` (numeric) one after another into the file ``path``, each at a 64-byte boundary; returns their
    layout, (name, dtype, shape, offset) each, for :func:`_unpack`. One file and a write per array: each system call
    takes the GIL back once."""
    layout, offset = [], 0
    with open(path, "wb") as f:
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            if a.dtype.hasobject:
                raise TypeError(f"array {name!r} holds Python objects: only numeric arrays cross to a build worker")
            offset = -(-offset // 64) * 64
            f.seek(offset)
            f.write(memoryview(a.reshape(-1)).cast("B"))
            layout.append((name, a.dtype.str, a.shape, offset))
            offset += a.nbytes
        f.truncate(offset)  # a last empty array's offset past the end of what was written
    return layout


def _unpack(path: str, layout: list[tuple[str, str, tuple, int]],
            names: set[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays ``names`` (default all) of a :func:`_pack`ed file, as writable views of a private mapping of it: no
    copy, pages read as touched, and the file may be deleted at once (the mapping keeps its pages)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else bytearray()
    return {name: np.frombuffer(mapped, np.dtype(dtype), int(np.prod(shape)), offset).reshape(shape)
            for name, dtype, shape, offset in layout if names is None or name in names}


def _settle_watching(futures: list[Future]) -> list:
    """:func:`threads.settle` of ``futures``, also cancelling those not started once the calling thread's stop is set
    (another layer's error, an interrupt): their ``result()`` then raises ``CancelledError``."""
    stop = current_stop()
    if stop is not None:
        pending = futures
        while pending and not stop.is_set():
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_EXCEPTION)
            if any(not f.cancelled() and f.exception() is not None for f in done):
                break
        if stop.is_set():
            for f in futures:
                f.cancel()
    return settle(futures, stop)


def _restored(cls: type[Index], rows: KeyRows, params: dict[str, Any], n_keys: int, dim: int, packed: str,
              layout: list, keys_as: str | None) -> Index:
    """The index a worker built, from its :func:`_pack`ed arrays (``keys_as``: the array that was the key rows given,
    read from ``rows`` instead), each copied out of the mapping: a view would keep the whole file's pages (old graph
    rows included, once an add has grown them) in the memory-backed file system for the index's life."""
    arrays = {name: np.array(a) for name, a in _unpack(packed, layout).items()}
    if keys_as is not None:
        arrays[keys_as] = rows.view(n_keys)
    return cls(**params).restored_on(rows, arrays, n_keys, dim)


# -- in the workers ----------------------------------------------------------------------------------------------------


def _worker_start(warm: tuple[str, ...], parent: int, by_main_thread: bool) -> None:
    """A worker's set-up: one thread per library, the lowest priority, Ctrl-C ignored, ended with ``parent`` (a
    decode killed by SIGKILL left its workers building), ``warm``'s kernels loaded."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the caller stops the builds
    die_with(parent, by_main_thread=by_main_thread)
    one_thread()
    # Process-wide here (a worker runs nothing else): on a process's main thread one_thread() leaves torch's bfloat16
    # product a team of the cores, whose threads spin between products (a SmolLM2 head's build: 1.5x its CPU alone,
    # 2.5x beside a second worker).
    torch.set_num_threads(1)
    numpy_blas_one_thread()
    lower_priority()
    if warm:
        from anns_lab.indexes.warmup import warm_up

        warm_up(list(warm), 64)  # numba's kernels are typed by dtype and rank, not by dimension


def _build_remote(name: str, params: dict[str, Any], packed: str, layout: list, keys: str, arrays: list[str],
                  out: str) -> tuple[dict[str, Any], int, int, str, list, str | None]:
    """Build index ``name`` on the arrays ``keys`` and ``arrays`` (named ``"<item>.<build argument>"``) of the
    :func:`_pack`ed inputs; pack its ``_arrays()`` into the file ``out``, less the key rows it keeps as they were given
    (``keys_as`` names that array). Returns what :func:`_restored` takes."""
    from anns_lab.indexes import protocol, registry

    try:
        given = _unpack(packed, layout, {keys, *arrays})
        rows = given.pop(keys)
        given = {k.partition(".")[2]: a for k, a in given.items()}
        before = protocol.input_sums(rows, given.get("train_queries"))
        index = registry.get(name)(**params).build(rows, **given)
        # the caller serves the keys it gave, not these copies: an index that wrote into them must fail as on a thread
        if protocol.input_sums(rows, given.get("train_queries")) != before:
            raise protocol.inputs_changed(name)
        saved = index._arrays()
        keys_as = next((k for k, a in saved.items() if a.shape == rows.shape and np.shares_memory(a, rows)), None)
        kept = _pack(out, {k: a for k, a in saved.items() if k != keys_as})
        return index.params, index.n_keys, index.dim, out, kept, keys_as
    except BaseException as err:  # noqa: BLE001 - sent back whole where it pickles; a plugin's own class may not
        try:
            pickle.loads(pickle.dumps(err))
        except Exception:  # noqa: BLE001
            raise RuntimeError(error_text(err)) from None
        raise

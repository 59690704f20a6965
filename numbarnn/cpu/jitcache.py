"""numba's on-disk cache (``cache=True``) made safe for processes that compile at the same time.

Why: numba saves a compiled function in two steps, an index (``<function>.nbi``: which key is in which data
file) and the data files (``<function>.<n>.nbc``), with no lock between processes.  Two processes that compile
two variants of one function at once (two signatures, or two closures of one loop: the cpu backend's per-cell
loops are closures) both read the index, both pick the first free data file ``.1.nbc``, and both write it and
the index: the index can end up naming a data file that holds the OTHER variant's machine code, which the
next process loads and runs (numba issue #4807, open: "Cache causes Segmentation Faults when generated in
parallel").  numbarnn meets exactly that case: pytest-xdist workers on a cold cache (CI), DDP processes, any
two scripts started together after an install or an edit.  One such crash was seen here in a test worker
(tests/test_cpu_fused.py, 2 workers, cold cache); `python -m numbarnn.cpu.jitcache` races two processes over
one index (numba's class: mismatched entries; this one: none).

What: `LockedCacheFile.save` takes an exclusive lock on ``<index>.lock`` (fcntl; where there is no fcntl,
Windows, it behaves as numba's), re-reads the index inside it, writes the data file BEFORE the index (a reader
that finds a key finds its data; numba writes the index first) and then the index.  `njit_cached` is
``njit(cache=True)`` with that class installed on the dispatcher's cache, for numbarnn's functions only (numba
itself is not patched).
"""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing

from numba import njit
from numba.core.caching import IndexDataCacheFile

try:
    import fcntl
except ImportError:                                   # Windows: numba's behaviour, unlocked
    fcntl = None


@contextlib.contextmanager
def _exclusive(path: str):
    """An exclusive lock on `path` for the block; none where the platform or the filesystem has no locks
    (some NFS mounts): numba's own behaviour there."""
    handle = None
    if fcntl is not None:
        try:
            handle = open(path, "ab")   # noqa: SIM115  (closed below, after the unlock)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            if handle is not None:
                handle.close()
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


class LockedCacheFile(IndexDataCacheFile):
    """numba's index + data cache file, its read-modify-write of the index under a lock, data before index."""

    def save(self, key, data):
        with _exclusive(self._index_path + ".lock"):
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:                          # the first data file no key of the index names
                used = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1)) if n not in used)
            self._save_data(name, data)
            overloads[key] = name
            self._save_index(overloads)


def locked(dispatcher):
    """Give a dispatcher made with cache=True the locked cache file (kept as numba's if numba's internals
    change shape: then caching works as numba's own, races and all)."""
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if type(cache_file) is IndexDataCacheFile:
        cache_file.__class__ = LockedCacheFile
    return dispatcher


def njit_cached(fn=None, **flags):
    """``njit(cache=True, **flags)`` with `LockedCacheFile`; as ``@njit_cached`` or ``@njit_cached(...)``."""
    if fn is None:
        return lambda f: locked(njit(cache=True, **flags)(f))
    return locked(njit(cache=True, **flags)(fn))


def race(cache_file_class, path: str, processes: int = 2, saves: int = 150) -> tuple[int, int]:
    """`processes` processes save `saves` distinct keys each into one index at once; then every key is loaded
    back: -> (keys whose data is another key's, keys lost).  Lost keys only cost a compile; wrong ones run
    another function's machine code."""
    context = multiprocessing.get_context("spawn")   # no fork of a process that runs OpenMP/BLAS threads
    workers = [context.Process(target=_race_worker, args=(cache_file_class, path, w, saves))
               for w in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    reader = IndexDataCacheFile(cache_path=path, filename_base="race", source_stamp=("race", 1))
    wrong = lost = 0
    for w in range(processes):
        for i in range(saves):
            got = reader.load((w, i))
            lost += got is None
            wrong += got is not None and got != ("payload", w, i)
    return wrong, lost


def _race_worker(cache_file_class, path, w, saves):
    cache_file = cache_file_class(cache_path=path, filename_base="race", source_stamp=("race", 1))
    for i in range(saves):
        cache_file.save((w, i), ("payload", w, i))


if __name__ == "__main__":
    import tempfile

    for cls in (IndexDataCacheFile, LockedCacheFile):
        with tempfile.TemporaryDirectory() as tmp:
            wrong, lost = race(cls, tmp)
        print(f"{cls.__name__:20s} 2 processes x 150 keys into one index: {wrong} keys load another key's data, "
              f"{lost} lost")

"""One thread budget per call: while a cpu-backend call runs, BLAS uses at most the threads numba's loops use.

A process holding numbarnn has up to three thread pools: numba's (the fused loops), the BLAS library's that
NumPy loaded (OpenBLAS: the backward's weight-gradient products, the BLAS loops) and, with PyTorch, torch's.
The caller chooses one count: ``numba.set_num_threads(n)`` for NumPy callers; inside ``numbarnn.torch``,
``torch.set_num_threads(n)``, which the modules hand to numba for the call.  `budget` then lowers BLAS's pool
to that count for the call (through threadpoolctl, which finds the BLAS libraries NumPy loaded) and puts it
back afterwards: a program that asked for one thread gets one, not one per pool (a training loop on 2 cores
ran 1.36-1.59x slower than torch.nn with each pool at its default).  Nothing is raised above what it was.
Without threadpoolctl (an install without the dependency) BLAS keeps its own setting.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba

from .. import settings


@functools.cache
def _blas_libraries() -> tuple:
    """threadpoolctl's controllers of the BLAS libraries loaded now (looked up once, ~2 ms: NumPy loads its
    BLAS at import, before any call), or () without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController  # lazy: threadpoolctl may be absent
    except ImportError:       # pragma: no cover - threadpoolctl is a dependency
        return ()
    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


try:                                               # numba's internals, read by `num_threads` where present
    from numba.np.ufunc import parallel as _parallel
except ImportError:                                # pragma: no cover - another numba
    _parallel = None


def _layer_functions() -> tuple | None:
    """numba's (_get_num_threads, _set_num_threads) of its threading layer once the layer is up (numba defines
    them when it launches its threads: not yet when this module is imported), else None."""
    if _parallel is None or not getattr(_parallel, "_is_initialized", False):
        return None
    get, put = getattr(_parallel, "_get_num_threads", None), getattr(_parallel, "_set_num_threads", None)
    return None if get is None or put is None else (get, put)


def num_threads() -> int:
    """numba.get_num_threads(), without its two locks once numba's threading layer is up (~0.2 us instead of
    ~1.4: a tiny call asks several times); numba's own function otherwise."""
    layer = _layer_functions()
    if layer is not None:
        n = layer[0]()
        if n > 0:
            return n
    return numba.get_num_threads()


def set_num_threads(n: int) -> None:
    """numba.set_num_threads(n) for 1 <= n <= NUMBA_NUM_THREADS, without its locks and checks once numba's
    threading layer is up (numbarnn.torch sets torch's count around every call, and back: ~10 us a tiny call)."""
    layer = _layer_functions()
    if layer is not None and 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        layer[1](n)
    else:
        numba.set_num_threads(n)


@contextlib.contextmanager
def budget():
    """BLAS at most at numba's thread count inside the block (~1 us a library when it already is)."""
    n = num_threads()
    lowered = [(lib, lib.num_threads) for lib in _blas_libraries() if lib.num_threads > n]
    for lib, _ in lowered:
        lib.set_num_threads(n)
    try:
        yield
    finally:
        for lib, old in lowered:
            lib.set_num_threads(old)


def within_budget(fn):
    """`fn` run inside `budget` (the cpu backend's entry points)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with budget():
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def serial_blas():
    """BLAS on one thread inside the block: for loops of small per-step products (a modulated cell's two per step,
    cpu/modulated.py), where waking BLAS's other threads at every product cost more than they gave (measured on
    2 shared cores: a [256, 256] x [256, 32] float32 product 0.1-0.3 ms on one thread, several ms on two)."""
    lowered = [(lib, lib.num_threads) for lib in _blas_libraries() if lib.num_threads > 1]
    for lib, _ in lowered:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, old in lowered:
            lib.set_num_threads(old)


_helper: list = []                                 # [the helper thread's executor], made at first use
_helper_lock = threading.Lock()


def _helper_executor() -> ThreadPoolExecutor:
    with _helper_lock:
        if not _helper:
            _helper.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="numbarnn"))
    return _helper[0]


def _forget_helper() -> None:
    """In a forked child: its parent's helper thread does not exist there (a job handed to it would wait forever),
    and the lock may have been held by another thread at the fork; the child makes its own at first use."""
    global _helper_lock
    _helper.clear()
    _helper_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_helper)


def side_by_side(first, second):
    """first() here while second() runs on numbarnn's helper thread (in this thread's settings), both done on
    return -> (first's result, second's).  For two independent pieces of one call on a call's two threads
    (the two directions of a layer, network.py): compiled loops release the GIL (`cells.cached_step`) and
    NumPy's BLAS calls do.  An exception of either is raised here once both have finished."""
    scope = settings.current()

    def run():
        with settings.override(**scope):
            return second()

    later = _helper_executor().submit(run)
    try:
        here = first()
    finally:
        there = later.result()                   # waits (and raises second's error) even when first raised
    return here, there

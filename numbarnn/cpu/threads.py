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

import numba


@functools.cache
def _blas_libraries() -> tuple:
    """threadpoolctl's controllers of the BLAS libraries loaded now (looked up once, ~2 ms: NumPy loads its
    BLAS at import, before any call), or () without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:       # pragma: no cover - threadpoolctl is a dependency
        return ()
    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


@contextlib.contextmanager
def budget():
    """BLAS at most at numba's thread count inside the block (~1 us a library when it already is)."""
    n = numba.get_num_threads()
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

"""Scratch memory kept across calls: the backends' workspaces (what cuDNN calls its workspace).

An RNN call needs scratch the size of its activations: W x_t for all steps, the backward's pre-activation
gradients, state buffers, the reserve of an inference call.  Allocated per call, that is
- on the CPU, a fresh mmap per large NumPy array whose pages fault in on first write (measured on the 2-core
  KVM machine: 61-78 ms to touch a new 26 MB array, 1 ms to rewrite one already mapped; see
  bench/results/cpu.md, "workspace");
- on a GPU, a cudaMalloc per array and a deferred cudaFree, on the host's critical path of every call.
So each backend keeps a `ScratchPool`: named buffers, one set per thread (and per device for CUDA), grown
when a larger call needs one and handed out as views.  No call after the first of its size allocates scratch.

    pool.get("gx", (D, T, B, G * H), np.float32)    -> an uninitialised [D, T, B, G*H] array, the same memory
                                                       as the previous call's "gx" in this thread (if large enough)

Rules for callers: a name holds one live array at a time (ask again only when the old contents are dead);
contents are garbage on entry (fill what you read: tests poison the pool with NaN to prove it); results that
leave the call are allocated fresh, never taken from the pool.  `release()` frees this thread's buffers;
`release_all()` those of every pool created so far (a backend not imported has none).
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Callable

import numpy as np


_POOLS: weakref.WeakSet = weakref.WeakSet()     # every ScratchPool, for release_all


class ScratchPool:
    """Named scratch buffers per thread (and per `where` key, e.g. a CUDA device id).

    allocate(n, dtype) -> a new 1-D array of n elements (NumPy or device); fill(buf, value) sets every element
    (for `poison`).  Views of an empty request are fresh empty arrays (numba-cuda refuses empty slices)."""

    def __init__(self, allocate: Callable, fill: Callable, where: Callable = lambda: None):
        self._allocate, self._fill, self._where = allocate, fill, where
        self._local = threading.local()
        _POOLS.add(self)

    def _state(self) -> tuple[dict, dict]:
        """This thread's (buffers, views) for the current `where`: (name, dtype) -> 1-D buffer, and
        (name, shape, dtype) -> the view `get` handed out of it (the same object again while the buffer stays)."""
        pools = getattr(self._local, "pools", None)
        if pools is None:
            pools = self._local.pools = {}
        state = pools.get(self._where())
        if state is None:
            state = pools[self._where()] = ({}, {})
        return state

    def _buffers(self) -> dict:
        return self._state()[0]

    def get(self, name: str, shape: tuple, dtype):
        """An uninitialised C-contiguous array of `shape` and `dtype`, reusing this thread's buffer `name`.

        A repeated request gets the same view object (a dict lookup: a small call asks ~10 times, and a device
        array made once keeps its launch arguments packed, `kernels/launch.py`)."""
        buffers, views = self._state()
        asked = (name, shape, dtype)                     # as given (a list shape cannot be a key: no reuse)
        try:
            view = views.get(asked)
        except TypeError:
            view, asked = None, None
        if view is not None:
            return view
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape)
        if n == 0:
            return self._allocate(0, dtype).reshape(shape)
        buf = buffers.get((name, dtype))
        if buf is None or buf.shape[0] < n:
            buffers.pop((name, dtype), None)             # drop the old one first: peak memory = one copy
            for key in [k for k in views if k[0] == name and np.dtype(k[2]) == dtype]:
                del views[key]                           # views of the old buffer
            buf = buffers[(name, dtype)] = self._allocate(n, dtype)
        view = buf[:n].reshape(shape)
        if asked is not None:
            views[asked] = view
        return view

    def poison(self, value=np.nan) -> None:
        """Set every buffer this thread holds to `value` (tests: no call may read scratch it did not write)."""
        for buf in self._buffers().values():
            self._fill(buf, value)

    def held_bytes(self) -> int:
        """Bytes of scratch this thread holds (here, for the current `where`)."""
        return sum(buf.shape[0] * buf.dtype.itemsize for buf in self._buffers().values())

    def release(self) -> int:
        """Free this thread's scratch (for the current `where`); returns the bytes it held."""
        held = self.held_bytes()
        for part in self._state():
            part.clear()
        return held


def track(pool) -> None:
    """Let `release_all` free another kind of memory kept across calls (an object with `release() -> bytes`,
    e.g. the cpu backend's kept weight panels)."""
    _POOLS.add(pool)


def release_all() -> int:
    """Free this thread's scratch in every pool (the cpu backend's, the cuda driver's: those imported so far),
    and what else was `track`ed; returns the bytes released."""
    return sum(pool.release() for pool in list(_POOLS))

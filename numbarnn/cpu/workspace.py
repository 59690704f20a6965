"""The CPU backend's workspace: scratch NumPy arrays kept across calls, per thread (`numbarnn.workspace`).

    scratch("gx", (T, B, G * H), np.float32)   -> an uninitialised view, the same memory at every call,
                                                  starting at a multiple of 64 bytes (`aligned_empty`)

Measured (one process, the two variants interleaved: `python bench/bench_cpu_workspace.py`): see
bench/results/cpu.md, "workspace".  `release()` frees this thread's scratch, `held_bytes()` says how much it
holds, `poison(value)` fills it (tests).
"""
from __future__ import annotations

import numpy as np

from ..workspace import ScratchPool

#: bytes the arrays below start at a multiple of: a cache line, and an AVX-512 vector (NumPy aligns to 16 bytes,
#: so a 64-byte load of a packed panel would straddle two cache lines every time)
ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype) whose data starts at a multiple of ALIGN bytes (a view into a slightly larger array)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.empty(shape, dtype)
    raw = np.empty(n * dtype.itemsize + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n * dtype.itemsize].view(dtype).reshape(shape)


POOL = ScratchPool(allocate=aligned_empty, fill=lambda buf, value: buf.fill(value))
scratch = POOL.get
poison = POOL.poison
held_bytes = POOL.held_bytes
release = POOL.release

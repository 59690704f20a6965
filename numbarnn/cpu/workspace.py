"""The CPU backend's workspace: scratch NumPy arrays kept across calls, per thread (`numbarnn.workspace`).

    scratch("gx", (T, B, G * H), np.float32)   -> an uninitialised view, the same memory at every call

Measured (one process, the two variants interleaved: `python bench/bench_cpu_workspace.py`): see
bench/results/cpu.md, "workspace".  `release()` frees this thread's scratch, `held_bytes()` says how much it
holds, `poison(value)` fills it (tests).
"""
from __future__ import annotations

import numpy as np

from ..workspace import ScratchPool

POOL = ScratchPool(allocate=lambda n, dtype: np.empty(n, dtype=dtype), fill=lambda buf, value: buf.fill(value))
scratch = POOL.get
poison = POOL.poison
held_bytes = POOL.held_bytes
release = POOL.release

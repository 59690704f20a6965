"""The target the kernels are planned for: numba's CUDA simulator or a GPU, explicit and scoped.

Launch sizes differ by target (the simulator runs one Python thread per CUDA thread: tiny blocks, a partial last
block; a GPU: warps, its SM count, its tiles), and so do the step versions and slices chosen.  Every planning
function reads `current()`; a tool that plans for a GPU while it runs in the simulator (the profiler's GPU
geometry, which records what a GPU's launches would touch) says so with `planning_for(Target.gpu_in_simulator())`
around its calls, instead of changing module globals.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from numba import config as _numba_config
from numba import cuda


@dataclass(frozen=True)
class Target:
    """simulator: plan the simulator's launch sizes (True) or a GPU's (False).  gpu_model: a GPU plan whose
    launches run in numba's simulator, so v3's co-residency is the simulator's (every block of a cooperative
    grid at once) rather than a device's answer."""

    simulator: bool
    gpu_model: bool = False

    @classmethod
    def of_process(cls) -> "Target":
        """Where this process's launches run, as numba was imported (NUMBA_ENABLE_CUDASIM)."""
        return cls(simulator=bool(_numba_config.ENABLE_CUDASIM))

    @classmethod
    def gpu_in_simulator(cls) -> "Target":
        """A GPU's launch sizes, run in the simulator (the profiler's GPU geometry)."""
        return cls(simulator=False, gpu_model=True)


PROCESS = Target.of_process()
_local = threading.local()


def current() -> Target:
    """The innermost `planning_for` target of this thread, else the process's."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else PROCESS


def simulator(given: bool | None = None) -> bool:
    """`given` where a caller names the geometry (launch_plan(gpu=...)), else the current target's."""
    return current().simulator if given is None else given


@contextlib.contextmanager
def planning_for(target: Target):
    """Plan (and launch) for `target` inside the block, in this thread; blocks nest."""
    if not isinstance(target, Target):
        raise TypeError(f"planning_for: expected a Target, got {target!r}")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(target)
    try:
        yield target
    finally:
        stack.pop()


def device_geometry() -> tuple:
    """(compute capability, SM count) of this process's GPU; raises without one."""
    dev = cuda.get_current_device()
    return tuple(dev.compute_capability), dev.MULTIPROCESSOR_COUNT


def device_geometry_or_none() -> tuple | None:
    """`device_geometry()`, or None where there is no GPU to ask (what v3's widths and v2's narrow tiles fall back
    on: the plan's block, the GPU tiles)."""
    try:
        return device_geometry()
    except Exception:
        return None

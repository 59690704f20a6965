"""GPU or CUDA simulator: decided before numba is imported (this module imports no numba).

numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported; setting it later silently does nothing.
Scripts, the CLI and the tutorials call `use_simulator_unless_gpu()` first thing, so that without a GPU the
kernels run in numba's CUDA simulator (slow: for tests and teaching) and with one they run for real.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import sys

from . import settings

SIM_VAR = settings.SIM_VAR
REAL_GPU_VAR = settings.SETTINGS["real_gpu"][0]


@functools.lru_cache(maxsize=None)
def real_gpu_present() -> bool:
    """A real NVIDIA GPU, found without importing numba: NUMBARNN_REAL_GPU=1/0 decides, else `nvidia-smi -L`."""
    forced = settings.get("real_gpu")
    if forced is not None:
        return forced == "1"
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and "GPU" in proc.stdout


def use_simulator_unless_gpu() -> str:
    """Set NUMBA_ENABLE_CUDASIM=1 when there is no GPU and the user did not choose; returns a description."""
    if settings.simulator_chosen():
        where = "CUDA simulator" if settings.simulator() else "real GPU"
        return f"{where} ({SIM_VAR}={settings.raw(SIM_VAR)} set by the user)"
    if real_gpu_present():
        return "real GPU"
    settings.request_simulator()
    if "numba" in sys.modules:   # too late for numba to notice (only happens when embedded, e.g. in a test run)
        return f"CUDA simulator requested, but numba was imported before {SIM_VAR}=1 was set"
    return f"CUDA simulator (no GPU found; {SIM_VAR}=1 set)"

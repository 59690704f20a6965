"""The one place that picks a backend.

A backend is a module with the functions `rnn_forward`, `rnn_backward`, `block_lstm`, `block_lstm_grad`,
`swap01` (swap the first two axes into a contiguous array) and `zeros(shape, dtype, like)`; see
`numbarnn/reference/backend.py` for the contract.  Selection: the `backend=` argument of an op, else
`set_default_backend(...)`, else the environment variable NUMBARNN_BACKEND, else "cuda" when a real GPU
is present and "cpu" otherwise (numba.njit + BLAS, `numbarnn/cpu/`; the CUDA simulator is for tests and
teaching, far too slow for work; "reference", the float64 NumPy oracle, stays selectable).
"""
from __future__ import annotations

import functools
import importlib
import sys

from . import settings
from .validation import check_choice
from .workspace import release_all

BACKENDS = {"reference": "numbarnn.reference.backend", "cpu": "numbarnn.cpu.backend",
            "cuda": "numbarnn.kernels.backend"}
ENV_VAR = settings.SETTINGS["backend"][0]
_default: str | None = None


@functools.lru_cache(maxsize=None)
def real_gpu_available() -> bool:
    """A real CUDA device (not the simulator) is usable."""
    if settings.simulator():
        return False
    try:
        from numba import cuda  # lazy: numba.cuda after the simulator switch
        return bool(cuda.is_available())
    except Exception:  # pragma: no cover - broken driver installs
        return False


def set_default_backend(name: str | None) -> None:
    """Set the backend used when an op gets backend=None; None restores automatic selection."""
    global _default
    _default = None if name is None else check_choice("backend", name, tuple(BACKENDS))


def get_default_backend() -> str:
    if _default is not None:
        return _default
    env = settings.get("backend")
    if env:
        return check_choice(f"{ENV_VAR} (environment variable)", env, tuple(BACKENDS))
    return "cuda" if real_gpu_available() else "cpu"


def get_backend(name: str | None = None):
    """The backend module for `name` (None = the default).  An imported backend is read from sys.modules (a dict
    look-up: import_module and the name check cost ~4 us a call), so a reload or a stand-in put there is what runs."""
    name = get_default_backend() if name is None else name
    module = sys.modules.get(BACKENDS.get(name)) if type(name) is str else None
    if module is None:
        check_choice("backend", name, tuple(BACKENDS))
        module = importlib.import_module(BACKENDS[name])
    return module


def release_workspaces() -> int:
    """Free the scratch the cpu and cuda backends keep across calls in this thread (numbarnn/workspace.py: the
    arrays a call needs but does not return, kept so the next call of its size allocates nothing); returns the
    bytes released.  Backends not imported yet hold nothing and are not imported."""
    return release_all()

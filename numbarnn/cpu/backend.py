"""The "cpu" backend: the contract of `numbarnn/reference/backend.py`, computed by `numbarnn.cpu.network` and
`numbarnn.cpu.block_lstm` (BLAS + numba.njit; see the package docstring for threads and dtypes).

Host arrays only: device arrays (numba, CuPy, torch CUDA tensors) are copied to the host first, and results
are NumPy arrays.  BLAS runs on at most numba's thread count during a call (`threads.budget`).  Inputs are
converted to the compute dtype once (no copy when they already are, and never written to); results are
converted to the call's dtype once.
"""
from __future__ import annotations

import numpy as np

from ..reference.backend import to_host
from . import block_lstm as _block_lstm
from . import network
from .cells import compute_dtype as _compute_dtype
from .threads import within_budget


def compute_dtype(dtype) -> np.dtype:
    """`cells.compute_dtype`, looked up for the three float dtypes (np.dtype's comparisons cost ~1 us a call)."""
    try:
        return _COMPUTE[dtype]
    except (KeyError, TypeError):
        return _compute_dtype(dtype)


_COMPUTE = {np.dtype(t): _compute_dtype(t) for t in (np.float16, np.float32, np.float64)}


def _ct(a, ct):
    if type(a) is np.ndarray and a.dtype == ct and a.flags.c_contiguous:
        return a                                  # (already: no conversion call)
    return None if a is None else np.ascontiguousarray(to_host(a), dtype=ct)


def swap01(a):
    return np.ascontiguousarray(np.swapaxes(to_host(a), 0, 1))


def zeros(shape, dtype, like=None):
    return np.zeros(shape, dtype=dtype)


def rnn_forward(call, x, h0, c0, params):     # (the fused forward calls no BLAS: network.forward budgets the rest)
    dt, ct = np.dtype(call.dtype), compute_dtype(call.dtype)
    y, hT, cT, reserve = network.forward(call, _ct(x, ct), _ct(h0, ct), _ct(c0, ct), _ct(params, ct), ct)
    cT = cT.astype(dt, copy=False) if cT is not None else np.zeros((0,), dtype=dt)
    reserve = reserve.astype(dt, copy=False) if call.is_training else np.zeros((0,), dtype=dt)
    return y.astype(dt), hT.astype(dt, copy=False), cT, reserve


@within_budget
def rnn_backward(call, x, h0, c0, params, dy, dhT, dcT, reserve):
    dt, ct = np.dtype(call.dtype), compute_dtype(call.dtype)
    dx, dh0, dc0, dparams = network.backward(call, *(_ct(a, ct) for a in (x, h0, c0, params, dy, dhT, dcT,
                                                                            reserve)), ct)
    return (dx.astype(dt, copy=False), dh0.astype(dt, copy=False),
            dc0.astype(dt, copy=False) if dc0 is not None else None, dparams.astype(dt, copy=False))


@within_budget
def block_lstm(call, *arrays):
    return _block_lstm.forward(call, *[to_host(a) for a in arrays])


@within_budget
def block_lstm_grad(call, *arrays):
    return _block_lstm.backward(call, *[to_host(a) for a in arrays])

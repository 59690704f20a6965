"""Dropout keep masks (SPEC 6) on the CPU: the CUDA kernels' own Philox4x32-10 device functions
(`numbarnn/kernels/philox.py`, written with explicit uint32/uint64 casts so they mean the same on any target)
compiled with numba.njit by `compile_with_twins`, in a parallel loop over the elements.  Bit-identical to
`numbarnn.reference.philox.dropout_keep_mask` (tests/test_cpu_backend.py checks it)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from ..cells.functions import compile_with_twins
from ..dropout import check_mask_args, dropout_key, dropout_threshold
from ..kernels import philox as _cuda_philox

#: keep(n, k0, k1, threshold) -> bool, the device function `dropout_keep` compiled for the CPU
dropout_keep = compile_with_twins(_cuda_philox.dropout_keep.py_func, {}, njit(inline="always"))
_ONE = np.uint64(1)


@njit(parallel=True)
def _mask(
    out,        # [T, B, W] uint8: 1 = keep, 0 = drop (written)
    layer,      # uint64: the layer whose input is masked, >= 1
    k0,         # uint32: key low word
    k1,         # uint32: key high word
    threshold,  # uint32
):
    T, B, W = out.shape
    for e in prange(T * B * W):
        t = e // (B * W)
        b = (e // W) % B
        j = e % W
        n = (((uint64(layer) - _ONE) * uint64(T) + uint64(t)) * uint64(B) + uint64(b)) * uint64(W) + uint64(j)
        out[t, b, j] = 1 if dropout_keep(n, k0, k1, threshold) else 0


def dropout_keep_mask(seed: int, seed2: int, layer: int, T: int, B: int, W: int, p: float) -> np.ndarray:
    """uint8 [T, B, W] keep flags of the dropout on the input of layer `layer` (>= 1)."""
    layer, T, B, W = check_mask_args(layer, T, B, W)
    k0, k1 = dropout_key(seed, seed2)
    out = np.empty((T, B, W), dtype=np.uint8)
    if out.size:
        _mask(out, np.uint64(layer), np.uint32(k0), np.uint32(k1), np.uint32(dropout_threshold(p)))
    return out

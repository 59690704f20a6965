"""Dropout keep masks (SPEC 6) and zoneout's update masks (SPEC 6.1, zoneout.py) on the CPU: the CUDA kernels' own
Philox4x32-10 device functions (`numbarnn/kernels/philox.py`, written with explicit uint32/uint64 casts so they
mean the same on any target) compiled with numba.njit by `compile_with_twins`, in a parallel loop over the
elements.  Bit-identical to `numbarnn.reference.philox` (tests/test_cpu_backend.py, tests/test_zoneout.py)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from ..cells.functions import compile_with_twins
from ..dropout import check_mask_args, dropout_key, dropout_threshold
from ..kernels import philox as _cuda_philox
from .jitcache import njit_cached

#: test(n, k0, k1, threshold, stream) -> bool, the device function `stream_test` compiled for the CPU
stream_test = compile_with_twins(_cuda_philox.stream_test.py_func, {}, njit(inline="always"))


@njit_cached(parallel=True)
def stream_mask(
    out,        # [T, B, W] uint8: 1 where the test passes (written)
    block,      # uint64: which [T, B, W] block of the stream (dropout: layer - 1; zoneout: the pseudo-layer)
    k0,         # uint32: key low word
    k1,         # uint32: key high word
    threshold,  # uint32
    stream,     # uint32: counter word 2 (dropout 0, zoneout ZONEOUT_STREAM)
):
    """out[t, b, j] = stream_test(n), n = ((block*T + t)*B + b)*W + j: one block of a stream's masks."""
    T, B, W = out.shape
    for e in prange(T * B * W):
        t = e // (B * W)
        b = (e // W) % B
        j = e % W
        n = ((uint64(block) * uint64(T) + uint64(t)) * uint64(B) + uint64(b)) * uint64(W) + uint64(j)
        out[t, b, j] = 1 if stream_test(n, k0, k1, threshold, stream) else 0


def dropout_keep_mask(seed: int, seed2: int, layer: int, T: int, B: int, W: int, p: float) -> np.ndarray:
    """uint8 [T, B, W] keep flags of the dropout on the input of layer `layer` (>= 1)."""
    layer, T, B, W = check_mask_args(layer, T, B, W)
    k0, k1 = dropout_key(seed, seed2)
    out = np.empty((T, B, W), dtype=np.uint8)
    if out.size:
        stream_mask(out, np.uint64(layer - 1), np.uint32(k0), np.uint32(k1), np.uint32(dropout_threshold(p)),
                    np.uint32(0))
    return out

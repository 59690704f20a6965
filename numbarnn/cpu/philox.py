"""Dropout keep masks (SPEC 6) and zoneout's update masks (SPEC 6.1, zoneout.py) on the CPU: the CUDA kernels' own
Philox4x32-10 device functions (`numbarnn/kernels/philox.py`, written with explicit uint32/uint64 casts so they
mean the same on any target) compiled with numba.njit by `compile_with_twins`, in a parallel loop over the
Philox counters (one call gives the words of four elements).  Bit-identical to `numbarnn.reference.philox`
(tests/test_cpu_backend.py, tests/test_zoneout.py); layer_input.py applies the dropout masks to a layer's input."""
from __future__ import annotations

import numpy as np
from numba import njit, prange, uint32, uint64

from ..cells.functions import compile_with_twins
from ..dropout import check_mask_args, dropout_key, dropout_threshold
from ..kernels import philox as _cuda_philox
from .jitcache import njit_cached

#: Philox4x32-10(c0, c1, c2, c3, k0, k1) -> 4 uint32, the device function compiled for the CPU
philox4x32_10 = compile_with_twins(_cuda_philox.philox4x32_10.py_func, {}, njit(inline="always"))
_SHIFT8 = np.uint32(8)


@njit_cached(parallel=True)
def stream_mask(
    out,        # [T, B, W] uint8, C-contiguous: 1 where the test passes (written)
    block,      # uint64: which [T, B, W] block of the stream (dropout: layer - 1; zoneout: the pseudo-layer)
    k0,         # uint32: key low word
    k1,         # uint32: key high word
    threshold,  # uint32
    stream,     # uint32: counter word 2 (dropout 0, zoneout ZONEOUT_STREAM)
):
    """out[t, b, j] = `kernels/philox.stream_test` of n = block*T*B*W + (t*B + b)*W + j, one Philox call per
    counter n // 4 (its 4 words are the tests of 4 consecutive n; the test per element makes each call 4 times)."""
    flat = out.reshape(-1)                      # element e = (t*B + b)*W + j, n = first + e
    size = uint64(flat.shape[0])
    first = uint64(block) * size
    q0 = first >> uint64(2)
    for i in prange((((first + size + uint64(3)) >> uint64(2)) - q0)):
        q = q0 + uint64(i)                      # counter (lo32(q), hi32(q), stream, 0)
        x = philox4x32_10(uint32(q & uint64(0xFFFFFFFF)), uint32(q >> uint64(32)), stream, uint32(0), k0, k1)
        for lane in range(4):
            n = (q << uint64(2)) + uint64(lane)
            if n >= first and n < first + size:
                flat[n - first] = 1 if uint32(x[lane] >> _SHIFT8) >= uint32(threshold) else 0


def dropout_keep_mask(seed: int, seed2: int, layer: int, T: int, B: int, W: int, p: float) -> np.ndarray:
    """uint8 [T, B, W] keep flags of the dropout on the input of layer `layer` (>= 1)."""
    layer, T, B, W = check_mask_args(layer, T, B, W)
    k0, k1 = dropout_key(seed, seed2)
    out = np.empty((T, B, W), dtype=np.uint8)
    if out.size:
        stream_mask(out, np.uint64(layer - 1), np.uint32(k0), np.uint32(k1), np.uint32(dropout_threshold(p)),
                    np.uint32(0))
    return out

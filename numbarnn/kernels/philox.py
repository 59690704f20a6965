"""Philox4x32-10 and the dropout keep-mask of SPEC section 6 as numba.cuda device functions and a kernel.

Bit-identical to `numbarnn.reference.philox` (see there for the algorithm and the mask formula).

Typing rules that keep this exact on a real GPU *and* in the simulator:

- numba types ``int64 op uint64`` as float64, so every integer here is explicitly uint32 or uint64,
  and every constant is a NumPy uint32/uint64 global (frozen as a typed constant) or cast in place;
- numba widens ``uint32 op uint32`` to uint64 while NumPy (the simulator) keeps uint32, so results
  are cast back with ``uint32(...)`` after masking, which gives the same value on both;
- the 32x32 -> 64-bit ``mulhilo`` is a uint64 product (``cuda.libdevice.umulhi`` is not simulated);
  NVVM turns ``(uint64(a) * uint64(b)) >> 32`` into a single ``mul.wide.u32``;
- the device functions are ``common.device``: NVVM inlines them, and ``compile_ptx`` of a kernel calling
  them works without a GPU (``common.device`` says how).

The mask kernel writes **uint8** flags (1 = keep, 0 = drop); kernels that apply dropout call
`dropout_keep` inline instead of reading a mask.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, uint32, uint64

from numbarnn.dropout import (PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, check_mask_args, dropout_key,
                              dropout_threshold)
from numbarnn.kernels.common import device
from numbarnn.kernels.launch import launch
from numbarnn.validation import ArgumentTypeError, check_shape

# typed constants (module globals that numba freezes into the kernels)
_M0 = np.uint64(PHILOX_M0)
_M1 = np.uint64(PHILOX_M1)
_W0 = np.uint64(PHILOX_W0)
_W1 = np.uint64(PHILOX_W1)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_ZERO32 = np.uint32(0)
_SHIFT8 = np.uint32(8)
_U64_0 = np.uint64(0)
_U64_1 = np.uint64(1)
_U64_2 = np.uint64(2)
_U64_3 = np.uint64(3)
_KEEP = np.uint8(1)
_DROP = np.uint8(0)

#: threads per block of the mask kernel (small: the simulator runs one Python thread per CUDA thread)
THREADS_PER_BLOCK = 64
#: at most this many blocks; a grid-stride loop covers the rest
MAX_BLOCKS = 1024


@device
def philox_round(c0, c1, c2, c3, k0, k1):
    """One Philox4x32 round: (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0); all uint32."""
    p0 = uint64(c0) * _M0                     # 64-bit product M0 * c0
    p1 = uint64(c2) * _M1                     # 64-bit product M1 * c2
    hi0 = uint32(p0 >> _SHIFT32)
    lo0 = uint32(p0 & _MASK32)
    hi1 = uint32(p1 >> _SHIFT32)
    lo1 = uint32(p1 & _MASK32)
    return (uint32(hi1 ^ c1 ^ k0), lo1, uint32(hi0 ^ c3 ^ k1), lo0)


@device
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of Random123: counter (c0, c1, c2, c3), key (k0, k1) -> 4-tuple of uint32."""
    c0 = uint32(c0)
    c1 = uint32(c1)
    c2 = uint32(c2)
    c3 = uint32(c3)
    k0 = uint32(k0)
    k1 = uint32(k1)
    c0, c1, c2, c3 = philox_round(c0, c1, c2, c3, k0, k1)
    for _ in range(9):  # 9 more rounds, the key bumped (mod 2**32) before each
        k0 = uint32((uint64(k0) + _W0) & _MASK32)
        k1 = uint32((uint64(k1) + _W1) & _MASK32)
        c0, c1, c2, c3 = philox_round(c0, c1, c2, c3, k0, k1)
    return (c0, c1, c2, c3)


@device
def stream_test(n, k0, k1, threshold, stream):
    """The Bernoulli test of element n (uint64) on a Philox stream: (x >> 8) >= threshold,
    x = Philox4x32-10(counter=(lo32(n//4), hi32(n//4), stream, 0), key=(k0, k1))[n % 4]."""
    n = uint64(n)
    q = n >> _U64_2                           # counter n // 4
    lane = n & _U64_3                         # n % 4
    x0, x1, x2, x3 = philox4x32_10(uint32(q & _MASK32), uint32(q >> _SHIFT32), stream, _ZERO32, k0, k1)
    x = x3
    if lane == _U64_0:
        x = x0
    elif lane == _U64_1:
        x = x1
    elif lane == _U64_2:
        x = x2
    return uint32(x >> _SHIFT8) >= uint32(threshold)


@device
def dropout_keep(n, k0, k1, threshold):
    """True iff dropout keeps element n (uint64): the test of stream 0 (SPEC 6)."""
    return stream_test(n, k0, k1, threshold, _ZERO32)


_ZONEOUT_STREAM = np.uint32(1)   # numbarnn.dropout.ZONEOUT_STREAM: counter word 2 of the zoneout masks


@device
def zoneout_update(n, k0, k1, threshold):
    """True iff h takes h_new at zoneout element n (uint64) (SPEC 6.1): dropout's test on stream 1."""
    return stream_test(n, k0, k1, threshold, _ZONEOUT_STREAM)


@cuda.jit
def dropout_keep_mask_kernel(
    out,        # [T, B, W] uint8: 1 = keep, 0 = drop (written)
    layer,      # uint64 scalar: the layer whose input is masked, >= 1
    k0,         # uint32 scalar: key low word, uint32(seed2)
    k1,         # uint32 scalar: key high word, uint32(seed)
    threshold,  # uint32 scalar: min(2**24, ceil(p * 2**24))
):
    """out[t, b, j] = keep(n), n = (((l-1)*T + t)*B + b)*W + j; one thread per element, grid-stride."""
    T, B, W = out.shape
    for e in range(cuda.grid(1), T * B * W, cuda.gridsize(1)):
        t = e // (B * W)
        b = (e // W) % B
        j = e % W
        n = (((uint64(layer) - _U64_1) * uint64(T) + uint64(t)) * uint64(B) + uint64(b)) * uint64(W) + uint64(j)
        out[t, b, j] = _KEEP if dropout_keep(n, k0, k1, threshold) else _DROP


#: (name, dtype, python function, numba signature, threads per block) of every kernel here (the format
#: of `numbarnn.kernels.registry`), for ``numba.cuda.compile_ptx(pyfunc, sig, cc=(8, 0))`` in a process
#: without NUMBA_ENABLE_CUDASIM
KERNEL_SPECS = [
    ("dropout_keep_mask_kernel", "uint8", dropout_keep_mask_kernel.py_func,
     "void(uint8[:, :, ::1], uint64, uint32, uint32, uint32)", THREADS_PER_BLOCK),
]


def dropout_keep_mask(seed: int, seed2: int, layer: int, T: int, B: int, W: int, p: float, out=None):
    """Keep flags of the dropout on the input of layer `layer` (>= 1), computed on the device.

    Returns `out`, a device array uint8 [T, B, W] (1 = keep, 0 = drop), bit-identical to
    `numbarnn.reference.philox.dropout_keep_mask` (``out.copy_to_host().astype(bool)``).
    `out`, if given, must be a uint8 array of shape [T, B, W] (device, or NumPy which
    numba copies in and back); otherwise a new device array is allocated.
    """
    layer, T, B, W = check_mask_args(layer, T, B, W)
    k0, k1 = dropout_key(seed, seed2)
    threshold = dropout_threshold(p)
    if out is None:
        out = cuda.device_array((T, B, W), dtype=np.uint8)        # [T, B, W] uint8
    else:
        check_shape("out", out, (T, B, W), "[T, B, W]")
        if np.dtype(out.dtype) != np.uint8:
            raise ArgumentTypeError(f"out: expected dtype uint8, got {np.dtype(out.dtype)}")
    total = T * B * W
    if total == 0:
        return out
    blocks = min(MAX_BLOCKS, math.ceil(total / THREADS_PER_BLOCK))
    launch(dropout_keep_mask_kernel, blocks, THREADS_PER_BLOCK,
           out, np.uint64(layer), np.uint32(k0), np.uint32(k1), np.uint32(threshold))
    return out

"""Philox4x32-10 and the dropout keep-mask of SPEC section 6, in plain NumPy (the teaching version).

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the Random123
library) is a counter-based generator: a pure function ``(counter, key) -> 4 random uint32``.
Each of its 10 rounds does two 32x32 -> 64-bit multiplications and a few xors::

    hi0, lo0 = mulhilo(M0, c0)            M0 = 0xD2511F53
    hi1, lo1 = mulhilo(M1, c2)            M1 = 0xCD9E8D57
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

and between two rounds the key is bumped by the Weyl constants ``k0 += 0x9E3779B9``,
``k1 += 0xBB67AE85`` (mod 2**32).

The dropout mask of layer ``l >= 1`` (the input of layer l, width ``W = D*P``) is a pure function
of ``(seed, seed2, l, t, b, j)``, the same on every backend and on every call **(choice)**::

    key = (uint32(seed2), uint32(seed))                   # low, high word of (seed << 32) | seed2
    n   = (((l-1)*T + t)*B + b)*W + j                     # element index, uint64
    x   = Philox4x32-10(counter=(lo32(n//4), hi32(n//4), 0, 0), key)[n % 4]
    keep  iff  (x >> 8) >= min(2**24, ceil(p * 2**24))    # integer compare, no float rounding

so a 24-bit uniform integer is compared with an exactly rounded threshold: ``p == 0`` keeps
everything, ``p == 1`` keeps nothing, and the keep probability is ``1 - threshold / 2**24``.

All arithmetic is done in uint64 (products of two uint32 fit exactly), then masked back to 32
bits, so NumPy never warns about overflow.
"""
from __future__ import annotations


import numpy as np

from numbarnn.dropout import (DROPOUT_BITS, PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0,  # noqa: F401
                              PHILOX_W1, ZONEOUT_STREAM, check_mask_args, check_zoneout_mask_args, dropout_key,
                              dropout_threshold)
from numbarnn.validation import ArgumentTypeError

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _as_uint32_words(name: str, a, words: int) -> np.ndarray:
    """`a` as a uint64 array [..., words] holding values in [0, 2**32); clear errors otherwise."""
    arr = np.asarray(a)
    if arr.dtype.kind not in "ui":
        raise ArgumentTypeError(f"{name}: expected an integer array (uint32 words), got dtype {arr.dtype}")
    if arr.ndim == 0 or arr.shape[-1] != words:
        raise ValueError(f"{name}: expected shape [..., {words}], got {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError(f"{name}: expected values in [0, 2**32), got values in "
                         f"[{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(np.uint64)


def _mulhilo(a: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(high 32 bits, low 32 bits) of the 64-bit product a * m; a: uint64 [...] holding uint32 values."""
    product = a * np.uint64(m)                 # [...] uint64, exact: both factors < 2**32
    return product >> _SHIFT32, product & _MASK32


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 of Random123.

    counter: uint32 [..., 4]; key: uint32 [..., 2]; leading dimensions broadcast.
    Returns uint32 [..., 4] (the broadcast leading shape).
    """
    ctr = _as_uint32_words("counter", counter, 4)     # [..., 4] uint64
    k = _as_uint32_words("key", key, 2)               # [..., 2] uint64
    c0, c1, c2, c3 = ctr[..., 0], ctr[..., 1], ctr[..., 2], ctr[..., 3]   # [...] each
    k0, k1 = k[..., 0], k[..., 1]                                          # [...] each
    for r in range(PHILOX_ROUNDS):
        if r > 0:  # bump the key between two rounds
            k0 = (k0 + np.uint64(PHILOX_W0)) & _MASK32
            k1 = (k1 + np.uint64(PHILOX_W1)) & _MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    c0, c1, c2, c3 = np.broadcast_arrays(c0, c1, c2, c3)
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)   # [..., 4]


def dropout_element_index(layer: int, T: int, B: int, W: int) -> np.ndarray:
    """n = (((l-1)*T + t)*B + b)*W + j for every (t, b, j): uint64 [T, B, W]."""
    layer, T, B, W = check_mask_args(layer, T, B, W)
    t = np.arange(T, dtype=np.uint64)[:, None, None]      # [T, 1, 1]
    b = np.arange(B, dtype=np.uint64)[None, :, None]      # [1, B, 1]
    j = np.arange(W, dtype=np.uint64)[None, None, :]      # [1, 1, W]
    u = np.uint64
    return (((u(layer - 1) * u(T) + t) * u(B) + b) * u(W) + j)   # [T, B, W] uint64


def dropout_random_bits(seed: int, seed2: int, layer: int, T: int, B: int, W: int) -> np.ndarray:
    """x = Philox4x32-10(counter=(lo32(n//4), hi32(n//4), 0, 0), key)[n % 4]: uint32 [T, B, W]."""
    k0, k1 = dropout_key(seed, seed2)
    n = dropout_element_index(layer, T, B, W)              # [T, B, W] uint64
    q = n >> np.uint64(2)                                  # [T, B, W] uint64: counter n // 4
    zero = np.zeros_like(q)                                # [T, B, W]
    counter = np.stack([q & _MASK32, q >> _SHIFT32, zero, zero], axis=-1)   # [T, B, W, 4]
    key = np.array([k0, k1], dtype=np.uint64)                               # [2]
    x4 = philox4x32_10(counter, key)                                        # [T, B, W, 4] uint32
    lane = (n & np.uint64(3)).astype(np.intp)                               # [T, B, W]: n % 4
    return np.take_along_axis(x4, lane[..., None], axis=-1)[..., 0]         # [T, B, W] uint32


def dropout_keep_mask(seed: int, seed2: int, layer: int, T: int, B: int, W: int, p: float) -> np.ndarray:
    """Keep flags of the dropout applied to the input of layer `layer` (>= 1): bool [T, B, W].

    W is the width of that input, D*P. keep iff (x >> 8) >= dropout_threshold(p), with x from
    `dropout_random_bits`. p == 0 keeps everything, p == 1 keeps nothing.
    """
    threshold = dropout_threshold(p)
    x = dropout_random_bits(seed, seed2, layer, T, B, W)   # [T, B, W] uint32
    return (x >> np.uint32(8)).astype(np.int64) >= threshold   # [T, B, W] bool


def zoneout_update_mask(seed: int, seed2: int, pseudo_layer: int, T: int, B: int, P: int, p: float) -> np.ndarray:
    """haste's zoneout mask of pseudo-layer `pseudo_layer` = l*D + d (SPEC 6.1): bool [T, B, P], True where the
    step takes the new state h_new, False where h keeps h_prev (probability ~p).

    Dropout's Philox under dropout's key, on a stream of its own (counter word 2 = ZONEOUT_STREAM):
        n = ((pseudo_layer*T + t)*B + b)*P + j
        x = Philox4x32-10(counter=(lo32(n//4), hi32(n//4), ZONEOUT_STREAM, 0), key)[n % 4]
        update iff (x >> 8) >= dropout_threshold(p)
    """
    threshold = dropout_threshold(p)
    k0, k1 = dropout_key(seed, seed2)
    pl, T, B, P = check_zoneout_mask_args(pseudo_layer, T, B, P)
    u = np.uint64
    t = np.arange(T, dtype=u)[:, None, None]               # [T, 1, 1]
    b = np.arange(B, dtype=u)[None, :, None]               # [1, B, 1]
    j = np.arange(P, dtype=u)[None, None, :]               # [1, 1, P]
    n = ((u(pl) * u(T) + t) * u(B) + b) * u(P) + j         # [T, B, P] uint64
    q = n >> u(2)                                          # counter n // 4
    counter = np.stack([q & _MASK32, q >> _SHIFT32, np.full_like(q, ZONEOUT_STREAM), np.zeros_like(q)],
                       axis=-1)                            # [T, B, P, 4]
    x4 = philox4x32_10(counter, np.array([k0, k1], dtype=u))                       # [T, B, P, 4] uint32
    x = np.take_along_axis(x4, (n & u(3)).astype(np.intp)[..., None], axis=-1)[..., 0]   # [T, B, P] uint32
    return (x >> np.uint32(8)).astype(np.int64) >= threshold

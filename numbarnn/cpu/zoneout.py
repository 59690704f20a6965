"""haste's zoneout of the state h (SPEC 6.1) on the CPU: small njit loops around the BLAS loop's step.

The step loop of `network.blas_forward` writes h' = h_new into the state h and the output y; with zoneout a
commit after it (and after the projection) replaces h' of every active row:

    training   h'[b, j] = h_new if mask[t, b, j] else h_prev      the mask from `update_mask`, recorded in zmask
    inference  h'[b, j] = p*h_prev + (1-p)*h_new                  the expectation

Backward splits the gradient before the cell step (`split`) and adds the bypass after it (`carry`):

    dh_tot = dy[t, b] + dh[b] ;  the cell gets mask*dh_tot ;  dh_prev = ... + (1-mask)*dh_tot

The masks are `kernels/philox.zoneout_update`'s draws, by the CUDA kernels' Philox device function compiled for
the CPU (philox.stream_mask: one call per counter, its 4 words), bit-identical to
`numbarnn.reference.philox.zoneout_update_mask`.

The fused loops (`fused.py`) take zoneout the same way, lanes at a time: `zone_lanes` after the cell (or the
projection) of a row tile, `split_row` and a carry around the backward's step of a row group.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..dropout import ZONEOUT_STREAM, check_zoneout_mask_args, dropout_key, dropout_threshold
from .jitcache import njit_cached
from .philox import stream_mask
from .workspace import scratch


def update_mask(seed: int, seed2: int, pseudo_layer: int, T: int, B: int, P: int, p: float) -> np.ndarray:
    """uint8 [T, B, P] zoneout mask of pseudo-layer `pseudo_layer` (1: h takes h_new)."""
    pseudo_layer, T, B, P = check_zoneout_mask_args(pseudo_layer, T, B, P)
    k0, k1 = dropout_key(seed, seed2)
    out = np.empty((T, B, P), dtype=np.uint8)
    if out.size:
        stream_mask(out, np.uint64(pseudo_layer), np.uint32(k0), np.uint32(k1),
                    np.uint32(dropout_threshold(p)), np.uint32(ZONEOUT_STREAM))
    return out


@njit_cached
def commit(
    s,        # int     step index
    d,        # int     direction
    lens,     # [B]     int32
    training,  # bool   True: the mask; False: the expectation with p
    p,        # float   the zoneout probability
    mask,     # [T, B, P] uint8 the update mask (training; [0, 0, 0] at inference)
    zmask,    # [T, B, P] reserve: the mask at active positions (training)
    h_prev,   # [B, P]  h entering the step
    h,        # [B, P]  in: h_new of active rows; out: the zoned-out h'
    y,        # [T, B, D*P] layer output: the same h'
):
    B, P = h.shape
    q = 1.0 - p
    for b in range(B):
        if s < lens[b]:
            t = s if d == 0 else lens[b] - 1 - s
            for k in range(P):
                if training:
                    keep_new = mask[t, b, k] != 0
                    zmask[t, b, k] = 1.0 if keep_new else 0.0
                    v = h[b, k] if keep_new else h_prev[b, k]
                else:
                    v = p * h_prev[b, k] + q * h[b, k]
                h[b, k] = v
                y[t, b, d * P + k] = v


@njit(inline="always")
def split_row(
    t,        # int     time index of the row's step
    b,        # int     batch row (active at the step)
    d,        # int     direction
    zmask,    # [T, B, P] reserve: the forward's mask
    dy,       # [T, B, D*P] gradient reaching the layer output
    dh,       # [B, P]  in: dh' from the next step; out: mask*(dy + dh)
    carry,    # [B, P]  out: (1-mask)*(dy + dh)
):
    """One active row's `split` (the BLAS loop's `split` runs it for every active row, the fused backward per row)."""
    P = dh.shape[1]
    for k in range(P):
        tot = dy[t, b, d * P + k] + dh[b, k]
        if zmask[t, b, k] != 0:
            dh[b, k] = tot
            carry[b, k] = 0.0
        else:
            dh[b, k] = 0.0
            carry[b, k] = tot


@njit_cached
def split(
    s,        # int     step index
    d,        # int     direction
    lens,     # [B]     int32
    zmask,    # [T, B, P] reserve: the forward's mask
    dy,       # [T, B, D*P] gradient reaching the layer output
    dh,       # [B, P]  in: dh' from the next step; out: mask*(dy + dh), what the cell step gets (with a zero dy)
    carry,    # [B, P]  out: (1-mask)*(dy + dh), what bypasses the cell to h_prev (0 for inactive rows)
):
    B, P = dh.shape
    for b in range(B):
        if s < lens[b]:
            split_row(s if d == 0 else lens[b] - 1 - s, b, d, zmask, dy, dh, carry)
        else:
            for k in range(P):
                carry[b, k] = 0.0


@njit_cached
def add_carry(
    dh,       # [B, P]  in: dh_prev through the cell and R; out: plus the bypass
    carry,    # [B, P]
):
    B, P = dh.shape
    for b in range(B):
        for k in range(P):
            dh[b, k] += carry[b, k]


#: the mode argument of the fused loops: no zoneout, the training mask, the inference expectation
NONE, MASK, EXPECTATION = 0, 1, 2

#: [0, 0, 0] uint8: the fused forward's mask argument without a training mask (never read)
NO_MASK = np.zeros((0, 0, 0), np.uint8)


def fused_mode(call) -> int:
    """The fused loops' zoneout mode of a call (NONE, MASK or EXPECTATION)."""
    return MASK if call.zoneout_active else EXPECTATION if call.zoneout_expected else NONE


@njit(inline="always")
def zone_lanes(
    mode,     # int     MASK or EXPECTATION (NONE: nothing to do, not called)
    p,        # float   the zoneout probability
    mask,     # [T, B, P] uint8 the update mask (MASK)
    zmask,    # [T, B, P] reserve: the mask recorded at [t, b, c0:c0+n] (MASK)
    t,        # int     time index of the row's step
    b,        # int     batch row
    c0,       # int     first column of h the lanes hold
    n,        # int     lanes
    h_prev,   # [n]     h entering the step, columns c0..
    h_new,    # [n]     in: the cell's (or the projection's) h_new; out: h', what y and the next step get
):
    """`commit` for n columns of one row, in the fused forward: the same values, the same arithmetic."""
    if mode == MASK:
        for k in range(n):
            keep_new = mask[t, b, c0 + k] != 0
            zmask[t, b, c0 + k] = 1.0 if keep_new else 0.0
            if not keep_new:
                h_new[k] = h_prev[k]
    else:
        q = 1.0 - p
        for k in range(n):
            h_new[k] = p * h_prev[k] + q * h_new[k]


def carry_buffer(B: int, P: int, ct) -> np.ndarray:
    """[B, P] the backward's carry (`split`, `add_carry`): what bypasses the cell to h_prev (the calling thread's
    scratch: each direction run side by side has its own)."""
    return scratch("zoneout_carry", (B, P), ct)


def backward_buffers(T: int, B: int, D: int, P: int, ct) -> tuple:
    """The backward's scratch for zoneout (`split`, `add_carry`): (carry [B, P], `carry_buffer`; no_dy [T, B, D*P]
    zeros, the step's dy, since `split` puts dy into dh)."""
    carry = carry_buffer(B, P, ct)
    no_dy = scratch("zoneout_no_dy", (T, B, D * P), ct)
    no_dy.fill(0)
    return carry, no_dy

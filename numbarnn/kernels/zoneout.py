"""haste's zoneout of the state h (SPEC 6.1): three small per-step kernels around v1's step kernels.

One thread per (d, b, k), k < P; grid = (ceil(P / threads), B, D), like v1's project kernel.  Within a step's
launches (kernels/plan.py runs them in order, then swaps the double-buffered state):

    forward   after the step (and project):  h_out = h_new where the mask is 1, else h_in (the previous h);
              at inference p*h_in + (1-p)*h_out; y[t] = h_out; training records the mask in zmask
              (`make_zoneout_forward`, the mask drawn inline by `philox.zoneout_update`)
    backward  before the step:  tot = dy[t] + dh_in ; dh_in = mask*tot (what the cell gets; the step then reads a
              zero dy) ; carry = (1-mask)*tot                                            (`make_zoneout_split`)
              after recurrent_backward:  dh_out += carry                                  (`make_zoneout_carry`)

The v2/v3 step kernels have no such hook: with zoneout `steps.step_plan` runs v1 and says so (ZONEOUT_NOTE).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, uint32, uint64

from ..dropout import dropout_key, dropout_threshold
from .common import DTYPES, acc_dtype, arr, nb
from .philox import zoneout_update
from .steps import per_step


@functools.lru_cache(maxsize=None)
def make_zoneout_forward(dtype, training: bool):
    """h' = mask ? h_new : h_prev (training, the mask recorded) or p*h_prev + (1-p)*h_new, for active rows."""
    acc = acc_dtype(dtype).type
    one, zero = acc(1.0), acc(0.0)

    def zoneout_forward(
        s,          # int64           step index
        lens,       # [B] int32
        h_in,       # [D, B, P] acc   h entering the step (h_prev)
        h_out,      # [D, B, P] acc   in: h_new; out: the zoned-out h'
        y,          # [T, B, D*P]     layer output: h'
        zmask,      # [D, T, B, P]    reserve: the mask (training; 1 = h takes h_new)
        base,       # uint64          the layer's first pseudo-layer, l*D
        k0,         # uint32          Philox key, low word (seed2)
        k1,         # uint32          high word (seed)
        threshold,  # uint32          min(2**24, ceil(p * 2**24))
        p,          # acc             the zoneout probability (inference)
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        P = h_in.shape[2]
        T = y.shape[0]
        B = y.shape[1]
        if k >= P or s >= lens[b]:
            return
        t = s if d == 0 else lens[b] - 1 - s
        h_prev = h_in[d, b, k]
        h_new = h_out[d, b, k]
        if training:
            n = ((uint64(base) + uint64(d)) * uint64(T) + uint64(t)) * uint64(B) + uint64(b)
            n = n * uint64(P) + uint64(k)
            h = h_prev
            if zoneout_update(n, uint32(k0), uint32(k1), uint32(threshold)):
                zmask[d, t, b, k] = one
                h = h_new
            else:
                zmask[d, t, b, k] = zero
        else:
            h = acc(p) * h_prev + (acc(1.0) - acc(p)) * h_new
        h_out[d, b, k] = h
        y[t, b, d * P + k] = h

    return zoneout_forward


@functools.lru_cache(maxsize=None)
def make_zoneout_split(dtype):
    """Before the backward step: dh_in = mask*(dy + dh_in), carry = (1-mask)*(dy + dh_in), for active rows."""
    acc = acc_dtype(dtype).type

    def zoneout_split(
        s,          # int64           step index
        lens,       # [B] int32
        dy,         # [T, B, D*P]     gradient reaching the layer output
        zmask,      # [D, T, B, P]    reserve: the forward's mask
        dh_in,      # [D, B, P] acc   in: dh' from the next step; out: the part the cell gets
        carry,      # [D, B, P] acc   out: the part that bypasses the cell to h_prev
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        P = dh_in.shape[2]
        if k >= P or s >= lens[b]:
            return
        t = s if d == 0 else lens[b] - 1 - s
        total = acc(dy[t, b, d * P + k]) + dh_in[d, b, k]
        if zmask[d, t, b, k] != 0:
            dh_in[d, b, k] = total
            carry[d, b, k] = acc(0.0)
        else:
            dh_in[d, b, k] = acc(0.0)
            carry[d, b, k] = total

    return zoneout_split


@functools.lru_cache(maxsize=None)
def make_zoneout_carry(dtype):
    """After recurrent_backward: dh_out += carry, for active rows (inactive ones carried dh already)."""

    def zoneout_carry(
        s,          # int64           step index
        lens,       # [B] int32
        carry,      # [D, B, P] acc   (1-mask)*(dy + dh') of this step
        dh_out,     # [D, B, P] acc   dh leaving towards step s-1
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        if k >= dh_out.shape[2] or s >= lens[b]:
            return
        dh_out[d, b, k] += carry[d, b, k]

    return zoneout_carry


def zoneout_args(cfg, layer: int, dt) -> tuple:
    """The forward kernel's (base, k0, k1, threshold, p) of layer `layer` (SPEC 6.1)."""
    k0, k1 = dropout_key(cfg.seed, cfg.seed2)
    return (np.uint64(layer * cfg.D), np.uint32(k0), np.uint32(k1), np.uint32(dropout_threshold(cfg.zoneout)),
            acc_dtype(dt).type(cfg.zoneout))


# ---------------------------------------------------------------------------------------------------
# the plan's entries (kernels/plan.py's Builder)
# ---------------------------------------------------------------------------------------------------

def plan_forward(b) -> None:
    """After v1's step launches of layer b.layer: the zoneout commit, one launch per step."""
    call, layer, B, D, P = b.call, b.layer, b.B, b.D, b.P
    training = call.zoneout_active
    per_step(b, "zoneout_forward_step", "zoneout_forward_step", *b.unit_grid(P),
             (make_zoneout_forward, b.dts, training),
             ("s", "lens", "h_in", "h_out", f"saved.y{layer}", f"saved.zmask{layer}",
              *zoneout_args(b.cfg, layer, b.dt)),
             3 * D * B * P, D * B * P * (4 + training) * b.sz, swaps=False)


def plan_backward_before(b, dy) -> None:
    """Before v1's backward step of layer b.layer: split dh' into the cell's part and the bypass."""
    B, D, P = b.B, b.D, b.P
    per_step(b, "zoneout_split_step", "zoneout_split_step", *b.unit_grid(P), (make_zoneout_split, b.dts),
             ("s", "lens", dy, f"saved.zmask{b.layer}", "dh_in", "zoneout_carry"), D * B * P, 5 * D * B * P * b.sz,
             swaps=False)


def plan_backward_after(b) -> None:
    """After v1's recurrent_backward: add the bypass to dh_prev."""
    B, D, P = b.B, b.D, b.P
    per_step(b, "zoneout_carry_step", "zoneout_carry_step", *b.unit_grid(P), (make_zoneout_carry, b.dts),
             ("s", "lens", "zoneout_carry", "dh_out"), D * B * P, 3 * D * B * P * b.sz, swaps=False)


def kernel_specs():
    """The three zoneout kernels per dtype (the forward's training and inference twins); their names end in "_step"
    (launched once per step: analysis/profiler.is_step_kernel)."""
    specs = []
    i64, i32 = nb("int64"), arr("int32", 1)
    for dt in DTYPES:
        a = str(acc_dtype(dt))
        state = arr(a, 3)
        for training in (True, False):
            specs.append(("zoneout_forward_step" if training else "zoneout_inference_step", dt,
                          make_zoneout_forward(dt, training),
                          (i64, i32, state, state, arr(dt, 3), arr(dt, 4), nb("uint64"), nb("uint32"), nb("uint32"),
                           nb("uint32"), nb(a)), 128))
        specs.append(("zoneout_split_step", dt, make_zoneout_split(dt),
                      (i64, i32, arr(dt, 3), arr(dt, 4), state, state), 128))
        specs.append(("zoneout_carry_step", dt, make_zoneout_carry(dt), (i64, i32, state, state), 128))
    return specs

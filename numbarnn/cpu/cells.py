"""A cell's pointwise math as fused numba.njit step loops (the CPU twins of `numbarnn/kernels/cell_steps.py`).

The cell's `forward` / `backward` are plain scalar Python (numbarnn.cells.spec).  `njit_function` compiles
them with every helper they call (sigmoid, tanh, ...) rebound to an njit twin computing in the compute dtype
(`numbarnn.cells.functions.compile_with_twins`, the mechanism the CUDA kernels' `device_function` uses).
The step loops below call them once per (active row b, unit j):

    forward_step:   wx[g] = gx[t, b, g*H+j] + bW[g*H+j] ; rh[g] = gh[b, g*H+j] + bR[g*H+j]
                    m, c' = cell.forward(wx, rh, v, h[b, j], c[b, j], saved)
                    saved -> acts[t, b] ; c' -> c, cs[t, b] ; m -> h, y[t, b] (or -> m_step, ms[t, b] to project)
    backward_step:  dm = dy[t, b, dP+j] + dh[b, j] (projection: dm from BLAS, W_proj^T (dy + dh))
                    dh_direct, dc_prev = cell.backward(dm, dc[b, j], saved, v, h, c, c', dwx, drh, dv)
                    dwx -> dgx[t, b] ; drh (split gates) or dwx -> dgh_s[b] ; dv -> dv_acc[b] ; dc_prev -> dc

`t = s` (forward direction) or `len[b]-1-s` (reverse), row b active iff s < len[b].  The small per-unit
arrays (wx, rh, saved, ...) are allocated once per row and step, not per unit.

Caching: ``cache=True`` is used for the fixed loops here and in `network.py`, `block_lstm.py`, `philox.py`.
The per-cell step loops are closures over the cell's rebound functions, made at run time; numba keys a cached
closure by its code and the pickled closure values, but the rebound cell functions are new objects whose
globals numba does not hash, so two cells (or two float types) could share one cache entry.  They are
therefore compiled in each process (measured cold compile: see bench/results/cpu.md).
"""
from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import njit, prange

from ..cells import HELPERS
from ..cells.functions import compile_with_twins

#: below this many (row, unit) pairs per step the serial twin of a step loop runs (no parallel region).
#: Measured on 2 cores (LSTM B=32 H=512, 100 steps): the serial loop 47 ms, the prange loop 94 ms: numba's
#: workers and OpenBLAS's (spinning after every per-step matmul) fight for the same cores, so a parallel
#: region pays only for very wide steps.
PARALLEL_MIN_WORK = 1 << 20

# float32 tanh as Eigen's rational approximation (generic_fast_tanh_float: odd degree-13 / even degree-6
# polynomials, |x| clamped to 7.905..., where float32 tanh is 1): no libm call in the loop, max abs error
# 3.3e-7 measured over [-10, 10] (SPEC 10 float32 allows 1e-5); NaN propagates (comparisons are False).
_F32_ALPHA = tuple(np.float32(v) for v in (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05,
                                           5.12229709037114e-08, -8.60467152213735e-11, 2.00018790482477e-13,
                                           -2.76076847742355e-16))
_F32_BETA = tuple(np.float32(v) for v in (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04,
                                          1.19825839466702e-06))
_F32_CLAMP = np.float32(7.90531110763549805)


@njit(inline="always")
def tanh_f32(x):
    """tanh for float32 without libm (see above)."""
    a1, a3, a5, a7, a9, a11, a13 = _F32_ALPHA
    b0, b2, b4, b6 = _F32_BETA
    if x > _F32_CLAMP:
        x = _F32_CLAMP
    elif x < -_F32_CLAMP:
        x = -_F32_CLAMP
    x2 = x * x
    p = x2 * a13 + a11
    p = x2 * p + a9
    p = x2 * p + a7
    p = x2 * p + a5
    p = x2 * p + a3
    p = x2 * p + a1
    q = x2 * b6 + b4
    q = x2 * q + b2
    q = x2 * q + b0
    return x * p / q


@njit(inline="always")
def tanh_libm(x):
    return math.tanh(x)


def compute_dtype(dtype) -> np.dtype:
    """float64 computes in float64; float32 and float16 in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@functools.cache
def helpers(compute: str) -> dict:
    """numbarnn.cells helper -> its njit twin computing in `compute` (typed constants: numba would promote
    ``float32 * 0.5`` to float64).  tanh: `tanh_f32` in float32, libm in float64."""
    f = np.dtype(compute).type
    zero, half, one = f(0.0), f(0.5), f(1.0)
    th = tanh_f32 if np.dtype(compute) == np.float32 else tanh_libm

    @njit(inline="always")
    def sigmoid(x):
        return half * th(half * x) + half             # = 1/(1+e^-x), no exp to overflow

    @njit(inline="always")
    def tanh(x):
        return th(x)

    @njit(inline="always")
    def relu(x):
        return zero if x <= zero else x                # NaN propagates, as np.maximum  # noqa: FURB136

    @njit(inline="always")
    def dsigmoid(s):
        return s * (one - s)

    @njit(inline="always")
    def dtanh(t):
        return one - t * t

    @njit(inline="always")
    def drelu(r):
        return one if r > zero else zero

    @njit(inline="always")
    def one_minus(x):
        return one - x

    twins = {"sigmoid": sigmoid, "tanh": tanh, "relu": relu, "dsigmoid": dsigmoid, "dtanh": dtanh,
             "drelu": drelu, "one_minus": one_minus}
    return {HELPERS[name]: twin for name, twin in twins.items()}


def njit_function(fn, compute: str):
    """`fn` (a cell's plain Python pointwise function) as an inlined njit function computing in `compute`."""
    return compile_with_twins(fn, helpers(compute), njit(inline="always"))


def _jit(fn, parallel: bool):
    return njit(parallel=True)(fn) if parallel else njit(fn)


@functools.cache
def forward_step(cell, compute: str, has_proj: bool, parallel: bool):
    """The fused pointwise forward of one step, one direction (see the module docstring)."""
    acc = np.dtype(compute).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    STATE = cell.cell_state
    PROJ = has_proj
    pointwise = njit_function(cell.forward, compute)

    def step(
        s,        # int     step index
        d,        # int     direction (0 forward, 1 reverse)
        lens,     # [B]     int32 sequence lengths
        gx,       # [T, B, G*H]   W x_t (no bias), this direction
        gh,       # [B, G*H]      R h of this step (no bias), every row
        bW,       # [G*H]
        bR,       # [G*H]
        vec,      # [V, H]        cell vectors ([0, H] without)
        h,        # [B, P]        state h, updated in place for active rows (no projection)
        c,        # [B, H]        state c, updated in place (cells with a state)
        m_step,   # [B, H]        out (projection): m, the projection's input
        y,        # [T, B, D*P]   layer output (no projection)
        acts,     # [T, B, S*H]   reserve: saved values
        cs,       # [T, B, H]     reserve: c'
        ms,       # [T, B, H]     reserve: m (projection)
    ):
        B = h.shape[0]
        P = h.shape[1]
        H = gx.shape[2] // G
        for b in prange(B):
            if s >= lens[b]:                    # past the length: carry the state, no output
                continue
            t = s if d == 0 else lens[b] - 1 - s
            wx = np.empty(G, acc)               # W_g x + bW_g of unit j
            rh = np.empty(G, acc)               # R_g h + bR_g
            v = np.empty(max(V, 1), acc)        # cell vectors at unit j
            saved = np.empty(S, acc)
            for j in range(H):
                for g in range(G):
                    wx[g] = gx[t, b, g * H + j] + bW[g * H + j]
                    rh[g] = gh[b, g * H + j] + bR[g * H + j]
                for k in range(V):
                    v[k] = vec[k, j]
                h_unit = zero if PROJ else h[b, j]      # with a projection the cell never reads h
                c_prev = c[b, j] if STATE else zero
                m, c_new = pointwise(wx, rh, v, h_unit, c_prev, saved)
                for k in range(S):
                    acts[t, b, k * H + j] = saved[k]
                if STATE:
                    c[b, j] = c_new
                    cs[t, b, j] = c_new
                if PROJ:
                    m_step[b, j] = m
                    ms[t, b, j] = m
                else:
                    h[b, j] = m
                    y[t, b, d * P + j] = m

    return _jit(step, parallel)


@functools.cache
def backward_step(cell, compute: str, has_proj: bool, parallel: bool):
    """The fused pointwise backward of one step, one direction (see the module docstring)."""
    acc = np.dtype(compute).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    STATE = cell.cell_state
    PROJ = has_proj
    SPLIT = cell.split_mask                     # per gate: the R side has its own gradient
    pointwise = njit_function(cell.backward, compute)

    def step(
        s,        # int     step index (runs T-1 .. 0)
        d,        # int     direction
        lens,     # [B]     int32
        dy,       # [T, B, D*P]   gradient reaching the layer output
        y,        # [T, B, D*P]   layer output (reserve): h entering each step
        h0,       # [B, P]        initial h of this pseudo-layer
        c0,       # [B, H]        initial c
        acts,     # [T, B, S*H]   reserve: saved values
        cs,       # [T, B, H]     reserve: c'
        vec,      # [V, H]        cell vectors
        dm_proj,  # [B, P->H]     projection: W_proj^T (dy + dh) of this step, from BLAS
        dh,       # [B, P]        in: dh' from the next step; out: the part that bypasses R
        dc,       # [B, H]        in: dc'; out: dc_prev
        dgx,      # [T, B, G*H]   out: W-side pre-activation gradients (t layout)
        dgh_s,    # [B, G*H]      out: R-side pre-activation gradients of this step (0 for inactive rows)
        hp_s,     # [B, P]        out: h entering this step (for dR; 0 for inactive rows)
        dv_acc,   # [B, V, H]     cell-vector gradients, accumulated per row
    ):
        B = dh.shape[0]
        P = dh.shape[1]
        H = dgx.shape[2] // G
        for b in prange(B):
            if s >= lens[b]:                    # inactive: no gradient through R, dh and dc carry
                for q in range(G * H):
                    dgh_s[b, q] = zero
                for k in range(P):
                    hp_s[b, k] = zero
                continue
            t = s if d == 0 else lens[b] - 1 - s
            tp = t - 1 if d == 0 else t + 1     # the time index of the previous step
            first = s == 0
            for k in range(P):
                hp_s[b, k] = h0[b, k] if first else y[tp, b, d * P + k]
            saved = np.empty(S, acc)
            v = np.empty(max(V, 1), acc)
            dwx = np.empty(G, acc)
            drh = np.empty(G, acc)
            dv = np.empty(max(V, 1), acc)
            for j in range(H):
                if PROJ:
                    dm = dm_proj[b, j]
                    hp = zero
                else:
                    dm = dy[t, b, d * P + j] + dh[b, j]
                    hp = hp_s[b, j]
                for k in range(S):
                    saved[k] = acts[t, b, k * H + j]
                for k in range(V):
                    v[k] = vec[k, j]
                    dv[k] = zero
                for g in range(G):
                    dwx[g] = zero
                    drh[g] = zero
                c_prev = zero
                c_new = zero
                dcell = zero
                if STATE:
                    c_prev = c0[b, j] if first else cs[tp, b, j]
                    c_new = cs[t, b, j]
                    dcell = dc[b, j]
                dh_direct, dc_prev = pointwise(dm, dcell, saved, v, hp, c_prev, c_new, dwx, drh, dv)
                for g in range(G):
                    dgx[t, b, g * H + j] = dwx[g]
                    dgh_s[b, g * H + j] = drh[g] if SPLIT[g] else dwx[g]
                for k in range(V):
                    dv_acc[b, k, j] += dv[k]
                if STATE:
                    dc[b, j] = dc_prev
                if not PROJ:
                    dh[b, j] = dh_direct
            if PROJ:                            # no path bypasses R with a projection
                for k in range(P):
                    dh[b, k] = zero

    return _jit(step, parallel)


def pick(factory, cell, compute, has_proj, B, H):
    """The serial or parallel twin of a step loop for B rows of H units (see PARALLEL_MIN_WORK)."""
    parallel = B * H >= PARALLEL_MIN_WORK and numba.get_num_threads() > 1 and B > 1
    return factory(cell, str(compute), has_proj, parallel)

"""The recurrent half of every cell's backward step: dh_prev = direct + dgh @ R.

One thread per (d, b, k), k < P; grid = (ceil(P / threads), B, D).  The cell's backward step has written the
part of dh_prev that bypasses R (GRU's z*dm; 0 for most cells) into dh_out; active rows then get
    dh_out[d, b, k] += sum_{gj} dgh[d, t, b, gj] * R[gj, k]
and inactive rows carry dh (double-buffered dh_in -> dh_out, like h in the forward pass).

A cell with a diagonal recurrence (R holds the vectors u_g [H], P == H) has no product to make:
    dh_out[d, b, k] += sum_g dgh[d, t, b, g*H+k] * u[g*H+k]                 (`make_recurrent_backward`, diagonal)
and after the time loop its weight gradient is a sum over rows instead of the GEMM dgh^T h_prev:
    du[g*H+j] = sum_n dgh[n, g*H+j] * h_prev[n, j]       n = (t, b)         (`make_diagonal_gradient`)
"""
from __future__ import annotations

import functools

from numba import cuda

from .common import DTYPES, acc_dtype, arr, nb


@functools.lru_cache(maxsize=None)
def make_recurrent_backward(dtype, diagonal: bool = False):
    """The kernel for R matrices [G*H, P], or (diagonal) R vectors [G*H]."""
    if diagonal:
        return make_diagonal_recurrent_backward(dtype)
    acc = acc_dtype(dtype).type

    def recurrent_backward(
        s,        # int64           step index
        lens,     # [B] int32
        dgh,      # [D, T, B, G*H]  R-side pre-activation gradients of this step
        R_fwd,    # [G*H, P]
        R_rev,    # [G*H, P]
        dh_in,    # [D, B, P] acc   dh arriving at this step
        dh_out,   # [D, B, P] acc   in: the cell's direct term; out: dh leaving towards step s-1
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        P = dh_in.shape[2]
        GH = dgh.shape[3]
        if k >= P:
            return
        if s >= lens[b]:
            dh_out[d, b, k] = dh_in[d, b, k]
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        total = dh_out[d, b, k]
        for gj in range(GH):
            total += acc(dgh[d, t, b, gj]) * acc(R[gj, k])
        dh_out[d, b, k] = total

    return recurrent_backward


@functools.lru_cache(maxsize=None)
def make_diagonal_recurrent_backward(dtype):
    acc = acc_dtype(dtype).type

    def recurrent_backward_diagonal(
        s,        # int64           step index
        lens,     # [B] int32
        dgh,      # [D, T, B, G*H]  R-side pre-activation gradients of this step
        u_fwd,    # [G*H]           the gates' recurrent vectors u_g, forward direction
        u_rev,    # [G*H]           ... reverse direction
        dh_in,    # [D, B, H] acc   dh arriving at this step
        dh_out,   # [D, B, H] acc   in: the cell's direct term; out: dh leaving towards step s-1
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = dh_in.shape[2]
        G = dgh.shape[3] // H
        if k >= H:
            return
        if s >= lens[b]:
            dh_out[d, b, k] = dh_in[d, b, k]
            return
        t = s if d == 0 else lens[b] - 1 - s
        u = u_fwd if d == 0 else u_rev
        total = dh_out[d, b, k]
        for g in range(G):                      # unit k reaches only its own rh_g: dh[k] += dgh_g[k] * u_g[k]
            total += acc(dgh[d, t, b, g * H + k]) * acc(u[g * H + k])
        dh_out[d, b, k] = total

    return recurrent_backward_diagonal


@functools.lru_cache(maxsize=None)
def make_diagonal_gradient(dtype):
    """du = sum over rows of dgh_g ⊙ h_prev: one thread per element g*H+j, rows in order (deterministic)."""
    acc = acc_dtype(dtype).type

    def diagonal_gradient(
        dgh,      # [N, G*H]  R-side pre-activation gradients of every (t, b) of one direction
        h_prev,   # [N, H]    h entering each step
        du,       # [G*H]     out: the gradient of the vectors u_g
    ):
        gj = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        GH = du.shape[0]
        H = h_prev.shape[1]
        if gj >= GH:
            return
        j = gj % H
        total = acc(0.0)
        for n in range(dgh.shape[0]):
            total += acc(dgh[n, gj]) * acc(h_prev[n, j])
        du[gj] = total

    return diagonal_gradient


def kernel_specs():
    specs = []
    for dt in DTYPES:
        a = str(acc_dtype(dt))
        specs.append(("recurrent_backward", dt, make_recurrent_backward(dt),
                      (nb("int64"), arr("int32", 1), arr(dt, 4), arr(dt, 2), arr(dt, 2), arr(a, 3), arr(a, 3)),
                      128))
        specs.append(("recurrent_backward_diagonal", dt, make_diagonal_recurrent_backward(dt),
                      (nb("int64"), arr("int32", 1), arr(dt, 4), arr(dt, 1), arr(dt, 1), arr(a, 3), arr(a, 3)),
                      128))
        specs.append(("diagonal_gradient", dt, make_diagonal_gradient(dt), (arr(dt, 2), arr(dt, 2), arr(dt, 1)),
                      128))
    return specs

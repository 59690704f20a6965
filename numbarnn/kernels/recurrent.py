"""The recurrent half of every cell's backward step: dh_prev = dgh @ R (+ GRU's direct term).

One thread per (d, b, k), k < P; grid = (ceil(P / threads), B, D).  Active rows get
    dh_prev[d, b, k] = direct[d, b, k] + sum_{gj} dgh[d, t, b, gj] * R[gj, k]
and inactive rows carry dh (double-buffered dh_in -> dh_out, like h in the forward pass).
"""
from __future__ import annotations

import functools

from numba import cuda

from .common import DTYPES, acc_dtype, arr, nb


@functools.lru_cache(maxsize=None)
def make_recurrent_backward(dtype, has_direct: bool):
    acc = acc_dtype(dtype).type

    def recurrent_backward(
        s,        # int64           step index
        lens,     # [B] int32
        dgh,      # [D, T, B, G*H]  R-side pre-activation gradients of this step
        R_fwd,    # [G*H, P]
        R_rev,    # [G*H, P]
        dh_in,    # [D, B, P] acc   dh arriving at this step
        dh_out,   # [D, B, P] acc   dh leaving it towards step s-1
        direct,   # [D, B, P] acc   GRU: dm*z (ignored for other cells)
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
        total = direct[d, b, k] if has_direct else acc(0.0)
        for gj in range(GH):
            total += acc(dgh[d, t, b, gj]) * acc(R[gj, k])
        dh_out[d, b, k] = total

    return recurrent_backward


def kernel_specs():
    specs = []
    for dt in DTYPES:
        a = str(acc_dtype(dt))
        for has_direct in (False, True):
            specs.append(("recurrent_backward" + ("_direct" if has_direct else ""), dt,
                          make_recurrent_backward(dt, has_direct),
                          (nb("int64"), arr("int32", 1), arr(dt, 4), arr(dt, 2), arr(dt, 2), arr(a, 3), arr(a, 3),
                           arr(a, 3)), 128))
    return specs

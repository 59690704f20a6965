"""The recurrent half of every cell's backward step: dh_prev = direct + dgh @ R.

One thread per (d, b, k), k < P; grid = (ceil(P / threads), B, D).  The cell's backward step has written the
part of dh_prev that bypasses R (GRU's z*dm; 0 for most cells) into dh_out; active rows then get
    dh_out[d, b, k] += sum_{gj} dgh[d, t, b, gj] * R[gj, k]
and inactive rows carry dh (double-buffered dh_in -> dh_out, like h in the forward pass).
"""
from __future__ import annotations

import functools

from numba import cuda

from .common import DTYPES, acc_dtype, arr, nb


@functools.lru_cache(maxsize=None)
def make_recurrent_backward(dtype):
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


def kernel_specs():
    specs = []
    for dt in DTYPES:
        a = str(acc_dtype(dt))
        specs.append(("recurrent_backward", dt, make_recurrent_backward(dt),
                      (nb("int64"), arr("int32", 1), arr(dt, 4), arr(dt, 2), arr(dt, 2), arr(a, 3), arr(a, 3)),
                      128))
    return specs

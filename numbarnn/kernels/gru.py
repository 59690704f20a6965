"""GRU step kernels (SPEC 2), the twins of `numbarnn/reference/gru.py`.

Thread layout and step indexing as in `lstm.py` (one thread per (d, b, j); both directions per launch).

Forward step (1 launch per step):
    r = σ(gx_r + bW_r + R_r h + bR_r) ; z = σ(gx_z + bW_z + R_z h + bR_z)
    hn = R_n h + bR_n ; n = tanh(gx_n + bW_n + r*hn)     (reset AFTER the recurrent matmul, bR_n inside)
    h' = (1-z)*n + z*h
Backward step (pointwise half; `recurrent.py` adds dgh @ R to the direct term):
    dm = dy + dh_next ; dn_pre = dm*(1-z)*(1-n²) ; dz_pre = dm*(h-n)*z(1-z) ; dr_pre = dn_pre*hn*r(1-r)
    W side [dr_pre, dz_pre, dn_pre] ; R side [dr_pre, dz_pre, dn_pre*r] ; direct = dm*z
"""
from __future__ import annotations

import functools

from numba import cuda, int64

from .common import DTYPES, acc_dtype, activations, step_signatures

G = 3
R_, Z_, N_ = 0, 1, 2     # gate offsets in units of H (cuDNN order r, z, n)


@functools.lru_cache(maxsize=None)
def make_forward_step(dtype, has_proj: bool = False):
    acc = acc_dtype(dtype).type
    one = acc(1.0)
    sigmoid, tanh, _ = activations(dtype)

    def gru_forward_step(
        s,        # int64            step index
        lens,     # [B] int32        sequence lengths
        gx,       # [D, T, B, 3H]    W x_t for every step (no bias)
        bias,     # [D, 2, 3H]       bW, bR
        R_fwd,    # [3H, H]          recurrent matrices, forward direction
        R_rev,    # [3H, H]          ... reverse direction
        h_in,     # [D, B, H] acc    h entering the step
        h_out,    # [D, B, H] acc    h leaving it
        c,        # unused (LSTM only)
        y,        # [T, B, D*H]      layer output
        acts,     # [D, T, B, 4H]    reserve: r, z, n, hn
        cs,       # unused
        ms,       # unused
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = h_in.shape[2]
        if j >= H:
            return
        if s >= lens[b]:
            h_out[d, b, j] = h_in[d, b, j]
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        a_r = acc(gx[d, t, b, R_ * H + j]) + acc(bias[d, 0, R_ * H + j]) + acc(bias[d, 1, R_ * H + j])
        a_z = acc(gx[d, t, b, Z_ * H + j]) + acc(bias[d, 0, Z_ * H + j]) + acc(bias[d, 1, Z_ * H + j])
        hn = acc(bias[d, 1, N_ * H + j])
        for k in range(H):                    # the recurrent matvec, fused
            hk = h_in[d, b, k]
            a_r += acc(R[R_ * H + j, k]) * hk
            a_z += acc(R[Z_ * H + j, k]) * hk
            hn += acc(R[N_ * H + j, k]) * hk
        r = sigmoid(a_r)
        z = sigmoid(a_z)
        n = tanh(acc(gx[d, t, b, N_ * H + j]) + acc(bias[d, 0, N_ * H + j]) + r * hn)
        h = (one - z) * n + z * h_in[d, b, j]
        acts[d, t, b, 0 * H + j] = r
        acts[d, t, b, 1 * H + j] = z
        acts[d, t, b, 2 * H + j] = n
        acts[d, t, b, 3 * H + j] = hn
        h_out[d, b, j] = h
        y[t, b, d * H + j] = h

    return gru_forward_step


@functools.lru_cache(maxsize=None)
def make_backward_step(dtype, has_proj: bool = False):
    acc = acc_dtype(dtype).type
    one = acc(1.0)

    def gru_backward_step(
        s,          # int64            step index (runs T-1 .. 0)
        lens,       # [B] int32
        dy,         # [T, B, D*H]      gradient reaching the layer output
        y,          # [T, B, D*H]      layer output (reserve): h entering each step
        h0,         # [D, B, H]        initial h of this layer
        c0,         # unused
        acts,       # [D, T, B, 4H]    reserve: r, z, n, hn
        cs,         # unused
        Wp_fwd,     # unused
        Wp_rev,     # unused
        dh,         # [D, B, H] acc    dh' arriving from the next step
        dc,         # unused
        dgx,        # [D, T, B, 3H]    out: W-side pre-activation gradients
        dgh,        # [D, T, B, 3H]    out: R-side pre-activation gradients
        h_prev,     # [D, T, B, H]     out: h entering each step (for dR)
        dh_total,   # unused
        direct,     # [D, B, H] acc    out: dm*z, the part of dh_prev that bypasses R
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = h0.shape[2]
        if j >= H or s >= lens[b]:
            return
        step = int64(1) if d == 0 else int64(-1)
        t = s if d == 0 else lens[b] - 1 - s
        hp = acc(h0[d, b, j]) if s == 0 else acc(y[t - step, b, d * H + j])
        h_prev[d, t, b, j] = hp
        dm = acc(dy[t, b, d * H + j]) + dh[d, b, j]
        r = acc(acts[d, t, b, 0 * H + j])
        z = acc(acts[d, t, b, 1 * H + j])
        n = acc(acts[d, t, b, 2 * H + j])
        hn = acc(acts[d, t, b, 3 * H + j])
        dn_pre = dm * (one - z) * (one - n * n)
        dz_pre = dm * (hp - n) * z * (one - z)
        dr_pre = dn_pre * hn * r * (one - r)
        dgx[d, t, b, R_ * H + j] = dr_pre
        dgx[d, t, b, Z_ * H + j] = dz_pre
        dgx[d, t, b, N_ * H + j] = dn_pre
        dgh[d, t, b, R_ * H + j] = dr_pre
        dgh[d, t, b, Z_ * H + j] = dz_pre
        dgh[d, t, b, N_ * H + j] = dn_pre * r
        direct[d, b, j] = dm * z

    return gru_backward_step


def kernel_specs():
    specs = []
    for dt in DTYPES:
        forward, backward = step_signatures(dt)
        specs.append(("gru_forward_step", dt, make_forward_step(dt), forward, 128))
        specs.append(("gru_backward_step", dt, make_backward_step(dt), backward, 128))
    return specs

"""LSTM step kernels (SPEC 2), the twins of `numbarnn/reference/lstm.py`.

One thread per (direction d, batch row b, unit j); grid = (ceil(H / threads), B, D), so one launch serves
both directions of a layer.  At step s, row b is active iff s < len[b]; its time index is t = s (forward)
or len[b]-1-s (reverse: reversal within the sequence's length, no reversed copy of the data).

Forward step (1 launch per step; +1 `lstm_project` launch with a projection):
    a_g = gx[d, t, b, g*H+j] + bW[g*H+j] + bR[g*H+j] + sum_k R[g*H+j, k] * h[d, b, k]    (fused recurrent matvec)
    i = σ(a_i) ; f = σ(a_f) ; g = tanh(a_g) ; o = σ(a_o)
    c' = f*c + i*g ; m = o*tanh(c')            h' = m, or W_proj m (lstm_project)
Inactive rows keep their state (h is double-buffered: h_in -> h_out, so the carry is a copy) and write no output.

Backward step (the pointwise half; `recurrent.py` does dh_prev = dgh @ R):
    dh = dy[t, b] + dh_next ; dm = dh (or W_proj^T dh) ; tc = tanh(c')
    do = dm*tc ; dc' = dc + dm*o*(1-tc²) ; di = dc'*g ; dg = dc'*i ; df = dc'*c ; dc_prev = dc'*f
    dgates = [di*i(1-i), df*f(1-f), dg*(1-g²), do*o(1-o)]       (the same for the W and R sides)
"""
from __future__ import annotations

import functools

from numba import cuda, int64

from .common import DTYPES, acc_dtype, activations, arr, nb, step_signatures

G = 4
I_, F_, G_, O_ = 0, 1, 2, 3     # gate offsets in units of H (cuDNN order i, f, g, o)


@functools.lru_cache(maxsize=None)
def make_forward_step(dtype, has_proj: bool):
    """Fused recurrent matvec + LSTM cell for one step of both directions."""
    acc = acc_dtype(dtype).type
    sigmoid, tanh, _ = activations(dtype)

    def lstm_forward_step(
        s,        # int64            step index
        lens,     # [B] int32        sequence lengths
        gx,       # [D, T, B, 4H]    W x_t for every step (no bias)
        bias,     # [D, 2, 4H]       bW, bR
        R_fwd,    # [4H, P]          recurrent matrices, forward direction
        R_rev,    # [4H, P]          ... reverse direction (= R_fwd when D == 1)
        h_in,     # [D, B, P] acc    h entering the step
        h_out,    # [D, B, P] acc    h leaving it (unused with a projection: lstm_project writes it)
        c,        # [D, B, H] acc    cell state, updated in place
        y,        # [T, B, D*P]      layer output
        acts,     # [D, T, B, 4H]    reserve: i, f, g, o
        cs,       # [D, T, B, H]     reserve: c'
        ms,       # [D, T, B, H]     reserve: m = o*tanh(c') (projection only)
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = c.shape[2]
        P = h_in.shape[2]
        if j >= H:
            return
        if s >= lens[b]:                       # past the length: carry the state, no output
            if not has_proj:
                h_out[d, b, j] = h_in[d, b, j]
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        a_i = acc(gx[d, t, b, I_ * H + j]) + acc(bias[d, 0, I_ * H + j]) + acc(bias[d, 1, I_ * H + j])
        a_f = acc(gx[d, t, b, F_ * H + j]) + acc(bias[d, 0, F_ * H + j]) + acc(bias[d, 1, F_ * H + j])
        a_g = acc(gx[d, t, b, G_ * H + j]) + acc(bias[d, 0, G_ * H + j]) + acc(bias[d, 1, G_ * H + j])
        a_o = acc(gx[d, t, b, O_ * H + j]) + acc(bias[d, 0, O_ * H + j]) + acc(bias[d, 1, O_ * H + j])
        for k in range(P):                     # the recurrent matvec, fused: R h for this unit's 4 rows
            hk = h_in[d, b, k]
            a_i += acc(R[I_ * H + j, k]) * hk
            a_f += acc(R[F_ * H + j, k]) * hk
            a_g += acc(R[G_ * H + j, k]) * hk
            a_o += acc(R[O_ * H + j, k]) * hk
        i = sigmoid(a_i)
        f = sigmoid(a_f)
        g = tanh(a_g)
        o = sigmoid(a_o)
        c_new = f * c[d, b, j] + i * g
        m = o * tanh(c_new)
        c[d, b, j] = c_new
        acts[d, t, b, I_ * H + j] = i
        acts[d, t, b, F_ * H + j] = f
        acts[d, t, b, G_ * H + j] = g
        acts[d, t, b, O_ * H + j] = o
        cs[d, t, b, j] = c_new
        if has_proj:
            ms[d, t, b, j] = m
        else:
            h_out[d, b, j] = m
            y[t, b, d * P + j] = m

    return lstm_forward_step


@functools.lru_cache(maxsize=None)
def make_project(dtype):
    """h' = W_proj m for active rows (one thread per (d, b, k), k < P); carry h for the others."""
    acc = acc_dtype(dtype).type

    def lstm_project(
        s,         # int64          step index
        lens,      # [B] int32
        ms,        # [D, T, B, H]   m = o*tanh(c') of this step (reserve)
        Wp_fwd,    # [P, H]         projection, forward direction
        Wp_rev,    # [P, H]         ... reverse direction
        h_in,      # [D, B, P] acc
        h_out,     # [D, B, P] acc
        y,         # [T, B, D*P]
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        P = h_in.shape[2]
        H = ms.shape[3]
        if k >= P:
            return
        if s >= lens[b]:
            h_out[d, b, k] = h_in[d, b, k]
            return
        t = s if d == 0 else lens[b] - 1 - s
        Wp = Wp_fwd if d == 0 else Wp_rev
        h = acc(0.0)
        for j in range(H):
            h += acc(Wp[k, j]) * acc(ms[d, t, b, j])
        h_out[d, b, k] = h
        y[t, b, d * P + k] = h

    return lstm_project


@functools.lru_cache(maxsize=None)
def make_backward_step(dtype, has_proj: bool):
    """Pointwise LSTM backward for one step of both directions (one thread per (d, b, j))."""
    acc = acc_dtype(dtype).type
    one = acc(1.0)
    _, tanh, _ = activations(dtype)

    def lstm_backward_step(
        s,          # int64            step index (runs T-1 .. 0)
        lens,       # [B] int32
        dy,         # [T, B, D*P]      gradient reaching the layer output
        y,          # [T, B, D*P]      layer output (reserve): h entering each step
        h0,         # [D, B, P]        initial h of this layer
        c0,         # [D, B, H]        initial c of this layer
        acts,       # [D, T, B, 4H]    reserve: i, f, g, o
        cs,         # [D, T, B, H]     reserve: c'
        Wp_fwd,     # [P, H]           projection (ignored without)
        Wp_rev,     # [P, H]
        dh,         # [D, B, P] acc    dh' arriving from the next step
        dc,         # [D, B, H] acc    dc' arriving from the next step, replaced by dc_prev
        dgx,        # [D, T, B, 4H]    out: pre-activation gradients (W side)
        dgh,        # [D, T, B, 4H]    R side: the same as the W side for an LSTM, so the driver passes dgx
        h_prev,     # [D, T, B, P]     out: h entering each step (for dR)
        dh_total,   # [D, T, B, P]     out: dy + dh_next (for dW_proj; projection only)
        direct,     # [D, B, P] acc    unused (GRU's z*dh term)
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = c0.shape[2]
        P = h0.shape[2]
        if j >= H or s >= lens[b]:
            return
        step = int64(1) if d == 0 else int64(-1)
        t = s if d == 0 else lens[b] - 1 - s
        first = s == 0
        if j < P:                             # this thread also records h entering the step, unit j
            h_prev[d, t, b, j] = h0[d, b, j] if first else y[t - step, b, d * P + j]
            if has_proj:
                dh_total[d, t, b, j] = acc(dy[t, b, d * P + j]) + dh[d, b, j]
        if has_proj:                          # dm = W_proj^T (dy + dh_next), fused
            Wp = Wp_fwd if d == 0 else Wp_rev
            dm = acc(0.0)
            for k in range(P):
                dm += acc(Wp[k, j]) * (acc(dy[t, b, d * P + k]) + dh[d, b, k])
        else:
            dm = acc(dy[t, b, d * P + j]) + dh[d, b, j]
        i = acc(acts[d, t, b, I_ * H + j])
        f = acc(acts[d, t, b, F_ * H + j])
        g = acc(acts[d, t, b, G_ * H + j])
        o = acc(acts[d, t, b, O_ * H + j])
        c_prev = acc(c0[d, b, j]) if first else acc(cs[d, t - step, b, j])
        tc = tanh(acc(cs[d, t, b, j]))
        do = dm * tc
        dcell = dc[d, b, j] + dm * o * (one - tc * tc)
        dgx[d, t, b, I_ * H + j] = dcell * g * i * (one - i)
        dgx[d, t, b, F_ * H + j] = dcell * c_prev * f * (one - f)
        dgx[d, t, b, G_ * H + j] = dcell * i * (one - g * g)
        dgx[d, t, b, O_ * H + j] = do * o * (one - o)
        dc[d, b, j] = dcell * f

    return lstm_backward_step


def kernel_specs():
    specs = []
    for dt in DTYPES:
        forward, backward = step_signatures(dt)
        for proj in (False, True):
            tag = "_proj" if proj else ""
            specs.append((f"lstm_forward_step{tag}", dt, make_forward_step(dt, proj), forward, 128))
            specs.append((f"lstm_backward_step{tag}", dt, make_backward_step(dt, proj), backward, 128))
        a = str(acc_dtype(dt))
        specs.append(("lstm_project", dt, make_project(dt),
                      (nb("int64"), arr("int32", 1), arr(dt, 4), arr(dt, 2), arr(dt, 2), arr(a, 3), arr(a, 3),
                       arr(dt, 3)), 128))
    return specs

"""Plain RNN step kernels, rnn_tanh and rnn_relu (SPEC 2), twins of `numbarnn/reference/rnn.py`.

Thread layout and step indexing as in `lstm.py`.  Specialised per nonlinearity by the factory.
    forward:  h' = act(gx + bW + R h + bR)
    backward: d_pre = dm * act'(h')  with act' = 1-h'² (tanh) or [h' > 0] (relu); W side = R side
"""
from __future__ import annotations

import functools

from numba import cuda, int64

from .common import DTYPES, acc_dtype, activations, step_signatures

G = 1
NONLINEARITIES = ("tanh", "relu")


@functools.lru_cache(maxsize=None)
def make_forward_step(dtype, nonlinearity: str, has_proj: bool = False):
    acc = acc_dtype(dtype).type
    _, tanh, relu = activations(dtype)
    act = tanh if nonlinearity == "tanh" else relu

    def rnn_forward_step(
        s,        # int64            step index
        lens,     # [B] int32        sequence lengths
        gx,       # [D, T, B, H]     W x_t for every step (no bias)
        bias,     # [D, 2, H]        bW, bR
        R_fwd,    # [H, H]           recurrent matrix, forward direction
        R_rev,    # [H, H]           ... reverse direction
        h_in,     # [D, B, H] acc    h entering the step
        h_out,    # [D, B, H] acc    h leaving it
        c,        # unused (LSTM only)
        y,        # [T, B, D*H]      layer output
        acts,     # [D, T, B, H]     reserve: h'
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
        a = acc(gx[d, t, b, j]) + acc(bias[d, 0, j]) + acc(bias[d, 1, j])
        for k in range(H):                    # the recurrent matvec, fused
            a += acc(R[j, k]) * h_in[d, b, k]
        h = act(a)
        acts[d, t, b, j] = h
        h_out[d, b, j] = h
        y[t, b, d * H + j] = h

    return rnn_forward_step


@functools.lru_cache(maxsize=None)
def make_backward_step(dtype, nonlinearity: str, has_proj: bool = False):
    acc = acc_dtype(dtype).type
    one, zero = acc(1.0), acc(0.0)
    is_tanh = nonlinearity == "tanh"

    def rnn_backward_step(
        s,          # int64            step index (runs T-1 .. 0)
        lens,       # [B] int32
        dy,         # [T, B, D*H]      gradient reaching the layer output
        y,          # [T, B, D*H]      layer output (reserve): h entering each step
        h0,         # [D, B, H]        initial h of this layer
        c0,         # unused
        acts,       # [D, T, B, H]     reserve: h'
        cs,         # unused
        Wp_fwd,     # unused
        Wp_rev,     # unused
        dh,         # [D, B, H] acc    dh' arriving from the next step
        dc,         # unused
        dgx,        # [D, T, B, H]     out: pre-activation gradients (W side)
        dgh,        # [D, T, B, H]     R side: the same as the W side, so the driver passes dgx
        h_prev,     # [D, T, B, H]     out: h entering each step (for dR)
        dh_total,   # unused
        direct,     # unused
    ):
        j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        H = h0.shape[2]
        if j >= H or s >= lens[b]:
            return
        step = int64(1) if d == 0 else int64(-1)
        t = s if d == 0 else lens[b] - 1 - s
        h_prev[d, t, b, j] = h0[d, b, j] if s == 0 else y[t - step, b, d * H + j]
        dm = acc(dy[t, b, d * H + j]) + dh[d, b, j]
        h = acc(acts[d, t, b, j])
        if is_tanh:
            dgx[d, t, b, j] = dm * (one - h * h)
        else:
            dgx[d, t, b, j] = dm if h > zero else zero

    return rnn_backward_step


def kernel_specs():
    specs = []
    for dt in DTYPES:
        forward, backward = step_signatures(dt)
        for nl in NONLINEARITIES:
            specs.append((f"rnn_{nl}_forward_step", dt, make_forward_step(dt, nl), forward, 128))
            specs.append((f"rnn_{nl}_backward_step", dt, make_backward_step(dt, nl), backward, 128))
    return specs

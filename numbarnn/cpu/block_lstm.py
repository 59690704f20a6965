"""TensorFlow's BlockLSTM / BlockLSTMV2 and their gradients on the CPU (SPEC 9).

The reference's structure (`numbarnn/reference/block_lstm.py`): one BLAS matmul for the input part of every
step (x @ w[:I] + b), one BLAS matmul per step for the recurrent part (h_p @ w[I:], written into a
preallocated buffer), and the fused pointwise cell in numba.njit (`cell_forward` / `cell_backward`, cached:
they are fixed functions, the layout arrives as gate offsets).  Backward: per step the njit pointwise writes
dgates[t] and dcs_next, then dh_next = dgates[t] @ w[I:]^T (BLAS); after the loop x_grad, w_grad and b_grad
as single big matmuls.  Compute dtype: float64 for float64, float32 for float32 and float16.
"""
from __future__ import annotations

import math

import numpy as np

from .cells import compute_dtype
from .jitcache import njit_cached
from .network import sum_of_outer


@njit_cached(inline="always")
def _sigmoid(x):
    return 0.5 * math.tanh(0.5 * x) + 0.5


@njit_cached
def cell_forward(
    gates,       # [B, 4C]  x_t @ w_x + b + h_p @ w_h of this step
    cs_p,        # [B, C]   previous cell state
    wci,         # [C]      peepholes
    wcf,         # [C]
    wco,         # [C]
    oi, oci, of, oo,   # int: first column of the gates i, ci, f, o
    forget_bias,  # float
    cell_clip,   # float (> 0: clip cs)
    peephole,    # bool
    i, cs, f, o, ci, co, h,   # [B, C] out: this step's rows of the seven outputs
):
    B, C = cs_p.shape
    ct = gates.dtype.type
    fb = ct(forget_bias)
    clip = ct(cell_clip)
    for b in range(B):
        for j in range(C):
            pre_i = gates[b, oi + j]
            pre_f = gates[b, of + j] + fb
            if peephole:
                pre_i += cs_p[b, j] * wci[j]
                pre_f += cs_p[b, j] * wcf[j]
            i_ = ct(_sigmoid(pre_i))
            ci_ = ct(math.tanh(gates[b, oci + j]))
            f_ = ct(_sigmoid(pre_f))
            cs_ = ci_ * i_ + f_ * cs_p[b, j]
            if clip > 0:
                cs_ = min(max(cs_, -clip), clip)
            co_ = ct(math.tanh(cs_))
            pre_o = gates[b, oo + j]
            if peephole:
                pre_o += cs_ * wco[j]           # the NEW cs
            o_ = ct(_sigmoid(pre_o))
            i[b, j] = i_
            ci[b, j] = ci_
            f[b, j] = f_
            cs[b, j] = cs_
            co[b, j] = co_
            o[b, j] = o_
            h[b, j] = o_ * co_


@njit_cached
def cell_backward(
    i, cs, f, o, ci, co,   # [B, C] this step's saved outputs
    cs_p,        # [B, C]  previous cell state
    cs_grad,     # [B, C]  upstream gradient of cs[t]
    h_grad,      # [B, C]  upstream gradient of h[t]
    dh_next,     # [B, C]  in: from step t+1 (the h part of xh_grad)
    dcs_next,    # [B, C]  in/out: dcs from step t+1, replaced by this step's dcs_prev
    wci, wcf, wco,   # [C]
    oi, oci, of, oo,  # int gate offsets
    peephole,    # bool
    dgates,      # [B, 4C] out
    wci_grad, wcf_grad, wco_grad,   # [C] accumulated
):
    B, C = cs_p.shape
    one = cs.dtype.type(1.0)
    for b in range(B):
        for j in range(C):
            dh = h_grad[b, j] + dh_next[b, j]
            do = o[b, j] * (one - o[b, j]) * dh * co[b, j]
            dcs = (one - co[b, j] * co[b, j]) * dh * o[b, j] + cs_grad[b, j] + dcs_next[b, j]
            if peephole:
                dcs += do * wco[j]
            dci = (one - ci[b, j] * ci[b, j]) * dcs * i[b, j]
            df = f[b, j] * (one - f[b, j]) * dcs * cs_p[b, j]
            di = i[b, j] * (one - i[b, j]) * dcs * ci[b, j]
            dgates[b, oi + j] = di
            dgates[b, of + j] = df
            dgates[b, oci + j] = dci
            dgates[b, oo + j] = do
            nxt = dcs * f[b, j]
            if peephole:
                nxt += di * wci[j] + df * wcf[j]
                wci_grad[j] += di * cs_p[b, j]
                wcf_grad[j] += df * cs_p[b, j]
                wco_grad[j] += do * cs[b, j]
            dcs_next[b, j] = nxt


def _offsets(call):
    return tuple(call.gate_offset(g) for g in ("i", "ci", "f", "o"))


def forward(call, x, cs_prev, h_prev, w, wci, wcf, wco, b):
    """-> (i, cs, f, o, ci, co, h), each [T, B, C] in the call's dtype, 0 at t >= seq_len_max."""
    T, B, I, C, S = call.T, call.B, call.I, call.C, call.seq_len_max
    ct = compute_dtype(call.dtype)
    x, cs_prev, h_prev, w, wci, wcf, wco, b = (np.asarray(a, dtype=ct) for a in
                                               (x, cs_prev, h_prev, w, wci, wcf, wco, b))
    outs = np.zeros((7, T, B, C), dtype=ct)                 # i, cs, f, o, ci, co, h
    i_, cs_, f_, o_, ci_, co_, h_ = outs
    gates = np.empty((S, B, 4 * C), dtype=ct)               # [S, B, 4C]
    if S * B:
        np.matmul(x[:S].reshape(S * B, I), w[:I], out=gates.reshape(S * B, 4 * C))
        gates += b
    gh = np.empty((B, 4 * C), dtype=ct)
    oi, oci, of, oo = _offsets(call)
    cs_p, h_p = cs_prev, h_prev
    for t in range(S):
        np.matmul(h_p, w[I:], out=gh)
        np.add(gates[t], gh, out=gh)
        cell_forward(gh, cs_p, wci, wcf, wco, oi, oci, of, oo, call.forget_bias, call.cell_clip,
                     call.use_peephole, i_[t], cs_[t], f_[t], o_[t], ci_[t], co_[t], h_[t])
        cs_p, h_p = cs_[t], h_[t]
    return tuple(a.astype(call.dtype, copy=False) for a in outs)


def backward(call, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h, cs_grad, h_grad):
    """-> (x_grad, cs_prev_grad, h_prev_grad, w_grad, wci_grad, wcf_grad, wco_grad, b_grad)."""
    T, B, I, C, S = call.T, call.B, call.I, call.C, call.seq_len_max
    ct = compute_dtype(call.dtype)
    (x, cs_prev, h_prev, w, wci, wcf, wco, i, cs, f, o, ci, co, h, cs_grad, h_grad) = (
        np.asarray(a, dtype=ct) for a in (x, cs_prev, h_prev, w, wci, wcf, wco, i, cs, f, o, ci, co, h,
                                          cs_grad, h_grad))
    dgates = np.zeros((S, B, 4 * C), dtype=ct)              # [S, B, 4C]
    peep = np.zeros((3, C), dtype=ct)                       # wci, wcf, wco grads
    dcs_next = np.zeros((B, C), dtype=ct)
    dh_next = np.zeros((B, C), dtype=ct)
    oi, oci, of, oo = _offsets(call)
    w_h_T = w[I:].T                                         # [4C, C] (a view: BLAS reads it transposed)
    for t in reversed(range(S)):
        cs_p = cs[t - 1] if t > 0 else cs_prev
        cell_backward(i[t], cs[t], f[t], o[t], ci[t], co[t], cs_p, cs_grad[t], h_grad[t], dh_next, dcs_next,
                      wci, wcf, wco, oi, oci, of, oo, call.use_peephole, dgates[t], peep[0], peep[1], peep[2])
        np.matmul(dgates[t], w_h_T, out=dh_next)
    x_grad = np.zeros((T, B, I), dtype=ct)
    w_grad = np.zeros((I + C, 4 * C), dtype=ct)
    if S * B:
        d2 = dgates.reshape(S * B, 4 * C)
        np.matmul(d2, w[:I].T, out=x_grad[:S].reshape(S * B, I))
        sum_of_outer(x[:S].reshape(S * B, I), d2, w_grad[:I])
        h_p_all = np.concatenate([h_prev[None], h[:S - 1]], axis=0)          # [S, B, C]
        sum_of_outer(h_p_all.reshape(S * B, C), d2, w_grad[I:])
    b_grad = dgates.reshape(S * B, 4 * C).sum(axis=0)
    dt = call.dtype
    return tuple(a.astype(dt, copy=False) for a in (x_grad, dcs_next, dh_next, w_grad, peep[0], peep[1], peep[2],
                                                   b_grad))

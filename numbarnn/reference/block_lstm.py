r"""NumPy reference for TensorFlow's BlockLSTM ops (SPEC section 9).

Forward, for t = 0 .. seq_len_max-1 (``cs_p, h_p`` = the previous step's ``cs, h``; ``cs_prev, h_prev``
at t = 0)::

    xh    = [x_t, h_p]                                   # [B, I+C]
    gates = xh @ w + b                                   # [B, 4C], blocks by layout:
                                                         #   V1 'icfo' = [i | ci | f | o]
                                                         #   V2 'ifco' = [i | f | ci | o]
    i  = σ(gates_i + (peephole ? cs_p*wci : 0))
    ci = tanh(gates_ci)
    f  = σ(gates_f + forget_bias + (peephole ? cs_p*wcf : 0))
    cs = ci*i + f*cs_p ;  if cell_clip > 0: cs = clip(cs, -cell_clip, cell_clip)
    co = tanh(cs)
    o  = σ(gates_o + (peephole ? cs*wco : 0))            # the output peephole reads the NEW cs
    h  = o*co

The seven outputs ``i, cs, f, o, ci, co, h`` are ``[T, B, C]`` and all 0 at t >= seq_len_max
(numbarnn's choice; TF zeroes only cs and h).

Backward (TF's gradient: the clip is ignored; it reads the saved activations), for
t = seq_len_max-1 .. 0 with ``dh_next = dcs_next = 0`` before the first step::

    dh  = h_grad[t] + dh_next
    do  = o(1-o) * dh * co                                # gradients w.r.t. the pre-activations
    dcs = (1-co²) * dh * o + cs_grad[t] + dcs_next (+ do*wco if peephole)
    dci = (1-ci²) * dcs * i
    df  = f(1-f) * dcs * cs_p
    di  = i(1-i) * dcs * ci
    dgates   = [di, df, dci, do] placed by the layout    # [B, 4C]
    dcs_next = dcs*f (+ di*wci + df*wcf if peephole)
    xh_grad  = dgates @ wᵀ ;  x_grad[t] = xh_grad[:, :I] ;  dh_next = xh_grad[:, I:]
    w_grad  += [x_t, h_p]ᵀ @ dgates ;  b_grad += Σ_batch dgates
    peephole: wci_grad += Σ_batch di*cs_p ; wcf_grad += Σ_batch df*cs_p ; wco_grad += Σ_batch do*cs[t]

    x_grad[t >= seq_len_max] = 0 ;  cs_prev_grad = dcs_next ;  h_prev_grad = dh_next

The code is laid out like the fused kernels: one big matmul for the input part of every step
(``x @ w[:I]``), one small recurrent matmul per step (``h_p @ w[I:]``), a pointwise cell update; in
backward a pointwise step producing ``dgates``, a per-step ``dgates @ w[I:]ᵀ`` for the recurrence and
the weight gradients as matmuls over all steps at the end. Everything is computed in float64 and the
results are cast back to the input dtype.
"""
from __future__ import annotations

import numpy as np

from numbarnn.block_lstm_config import GATE_ORDER, BlockLSTMCall


def gate_slices(layout: str, C: int) -> dict:
    """Slices of the gates 'i', 'ci', 'f', 'o' along the 4C axis of ``w`` / ``b`` / ``gates``."""
    return {gate: slice(k * C, (k + 1) * C) for k, gate in enumerate(GATE_ORDER[layout])}


def sigmoid(z):
    """σ(z) = 1/(1+e^-z) written so that it cannot overflow."""
    return 0.5 * np.tanh(0.5 * z) + 0.5


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def block_lstm_forward(call: BlockLSTMCall, x, cs_prev, h_prev, w, wci, wcf, wco, b):
    """BlockLSTM / BlockLSTMV2 forward; returns ``(i, cs, f, o, ci, co, h)``, each ``[T, B, C]``."""
    T, B, I, C, S = call.T, call.B, call.I, call.C, call.seq_len_max
    x, cs_prev, h_prev, w, wci, wcf, wco, b = _f64(x, cs_prev, h_prev, w, wci, wcf, wco, b)
    # x [T, B, I]; cs_prev, h_prev [B, C]; w [I+C, 4C]; wci, wcf, wco [C]; b [4C]
    g = gate_slices(call.layout, C)
    w_x = w[:I]                                 # [I, 4C]
    w_h = w[I:]                                 # [C, 4C]

    outputs = {name: np.zeros((T, B, C)) for name in ("i", "cs", "f", "o", "ci", "co", "h")}
    i_, cs_, f_, o_, ci_, co_, h_ = (outputs[n] for n in ("i", "cs", "f", "o", "ci", "co", "h"))

    x_gates = x[:S] @ w_x + b                   # [S, B, 4C]: the input part of every step at once
    cs_p, h_p = cs_prev, h_prev                 # [B, C]
    for t in range(S):
        gates = x_gates[t] + h_p @ w_h          # [B, 4C]
        pre_i = gates[:, g["i"]]                # [B, C]
        pre_f = gates[:, g["f"]] + call.forget_bias
        if call.use_peephole:
            pre_i = pre_i + cs_p * wci
            pre_f = pre_f + cs_p * wcf
        i = sigmoid(pre_i)                      # [B, C]
        ci = np.tanh(gates[:, g["ci"]])         # [B, C]
        f = sigmoid(pre_f)                      # [B, C]
        cs = ci * i + f * cs_p                  # [B, C]
        if call.cell_clip > 0.0:
            cs = np.clip(cs, -call.cell_clip, call.cell_clip)
        co = np.tanh(cs)                        # [B, C]
        pre_o = gates[:, g["o"]]
        if call.use_peephole:
            pre_o = pre_o + cs * wco            # the NEW cs
        o = sigmoid(pre_o)                      # [B, C]
        h = o * co                              # [B, C]

        i_[t], cs_[t], f_[t], o_[t], ci_[t], co_[t], h_[t] = i, cs, f, o, ci, co, h
        cs_p, h_p = cs, h

    return tuple(outputs[n].astype(call.dtype) for n in ("i", "cs", "f", "o", "ci", "co", "h"))


def block_lstm_backward(call: BlockLSTMCall, x, cs_prev, h_prev, w, wci, wcf, wco, b,
                        i, cs, f, o, ci, co, h, cs_grad, h_grad):
    """BlockLSTMGrad / BlockLSTMGradV2; returns
    ``(x_grad, cs_prev_grad, h_prev_grad, w_grad, wci_grad, wcf_grad, wco_grad, b_grad)``,
    shaped like ``x, cs_prev, h_prev, w, wci, wcf, wco, b``.

    ``i, cs, f, o, ci, co, h`` are the saved forward outputs ``[T, B, C]``; ``cs_grad, h_grad`` the
    upstream gradients of ``cs`` and ``h`` ``[T, B, C]`` (ignored at t >= seq_len_max).
    """
    T, B, I, C, S = call.T, call.B, call.I, call.C, call.seq_len_max
    x, cs_prev, h_prev, w, wci, wcf, wco = _f64(x, cs_prev, h_prev, w, wci, wcf, wco)
    i, cs, f, o, ci, co, h, cs_grad, h_grad = _f64(i, cs, f, o, ci, co, h, cs_grad, h_grad)
    # x [T, B, I]; cs_prev, h_prev [B, C]; w [I+C, 4C]; wci, wcf, wco [C]; (b [4C] is not needed)
    # i, cs, f, o, ci, co, h, cs_grad, h_grad [T, B, C]
    g = gate_slices(call.layout, C)
    w_h = w[I:]                                 # [C, 4C]

    dgates_all = np.zeros((S, B, 4 * C))        # [S, B, 4C]
    wci_grad = np.zeros(C)                      # [C]
    wcf_grad = np.zeros(C)                      # [C]
    wco_grad = np.zeros(C)                      # [C]
    dcs_next = np.zeros((B, C))                 # [B, C]
    dh_next = np.zeros((B, C))                  # [B, C]
    for t in reversed(range(S)):
        cs_p = cs[t - 1] if t > 0 else cs_prev  # [B, C]
        dh = h_grad[t] + dh_next                                            # [B, C]
        do = o[t] * (1.0 - o[t]) * dh * co[t]                               # [B, C]
        dcs = (1.0 - co[t] ** 2) * dh * o[t] + cs_grad[t] + dcs_next        # [B, C]
        if call.use_peephole:
            dcs = dcs + do * wco
        dci = (1.0 - ci[t] ** 2) * dcs * i[t]                               # [B, C]
        df = f[t] * (1.0 - f[t]) * dcs * cs_p                               # [B, C]
        di = i[t] * (1.0 - i[t]) * dcs * ci[t]                              # [B, C]

        dgates = dgates_all[t]                  # [B, 4C] (a view)
        dgates[:, g["i"]] = di
        dgates[:, g["f"]] = df
        dgates[:, g["ci"]] = dci
        dgates[:, g["o"]] = do

        dcs_next = dcs * f[t]
        if call.use_peephole:
            dcs_next = dcs_next + di * wci + df * wcf
            wci_grad += np.sum(di * cs_p, axis=0)
            wcf_grad += np.sum(df * cs_p, axis=0)
            wco_grad += np.sum(do * cs[t], axis=0)
        dh_next = dgates @ w_h.T                # [B, C]: the h part of xh_grad

    # the parts that need no recurrence, as matmuls over all S steps
    x_grad = np.zeros((T, B, I))                # [T, B, I], 0 at t >= S
    x_grad[:S] = dgates_all @ w[:I].T           # the x part of xh_grad
    h_p_all = np.concatenate([h_prev[None], h[:max(S - 1, 0)]], axis=0)[:S]  # [S, B, C]: h_p per step
    dgates_2d = dgates_all.reshape(S * B, 4 * C)                            # [S*B, 4C]
    w_grad = np.concatenate([
        x[:S].reshape(S * B, I).T @ dgates_2d,          # [I, 4C]
        h_p_all.reshape(S * B, C).T @ dgates_2d,        # [C, 4C]
    ], axis=0)                                  # [I+C, 4C]
    b_grad = dgates_2d.sum(axis=0)              # [4C]

    dt = call.dtype
    return (x_grad.astype(dt), dcs_next.astype(dt), dh_next.astype(dt), w_grad.astype(dt),
            wci_grad.astype(dt), wcf_grad.astype(dt), wco_grad.astype(dt), b_grad.astype(dt))

"""The reference backend: NumPy, float64 inside, the input's dtype outside.

Backend contract (every backend implements these; arrays arrive validated and time-major):
    rnn_forward(call, x [T,B,I], h0 [L*D,B,P], c0 [L*D,B,H] | None, params [N])
        -> (y [T,B,D*P], hT [L*D,B,P], cT [L*D,B,H] (LSTM) or empty (0,), reserve [R] (empty if not training))
    rnn_backward(call, x, h0, c0, params, dy [T,B,D*P], dhT [L*D,B,P], dcT [L*D,B,H] | None, reserve [R])
        -> (dx [T,B,I], dh0 [L*D,B,P], dc0 [L*D,B,H] | None, dparams [N])
    block_lstm(call, x, cs_prev, h_prev, w, wci, wcf, wco, b) -> (i, cs, f, o, ci, co, h)
    block_lstm_grad(call, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h, cs_grad, h_grad)
        -> (x_grad, cs_prev_grad, h_prev_grad, w_grad, wci_grad, wcf_grad, wco_grad, b_grad)
    swap01(a) ; zeros(shape, dtype, like)
"""
from __future__ import annotations

import numpy as np

from ..reserve import reserve_entries, reserve_views
from ..verify import host as to_host
from . import block_lstm as _block_lstm
from . import network


def _f64(a):
    return None if a is None else np.asarray(to_host(a), dtype=np.float64)


def swap01(a):
    return np.ascontiguousarray(np.swapaxes(to_host(a), 0, 1))


def zeros(shape, dtype, like=None):
    return np.zeros(shape, dtype=dtype)


def rnn_forward(call, x, h0, c0, params):
    dt = call.dtype
    y, hT, cT, saved = network.forward(call, _f64(x), _f64(h0), _f64(c0), _f64(params))
    if call.is_training:
        reserve = np.concatenate([saved[e.name].reshape(-1) if e.name in saved else np.zeros(e.size)   # nonce: ops
                                  for e in reserve_entries(call)] or [np.zeros(0)])

    else:
        reserve = np.zeros(0)
    cT = cT.astype(dt) if cT is not None else np.zeros((0,), dtype=dt)
    return y.astype(dt), hT.astype(dt), cT, reserve.astype(dt)


def rnn_backward(call, x, h0, c0, params, dy, dhT, dcT, reserve):
    dt = call.dtype
    reserve = _f64(reserve)
    saved = reserve_views(call, reserve)
    dx, dh0, dc0, dparams = network.backward(call, _f64(x), _f64(h0), _f64(c0), _f64(params), _f64(dy),
                                              _f64(dhT), _f64(dcT), saved)
    return dx.astype(dt), dh0.astype(dt), (dc0.astype(dt) if dc0 is not None else None), dparams.astype(dt)


def block_lstm(call, *arrays):
    outs = _block_lstm.block_lstm_forward(call, *[to_host(a) for a in arrays])
    return tuple(outs)


def block_lstm_grad(call, *arrays):
    return tuple(_block_lstm.block_lstm_backward(call, *[to_host(a) for a in arrays]))

"""Coupled input-forget gate LSTM (CIFG: f = 1 - i, 3 gates), as a user cell: one file, public API only.

    i = σ(wx_i + rh_i)      g = tanh(wx_g + rh_g)      o = σ(wx_o + rh_o)
    c' = (1-i)*c + i*g      m = o*tanh(c')
Backward (dm reaching m, dc reaching c'):
    tc = tanh(c') ; dc' = dc + dm*o*(1-tc²)
    di = dc'*(g - c)*σ'(i) ; dg = dc'*i*(1-g²) ; do = dm*tc*σ'(o) ; dc_prev = dc'*(1-i)
"""
from numbarnn.cells import CellSpec, dsigmoid, dtanh, one_minus, register, sigmoid, tanh

I, G, O = 0, 1, 2                # gates (and saved values)


def forward(wx, rh, v, h, c, saved):
    i = sigmoid(wx[I] + rh[I])
    g = tanh(wx[G] + rh[G])
    o = sigmoid(wx[O] + rh[O])
    c_new = c + i * (g - c)                  # = (1-i)*c + i*g
    saved[I] = i
    saved[G] = g
    saved[O] = o
    return o * tanh(c_new), c_new


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    i, g, o = saved[I], saved[G], saved[O]
    tc = tanh(c_new)
    dcell = dc + dm * o * dtanh(tc)
    dwx[I] = dcell * (g - c) * dsigmoid(i)
    dwx[G] = dcell * i * dtanh(g)
    dwx[O] = dm * tc * dsigmoid(o)
    return 0.0, dcell * one_minus(i)


SPEC = register(CellSpec(name="cifg_lstm", gates=("i", "g", "o"), saved=("i", "g", "o"), forward=forward,
                         backward=backward, cell_state=True, projection=True, equations=__doc__))

"""Peephole LSTM (TF's LSTMBlockCell with use_peephole=True), as a user cell: one file, public API only.

    i = σ(wx_i + rh_i + w_ci*c)      f = σ(wx_f + rh_f + w_cf*c)      g = tanh(wx_g + rh_g)
    c' = f*c + i*g                   o = σ(wx_o + rh_o + w_co*c')     m = o*tanh(c')
The peephole weights w_ci, w_cf, w_co are per-unit vectors [H] (the spec's `vectors`: extra parameter
regions after each pseudo-layer's biases).  Backward (dm reaching m, dc reaching c'):
    tc = tanh(c') ; do = dm*tc*σ'(o) ; dc' = dc + dm*o*(1-tc²) + do*w_co
    di = dc'*g*σ'(i) ; df = dc'*c*σ'(f) ; dg = dc'*i*(1-g²) ; dc_prev = dc'*f + di*w_ci + df*w_cf
    dw_ci += di*c ; dw_cf += df*c ; dw_co += do*c'
"""
from numbarnn.cells import CellSpec, dsigmoid, dtanh, register, sigmoid, tanh

I, F, G, O = 0, 1, 2, 3          # gates (and saved values)
CI, CF, CO = 0, 1, 2             # cell vectors


def forward(wx, rh, v, h, c, saved):
    i = sigmoid(wx[I] + rh[I] + v[CI] * c)
    f = sigmoid(wx[F] + rh[F] + v[CF] * c)
    g = tanh(wx[G] + rh[G])
    c_new = f * c + i * g
    o = sigmoid(wx[O] + rh[O] + v[CO] * c_new)
    saved[I] = i
    saved[F] = f
    saved[G] = g
    saved[O] = o
    return o * tanh(c_new), c_new


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    i, f, g, o = saved[I], saved[F], saved[G], saved[O]
    tc = tanh(c_new)
    do = dm * tc * dsigmoid(o)
    dcell = dc + dm * o * dtanh(tc) + do * v[CO]
    di = dcell * g * dsigmoid(i)
    df = dcell * c * dsigmoid(f)
    dwx[I] = di
    dwx[F] = df
    dwx[G] = dcell * i * dtanh(g)
    dwx[O] = do
    dv[CI] = di * c
    dv[CF] = df * c
    dv[CO] = do * c_new
    return 0.0, dcell * f + di * v[CI] + df * v[CF]


SPEC = register(CellSpec(name="peephole_lstm", gates=("i", "f", "g", "o"), saved=("i", "f", "g", "o"),
                         forward=forward, backward=backward, cell_state=True, vectors=("w_ci", "w_cf", "w_co"),
                         projection=True, equations=__doc__))

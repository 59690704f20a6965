"""LSTM, cuDNN flavour (SPEC 2): gates i, f, g, o; a cell state; projection allowed.

    i = σ(wx_i + rh_i)   f = σ(wx_f + rh_f)   g = tanh(wx_g + rh_g)   o = σ(wx_o + rh_o)
    c' = f*c + i*g ;  m = o*tanh(c')                      (h' = m, or W_proj m with a projection)
backward (dm reaching m, dc reaching c'):
    tc = tanh(c') ; dc' = dc + dm*o*(1-tc²)
    di = dc'*g*σ' ; df = dc'*c*σ' ; dg = dc'*i*(1-g²) ; do = dm*tc*σ' ; dc_prev = dc'*f
"""
from .functions import dsigmoid, dtanh, sigmoid, tanh
from .spec import CellSpec

I, F, G, O = 0, 1, 2, 3          # gate offsets (and saved-value offsets: i, f, g, o are saved as they are)


def forward(wx, rh, v, h, c, saved):
    i = sigmoid(wx[I] + rh[I])
    f = sigmoid(wx[F] + rh[F])
    g = tanh(wx[G] + rh[G])
    o = sigmoid(wx[O] + rh[O])
    c_new = f * c + i * g
    saved[I] = i
    saved[F] = f
    saved[G] = g
    saved[O] = o
    return o * tanh(c_new), c_new


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    i, f, g, o = saved[I], saved[F], saved[G], saved[O]
    tc = tanh(c_new)
    dcell = dc + dm * o * dtanh(tc)
    dwx[I] = dcell * g * dsigmoid(i)
    dwx[F] = dcell * c * dsigmoid(f)
    dwx[G] = dcell * i * dtanh(g)
    dwx[O] = dm * tc * dsigmoid(o)
    return 0.0, dcell * f            # no path from h except through R


SPEC = CellSpec(name="lstm", gates=("i", "f", "g", "o"), saved=("i", "f", "g", "o"), forward=forward,
                backward=backward, cell_state=True, projection=True, equations=__doc__)

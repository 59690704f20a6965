"""haste's LayerNormLSTM, as a user cell: one file, public API only.

Layer normalisation (SPEC 13: across one batch row, ε = 1e-5) of the input products W x and of the recurrent
products R h, all 4H of a row together, each with a gain and no bias, and of the new cell state with a gain and a
bias; the state is carried unnormalised.  Gates in haste's order i, g, f, o:

    wx = LN(W x) γ_x + bW      rh = LN(R h) γ_r + bR                  (the framework's, `layer_norm`)
    i = σ(wx_i + rh_i)   g = tanh(wx_g + rh_g)   f = σ(wx_f + rh_f)   o = σ(wx_o + rh_o)
    c' = f*c + i*g        n = LN(c') γ_c + β_c (the framework's)      h' = o*tanh(n)   (`output`)
Backward (dm reaching h', dc reaching c'):
    tn = tanh(n) ; do = dm*tn*σ'(o) ; dn = dm*o*(1-tn²)                      (`output_backward`)
    dc' = dc + LN_c'(dn) (the framework's) ; di = dc'*g*σ'(i) ; dg = dc'*i*(1-g²) ; df = dc'*c*σ'(f)
    dc_prev = dc'*f                                                         (`backward`, called with dm = 0)
haste's parameters map one to one: kernel = W^T, recurrent_kernel = R^T, bias = bW (bR = 0), gamma[0] = γ_x,
gamma[1] = γ_r, gamma_h = γ_c, beta_h = β_c (numbarnn.torch.LayerNormLSTM takes haste's names).
"""
from numbarnn.cells import CellSpec, dsigmoid, dtanh, register, sigmoid, tanh

I, G, F, O = 0, 1, 2, 3          # gates (and saved values), haste's order


def forward(wx, rh, v, h, c, saved):
    i = sigmoid(wx[I] + rh[I])
    g = tanh(wx[G] + rh[G])
    f = sigmoid(wx[F] + rh[F])
    o = sigmoid(wx[O] + rh[O])
    saved[I] = i
    saved[G] = g
    saved[F] = f
    saved[O] = o
    return 0.0, f * c + i * g                # h' comes from the normalised state (`output`)


def output(n, saved, v):
    return saved[O] * tanh(n)


def output_backward(dm, n, saved, v, dwx, drh):
    o = saved[O]
    tn = tanh(n)
    dwx[O] = dm * tn * dsigmoid(o)
    return dm * o * dtanh(tn)


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    i, g, f = saved[I], saved[G], saved[F]
    dwx[I] = dc * g * dsigmoid(i)
    dwx[G] = dc * i * dtanh(g)
    dwx[F] = dc * c * dsigmoid(f)
    return 0.0, dc * f


SPEC = register(CellSpec(name="layer_norm_lstm", gates=("i", "g", "f", "o"), saved=("i", "g", "f", "o"),
                         forward=forward, backward=backward, cell_state=True, layer_norm=("wx", "rh", "c"),
                         output=output, output_backward=output_backward, equations=__doc__))

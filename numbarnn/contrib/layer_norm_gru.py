"""haste's LayerNormGRU, as a user cell: one file, public API only.

Layer normalisation (SPEC 13: across one batch row, ε = 1e-5) of the input products W x and of the recurrent
products R h, all 3H of a row together, each with a gain and then its bias.  Gates in haste's order z, r, g;
the reset gate applies after the recurrent product (as cuDNN's GRU):

    wx = LN(W x) γ_x + bW      rh = LN(R h) γ_r + bR                  (the framework's, `layer_norm`)
    z = σ(wx_z + rh_z)   r = σ(wx_r + rh_r)   g = tanh(wx_g + r*rh_g)   h' = z*h + (1-z)*g
rh_g is saved (hg): the R side of g gets its own gradient (split_recurrent = g).  Backward (dm reaching h'):
    dg = dm*(1-z)*(1-g²) ; dz = dm*(h-g)*σ'(z) ; dr = dg*hg*σ'(r)
    W side [dz, dr, dg] ; R side [dz, dr, dg*r] ; dh (bypassing R) = dm*z
haste's parameters map one to one: kernel = W^T, recurrent_kernel = R^T, bias = bW, recurrent_bias = bR,
gamma[0] = γ_x, gamma[1] = γ_r (numbarnn.torch.LayerNormGRU takes haste's names).
"""
from numbarnn.cells import CellSpec, dsigmoid, dtanh, register, sigmoid, tanh

Z, R, G = 0, 1, 2                # gates (and saved values), haste's order
HG = 3                           # saved: z, r, g, hg


def forward(wx, rh, v, h, c, saved):
    z = sigmoid(wx[Z] + rh[Z])
    r = sigmoid(wx[R] + rh[R])
    g = tanh(wx[G] + r * rh[G])
    saved[Z] = z
    saved[R] = r
    saved[G] = g
    saved[HG] = rh[G]
    return g + z * (h - g), c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    z, r, g, hg = saved[Z], saved[R], saved[G], saved[HG]
    dg = (dm - dm * z) * dtanh(g)
    dwx[Z] = dm * (h - g) * dsigmoid(z)
    dwx[R] = dg * hg * dsigmoid(r)
    dwx[G] = dg
    drh[G] = dg * r
    return dm * z, dc


SPEC = register(CellSpec(name="layer_norm_gru", gates=("z", "r", "g"), saved=("z", "r", "g", "hg"),
                         forward=forward, backward=backward, split_recurrent=("g",), layer_norm=("wx", "rh"),
                         equations=__doc__))

"""The classic GRU (Cho et al. 2014; Keras GRU(reset_after=False), TF1 GRUCell), as a user cell: one file, public API.

The reset gate applies BEFORE the candidate's recurrent product (`modulated=("n",)`: rh_n = R_n (r ⊙ h) + bR_n),
where numbarnn's built-in gru (cuDNN's) applies it after.  Gate order r, z, n and h' as the built-in gru:

    r = σ(wx_r + R_r h + bR_r)      z = σ(wx_z + R_z h + bR_z)      (wx_g = W_g x + bW_g)
    n = tanh(wx_n + R_n (r ⊙ h) + bR_n)                             h' = (1-z)*n + z*h = n + z*(h-n)
The framework computes R_r h, R_z h, then m = r (`modulation`), then R_n (r ⊙ h), then calls `forward`.
Backward (dm reaching h'):
    dn = dm*(1-z)*(1-n²) ; dz = dm*(h-n)*σ'(z) ; dh (bypassing R) = dm*z       (`backward`: r only through m)
    dr = dL/dm * σ'(r), dL/dm = (R_n^T dn)_j * h_j from the framework          (`modulation_backward`)
Keras and TF1 keep one bias per gate: their bias is bW here with bR = 0 (numbarnn keeps cuDNN's two biases).
"""
from numbarnn.cells import CellSpec, dsigmoid, dtanh, register, sigmoid, tanh

R, Z, N = 0, 1, 2                # gate offsets (and saved values r, z, n)


def forward(wx, rh, v, h, c, saved):
    r = sigmoid(wx[R] + rh[R])
    z = sigmoid(wx[Z] + rh[Z])
    n = tanh(wx[N] + rh[N])                  # rh_n = R_n (r ⊙ h) + bR_n
    saved[R] = r
    saved[Z] = z
    saved[N] = n
    return n + z * (h - n), c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    z, n = saved[Z], saved[N]
    dwx[N] = (dm - dm * z) * dtanh(n)
    dwx[Z] = dm * (h - n) * dsigmoid(z)
    dwx[R] = 0.0                             # r reaches h' only through m: modulation_backward's
    return dm * z, dc


def modulation(wx, rh, v, h):
    return sigmoid(wx[R] + rh[R])            # m = r


def modulation_backward(dmod, mod, saved, v, h, dwx, drh):
    dwx[R] = dmod * dsigmoid(mod)


SPEC = register(CellSpec(name="gru_v1", gates=("r", "z", "n"), saved=("r", "z", "n"), forward=forward,
                         backward=backward, modulated=("n",), modulation=modulation,
                         modulation_backward=modulation_backward, equations=__doc__))

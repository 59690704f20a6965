"""The minimal gated unit (MGU, Zhou et al. 2016), as a user cell: one file, public API only.

One gate f both resets the state before the candidate's recurrent product (`modulated=("n",)`: rh_n =
R_n (f ⊙ h) + bR_n) and interpolates:

    f = σ(wx_f + R_f h + bR_f)      n = tanh(wx_n + R_n (f ⊙ h) + bR_n)      h' = (1-f)*h + f*n = h + f*(n-h)
(wx_g = W_g x + bW_g.)  The framework computes R_f h, then m = f (`modulation`), then R_n (f ⊙ h), then `forward`.
Backward (dm reaching h'):
    df = dm*(n-h)*σ'(f) ; dn = dm*f*(1-n²) ; dh (bypassing R) = dm*(1-f)        (`backward`)
    df += dL/dm * σ'(f), dL/dm = (R_n^T dn)_j * h_j from the framework          (`modulation_backward`)
The paper has one bias per gate: it is bW here with bR = 0 (numbarnn keeps cuDNN's two biases).
"""
from numbarnn.cells import CellSpec, dsigmoid, dtanh, one_minus, register, sigmoid, tanh

F, N = 0, 1                      # gate offsets (and saved values f, n)


def forward(wx, rh, v, h, c, saved):
    f = sigmoid(wx[F] + rh[F])
    n = tanh(wx[N] + rh[N])                  # rh_n = R_n (f ⊙ h) + bR_n
    saved[F] = f
    saved[N] = n
    return h + f * (n - h), c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    f, n = saved[F], saved[N]
    dwx[F] = dm * (n - h) * dsigmoid(f)
    dwx[N] = dm * f * dtanh(n)
    return dm * one_minus(f), dc


def modulation(wx, rh, v, h):
    return sigmoid(wx[F] + rh[F])            # m = f


def modulation_backward(dmod, mod, saved, v, h, dwx, drh):
    dwx[F] = dmod * dsigmoid(mod)


SPEC = register(CellSpec(name="mgu", gates=("f", "n"), saved=("f", "n"), forward=forward, backward=backward,
                         modulated=("n",), modulation=modulation, modulation_backward=modulation_backward,
                         equations=__doc__))

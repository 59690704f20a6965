"""GRU, cuDNN flavour (SPEC 2): gates r, z, n; the reset gate applies AFTER the recurrent product.

    r = σ(wx_r + rh_r)   z = σ(wx_z + rh_z)   n = tanh(wx_n + r*rh_n)   h' = (1-z)*n + z*h = n + z*(h-n)
    rh_n = R_n h + bR_n is saved (hn): the R side of n gets its own gradient (split_recurrent = n)
backward (dm reaching h'):
    dn = dm*(1-z)*(1-n²) ; dz = dm*(h-n)*σ'(z) ; dr = dn*hn*σ'(r)
    W side [dr, dz, dn] ; R side [dr, dz, dn*r] ; dh (bypassing R) = dm*z
"""
from .functions import dsigmoid, dtanh, sigmoid, tanh
from .spec import CellSpec

R, Z, N = 0, 1, 2                # gate offsets
HN = 3                           # saved: r, z, n, hn


def forward(wx, rh, v, h, c, saved):
    r = sigmoid(wx[R] + rh[R])
    z = sigmoid(wx[Z] + rh[Z])
    n = tanh(wx[N] + r * rh[N])
    saved[R] = r
    saved[Z] = z
    saved[N] = n
    saved[HN] = rh[N]
    return n + z * (h - n), c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    r, z, n, hn = saved[R], saved[Z], saved[N], saved[HN]
    dn = (dm - dm * z) * dtanh(n)
    dwx[R] = dn * hn * dsigmoid(r)
    dwx[Z] = dm * (h - n) * dsigmoid(z)
    dwx[N] = dn
    drh[N] = dn * r
    return dm * z, dc


SPEC = CellSpec(name="gru", gates=("r", "z", "n"), saved=("r", "z", "n", "hn"), forward=forward,
                backward=backward, split_recurrent=("n",), equations=__doc__)

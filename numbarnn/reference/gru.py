"""GRU cell, cuDNN flavour (SPEC 2): the reset gate applies AFTER the recurrent matmul, bR_n inside.

    r = σ(W_r x + bW_r + R_r h + bR_r)          gate order r, z, n
    z = σ(W_z x + bW_z + R_z h + bR_z)
    hn = R_n h + bR_n
    n = tanh(W_n x + bW_n + r*hn)
    h' = (1-z)*n + z*h

Backward (dm: gradient reaching h'):
    dn = dm*(1-z) ; dz = dm*(h-n) ; dh_direct = dm*z
    dn_pre = dn*(1-n²) ; dr_pre = dn_pre*hn*r(1-r) ; dz_pre = dz*z(1-z)
    W side: [dr_pre, dz_pre, dn_pre] ; R side: [dr_pre, dz_pre, dn_pre*r]
"""
import numpy as np

from .activations import dsigmoid, dtanh, sigmoid, tanh

S = 4            # saved activations per unit: r, z, n, hn
R_, Z_, N_ = 0, 1, 2


def forward(gx, gh, h_prev, c_prev=None):
    """gx [n, 3H] = W x + bW ; gh [n, 3H] = R h + bR ; h_prev [n, H] -> (h' [n, H], None, acts [n, 4H])."""
    H = h_prev.shape[-1]
    r = sigmoid(gx[:, R_ * H:(R_ + 1) * H] + gh[:, R_ * H:(R_ + 1) * H])
    z = sigmoid(gx[:, Z_ * H:(Z_ + 1) * H] + gh[:, Z_ * H:(Z_ + 1) * H])
    hn = gh[:, N_ * H:(N_ + 1) * H]
    n = tanh(gx[:, N_ * H:(N_ + 1) * H] + r * hn)
    h = (1.0 - z) * n + z * h_prev
    return h, None, np.concatenate([r, z, n, hn], axis=1)


def backward(dm, dc, acts, h_prev, c_prev=None, c_new=None):
    """-> (dgx [n, 3H], dgh [n, 3H], dh_direct [n, H], None)."""
    H = h_prev.shape[-1]
    r, z, n, hn = (acts[:, k * H:(k + 1) * H] for k in range(4))
    dn_pre = dm * (1.0 - z) * dtanh(n)
    dz_pre = dm * (h_prev - n) * dsigmoid(z)
    dr_pre = dn_pre * hn * dsigmoid(r)
    dgx = np.concatenate([dr_pre, dz_pre, dn_pre], axis=1)
    dgh = np.concatenate([dr_pre, dz_pre, dn_pre * r], axis=1)
    return dgx, dgh, dm * z, None

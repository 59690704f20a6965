"""LSTM cell, cuDNN flavour (SPEC 2), one step for a batch of rows.

    i = σ(W_i x + bW_i + R_i h + bR_i)        gate order i, f, g, o
    f = σ(W_f x + bW_f + R_f h + bR_f)
    g = tanh(W_g x + bW_g + R_g h + bR_g)
    o = σ(W_o x + bW_o + R_o h + bR_o)
    c' = f*c + i*g ;  m = o*tanh(c')           h' = m, or W_proj m with a projection (done by the driver)

Backward, from the saved activations (dm: gradient reaching m; dc: reaching c' from the next step):
    tc = tanh(c') ; do = dm*tc ; dc' = dc + dm*o*(1-tc²)
    di = dc'*g ; dg = dc'*i ; df = dc'*c ; dc_prev = dc'*f
    pre-activation gradients: di*i(1-i), df*f(1-f), dg*(1-g²), do*o(1-o)   (the same for W and R sides)
"""
import numpy as np

from .activations import dsigmoid, dtanh, sigmoid, tanh

S = 4            # saved activations per unit: i, f, g, o
I_, F_, G_, O_ = 0, 1, 2, 3   # gate offsets (in units of H)


def forward(gx, gh, h_prev, c_prev):
    """gx [n, 4H] = W x + bW ; gh [n, 4H] = R h + bR ; c_prev [n, H] -> (m [n, H], c' [n, H], acts [n, 4H])."""
    H = c_prev.shape[-1]
    a = gx + gh                                    # [n, 4H] pre-activations
    i = sigmoid(a[:, I_ * H:(I_ + 1) * H])
    f = sigmoid(a[:, F_ * H:(F_ + 1) * H])
    g = tanh(a[:, G_ * H:(G_ + 1) * H])
    o = sigmoid(a[:, O_ * H:(O_ + 1) * H])
    c = f * c_prev + i * g
    m = o * tanh(c)
    return m, c, np.concatenate([i, f, g, o], axis=1)


def backward(dm, dc, acts, h_prev, c_prev, c_new):
    """-> (dgx [n, 4H], dgh [n, 4H], dh_direct [n, P] or 0, dc_prev [n, H])."""
    H = c_prev.shape[-1]
    i, f, g, o = (acts[:, k * H:(k + 1) * H] for k in range(4))
    tc = tanh(c_new)
    do = dm * tc
    dc = dc + dm * o * dtanh(tc)
    di, dg, df = dc * g, dc * i, dc * c_prev
    dgates = np.concatenate([di * dsigmoid(i), df * dsigmoid(f), dg * dtanh(g), do * dsigmoid(o)], axis=1)
    return dgates, dgates, 0.0, dc * f

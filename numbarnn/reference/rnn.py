"""Plain RNN cells, cuDNN flavour (SPEC 2).

    rnn_tanh: h' = tanh(W x + bW + R h + bR)
    rnn_relu: h' = max(0, W x + bW + R h + bR)

Backward from the saved h': d_pre = dm*(1-h'²) (tanh) or dm*[h' > 0] (relu), the same for W and R sides.
"""
from .activations import drelu, dtanh, relu, tanh

S = 1            # saved activation: h'


def make(nonlinearity):
    act, dact = {"tanh": (tanh, dtanh), "relu": (relu, drelu)}[nonlinearity]

    def forward(gx, gh, h_prev, c_prev=None):
        """gx, gh [n, H] -> (h' [n, H], None, acts [n, H])."""
        h = act(gx + gh)
        return h, None, h

    def backward(dm, dc, acts, h_prev, c_prev=None, c_new=None):
        d_pre = dm * dact(acts)
        return d_pre, d_pre, 0.0, None

    return forward, backward


tanh_forward, tanh_backward = make("tanh")
relu_forward, relu_backward = make("relu")

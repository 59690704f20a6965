"""Plain RNN with relu (SPEC 2): h' = max(0, wx + rh); backward d_pre = dm*[h' > 0] from the saved h'."""
from .functions import drelu, relu
from .spec import CellSpec

H = 0                            # the one gate, and the one saved value h'


def forward(wx, rh, v, h, c, saved):
    saved[H] = relu(wx[H] + rh[H])
    return saved[H], c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    dwx[H] = dm * drelu(saved[H])
    return 0.0, dc


SPEC = CellSpec(name="rnn_relu", gates=("h",), saved=("h",), forward=forward, backward=backward,
                equations=__doc__)

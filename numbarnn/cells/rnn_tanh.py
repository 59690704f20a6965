"""Plain RNN with tanh (SPEC 2): h' = tanh(wx + rh); backward d_pre = dm*(1-h'²) from the saved h'."""
from .functions import dtanh, tanh
from .spec import CellSpec

H = 0                            # the one gate, and the one saved value h'


def forward(wx, rh, v, h, c, saved):
    saved[H] = tanh(wx[H] + rh[H])
    return saved[H], c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    dwx[H] = dm * dtanh(saved[H])
    return 0.0, dc


SPEC = CellSpec(name="rnn_tanh", gates=("h",), saved=("h",), forward=forward, backward=backward,
                equations=__doc__)

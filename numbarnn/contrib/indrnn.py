"""IndRNN (Li et al. 2018, "Independently Recurrent Neural Network"), as user cells: one file, public API only.

The recurrent weight is a vector u [H], one scale per unit (`recurrence="diagonal"`): every unit sees only its
own previous output, so the params hold u where other cells hold the matrix R, and there is no recurrent product.

    indrnn       h' = tanh(W x + bW + u ⊙ h + bR)     haste's IndRNN (haste_pytorch.IndRNN: tanh, always)
    indrnn_relu  h' = relu(W x + bW + u ⊙ h + bR)     the paper's choice of activation

Per unit j the cell sees rh = u[j]*h[j] + bR[j] (the framework computes it); backward from the saved h':
    d_pre = dm*(1-h'²) (tanh) or dm*[h' > 0] (relu) ; the framework adds du += d_pre*h and dh += d_pre*u.
haste keeps one bias: its `bias` is bW here with bR = 0 (numbarnn keeps cuDNN's two biases for every cell).
"""
from numbarnn.cells import CellSpec, drelu, dtanh, register, relu, tanh

A = 0                            # the one gate (pre-activation), and the one saved value h'


def forward(wx, rh, v, h, c, saved):
    saved[A] = tanh(wx[A] + rh[A])
    return saved[A], c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    dwx[A] = dm * dtanh(saved[A])
    return 0.0, dc


def forward_relu(wx, rh, v, h, c, saved):
    saved[A] = relu(wx[A] + rh[A])
    return saved[A], c


def backward_relu(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    dwx[A] = dm * drelu(saved[A])
    return 0.0, dc


SPEC = register(CellSpec(name="indrnn", gates=("a",), saved=("h",), forward=forward, backward=backward,
                         recurrence="diagonal", equations=__doc__))
RELU_SPEC = register(CellSpec(name="indrnn_relu", gates=("a",), saved=("h",), forward=forward_relu,
                              backward=backward_relu, recurrence="diagonal", equations=__doc__))

"""Cells as data: one `CellSpec` per cell drives the params layout, the reserve layout, the kernels and the
tools; `register(spec)` adds a user cell everywhere (ops, layers, torch modules, `numbarnn check --mode`).

    from numbarnn.cells import CellSpec, register, sigmoid, tanh
    register(CellSpec(name="my_cell", gates=(...), saved=(...), forward=..., backward=..., ...))

See `spec.py` for the pointwise contract, `lstm.py` / `gru.py` / `rnn_tanh.py` / `rnn_relu.py` for the built-in
cells, `numbarnn/contrib/` for two cells built only through this API, and tutorials/06_custom_cell.py.
"""
from . import gru, lstm, rnn_relu, rnn_tanh
from .functions import HELPERS, drelu, dsigmoid, dtanh, one_minus, relu, sigmoid, tanh
from .spec import BUILTIN, CellSpec, cell_names, get_cell, is_builtin, load_cell_modules, register, registered_cell

for _module in (lstm, gru, rnn_tanh, rnn_relu):
    register(_module.SPEC)

__all__ = ["CellSpec", "register", "load_cell_modules", "get_cell", "cell_names", "is_builtin", "BUILTIN", "HELPERS", "sigmoid", "tanh",
           "relu", "dsigmoid", "dtanh", "drelu", "one_minus"]

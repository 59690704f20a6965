"""Drop-ins for ``torch.nn.RNNCell``, ``torch.nn.LSTMCell`` and ``torch.nn.GRUCell`` (one time step), and
``CellModule`` for any registered numbarnn cell.  Usage::

    from numbarnn.torch import LSTMCell
    cell = LSTMCell(8, 16)                           # torch.nn.LSTMCell's arguments (plus keyword backend=)
    h, c = cell(x_t, (h, c))                         # x_t [B, 8] or unbatched [8]: exactly torch.nn's outputs
    cell.load_state_dict(torch_cell.state_dict())    # and the other way round

Same constructor arguments and positional order as torch.nn (plus the keyword ``backend``: a numbarnn backend
name, None = numbarnn's default), the same parameters (``weight_ih`` [G*H, I], ``weight_hh`` [G*H, H],
``bias_ih`` / ``bias_hh`` [G*H], None with ``bias=False``), the same initialisation (uniform(-1/sqrt(H),
1/sqrt(H)) in parameter order, so ``torch.manual_seed(s)`` gives torch.nn's initial weights), the same forward
(input [B, I] or unbatched [I]; hx None -> zeros; unbatched in -> unbatched out), repr and argument checks with
torch.nn's messages (numbarnn's detail may follow; shape errors are ``numbarnn.torch.RNNShapeError``, a ValueError
and a RuntimeError; dtype errors ``RNNCellDtypeError``, a TypeError, ValueError and RuntimeError).

``CellModule(cell, input_size, hidden_size, bias=True, device=None, dtype=None, *, backend=None)`` is the same for
any registered cell: ``cell`` is an rnn_mode name ("lstm", "gru", "rnn_tanh", "rnn_relu", or a contrib cell such
as "peephole_lstm" once ``numbarnn.contrib.peephole_lstm`` is imported) or a ``numbarnn.cells.CellSpec``
(registered if need be).  Its parameters are weight_ih, weight_hh, bias_ih, bias_hh and one [H] parameter per cell
vector (named as the cell's ``vectors``, e.g. w_ci, w_cf, w_co); ``forward(input, hx=None)`` returns ``(h', c')``
for cells with a cell state (hx then a pair (h, c)), ``h'`` otherwise.  LSTMCell, GRUCell and RNNCell are
CellModules of "lstm", "gru" and "rnn_tanh"/"rnn_relu".

How: one step of a one-layer unidirectional network is one cell step, so a call is numbarnn.torch's operator
(``numbarnn::rnn``) with T = 1 -- the same autograd (numbarnn's backward kernels; double backward through the
cell's spec in torch operations), torch.func, torch.compile (fullgraph), bfloat16 and torch.autocast handling
as numbarnn.torch.LSTM.  Differences from torch.nn: under torch.autocast the input, state and weights are all
cast to the autocast dtype, so every output is in it (torch.nn's CPU cells return float32 for LSTMCell/GRUCell
there); hx must have the input's dtype.  Cells with hidden_size or input_size 0 (which torch.nn builds) run
the cell's spec in torch operations (numbarnn's op needs both sizes positive).

This module imports ``numbarnn.torch`` at its end (not its top) because numbarnn.torch imports these classes at
its own end: either module may be imported first.
"""
from __future__ import annotations

import torch

from .backends import BACKENDS
from .cells import CellSpec, get_cell, register
from .torch_network import _modulated_gh, cell_step, torch_cell_modulation
from .torch_ops import _NO_SEEDS, _call
from .torch_tensors import (_TORCH_DTYPES, RNNDtypeError, RNNShapeError, _autocast_dtype, _check_sizes, _layout,
                            _needs_reserve, _reset_uniform, _WeightViews)
from .validation import check_choice

__all__ = ["CellModule", "LSTMCell", "GRUCell", "RNNCell"]

#: torch.nn.RNNCell's nonlinearity -> numbarnn's rnn_mode
_RNN_MODES = {"tanh": "rnn_tanh", "relu": "rnn_relu"}
#: torch.nn's spelling of numbarnn's mismatched-dtype errors (matmul's): torch dtype -> ATen's scalar type name
_SCALAR_NAMES = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
                 torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                 torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
                 torch.complex128: "ComplexDouble"}


def _scalar_name(dtype: torch.dtype) -> str:
    return _SCALAR_NAMES.get(dtype, str(dtype).replace("torch.", ""))


class CellModule(torch.nn.Module):
    """One step of any registered numbarnn cell as a torch module: ``CellModule(cell, input_size, hidden_size,
    bias=True, device=None, dtype=None, *, backend=None)``; see the module docstring."""

    _torch_name = "CellModule"     # the name torch.nn's messages start with ("LSTMCell: Expected input ...")

    def __init__(self, cell, input_size, hidden_size, bias=True, device=None, dtype=None, *, backend=None):
        super().__init__()
        if isinstance(cell, CellSpec):
            register(cell)
            cell = cell.name
        self._setup(get_cell(cell).name, input_size, hidden_size, bias, device, dtype, backend)

    def _setup(self, rnn_mode: str, input_size, hidden_size, bias, device, dtype, backend) -> None:
        """Parameters as torch.nn.RNNCellBase registers them (then the cell's vectors), initialised as it does."""
        _check_sizes(minimum=0, input_size=input_size, hidden_size=hidden_size)
        self.cell = rnn_mode
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        self.backend = None if backend is None else check_choice("backend", backend, tuple(BACKENDS))
        layout = _layout(rnn_mode, 1, max(hidden_size, 1), max(input_size, 1), False, 0, bool(bias))
        self._has_cell_state = layout.config.has_cell_state
        factory = {"device": device, "dtype": dtype}
        names = []
        for name, shape in zip(layout.names, layout.shapes):       # weight_ih_l0, ..., then the cell's vectors
            name = name[:-len("_l0")]
            if not hidden_size or not input_size:                  # torch.nn's empty cells: the same shapes
                G = layout.config.G
                shape = {"weight_ih": (G * hidden_size, input_size),
                         "weight_hh": (G * hidden_size, hidden_size)}.get(name, (G * hidden_size,) if
                                                                         name.startswith("bias") else (hidden_size,))
            if name in self.__dict__ or hasattr(type(self), name):
                raise ValueError(f"cell: the cell vector name {name!r} of {rnn_mode!r} clashes with an attribute "
                                 f"of {type(self).__name__}")
            setattr(self, name, torch.nn.Parameter(torch.empty(shape, **factory)))
            names.append(name)
            if name == "weight_hh" and not bias:                   # torch.nn registers absent biases as None
                self.register_parameter("bias_ih", None)
                self.register_parameter("bias_hh", None)
        self._weight_names = tuple(names)                          # the operator's weight order
        self._weight_views = _WeightViews()                    # the gather's cached views of the weights
        self.reset_parameters()

    def __setstate__(self, state):
        """Cells pickled whole before the gather's cached views existed get them (state_dicts need nothing)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_weight_views", _WeightViews())

    # -- torch.nn.RNNCellBase compatibility -----------------------------------------------------------
    def reset_parameters(self) -> None:
        """PyTorch's init: every parameter uniform(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), in its order."""
        _reset_uniform(self, self.hidden_size)

    def extra_repr(self) -> str:
        s = "{input_size}, {hidden_size}"
        if type(self) is CellModule:
            s = "{cell!r}, " + s
        if "bias" in self.__dict__ and self.bias is not True:
            s += ", bias={bias}"
        if "nonlinearity" in self.__dict__ and self.nonlinearity != "tanh":
            s += ", nonlinearity={nonlinearity}"
        if self.backend is not None:
            s += ", backend={backend!r}"
        return s.format(**self.__dict__)

    # -- forward ----------------------------------------------------------------------------------------
    def _rnn_mode(self) -> str:
        """The rnn_mode of this call (RNNCell reads its nonlinearity at every call, as torch.nn does)."""
        return self.cell

    def _check_ranks(self, input, hx) -> None:
        """torch.nn's rank checks of input and hx, its messages."""
        name = self._torch_name
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{name}: input: expected a torch.Tensor, got {type(input).__name__}")
        if input.dim() not in (1, 2):
            raise RNNShapeError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
        if hx is None:
            return
        if self._has_cell_state:
            if not isinstance(hx, (tuple, list)):
                raise TypeError(f"{self.cell}_cell(): argument 'hx' (position 2) must be tuple of Tensors, not "
                                f"{type(hx).__name__} ({name}: hx is the pair (h, c))")
            for idx, value in enumerate(hx):
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{self.cell}_cell(): argument 'hx' (position 2) must be tuple of Tensors, "
                                    f"not {type(value).__name__} ({name}: hx is the pair (h, c))")
                if value.dim() not in (1, 2):
                    raise RNNShapeError(f"{name}: Expected hx[{idx}] to be 1D or 2D, got {value.dim()}D "
                                            "instead")
        else:
            if not isinstance(hx, torch.Tensor):
                raise TypeError(f"{name}: hx: expected a torch.Tensor, got {type(hx).__name__}")
            if hx.dim() not in (1, 2):
                raise RNNShapeError(f"{name}: Expected hidden to be 1D or 2D, got {hx.dim()}D instead")

    def _check_sizes(self, input, states, batched: bool, autocast: bool) -> None:
        """ATen's checks of a cell call (check_rnn_cell_forward_input / _hidden, then matmul's dtype rule), their
        messages, on the batched input [B, I] and states; then numbarnn's (a float dtype, one device)."""
        name, cell = self._torch_name, self.cell
        if self._has_cell_state and states and len(states) != 2:
            raise RNNShapeError(f"{cell}_cell expects two hidden states ({name}: hx is the pair (h, c), got "
                                    f"{len(states)} tensors)")
        if input.size(1) != self.input_size:
            raise RNNShapeError(f"input has inconsistent input_size: got {input.size(1)} expected "
                                    f"{self.input_size} ({name}: input shape {tuple(input.shape)})")
        B = input.size(0)
        for k, t in enumerate(states):
            shape = tuple(t.shape)
            if t.size(0) != B:
                raise RNNShapeError(f"Input batch size {B} doesn't match hidden{k} batch size {t.size(0)} "
                                        f"({name}: input shape {tuple(input.shape)}, hx shape {shape})")
            if t.dim() < 2 or t.size(1) != self.hidden_size:
                got = t.size(1) if t.dim() >= 2 else None
                raise RNNShapeError(f"hidden{k} has inconsistent hidden_size: got {got}, expected "
                                        f"{self.hidden_size} ({name}: hx shape {shape}, input shape "
                                        f"{tuple(input.shape)})")
            if t.dim() != 2:
                raise RNNShapeError(f"{name}: hx[{k}] should be {'2' if batched else '1'}D for "
                                        f"{'batched' if batched else 'unbatched'} input, got shape {shape}")
        w = self.weight_ih
        if not autocast:
            for what, t in (("input", input), ("hx", states[0] if states else None)):
                if t is not None and t.dtype != w.dtype:
                    raise RNNCellDtypeError(f"mat1 and mat2 must have the same dtype, but got "
                                            f"{_scalar_name(t.dtype)} and {_scalar_name(w.dtype)} ({name}: {what} "
                                            f"dtype {t.dtype}, weight dtype {w.dtype})")
            for k, t in enumerate(states):
                if t.dtype != input.dtype:
                    raise RNNCellDtypeError(f"{name}: hx[{k}]: expected dtype {input.dtype} (the input's), got "
                                            f"{t.dtype}")
        if input.dtype not in _TORCH_DTYPES:
            raise RNNCellDtypeError(f"{name}: input: expected dtype float16, bfloat16, float32 or float64, got "
                                    f"{input.dtype}")
        for what, t in (("input", input), *((f"hx[{k}]", t) for k, t in enumerate(states))):
            if t.device != w.device:
                raise RNNShapeError(f"{name}: {what} and parameter tensors are not at the same device, found "
                                        f"{what} tensor at {t.device} and parameter tensor at {w.device}")

    def forward(self, input, hx=None):
        self._check_ranks(input, hx)
        lstm = self._has_cell_state
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)                                   # [B, I]
        if hx is None:
            states = ()
        elif lstm:
            states = tuple(hx) if batched else tuple(t.unsqueeze(0) for t in hx)      # ([B, H], [B, H])
        else:
            states = (hx if batched else hx.unsqueeze(0),)                            # ([B, H],)
        rnn_mode = self._rnn_mode()
        autocast = _autocast_dtype(x)
        self._check_sizes(x, states, batched, autocast is not None)
        if not self.hidden_size or not self.input_size:    # an empty cell (numbarnn's op needs H, I > 0)
            return self._empty_step(x, states, batched, autocast)
        weights = [getattr(self, name) for name in self._weight_names]
        if autocast is not None:                            # torch.autocast: as numbarnn.torch's RNNs compute
            x = x.to(autocast)
            weights = [w.to(autocast) for w in weights]
            states = tuple(t.to(autocast) for t in states)
        if not states:
            zeros = x.new_zeros((1, x.size(0), self.hidden_size))                      # [1, B, H]
            h0, c0 = zeros, (zeros if lstm else None)
        else:
            h0, c0 = states[0].unsqueeze(0), (states[1].unsqueeze(0) if lstm else None)  # [1, B, H]
        x = x.unsqueeze(0)                                                             # [T=1, B, I]
        is_training = _needs_reserve(x, h0, c0, weights)
        backend = self.backend or ("cuda" if x.is_cuda else "")
        net = (rnn_mode, 1, self.hidden_size, self.input_size, False, 0, bool(self.bias), 0.0, bool(is_training),
               backend, 0.0)                                            # (no dropout, no zoneout)
        seeds = torch.zeros(2, dtype=torch.int64) if torch.compiler.is_compiling() else _NO_SEEDS
        views = self._weight_views if autocast is None else None     # (autocast: cast copies, new each call)
        _, hT, cT, _ = _call(x, h0, c0, weights, None, seeds, net, views)         # [1, B, H] each
        h1 = hT[0] if batched else hT[0, 0]
        if not lstm:
            return h1
        return h1, (cT[0] if batched else cT[0, 0])


    def _empty_step(self, x, states, batched, autocast):
        """torch.nn's cells with hidden_size 0 (an empty h') or input_size 0 (h' from h alone): computed here in
        torch operations, the cell's own forward on zero-width W x (`numbarnn.torch_network`'s cell step)."""
        dtype = autocast or x.dtype
        B, H = x.shape[0], self.hidden_size
        w = {name: getattr(self, name) for name in self._weight_names}
        h = states[0].to(dtype) if states else x.new_zeros((B, H), dtype=dtype)
        c = (states[1].to(dtype) if states else x.new_zeros((B, H), dtype=dtype)) if self._has_cell_state else None
        gx = x.to(dtype) @ w["weight_ih"].to(dtype).T + (w["bias_ih"].to(dtype) if self.bias else 0.0)
        vectors = [w[name].to(dtype) for name in get_cell(self._rnn_mode()).vectors]
        cell = get_cell(self._rnn_mode())
        if cell.modulated:                                         # R_g (m ⊙ h) for its modulated gates
            lp = {"R": w["weight_hh"].to(dtype), "bR": w["bias_hh"].to(dtype) if self.bias else None, "V": vectors}
            gh = _modulated_gh(cell, torch_cell_modulation(cell.name), lp, gx, h, H)
        else:
            gh = h @ w["weight_hh"].to(dtype).T + (w["bias_hh"].to(dtype) if self.bias else 0.0)
        h1, c1 = cell_step(self._rnn_mode(), gx, gh, vectors, h, c, H)
        if not batched:
            h1, c1 = h1[0], (None if c1 is None else c1[0])
        return (h1, c1) if self._has_cell_state else h1


class LSTMCell(CellModule):
    """torch.nn.LSTMCell on numbarnn: ``LSTMCell(input_size, hidden_size, bias=True, device=None, dtype=None, *,
    backend=None)``; ``forward(input, hx=None) -> (h', c')``."""

    _torch_name = "LSTMCell"

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None, *, backend=None):
        torch.nn.Module.__init__(self)
        self._setup("lstm", input_size, hidden_size, bias, device, dtype, backend)


class GRUCell(CellModule):
    """torch.nn.GRUCell on numbarnn: ``GRUCell(input_size, hidden_size, bias=True, device=None, dtype=None, *,
    backend=None)``; ``forward(input, hx=None) -> h'``."""

    _torch_name = "GRUCell"

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None, *, backend=None):
        torch.nn.Module.__init__(self)
        self._setup("gru", input_size, hidden_size, bias, device, dtype, backend)


class RNNCell(CellModule):
    """torch.nn.RNNCell on numbarnn: ``RNNCell(input_size, hidden_size, bias=True, nonlinearity='tanh',
    device=None, dtype=None, *, backend=None)``; ``forward(input, hx=None) -> h'``.  As in torch.nn, the
    nonlinearity ('tanh' or 'relu') is read at each call (an unknown one raises there, not here)."""

    _torch_name = "RNNCell"

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None, dtype=None, *,
                 backend=None):
        torch.nn.Module.__init__(self)
        self._setup("rnn_tanh", input_size, hidden_size, bias, device, dtype, backend)   # rnn_relu: same params
        self.nonlinearity = nonlinearity

    def _rnn_mode(self) -> str:
        mode = _RNN_MODES.get(self.nonlinearity) if isinstance(self.nonlinearity, str) else None
        if mode is None:
            raise RNNShapeError(f"Unknown nonlinearity: {self.nonlinearity} (RNNCell: expected 'tanh' or "
                                    "'relu')")
        return mode



class RNNCellDtypeError(RNNDtypeError, RuntimeError):
    """A bad or mixed dtype in a cell call: numbarnn's RNNDtypeError (TypeError, ValueError) and a RuntimeError
    (what torch.nn's cells raise: matmul's "mat1 and mat2 must have the same dtype")."""

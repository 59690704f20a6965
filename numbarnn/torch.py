"""Drop-ins for ``torch.nn.LSTM``, ``torch.nn.GRU`` and ``torch.nn.RNN`` that run on numbarnn's ops.

Install with ``pip install numbarnn[torch]``; the rest of numbarnn never imports torch.  Usage::

    from numbarnn.torch import LSTM
    lstm = LSTM(input_size=8, hidden_size=16, num_layers=2, bidirectional=True, batch_first=True)
    output, (h_n, c_n) = lstm(x)                      # exactly what torch.nn.LSTM returns
    lstm.load_state_dict(torch_lstm.state_dict())     # and the other way round

Same constructor arguments as torch.nn, in torch.nn's positional order (plus the keyword ``backend``: a numbarnn
backend name, None = numbarnn's default), the same parameter names, shapes and initialisation
(uniform(-1/sqrt(H), 1/sqrt(H)), drawn in PyTorch's order, so ``torch.manual_seed(s)`` gives the same initial
weights as torch.nn), the same inputs (padded ``[T, B, I]`` / ``[B, T, I]`` with ``batch_first``, unbatched
``[T, I]``, or a ``PackedSequence``), the same outputs, and torch.nn's checks with its messages (numbarnn's detail
after them).

* **One operator.** A call is the custom operator ``numbarnn::rnn`` (``torch.library``; backward:
  ``numbarnn::rnn_backward``), with a fake implementation (the meta device, FakeTensor tracing) and autograd
  registered on it: ``torch.compile(..., fullgraph=True)`` keeps it as one node (dynamo never traces numba) and
  ``torch.export`` exports it.  The operator gathers the parameters into numbarnn's opaque buffer (SPEC 4.2;
  ``weight_ih_l{k}`` is the stacked W of pseudo-layer p, ``weight_hh`` the stacked R, ``bias_ih``/``bias_hh``
  bW/bR, ``weight_hr`` W_proj; absent biases are zeros) and calls ``ops.cudnn_rnn_v3``; its backward calls
  ``ops.cudnn_rnn_backprop_v3`` and hands each parameter its slice of ``params_backprop``.  It runs with
  ``is_training=True`` (keeping the reserve space) whenever a gradient may be needed, or dropout is active.
* **Higher derivatives.** Under ``create_graph=True`` (double backward, gradgradcheck, Hessians) the gradients
  come from the network recomputed in torch operations from the cell's own spec (``numbarnn.torch_network``),
  which autograd differentiates again; first-order gradients stay numbarnn's kernels.  torch.func's transforms
  (vmap: extra batch rows; grad, jacrev; jacfwd: forward mode through ``torch_network``) go through an
  autograd.Function with ``setup_context`` around the same operator (torch.library's generated autograd
  refuses them).
* **Dtypes.** float16, bfloat16, float32, float64; bfloat16 and float16 are stored as such and computed in
  float32.  Under ``torch.autocast`` the input, state and weights are cast to the autocast dtype, as torch.nn's
  RNNs are.
* **Dropout** (training mode, ``num_layers > 1``) uses numbarnn's Philox mask (SPEC 6), not torch's bernoulli
  draws: each call draws ``(seed, seed2)`` with ``torch.randint`` from torch's default CPU generator (inside a
  compiled graph too), so masks differ from call to call and ``torch.manual_seed`` makes runs reproducible.
  Masks therefore differ from torch.nn's for the same seed (the distribution is the same).
* **Zoneout** (keyword ``zoneout``, haste's name; default 0.0, none): haste's zoneout of h (SPEC 6.1).  Training
  mode keeps h_prev where a Philox mask drawn like dropout's (fresh keys per call) is 0; eval mode takes the
  expectation ``p*h_prev + (1-p)*h_new`` (the op's inference; its gradient, when one is asked for, comes from
  ``torch_network``, as haste's eval-mode zoneout is an ordinary differentiable expression).
* **Errors** are raised before any work: shape errors as ``RNNShapeError`` (a ``ValueError`` and a
  ``RuntimeError``, whichever torch.nn raises), dtype errors as ``RNNDtypeError`` (``TypeError`` and
  ``ValueError``).

Distributed training.  The modules work under ``torch.nn.parallel.DistributedDataParallel`` unchanged (gloo on
the CPU, NCCL on GPUs; tests/test_ddp.py, examples/ddp_train.py): every weight is an ordinary registered
parameter, in a fixed order, reached by autograd through the one operator; there are no buffers and no state
outside the parameters, and ``flatten_parameters`` is a no-op.  With dropout, each process draws its Philox keys
from its own torch generator, so processes seeded alike draw the same masks for their (different) samples, as
torch.nn's dropout does; seed each process differently (``torch.manual_seed(seed + rank)`` after wrapping in DDP)
for independent masks.

Devices.  CPU tensors reach the ops as NumPy arrays (zero-copy views of the contiguous, detached tensors) and
results come back through ``torch.from_numpy``.  CUDA tensors reach the kernels zero-copy through
``__cuda_array_interface__`` (as numba device arrays; default backend "cuda") and results are wrapped with
``torch.as_tensor`` on the same device, still without a copy.  numbarnn launches its kernels on numba's default
stream, which is the legacy default stream that torch calls ``torch.cuda.default_stream()``; when torch's
current stream is another one, the call makes the default stream wait for torch's current stream before the
launch and torch's current stream wait for the default stream after it, so the op behaves as if it ran on
torch's current stream (no host synchronisation).  Device memory of results is allocated by numba, not by
torch's caching allocator.  The CUDA path cannot be exercised without a GPU (the tests cover the CPU path).

The parts: this module holds the modules (one base: constructor checks, parameter registration, input forms,
the eager per-signature fast path); numbarnn/torch_ops.py the two operators, their autograd, the eager way round
the dispatcher and the fast path's autograd function; numbarnn/torch_tensors.py tensors <-> arrays, the
parameters' layout and the checks the modules and the cells (numbarnn/torch_cells.py) share;
numbarnn/torch_layer_norm.py haste's LayerNormLSTM and LayerNormGRU; numbarnn/torch_network.py the network in
torch operations (higher derivatives, forward mode, haste's state sequences).

Why one file (over 500 lines): the modules a torch.nn user imports, one base class with torch.nn's checks and
messages and its subclasses; the operators and the tensor plumbing are in torch_ops.py and torch_tensors.py.
"""
from __future__ import annotations

import numbers
import warnings

import numpy as np

try:
    import torch
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("numbarnn.torch needs PyTorch: pip install numbarnn[torch]") from exc

from .backends import BACKENDS, get_backend, get_default_backend
from .cells import CellSpec, get_cell, register
from .config import check_zoneout, validate_forward
from .params import from_torch_state_dict, to_torch_state_dict
from .torch_cells import CellModule, GRUCell, LSTMCell, RNNCell
from .torch_layer_norm import LayerNormGRU, LayerNormLSTM
from .torch_ops import _NO_SEEDS, _call, _eager, _fast_forward, _FastRNNFunction, rnn_backward_op, rnn_op
from .torch_tensors import (_NUMPY_GATHER, _TORCH_DTYPES, RNNDtypeError, RNNShapeError, _autocast_dtype,
                            _call_config, _check_sizes, _FastCalls, _layout, _needs_reserve, _op_attrs,
                            _reset_uniform, _WeightViews)
from .validation import check_choice

__all__ = ["LSTM", "GRU", "RNN", "RNNBase", "LSTMCell", "GRUCell", "RNNCell", "CellModule", "RNNShapeError",
           "RNNDtypeError", "rnn_op", "rnn_backward_op", "LayerNormLSTM", "LayerNormGRU"]


# ---------------------------------------------------------------------------------------------------
# the modules
# ---------------------------------------------------------------------------------------------------

def _check_network_args(input_size, hidden_size, num_layers, bias, batch_first, dropout, proj_size) -> None:
    """torch.nn.RNNBase's constructor checks, in its order and with its messages (then numbarnn's own)."""
    if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
        raise ValueError("dropout should be a number in range [0, 1] representing the probability of an element "
                         f"being zeroed (got {dropout!r})")
    for name, value in (("bias", bias), ("batch_first", batch_first)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} should be of type bool, got: {type(value).__name__}")
    _check_sizes(input_size=input_size, hidden_size=hidden_size, num_layers=num_layers, proj_size=proj_size)
    if proj_size < 0:
        raise ValueError(f"proj_size should be a positive integer or zero to disable projections (got {proj_size})")
    if proj_size >= hidden_size:
        raise ValueError(f"proj_size has to be smaller than hidden_size (got proj_size={proj_size}, "
                         f"hidden_size={hidden_size})")


class _NumbaRNNBase(torch.nn.Module):
    """Shared by LSTM, GRU and RNN: parameters as torch.nn.RNNBase registers them, forward via numbarnn's
    operator.  Arguments are checked as torch.nn checks them, with torch.nn's messages."""

    def __init__(self, mode: str, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, backend=None,
                 zoneout=0.0):
        super().__init__()
        self.mode = mode   # torch.nn's spelling: "LSTM", "GRU", "RNN_TANH", "RNN_RELU"; or a registered cell
        self.rnn_mode = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}.get(mode, mode)
        _check_network_args(input_size, hidden_size, num_layers, bias, batch_first, dropout, proj_size)
        if dropout > 0 and num_layers == 1:
            warnings.warn("dropout option adds dropout after all but last recurrent layer, so non-zero dropout "
                          f"expects num_layers greater than 1, but got dropout={dropout} and "
                          f"num_layers={num_layers}", stacklevel=3)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bool(bidirectional), proj_size
        self.zoneout = check_zoneout(zoneout)        # haste's zoneout of h (SPEC 6.1): [0, 1), 0 = none
        self.backend = None if backend is None else check_choice("backend", backend, tuple(BACKENDS))
        self._layout = _layout(self.rnn_mode, num_layers, hidden_size, input_size, self.bidirectional, proj_size,
                               bias)                      # numbarnn's checks of the network (rnn_config)
        self._config = self._layout.config
        self._cell_state = self._layout.cell_state
        factory = {"device": device, "dtype": dtype}
        for name, shape in zip(self._layout.names, self._layout.shapes):
            setattr(self, name, torch.nn.Parameter(torch.empty(shape, **factory)))
        self._flat_weights_names = list(self._layout.names)
        self._all_weights = [list(group) for group in self._layout.groups]
        self._weight_views = _WeightViews()
        self._fast_calls = _FastCalls()
        self.reset_parameters()

    def __setstate__(self, state):
        """Modules pickled whole before the per-call helpers existed get them (state_dicts need nothing)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_weight_views", _WeightViews())
        self.__dict__.setdefault("_fast_calls", _FastCalls())
        self.__dict__.setdefault("_cell_state", get_cell(self.rnn_mode).cell_state)
        self.__dict__.setdefault("zoneout", 0.0)

    # -- torch.nn.RNNBase compatibility ---------------------------------------------------------
    def reset_parameters(self) -> None:
        """PyTorch's init: every parameter uniform(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), in its order."""
        _reset_uniform(self, self.hidden_size)

    def flatten_parameters(self) -> None:
        """No-op (torch.nn uses it for cuDNN's flat weight buffer; numbarnn gathers parameters per call)."""

    @property
    def _flat_weights(self) -> list:
        # (registered parameters read from the dict: getattr goes through Module.__getattr__, ~1 us each; names
        # not there, e.g. parametrized or weight-normed weights, through getattr)
        params = self._parameters
        return [params[name] if name in params else getattr(self, name) for name in self._flat_weights_names]

    @property
    def all_weights(self) -> list:
        return [[getattr(self, name) for name in names] for names in self._all_weights]

    def extra_repr(self) -> str:
        s = "{input_size}, {hidden_size}"
        if self.proj_size != 0:
            s += ", proj_size={proj_size}"
        if self.num_layers != 1:
            s += ", num_layers={num_layers}"
        if self.bias is not True:
            s += ", bias={bias}"
        if self.batch_first is not False:
            s += ", batch_first={batch_first}"
        if self.dropout != 0:
            s += ", dropout={dropout}"
        if self.bidirectional is not False:
            s += ", bidirectional={bidirectional}"
        if self.zoneout != 0:
            s += ", zoneout={zoneout}"
        if self.backend is not None:
            s += ", backend={backend!r}"
        return s.format(**self.__dict__)

    # -- forward ----------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor, packed: bool, autocast: bool, w: torch.Tensor) -> None:
        """torch.nn.RNNBase.check_input (dtype, rank, input_size), then numbarnn's: a float dtype, one device
        (w: the first weight)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input: expected a torch.Tensor or a PackedSequence, got {type(x).__name__}")
        if x.dtype != w.dtype and not autocast:
            raise RNNDtypeError(f"RNN input dtype ({x.dtype}) does not match weight dtype ({w.dtype}). Convert "
                                f"input: input.to({w.dtype}), or convert model: model.to({x.dtype})")
        expected = 2 if packed else 3
        if x.dim() != expected:
            raise RNNShapeError(f"input must have {expected} dimensions, got {x.dim()} (input"
                                f"{'.data of a PackedSequence' if packed else ''}: shape {tuple(x.shape)})")
        if x.size(-1) != self.input_size:
            raise RNNShapeError(f"input.size(-1) must be equal to input_size. Expected {self.input_size}, got "
                                f"{x.size(-1)} (input{'.data' if packed else ''}: shape {tuple(x.shape)})")
        if x.dtype not in _TORCH_DTYPES:
            raise RNNDtypeError(f"input: expected dtype float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.device != w.device:
            raise RNNShapeError(f"Input and parameter tensors are not at the same device, found input tensor at "
                                f"{x.device} and parameter tensor at {w.device}")

    def _initial_state(self, hx, x: torch.Tensor):
        """hx (None, a tensor, or (h_0, c_0) for LSTM), already batched -> h0 [L*D, B, P], c0 [L*D, B, H] or
        None, checked as torch.nn.RNNBase.check_hidden_size checks them (its messages)."""
        cfg, B, lstm = self._config, x.shape[1], self._cell_state
        expected_h, expected_c = (cfg.L * cfg.D, B, cfg.P), (cfg.L * cfg.D, B, cfg.H)
        if hx is None:
            h0 = x.new_zeros(expected_h)                                                   # [L*D, B, P]
            return h0, (x.new_zeros(expected_c) if lstm else None)                         # [L*D, B, H]
        states = (hx[0], hx[1]) if lstm else (hx,)
        for k, (t, expected) in enumerate(zip(states, (expected_h, expected_c))):
            if t.shape != expected:
                what_h = "[num_layers*num_directions, batch, proj_size or hidden_size]" if cfg.has_proj else \
                    "[num_layers*num_directions, batch, hidden_size]"
                what_c = "[num_layers*num_directions, batch, hidden_size]"
                msg = ("Expected hidden[0] size {}, got {} (h_0: " + what_h + ")",
                       "Expected hidden[1] size {}, got {} (c_0: " + what_c + ")")[k] if lstm else \
                    "Expected hidden size {}, got {} (hx: " + what_h + ")"
                raise RNNShapeError(msg.format(expected, list(t.size())))
            if t.dtype != x.dtype:
                raise RNNDtypeError(f"hx: expected dtype {x.dtype} (the input's), got {t.dtype}")
            if t.device != x.device:
                raise RNNShapeError(f"Input and hidden tensors are not at the same device, found input tensor at "
                                    f"{x.device} and hidden tensor at {t.device}")
        return states[0], (states[1] if lstm else None)

    def _batched_hx(self, hx, batched: bool):
        """torch.nn's rank checks of hx for padded input (its messages); unbatched hx gains the batch axis."""
        if hx is None:
            return None
        lstm = self._cell_state
        if lstm:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"hx: expected a tuple (h_0, c_0) for LSTM, got {type(hx).__name__}")
            for t in hx:
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"hx: expected a tuple of two tensors (h_0, c_0), got {type(t).__name__}")
            rank, what = (3, "batched 3-D") if batched else (2, "unbatched 2-D")
            if hx[0].dim() != rank or hx[1].dim() != rank:
                raise RNNShapeError(f"For {what} input, hx and cx should also be {rank}-D but got "
                                    f"({hx[0].dim()}-D, {hx[1].dim()}-D) tensors")
            return hx if batched else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        if not isinstance(hx, torch.Tensor):
            raise TypeError(f"hx: expected a tensor, got {type(hx).__name__}")
        rank, what = (3, "batched 3-D") if batched else (2, "unbatched 2-D")
        if hx.dim() != rank:
            raise RNNShapeError(f"For {what} input, hx should also be {rank}-D but got {hx.dim()}-D tensor")
        return hx if batched else hx.unsqueeze(1)

    def _call_args(self, x, h0, c0, weights) -> tuple:
        """(seeds [2] int64, dropout, is_training, needs_grad) of this call: the op keeps the reserve space whenever a
        gradient may be needed (eval mode too, then with dropout 0) or dropout is active; a fresh Philox key per
        call with active dropout, drawn from torch's default generator."""
        dropout_active = self.training and self.dropout > 0 and self.num_layers > 1
        zoneout_active = self.training and self.zoneout > 0
        needs_grad = _needs_reserve(x, h0, c0, weights)
        if dropout_active or zoneout_active:
            seeds = torch.randint(0, 2 ** 32, (2,), dtype=torch.int64)
        elif torch.compiler.is_compiling():
            seeds = torch.zeros(2, dtype=torch.int64)
        else:
            seeds = _NO_SEEDS                   # (never written: the ops only read it)
        is_training = bool(needs_grad or dropout_active or zoneout_active)
        if self.zoneout > 0 and not self.training:   # zoneout's expectation (the op's inference; its gradient:
            is_training = False                      # torch's, `_grads`)
        return seeds, (self.dropout if dropout_active else 0.0), is_training, needs_grad

    def _fast(self, x: torch.Tensor, hx, weights):
        """(output, h_n[, c_n]) of an eager CPU call on the cpu backend that draws no masks (no active dropout, no
        training-mode zoneout; eval-mode zoneout is its expectation, taken here, without gradients), padded and
        batched [T, B, I] input in float32/float64 with weights of its dtype; None for every other call (the
        general path below then runs it, with the same checks and results).  What depends only on the call's
        signature is made once (`_FastCalls`); a call that may be differentiated runs `_FastRNNFunction`."""
        if not (x.is_cpu and x.dim() == 3 and x.dtype in _NUMPY_GATHER and x.shape[0] > 0) or (
                self.training and (self.zoneout > 0 or self.dropout > 0 and self.num_layers > 1)) or \
                _autocast_dtype(x) is not None:                  # (training masks: keys drawn per call)
            return None
        if hx is not None:                                   # torch.nn's checks (its messages) of a given state
            h0, c0 = self._initial_state(self._batched_hx(hx, True), x.transpose(0, 1) if self.batch_first
                                         else x)
        else:
            h0 = c0 = None
        if not _eager((x, *weights) if hx is None else (x, h0, *weights) if c0 is None else (x, h0, c0, *weights)):
            return None
        training = _needs_reserve(x, h0, c0, weights)
        if training and self.zoneout > 0 or (self.backend or get_default_backend()) != "cpu":
            return None               # (eval-mode zoneout's gradient: torch's; the default may change between calls)
        params = self._weight_views.array(self._layout.spans, self._layout.size, weights, x.dtype)     # [N]
        if params is None:
            return None
        key = (x.shape, x.dtype, self.batch_first, self.zoneout, training)
        entry = self._fast_calls.entries.get(key)
        if entry is None:
            entry = self._fast_calls.entries[key] = self._fast_entry(x, weights, params, training)
        if training:
            return self._outputs(_FastRNNFunction.apply(x, h0, c0, entry, params, *weights))
        return self._outputs(_fast_forward(entry, x, h0, c0, params)[0])

    def _fast_entry(self, x, weights, params, training: bool) -> tuple:
        """A `_FastCalls` entry for input x (checked as the general path checks it, torch.nn's messages)."""
        self._check_input(x, False, False, weights[0])
        xt = x.transpose(0, 1) if self.batch_first else x                         # [T, B, I]
        L_D, B, dtype = self._config.L * self._config.D, xt.shape[1], _NUMPY_GATHER[x.dtype]
        zeros_h = np.zeros((L_D, B, self._config.P), dtype)                       # [L*D, B, P]
        zeros_c = np.zeros((L_D, B, self._config.H), dtype) if self._cell_state else None   # [L*D, B, H]
        cfg = _call_config(self._layout, 0.0, (0, 0), self.zoneout)         # (eval: zoneout's expectation)
        attrs = {k: v for k, v in _op_attrs(cfg, "").items() if k != "backend"}
        call, _ = validate_forward(np.zeros(tuple(xt.shape), dtype), zeros_h, zeros_c, params, None,
                                   is_training=training, **attrs)
        net = (self.rnn_mode, self.num_layers, self.hidden_size, self.input_size, self.bidirectional,
               self.proj_size, self.bias, 0.0, training, "cpu", self.zoneout)
        return call, get_backend("cpu"), zeros_h, zeros_c, self.batch_first, net

    def _outputs(self, out: tuple) -> tuple:
        """(y, h_n[, c_n]) -> the module's (output, h_n) or (output, (h_n, c_n))."""
        return (out[0], (out[1], out[2])) if self._cell_state else (out[0], out[1])

    def forward(self, input, hx=None):
        weights = self._flat_weights
        if type(input) is torch.Tensor:                      # the common case first: an eager CPU call
            out = self._fast(input, hx, weights)
            if out is not None:
                return out
        packed = isinstance(input, PackedSequence)
        if packed:
            autocast = _autocast_dtype(input.data)
            self._check_input(input.data, True, autocast is not None, weights[0])
            x, lengths = pad_packed_sequence(input)          # [T, B, I] in the caller's batch order, [B]
            lengths = tuple(int(v) for v in lengths)
            batched = True
        else:
            if not isinstance(input, torch.Tensor):
                raise TypeError(f"input: expected a torch.Tensor or a PackedSequence, got {type(input).__name__}")
            if input.dim() not in (2, 3):
                name = {"LSTM": "LSTM", "GRU": "GRU", "RNN_TANH": "RNN", "RNN_RELU": "RNN"}.get(self.mode,
                                                                                          type(self).__name__)
                raise RNNShapeError(f"{name}: Expected input to be 2D or 3D, got {input.dim()}D "
                                    f"{'tensor ' if name == 'RNN' else ''}instead")
            batched = input.dim() == 3
            x = input if batched else input.unsqueeze(0 if self.batch_first else 1)
            autocast = _autocast_dtype(x)
            self._check_input(x, False, autocast is not None, weights[0])
            if self.batch_first:
                x = x.transpose(0, 1)                         # [T, B, I]
            lengths = None
            if x.shape[0] == 0:
                raise RNNShapeError("Expected sequence length to be larger than 0 in RNN")
        hx = self._batched_hx(hx, batched)                    # in the caller's batch order, as x
        if autocast is not None:                              # torch.autocast: compute as torch.nn does
            x = x.to(autocast)
            weights = [w.to(autocast) for w in weights]
            if hx is not None:
                hx = tuple(t.to(autocast) for t in hx) if self._cell_state else hx.to(autocast)
        h0, c0 = self._initial_state(hx, x)
        seeds, dropout, is_training, needs_grad = self._call_args(x, h0, c0, weights)
        backend = self.backend or ("cuda" if x.is_cuda else "")
        net = (self.rnn_mode, self.num_layers, self.hidden_size, self.input_size, self.bidirectional,
               self.proj_size, self.bias, dropout, is_training, backend, self.zoneout)
        views = self._weight_views if autocast is None else None       # (autocast: cast copies, new each call)
        y, hT, cT, _ = _call(x, h0, c0, weights, lengths, seeds, net, views, needs_grad)   # [T, B, D*P], [L*D, B, P],
        #                                                                                 [L*D, B, H]
        cT = cT if self._cell_state else None

        if packed:
            output = _repack(y, lengths, input)
        else:
            output = y.transpose(0, 1).contiguous() if self.batch_first else y
            if not batched:
                output = output.squeeze(0 if self.batch_first else 1)
                hT = hT.squeeze(1)
                cT = None if cT is None else cT.squeeze(1)
        return (output, (hT, cT)) if self._cell_state else (output, hT)


def _repack(y: torch.Tensor, lengths: tuple, like: PackedSequence) -> PackedSequence:
    """y [T, B, D*P] in the caller's batch order -> a PackedSequence with `like`'s batch_sizes and indices."""
    if like.sorted_indices is not None:
        y = y.index_select(1, like.sorted_indices)                       # batch in decreasing length
        order = like.sorted_indices.cpu().tolist()
        lengths = tuple(lengths[b] for b in order)
    data = pack_padded_sequence(y, torch.tensor(lengths, dtype=torch.int64), enforce_sorted=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


class LSTM(_NumbaRNNBase):
    """torch.nn.LSTM on numbarnn: ``LSTM(input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
    dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None, zoneout=0.0)``.

    ``forward(input, hx=None) -> (output, (h_n, c_n))``; see the module docstring for what differs.
    ``zoneout``: haste's zoneout of h (its argument name; SPEC 6.1): in training each step keeps h_prev with
    probability zoneout (Philox masks drawn per call, like dropout's), in eval mode h' = p*h_prev + (1-p)*h_new.
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None, zoneout=0.0):
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, device, dtype, backend, zoneout)


def _no_proj(proj_size) -> None:
    """torch.nn.GRU / RNN take proj_size (positionally after bidirectional) only as 0."""
    if proj_size != 0:
        raise ValueError(f"proj_size argument is only supported for LSTM, not RNN or GRU (got proj_size={proj_size})")


class RNNBase(_NumbaRNNBase):
    """A torch module of any registered cell, parameters named as torch.nn.RNNBase names them (plus one
    ``<vector>_l{k}[_reverse]`` per cell vector): ``RNNBase(cell, input_size, hidden_size, num_layers=1,
    bias=True, batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *,
    backend=None, zoneout=0.0)``.  `cell` is an rnn_mode name or a `numbarnn.cells.CellSpec` (registered if need
    be); ``zoneout`` as `LSTM`'s (haste's IndRNN takes it too).

    ``forward(input, hx=None) -> (output, (h_n, c_n))`` for cells with a cell state, ``(output, h_n)`` otherwise.
    """

    def __init__(self, cell, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None, zoneout=0.0):
        if isinstance(cell, CellSpec):
            register(cell)
            cell = cell.name
        super().__init__(get_cell(cell).name, input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, proj_size, device, dtype, backend, zoneout)


class GRU(_NumbaRNNBase):
    """torch.nn.GRU on numbarnn: ``GRU(input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
    dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None, zoneout=0.0)``
    (torch.nn's positional order; proj_size only 0, as torch.nn.GRU takes it; ``zoneout`` as `LSTM`'s).

    ``forward(input, hx=None) -> (output, h_n)``.
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None, zoneout=0.0):
        _no_proj(proj_size)
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype, backend, zoneout)


class RNN(_NumbaRNNBase):
    """torch.nn.RNN on numbarnn: ``RNN(input_size, hidden_size, num_layers=1, nonlinearity='tanh', bias=True,
    batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *,
    backend=None)`` (torch.nn's positional order; proj_size only 0).

    ``nonlinearity`` 'tanh' or 'relu' (numbarnn's rnn_tanh / rnn_relu).  ``forward(input, hx=None) -> (output,
    h_n)``.
    """

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None):
        _no_proj(proj_size)
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or 'relu'.")
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size, hidden_size,
                         num_layers, bias, batch_first, dropout, bidirectional, 0, device, dtype, backend)
        self.nonlinearity = nonlinearity         # (not in repr: torch.nn's RNN leaves it out too)


# ---------------------------------------------------------------------------------------------------
# torch.nn itself as an independent oracle (used by `numbarnn check` and the cross-check tests)
# ---------------------------------------------------------------------------------------------------

_TORCH_NN = {"lstm": lambda **kw: torch.nn.LSTM(**kw), "gru": lambda **kw: torch.nn.GRU(**kw),
             "rnn_tanh": lambda **kw: torch.nn.RNN(nonlinearity="tanh", **kw),
             "rnn_relu": lambda **kw: torch.nn.RNN(nonlinearity="relu", **kw)}


def torch_nn_module(cfg, params, dtype=torch.float64, batch_first: bool = False) -> torch.nn.Module:
    """The torch.nn.LSTM / GRU / RNN of `cfg` holding the weights of numbarnn's opaque `params`, in `dtype`."""
    if cfg.rnn_mode not in _TORCH_NN:
        raise ValueError(f"rnn_mode: torch.nn has no {cfg.rnn_mode!r} cell")
    kw = dict(input_size=cfg.I, hidden_size=cfg.H, num_layers=cfg.L, bias=True, batch_first=batch_first,
              dropout=0.0, bidirectional=cfg.D == 2)
    if cfg.num_proj:
        kw["proj_size"] = cfg.num_proj
    module = _TORCH_NN[cfg.rnn_mode](**kw).to(dtype=dtype)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dtype)
             for k, v in to_torch_state_dict(cfg, np.asarray(params, np.float64)).items()}
    module.load_state_dict(state, strict=True)
    return module


def torch_nn_supports(case) -> str | None:
    """None when torch.nn can compute `case` (a numbarnn.testing.RNNCase), else why not."""
    cfg = case.cfg
    if cfg.rnn_mode not in _TORCH_NN:
        return f"torch.nn has no {cfg.rnn_mode!r} cell"
    if cfg.skip_input:
        return "torch.nn has no skip_input"
    if case.is_training and cfg.dropout > 0 and cfg.L > 1:
        return "torch.nn's dropout masks differ from numbarnn's Philox masks"
    if cfg.zoneout:
        return "torch.nn has no zoneout"
    if case.lengths is not None and min(case.lengths, default=1) < 1:
        return "torch.nn rejects length-0 sequences"
    return None


def torch_nn_outputs(case) -> dict:
    """Forward and gradients of `case` computed by torch.nn.LSTM/GRU/RNN in float64, in numbarnn's layouts.

    Keys: output, output_h, output_c (LSTM), input_backprop, input_h_backprop, input_c_backprop (LSTM),
    params_backprop (opaque layout).  The loss is <y, dy> + <h_n, dhT> (+ <c_n, dcT>), as in backprop_v3.
    Ragged lengths go through pack_padded_sequence(enforce_sorted=False).  Raises ValueError for a case
    torch.nn cannot express (see `torch_nn_supports`).
    """
    why = torch_nn_supports(case)
    if why:
        raise ValueError(f"case: {why}")
    cfg, tm = case.cfg, case.time_major
    module = torch_nn_module(cfg, case.params, torch.float64, batch_first=not tm)

    def leaf(a, swap=False):   # numbarnn batch-major states are [B, L*D, *]; torch's are [L*D, B, *] always
        a = np.asarray(a, dtype=np.float64)
        return torch.tensor(np.ascontiguousarray(np.swapaxes(a, 0, 1) if swap else a), requires_grad=True)

    def back(t, swap=False):
        a = t.detach().numpy()
        return np.ascontiguousarray(np.swapaxes(a, 0, 1)) if swap else a.copy()

    x, h0 = leaf(case.x), leaf(case.h0, not tm)
    c0 = leaf(case.c0, not tm) if cfg.has_cell_state else None
    if case.lengths is not None:
        seq = pack_padded_sequence(x, torch.as_tensor(np.asarray(case.lengths, np.int64)), batch_first=not tm,
                                   enforce_sorted=False)
        out, final = module(seq, (h0, c0) if cfg.has_cell_state else h0)
        y, _ = pad_packed_sequence(out, batch_first=not tm, total_length=case.T)
    else:
        y, final = module(x, (h0, c0) if cfg.has_cell_state else h0)
    hn, cn = final if cfg.has_cell_state else (final, None)
    loss = (y * torch.from_numpy(np.asarray(case.dy, np.float64))).sum() + \
        (hn * leaf(case.dhT, not tm).detach()).sum()
    if cfg.has_cell_state:
        loss = loss + (cn * leaf(case.dcT, not tm).detach()).sum()
    loss.backward()
    grads = {name: p.grad.detach().numpy() for name, p in module.named_parameters()}
    result = {"output": back(y), "output_h": back(hn, not tm), "input_backprop": back(x.grad),
              "input_h_backprop": back(h0.grad, not tm),
              "params_backprop": from_torch_state_dict(cfg, grads, dtype=np.float64)}
    if cfg.has_cell_state:
        result.update(output_c=back(cn, not tm), input_c_backprop=back(c0.grad, not tm))
    return result


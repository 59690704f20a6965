"""Drop-ins for ``torch.nn.LSTM``, ``torch.nn.GRU`` and ``torch.nn.RNN`` that run on numbarnn's ops.

Install with ``pip install numbarnn[torch]``; the rest of numbarnn never imports torch.  Usage::

    from numbarnn.torch import LSTM
    lstm = LSTM(input_size=8, hidden_size=16, num_layers=2, bidirectional=True, batch_first=True)
    output, (h_n, c_n) = lstm(x)                      # exactly what torch.nn.LSTM returns
    lstm.load_state_dict(torch_lstm.state_dict())     # and the other way round

Same constructor arguments as torch.nn (plus the keyword ``backend``: a numbarnn backend name, None = numbarnn's
default), the same parameter names, shapes and initialisation (uniform(-1/sqrt(H), 1/sqrt(H)), drawn in
PyTorch's order, so ``torch.manual_seed(s)`` gives the same initial weights as torch.nn), the same inputs
(padded ``[T, B, I]`` / ``[B, T, I]`` with ``batch_first``, unbatched ``[T, I]``, or a ``PackedSequence``) and the
same outputs.  Differences from torch.nn, by design:

* **Autograd.** One ``torch.autograd.Function`` per call: its forward gathers the parameters into numbarnn's
  opaque buffer (SPEC 4.2; PyTorch's ``weight_ih_l{k}`` is the stacked W of pseudo-layer p, ``weight_hh`` the
  stacked R, ``bias_ih``/``bias_hh`` bW/bR, ``weight_hr`` W_proj; absent biases are zeros) and calls
  ``ops.cudnn_rnn_v3``; its backward calls ``ops.cudnn_rnn_backprop_v3`` and hands each parameter its slice of
  ``params_backprop``.  Gradients reach the input, h_0, c_0 and every parameter; double backward is not supported.
  The op runs with ``is_training=True`` (keeping the reserve space) whenever a gradient may be needed, in eval
  mode too (then with dropout 0), or when dropout is active; otherwise it runs in inference mode.
* **Dropout** (training mode, ``num_layers > 1``) uses numbarnn's Philox mask (SPEC 6), not torch's bernoulli
  draws: each call draws ``(seed, seed2)`` with ``torch.randint`` from torch's default CPU generator, so masks
  differ from call to call and ``torch.manual_seed`` makes runs reproducible.  Calls without active dropout
  draw nothing.  Masks therefore differ from torch.nn's for the same seed (the distribution is the same).
* **Errors** are raised before any work: shape errors as ``ValueError`` (also catchable as ``RuntimeError``,
  which torch.nn raises), dtype errors as ``TypeError`` (also catchable as ``ValueError``).

Distributed training.  The modules work under ``torch.nn.parallel.DistributedDataParallel`` unchanged (gloo on
the CPU, NCCL on GPUs; tests/test_ddp.py, examples/ddp_train.py): every weight is an ordinary registered
parameter, in a fixed order, reached by autograd through the one Function; there are no buffers and no state
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

Why one file (~600 lines): the three modules share one base (RNNBase: constructor checks, parameter
registration, input forms, the autograd Function); split up, a reader would chase one call across files.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np

try:
    import torch
    from torch.autograd.function import once_differentiable
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("numbarnn.torch needs PyTorch: pip install numbarnn[torch]") from exc

from . import ops
from .backends import BACKENDS
from .config import RNNConfig, rnn_config
from .params import params_size, unpack
from .validation import check_choice, check_float, check_int, check_shape

__all__ = ["LSTM", "GRU", "RNN", "RNNShapeError", "RNNDtypeError"]


class RNNShapeError(ValueError, RuntimeError):
    """A bad shape or argument at call time: a ValueError (numbarnn's rule) and a RuntimeError (torch.nn's)."""


class RNNDtypeError(TypeError, ValueError):
    """A bad or mixed dtype: a TypeError (numbarnn's rule) and a ValueError (torch.nn's)."""


_TORCH_DTYPES = (torch.float16, torch.float32, torch.float64)
#: PyTorch parameter name prefix -> the LayerParams field of `numbarnn.params.unpack` it maps onto
_SLOT_OF_PREFIX = {"weight_ih": "W", "weight_hh": "R", "bias_ih": "bW", "bias_hh": "bR", "weight_hr": "W_proj"}


# ---------------------------------------------------------------------------------------------------
# tensors <-> the arrays numbarnn's ops take
# ---------------------------------------------------------------------------------------------------

def _array(t):
    """A tensor as an op argument: CPU -> NumPy view (zero-copy when contiguous); CUDA -> numba device array."""
    if t is None:
        return None
    t = t.detach().contiguous()
    if t.is_cuda:
        from numba import cuda
        return cuda.as_cuda_array(t)   # keeps `t` alive as its owner
    return t.numpy()


def _tensor(a, device: torch.device):
    """An op result as a tensor on `device`: NumPy via from_numpy, device arrays via __cuda_array_interface__."""
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a)
        return t if device.type == "cpu" else t.to(device)
    return torch.as_tensor(a, device=device)


@contextlib.contextmanager
def _device_scope(device: torch.device):
    """CPU: nothing.  CUDA: numba's context on the tensor's GPU, ordered with torch's current stream.

    numbarnn's kernels run on the legacy default stream (torch.cuda.default_stream()); events order it after
    the work already queued on torch's current stream, and that stream after the kernels.
    """
    if device.type != "cuda":
        yield
        return
    from numba import cuda   # pragma: no cover - needs a GPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    current, default = torch.cuda.current_stream(index), torch.cuda.default_stream(index)
    if current != default:
        default.wait_stream(current)
    with cuda.gpus[index]:
        yield
    if current != default:
        current.wait_stream(default)


# ---------------------------------------------------------------------------------------------------
# the autograd Function
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """Everything about one call that is not a tensor."""

    config: RNNConfig     # the network, with this call's dropout and seeds
    lengths: tuple | None  # B sequence lengths (PackedSequence input), None = all T
    is_training: bool     # the op's is_training: keep the reserve space for backward (and apply dropout)
    backend: str | None
    spans: tuple          # per weight tensor given to the Function: (offset, shape) in the opaque buffer

    def op_attrs(self) -> dict:
        c = self.config
        return dict(rnn_mode=c.rnn_mode, input_mode="linear_input", direction=c.direction, dropout=c.dropout,
                    seed=c.seed, seed2=c.seed2, num_proj=c.num_proj, time_major=True, backend=self.backend)

    def sequence_lengths(self):
        return None if self.lengths is None else np.asarray(self.lengths, dtype=np.int32)   # [B]


def _weight_spans(cfg: RNNConfig, slots) -> tuple:
    """(offset, shape) in the opaque buffer of each (pseudo-layer p, LayerParams field) slot.

    Read off `numbarnn.params.unpack` views of an index buffer, once per module (unpack walks every region).
    """
    index = np.arange(params_size(cfg))          # [N]: element k holds k
    views = unpack(cfg, index)
    spans = []
    for p, slot in slots:
        v = getattr(views[p], slot) if isinstance(slot, str) else getattr(views[p], slot[0])[slot[1]]
        # a view: its first element is its offset
        spans.append((int(v.reshape(-1)[0]), tuple(v.shape)))
    return tuple(spans)


def _opaque_params(plan: _Plan, weights, like: torch.Tensor) -> torch.Tensor:
    """The module's parameters gathered into numbarnn's opaque buffer [N] (missing biases stay 0)."""
    params = torch.zeros(params_size(plan.config), dtype=like.dtype, device=like.device)   # [N]
    for (offset, shape), w in zip(plan.spans, weights):
        params[offset:offset + w.numel()].view(shape).copy_(w.detach())
    return params


def _weight_grads(plan: _Plan, dparams: torch.Tensor) -> list:
    """params_backprop [N] -> one view per weight tensor (shaped like it)."""
    return [dparams[offset:offset + int(np.prod(shape))].view(shape) for offset, shape in plan.spans]


def _no_double_backward(backward):
    """Backward runs with grad mode on only under create_graph=True: numbarnn's backward is not differentiable,
    so say so instead of returning gradients without a graph (torch then fails later with a generic
    "element 0 of tensors does not require grad")."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("numbarnn.torch: double backward (gradients of gradients, create_graph=True) is not "
                               "supported: numbarnn's RNN backward is not itself differentiable; use "
                               "create_graph=False, or torch.nn's RNN modules where second derivatives are needed")
        return backward(ctx, *grads)
    return wrapper


class _NumbaRNNFunction(torch.autograd.Function):
    """(plan, x [T,B,I], h0 [L*D,B,P], c0 [L*D,B,H] | None, *weights) -> y [T,B,D*P], h_n [L*D,B,P][, c_n]."""

    @staticmethod
    def forward(ctx, plan, x, h0, c0, *weights):
        lstm = plan.config.has_cell_state
        params = _opaque_params(plan, weights, like=x)                                 # [N]
        with _device_scope(x.device):
            results = ops.cudnn_rnn_v3(
                _array(x), _array(h0), _array(c0) if lstm else None, _array(params), plan.sequence_lengths(),
                is_training=plan.is_training, **plan.op_attrs())
        y, hT, cT = results[:3]                                  # op arrays: [T, B, D*P], [L*D, B, P], [L*D, B, H]
        outputs = (_tensor(y, x.device), _tensor(hT, x.device)) + ((_tensor(cT, x.device),) if lstm else ())
        ctx.plan = plan
        ctx.results = None
        if plan.is_training:
            # the op arrays, not the output tensors (no reference cycle); they share memory with the outputs
            ctx.save_for_backward(x, h0, c0 if lstm else None, params)
            ctx.results = results                                 # (y, h_n, c_n, reserve_space, host_reserved)
        return outputs

    @staticmethod
    @_no_double_backward
    @once_differentiable
    def backward(ctx, *grads):

        plan = ctx.plan
        if ctx.results is None:   # pragma: no cover - the module only runs inference mode when no grad is needed
            raise RuntimeError("numbarnn.torch: backward through a call made without gradients")
        x, h0, c0, params = ctx.saved_tensors
        y, hT, cT, reserve, host_reserved = ctx.results
        lstm = plan.config.has_cell_state
        shapes = (y.shape, hT.shape) + ((cT.shape,) if lstm else ())
        # upstream gradients: all of them are used; an absent one is zeros
        dy, dhT, *rest = [torch.zeros(s, dtype=x.dtype, device=x.device) if g is None else g
                          for g, s in zip(grads, shapes)]
        dcT = rest[0] if lstm else None
        with _device_scope(x.device):
            dx, dh0, dc0, dparams = ops.cudnn_rnn_backprop_v3(
                _array(x), _array(h0), _array(c0), _array(params), plan.sequence_lengths(), y, hT,
                cT if lstm else None, _array(dy), _array(dhT), _array(dcT), reserve, host_reserved,
                **plan.op_attrs())
        device = x.device
        dparams = _tensor(dparams, device)                   # [N]
        weight_grads = _weight_grads(plan, dparams)
        need = ctx.needs_input_grad
        return (None,
                _tensor(dx, device) if need[1] else None,
                _tensor(dh0, device) if need[2] else None,
                _tensor(dc0, device) if (lstm and need[3]) else None,
                *[g if n else None for g, n in zip(weight_grads, need[4:])])


# ---------------------------------------------------------------------------------------------------
# the modules
# ---------------------------------------------------------------------------------------------------

def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


class _NumbaRNNBase(torch.nn.Module):
    """Shared by LSTM, GRU and RNN: parameters as torch.nn.RNNBase registers them, forward via numbarnn."""

    def __init__(self, mode: str, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, backend=None):
        super().__init__()
        self.mode = mode   # torch.nn's spelling: "LSTM", "GRU", "RNN_TANH", "RNN_RELU"; or a registered cell
        self.rnn_mode = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}.get(mode, mode)
        self.input_size = check_int("input_size", input_size, minimum=1)
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.bias = _check_bool("bias", bias)
        self.batch_first = _check_bool("batch_first", batch_first)
        self.dropout = check_float("dropout", dropout, 0.0, 1.0)
        self.bidirectional = _check_bool("bidirectional", bidirectional)
        self.proj_size = check_int("proj_size", proj_size, minimum=0)
        if self.proj_size >= self.hidden_size:
            raise ValueError(f"proj_size: expected 0 <= proj_size < hidden_size = {self.hidden_size} (PyTorch's "
                             f"rule), got {self.proj_size}")
        self.backend = None if backend is None else check_choice("backend", backend, tuple(BACKENDS))
        if self.dropout > 0 and self.num_layers == 1:
            warnings.warn("dropout option adds dropout after all but last recurrent layer, so non-zero dropout "
                          f"expects num_layers greater than 1, but got dropout={self.dropout} and "
                          f"num_layers={self.num_layers}", stacklevel=3)
        self._config = rnn_config(self.num_layers, self.hidden_size, self.input_size, self.rnn_mode,
                                  "linear_input", "bidirectional" if self.bidirectional else "unidirectional",
                                  self.proj_size)   # numbarnn's own checks of the network

        cfg = self._config
        factory = {"device": device, "dtype": dtype}
        self._flat_weights_names, self._all_weights, slots = [], [], []
        for p, layer, d in cfg.pseudo_layers():
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            shapes = {"weight_ih": (cfg.G * cfg.H, cfg.layer_input_size(layer)),   # stacked W  [G*H, I_l]
                      "weight_hh": (cfg.G * cfg.H, cfg.P)}                         # stacked R  [G*H, P]
            if self.bias:
                shapes.update({"bias_ih": (cfg.G * cfg.H,), "bias_hh": (cfg.G * cfg.H,)})   # bW, bR [G*H]
            if cfg.has_proj:
                shapes["weight_hr"] = (cfg.P, cfg.H)                                # W_proj     [P, H]
            slot_of = dict(_SLOT_OF_PREFIX)
            for k, name in enumerate(cfg.cell.vectors):                             # a cell's vectors [H]
                shapes[name] = (cfg.H,)
                slot_of[name] = ("V", k)
            names = []
            for prefix, shape in shapes.items():
                setattr(self, prefix + suffix, torch.nn.Parameter(torch.empty(shape, **factory)))
                names.append(prefix + suffix)
                slots.append((p, slot_of[prefix]))
            self._flat_weights_names.extend(names)
            self._all_weights.append(names)
        self._spans = _weight_spans(cfg, slots)
        self.reset_parameters()

    # -- torch.nn.RNNBase compatibility ---------------------------------------------------------
    def reset_parameters(self) -> None:
        """PyTorch's init: every parameter uniform(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), in its order."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            torch.nn.init.uniform_(weight, -stdv, stdv)

    def flatten_parameters(self) -> None:
        """No-op (torch.nn uses it for cuDNN's flat weight buffer; numbarnn gathers parameters per call)."""

    @property
    def _flat_weights(self) -> list:
        return [getattr(self, name) for name in self._flat_weights_names]

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
        if self.backend is not None:
            s += ", backend={backend!r}"
        return s.format(**self.__dict__)

    # -- forward ----------------------------------------------------------------------------------
    def _check_tensor(self, name: str, t, like: torch.Tensor | None = None) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _TORCH_DTYPES:
            raise RNNDtypeError(f"{name}: expected dtype float16, float32 or float64, got {t.dtype}")
        if like is not None and t.dtype != like.dtype:
            raise RNNDtypeError(f"{name}: expected dtype {like.dtype} (the dtype of the parameters), got {t.dtype}")
        if like is not None and t.device != like.device:
            raise RNNShapeError(f"{name}: expected a tensor on {like.device} (where the parameters are), "
                                f"got one on {t.device}")

    def _initial_state(self, hx, x: torch.Tensor, batched: bool):
        """hx (None, a tensor, or (h_0, c_0) for LSTM) -> h0 [L*D, B, P], c0 [L*D, B, H] or None."""
        cfg, B = self._config, x.shape[1]
        LD = cfg.L * cfg.D
        if hx is None:
            h0 = x.new_zeros((LD, B, cfg.P))                                      # [L*D, B, P]
            c0 = x.new_zeros((LD, B, cfg.H)) if cfg.has_cell_state else None             # [L*D, B, H]
            return h0, c0
        if cfg.has_cell_state:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"hx: expected a tuple (h_0, c_0) for LSTM, got {type(hx).__name__}")
            states = (("hx[0] (h_0)", hx[0], cfg.P, "proj_size or hidden_size"),
                      ("hx[1] (c_0)", hx[1], cfg.H, "hidden_size"))
        else:
            states = (("hx", hx, cfg.P, "hidden_size"),)
        out = []
        for name, t, width, what in states:
            self._check_tensor(name, t, like=x)
            if not batched:
                _check_shape(name, t, (LD, width), f"[num_layers*num_directions, {what}] for unbatched input")
                t = t.unsqueeze(1)
            _check_shape(name, t, (LD, B, width), f"[num_layers*num_directions, batch, {what}]")
            out.append(t)
        return out[0], (out[1] if cfg.has_cell_state else None)

    def _plan(self, x, h0, c0, weights, lengths) -> _Plan:
        cfg = self._config
        dropout_active = self.training and self.dropout > 0 and cfg.L > 1
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                     for t in (x, h0, c0, *weights))
        seed = seed2 = 0
        if dropout_active:   # a fresh Philox key per call, from torch's default generator
            seed, seed2 = (int(v) for v in torch.randint(0, 2 ** 32, (2,), dtype=torch.int64))
        config = rnn_config(cfg.L, cfg.H, cfg.I, cfg.rnn_mode, "linear_input", cfg.direction, cfg.num_proj,
                            self.dropout if dropout_active else 0.0, seed, seed2)
        backend = self.backend
        if backend is None and x.is_cuda:
            backend = "cuda"
        return _Plan(config, lengths, bool(needs_grad or dropout_active), backend, self._spans)

    def forward(self, input, hx=None):
        weights = self._flat_weights
        first = weights[0]
        packed = isinstance(input, PackedSequence)
        if packed:
            self._check_tensor("input.data", input.data, like=first)
            _check_shape("input.data", input.data, (input.data.shape[0], self.input_size),
                              "[sum of lengths, input_size]")
            x, lengths = pad_packed_sequence(input)          # [T, B, I] in the caller's batch order, [B]
            lengths = tuple(int(v) for v in lengths)
            batched = True
        else:
            self._check_tensor("input", input, like=first)
            if input.dim() not in (2, 3):
                raise RNNShapeError(f"input: expected rank 3 ([T, B, I], or [B, T, I] with batch_first) or rank 2 "
                                    f"(unbatched [T, I]), got rank {input.dim()} with shape {tuple(input.shape)}")
            batched = input.dim() == 3
            x = input if batched else input.unsqueeze(0 if self.batch_first else 1)
            if self.batch_first:
                x = x.transpose(0, 1)                         # [T, B, I]
            lengths = None
            legend = "[T, B, input_size]" if not self.batch_first else "[B, T, input_size]"
            _check_shape("input", input, tuple(input.shape[:-1]) + (self.input_size,),
                              legend if batched else "[T, input_size]")
        for name, w in zip(self._flat_weights_names, weights):
            self._check_tensor(name, w, like=first)
        h0, c0 = self._initial_state(hx, x, batched)
        plan = self._plan(x, h0, c0, weights, lengths)
        y, hT, *rest = _NumbaRNNFunction.apply(plan, x, h0, c0, *weights)   # [T, B, D*P], [L*D, B, P]
        cT = rest[0] if rest else None                                        # [L*D, B, H]

        if packed:
            output = _repack(y, lengths, input)
        else:
            output = y.transpose(0, 1).contiguous() if self.batch_first else y
            if not batched:
                output = output.squeeze(0 if self.batch_first else 1)
                hT = hT.squeeze(1)
                cT = None if cT is None else cT.squeeze(1)
        return (output, (hT, cT)) if self._config.has_cell_state else (output, hT)


def _check_shape(name: str, t, expected: tuple, legend: str) -> None:
    """numbarnn's check_shape, raising RNNShapeError (a ValueError that torch.nn users can catch as RuntimeError)."""
    try:
        check_shape(name, t, expected, legend)
    except ValueError as exc:
        raise RNNShapeError(str(exc)) from None


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
    dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None)``.

    ``forward(input, hx=None) -> (output, (h_n, c_n))``; see the module docstring for what differs.
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, device, dtype, backend)


def _no_proj(cls: str, proj_size) -> None:
    if proj_size is not None:
        raise ValueError(f"proj_size: projections are only supported for LSTM, not {cls}; got proj_size={proj_size}")


class RNNBase(_NumbaRNNBase):
    """A torch module of any registered cell, parameters named as torch.nn.RNNBase names them (plus one
    ``<vector>_l{k}[_reverse]`` per cell vector): ``RNNBase(cell, input_size, hidden_size, num_layers=1,
    bias=True, batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *,
    backend=None)``.  `cell` is an rnn_mode name or a `numbarnn.cells.CellSpec` (registered if need be).

    ``forward(input, hx=None) -> (output, (h_n, c_n))`` for cells with a cell state, ``(output, h_n)`` otherwise.
    """

    def __init__(self, cell, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None):
        from .cells import CellSpec, get_cell, register
        if isinstance(cell, CellSpec):
            register(cell)
            cell = cell.name
        super().__init__(get_cell(cell).name, input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, proj_size, device, dtype, backend)


class GRU(_NumbaRNNBase):
    """torch.nn.GRU on numbarnn: ``GRU(input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
    dropout=0.0, bidirectional=False, device=None, dtype=None, *, backend=None)``.

    ``forward(input, hx=None) -> (output, h_n)``.  (``proj_size`` is rejected, as torch.nn.GRU does.)
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, device=None, dtype=None, *, backend=None, proj_size=None):
        _no_proj("GRU", proj_size)
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype, backend)


class RNN(_NumbaRNNBase):
    """torch.nn.RNN on numbarnn: ``RNN(input_size, hidden_size, num_layers=1, nonlinearity='tanh', bias=True,
    batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None, *, backend=None)``.

    ``nonlinearity`` 'tanh' or 'relu' (numbarnn's rnn_tanh / rnn_relu).  ``forward(input, hx=None) -> (output,
    h_n)``.  (``proj_size`` is rejected, as torch.nn.RNN does.)
    """

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None, *, backend=None, proj_size=None):
        _no_proj("RNN", proj_size)
        nonlinearity = check_choice("nonlinearity", nonlinearity, ("tanh", "relu"))
        super().__init__("RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU", input_size, hidden_size,
                         num_layers, bias, batch_first, dropout, bidirectional, 0, device, dtype, backend)
        self.nonlinearity = nonlinearity

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.nonlinearity == "tanh" else s + ", nonlinearity='relu'"


# ---------------------------------------------------------------------------------------------------
# torch.nn itself as an independent oracle (used by `numbarnn check` and the cross-check tests)
# ---------------------------------------------------------------------------------------------------

_TORCH_NN = {"lstm": lambda **kw: torch.nn.LSTM(**kw), "gru": lambda **kw: torch.nn.GRU(**kw),
             "rnn_tanh": lambda **kw: torch.nn.RNN(nonlinearity="tanh", **kw),
             "rnn_relu": lambda **kw: torch.nn.RNN(nonlinearity="relu", **kw)}


def torch_nn_module(cfg, params, dtype=torch.float64, batch_first: bool = False) -> torch.nn.Module:
    """The torch.nn.LSTM / GRU / RNN of `cfg` holding the weights of numbarnn's opaque `params`, in `dtype`."""
    from .params import to_torch_state_dict

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
    from .params import from_torch_state_dict

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

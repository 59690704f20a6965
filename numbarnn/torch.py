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

Why one file: the modules share one base (constructor checks, parameter registration, input forms) and one
operator; split up, a reader would chase one call across files.  (The network in torch operations, used only
for higher derivatives, is its own module: numbarnn/torch_network.py.)
"""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

try:
    import torch
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("numbarnn.torch needs PyTorch: pip install numbarnn[torch]") from exc

from . import ops
from .backends import BACKENDS
from .cells import get_cell
from .config import RNNCall, RNNConfig, encode_host_reserved, rnn_config
from .params import params_size, unpack
from .reserve import NONCE_SIZE, reserve_size
from .validation import check_choice

__all__ = ["LSTM", "GRU", "RNN", "RNNBase", "LSTMCell", "GRUCell", "RNNCell", "CellModule", "RNNShapeError",
           "RNNDtypeError", "rnn_op", "rnn_backward_op", "LayerNormLSTM", "LayerNormGRU"]


class RNNShapeError(ValueError, RuntimeError):
    """A bad shape or argument at call time: a ValueError (numbarnn's rule) and a RuntimeError (torch.nn's)."""


class RNNDtypeError(TypeError, ValueError):
    """A bad or mixed dtype: a TypeError (numbarnn's rule) and a ValueError (torch.nn's)."""


_TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: PyTorch parameter name prefix -> the LayerParams field of `numbarnn.params.unpack` it maps onto
_SLOT_OF_PREFIX = {"weight_ih": "W", "weight_hh": "R", "bias_ih": "bW", "bias_hh": "bR", "weight_hr": "W_proj"}


# ---------------------------------------------------------------------------------------------------
# tensors <-> the arrays numbarnn's ops take
# ---------------------------------------------------------------------------------------------------

def _array(t):
    """A tensor as an op argument: CPU -> NumPy view (zero-copy when contiguous); CUDA -> numba device array."""
    if t is None or type(t) is np.ndarray:          # (NumPy: the eager CPU gather, `_WeightViews.array`)
        return t
    if t.requires_grad:                  # (each torch call costs a dispatch, ~1-2 us: only those needed)
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_cuda:
        return _device_array(t)
    return t.numpy()


#: numba device arrays over CUDA tensors' memory, by (address, shape, strides, dtype, device)
_DEVICE_ARRAYS: dict = {}


def _device_array(t: torch.Tensor):
    """A numba device array over a contiguous CUDA tensor's memory, made once per address and layout.

    The same object for the same memory lets the driver reuse the views it made of it (its `derived`), and
    skips numba's wrapping (~0.1 ms a call at 64x1x200 on an H100's host).  It is made without an owner and
    without numba's synchronisation of the tensor's stream (that waited for all queued work at every call):
    the caller holds the tensor for the call, and `_device_scope` orders numbarnn's stream with torch's."""
    key = (t.data_ptr(), tuple(t.shape), t.dtype, t.device.index)     # (contiguous: the shape gives the strides)
    d = _DEVICE_ARRAYS.get(key)
    if d is None:
        from numba import cuda
        if len(_DEVICE_ARRAYS) >= 64:
            _DEVICE_ARRAYS.clear()
        d = _DEVICE_ARRAYS[key] = cuda.from_cuda_array_interface(t.__cuda_array_interface__, owner=None,
                                                                 sync=False)
    return d


def _tensor(a, device: torch.device):
    """An op result as a tensor on `device`: NumPy via from_numpy, device arrays via __cuda_array_interface__."""
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a)
        return t if device.type == "cpu" else t.to(device)
    return torch.as_tensor(a, device=device)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype (t itself when it already is: no dispatch)."""
    return t if t.dtype == dtype else t.to(dtype)


class _device_scope:
    """CPU: numbarnn's loops on torch's thread count, torch's setting untouched.  CUDA: numba's context on the
    tensor's GPU, ordered with torch's current stream.

    CPU: numba's parallel loops run on `torch.get_num_threads()` threads (numba's own setting is restored after
    the call), and torch's count is put back if numba changed it: numba's OpenMP threading layer and torch share
    libgomp, and the layer's start sets OpenMP's thread count to numba's (torch.set_num_threads(1) was undone by
    the first call).  CUDA: numbarnn's kernels run on the legacy default stream (torch.cuda.default_stream());
    events order it after the work already queued on torch's current stream, and that stream after the kernels.
    (A class, not a generator context manager: it is entered at every call, and costs a third as much.)
    """

    __slots__ = ("device", "threads", "numba_threads", "wanted", "cuda")

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type != "cuda":
            numba, numba_threads = _numba()
            self.cuda = None
            self.threads, self.numba_threads = torch.get_num_threads(), numba_threads()
            self.wanted = max(1, min(self.threads, numba.config.NUMBA_NUM_THREADS))
            if self.wanted != self.numba_threads:   # (setting costs ~10 us: skipped when it would change nothing)
                numba.set_num_threads(self.wanted)
            return self
        self.cuda = _cuda_scope(self.device)      # pragma: no cover - needs a GPU
        self.cuda.__enter__()                     # pragma: no cover
        return self                               # pragma: no cover

    def __exit__(self, *exc):
        if self.cuda is not None:                 # pragma: no cover - needs a GPU
            return self.cuda.__exit__(*exc)
        if self.wanted != self.numba_threads:
            _numba()[0].set_num_threads(self.numba_threads)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return False


@functools.cache
def _numba() -> tuple:
    """(numba, its thread count without the locks of numba.get_num_threads once its threads are up): imported at
    the first CPU call."""
    import numba

    from .cpu.threads import num_threads
    return numba, num_threads


@contextlib.contextmanager
def _cuda_scope(device: torch.device):  # pragma: no cover - needs a GPU
    """`_device_scope` on a GPU: numba's context on `device`, the default stream ordered with torch's current one."""
    from numba import cuda
    index = device.index if device.index is not None else torch.cuda.current_device()
    current, default = torch.cuda.current_stream(index), torch.cuda.default_stream(index)
    if current != default:
        default.wait_stream(current)
    with cuda.gpus[index]:
        yield
    if current != default:
        current.wait_stream(default)


@functools.lru_cache(maxsize=256)
def _op_attrs(cfg: RNNConfig, backend: str) -> dict:
    """The op attributes of a call of the network `cfg` (time-major, linear input: torch.nn's RNNs); one dict per
    network and backend, shared (callers pass it as **attrs: never written)."""
    return dict(rnn_mode=cfg.rnn_mode, input_mode="linear_input", direction=cfg.direction, dropout=cfg.dropout,
                seed=cfg.seed, seed2=cfg.seed2, num_proj=cfg.num_proj, time_major=True, backend=backend or None)


def _lengths_array(lengths):
    return None if lengths is None else np.asarray(lengths, dtype=np.int32)      # [B]


def _weight_spans(cfg: RNNConfig, slots) -> tuple:
    """(offset, shape) in the opaque buffer of each (pseudo-layer p, LayerParams field) slot.

    Read off `numbarnn.params.unpack` views of an index buffer, once per layout (unpack walks every region).
    """
    index = np.arange(params_size(cfg))          # [N]: element k holds k
    views = unpack(cfg, index)
    spans = []
    for p, slot in slots:
        v = getattr(views[p], slot) if isinstance(slot, str) else getattr(views[p], slot[0])[slot[1]]
        # a view: its first element is its offset (a group of normalisation vectors [k, H] is one flat weight)
        flat = isinstance(slot, tuple) and slot[0] == "N"
        spans.append((int(v.reshape(-1)[0]), (v.size,) if flat else tuple(v.shape)))
    return tuple(spans)


@functools.lru_cache(maxsize=None)
def _gather_order(spans: tuple, n: int) -> tuple:
    """The opaque buffer [n] as consecutive pieces: (k, size) for weight k (torch.nn's order), (None, size) for
    a region no weight covers (missing biases: zeros); worked out once per layout."""
    pieces, at = [], 0
    for offset, shape, k in sorted((offset, shape, k) for k, (offset, shape) in enumerate(spans)):
        if offset > at:
            pieces.append((None, offset - at))
        pieces.append((k, math.prod(shape)))
        at = offset + math.prod(shape)
    if at < n:
        pieces.append((None, n - at))
    return tuple(pieces)


def _opaque_params(spans: tuple, weights, like: torch.Tensor, n: int, dtype=None) -> torch.Tensor:
    """The weights gathered into numbarnn's opaque buffer [n] in `dtype` (default: `like`'s; missing biases stay
    0), by one torch.cat in the buffer's order (a copy per weight into a zeroed buffer cost ~3x more at small
    sizes)."""
    dtype = like.dtype if dtype is None else dtype
    parts = [like.new_zeros(size, dtype=dtype) if k is None else _as(weights[k].detach().reshape(-1), dtype)
             for k, size in _gather_order(spans, n)]
    return torch.cat(parts) if parts else like.new_zeros(n, dtype=dtype)          # [N]


class _WeightViews:
    """A module's weights as the pieces of the opaque buffer: per piece a flat view of one weight (detached: the
    same memory) or a zeros region where no weight is, in the buffer's order; `torch.cat(pieces)` is the buffer.

    Made once and kept while every weight is the same tensor over the same memory (identity, data_ptr, shape,
    dtype, device: `module.to`, `param.data = ...` and replaced parameters make new ones).  The views share the
    weights' memory, so every change of their values shows through, those by optimizers (version counter) and
    those through `.data` (none) alike: no gathered copy is kept, so none can go stale.  Saves the detach and
    reshape per weight (two dispatches each) of every call; the gather is one torch.cat."""

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry = None            # (key, pieces), replaced whole: a reader never pairs one's key with another's

    def pieces(self, spans: tuple, n: int, weights) -> Optional[list]:
        """The pieces for `weights` (torch.nn's order), or None where one weight's flat form is no view of it
        (not contiguous) or the weights differ in dtype or device (the generic gather handles those)."""
        entry = self._entry
        if entry is not None and len(entry[0]) == len(weights) and all(
                w is k[0] and w.data_ptr() == k[1] and w.shape == k[2] for w, k in zip(weights, entry[0])):
            return entry[1]
        dtype, device = weights[0].dtype, weights[0].device
        views = [w.detach().reshape(-1) for w in weights]
        if any(w.dtype != dtype or w.device != device or v.data_ptr() != w.data_ptr()
               for v, w in zip(views, weights)):
            self._entry = None
            return None
        pieces = [weights[0].new_zeros(size) if k is None else views[k] for k, size in _gather_order(spans, n)]
        arrays = [p.numpy() for p in pieces] if device.type == "cpu" and dtype in _NUMPY_GATHER else None
        self._entry = (tuple((w, w.data_ptr(), w.shape) for w in weights), pieces, arrays)
        return pieces

    def array(self, spans: tuple, n: int, weights, dtype: torch.dtype) -> Optional[np.ndarray]:
        """The opaque buffer [n] gathered by NumPy from NumPy views of the same pieces (no torch dispatch: ~5 us
        less a call than torch.cat and the tensor's conversion), or None where the weights are no CPU float32 or
        float64 weights in `dtype` (then `pieces` and `_gathered`)."""
        if self.pieces(spans, n, weights) is None:
            return None
        arrays = self._entry[2]
        if arrays is None or weights[0].dtype != dtype:
            return None
        return np.concatenate(arrays) if arrays else np.zeros(n, _NUMPY_GATHER[dtype])

    def __reduce__(self):
        return (_WeightViews, ())          # copies and pickles start empty (their weights are other tensors)


#: weight dtypes the eager CPU path gathers with NumPy (`_WeightViews.array`): those the ops compute in
_NUMPY_GATHER = {torch.float32: np.float32, torch.float64: np.float64}


def _gathered(pieces: list, dtype: torch.dtype, n: int, like: torch.Tensor) -> torch.Tensor:
    """The opaque buffer [n] in `dtype` from `_WeightViews.pieces`: one torch.cat (then a cast for bfloat16)."""
    return _as(torch.cat(pieces), dtype) if pieces else like.new_zeros(n, dtype=dtype)          # [N]


def _weight_grads(spans: tuple, dparams: torch.Tensor) -> list:
    """params_backprop [N] -> one view per weight tensor (shaped like it): as_strided views, one dispatch each
    (a slice and a view cost two)."""
    if dparams.stride() != (1,):
        return [dparams[offset:offset + math.prod(shape)].view(shape) for offset, shape in spans]
    base = dparams.storage_offset()
    return [dparams.as_strided(shape, _contiguous_strides(shape), base + offset) for offset, shape in spans]


@functools.lru_cache(maxsize=None)
def _contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of `shape`."""
    return tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))


_dtype_name = functools.cache(lambda dtype: str(dtype).replace("torch.", ""))   # torch.float32 -> "float32"


@functools.lru_cache(maxsize=256)
def _host_reserved(cfg: RNNConfig, T: int, B: int, dtype: str, lengths) -> np.ndarray:
    """The host_reserved of a training call of `rnn_op` (the operators pass tensors only: its length is no shape a
    fake implementation can know), with the operator's fixed reserve tag; backward pairs it with the reserve."""
    lens = (T,) * B if lengths is None else tuple(lengths)
    call = RNNCall(cfg, T, B, np.dtype(dtype), True, True, lens)
    return encode_host_reserved(call, reserve_size(call), _NONCE)


# ---------------------------------------------------------------------------------------------------
# the network's parameter layout (per module configuration)
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Layout:
    """The parameters of one network as torch.nn names them, and where each sits in numbarnn's opaque buffer."""

    config: RNNConfig     # the network (no dropout: that is per call)
    names: tuple          # the flat weight names, torch.nn's order (weight_ih_l0, weight_hh_l0, bias_ih_l0, ...)
    groups: tuple         # the names per pseudo-layer (torch.nn's `_all_weights`)
    shapes: tuple         # the shape of each weight
    slots: tuple          # per weight: (pseudo-layer p, LayerParams field, or ("V", k) for cell vector k)
    spans: tuple          # per weight: (offset, shape) in the opaque buffer
    size: int             # N, the opaque buffer's length (params_size)
    cell_state: bool      # the cell has a state c (config.has_cell_state, read at every call)


@functools.lru_cache(maxsize=None)
def _layout(cell: str, num_layers: int, hidden_size: int, input_size: int, bidirectional: bool, proj_size: int,
            bias: bool) -> _Layout:
    cfg = rnn_config(num_layers, hidden_size, input_size, cell, "linear_input",
                     "bidirectional" if bidirectional else "unidirectional", proj_size)
    names, groups, shapes, slots = [], [], [], []
    for p, layer, d in cfg.pseudo_layers():
        suffix = f"_l{layer}" + ("_reverse" if d else "")
        shape_of = {"weight_ih": (cfg.G * cfg.H, cfg.layer_input_size(layer)),   # stacked W  [G*H, I_l]
                    "weight_hh": (cfg.G * cfg.H,) + cfg.recurrent_shape[1:]}     # stacked R  [G*H, P]
        #                                                         (a diagonal recurrence: the u_g stacked, [G*H])
        if bias:
            shape_of.update({"bias_ih": (cfg.G * cfg.H,), "bias_hh": (cfg.G * cfg.H,)})   # bW, bR [G*H]
        if cfg.has_proj:
            shape_of["weight_hr"] = (cfg.P, cfg.H)                                # W_proj     [P, H]
        slot_of = dict(_SLOT_OF_PREFIX)
        for k, name in enumerate(cfg.cell.vectors):                               # a cell's vectors [H]
            shape_of[name] = (cfg.H,)
            slot_of[name] = ("V", k)
        start = 0
        for name, count in cfg.cell.norm_groups:                                  # normalisation vectors (SPEC 13)
            shape_of[name] = (count * cfg.H,)                                     # [count*H], e.g. γ_x [G*H]
            slot_of[name] = ("N", slice(start, start + count))
            start += count
        group = []
        for prefix, shape in shape_of.items():
            names.append(prefix + suffix)
            group.append(prefix + suffix)
            shapes.append(shape)
            slots.append((p, slot_of[prefix]))
        groups.append(tuple(group))
    return _Layout(cfg, tuple(names), tuple(groups), tuple(shapes), tuple(slots), _weight_spans(cfg, slots),
                   params_size(cfg), cfg.has_cell_state)


def _call_config(layout: _Layout, dropout: float, seeds) -> RNNConfig:
    """The network of one call: the layout's, with this call's dropout and Philox keys."""
    return _config_with(layout.config, dropout, *seeds) if dropout else layout.config


@functools.lru_cache(maxsize=256)
def _config_with(c: RNNConfig, dropout: float, seed: int, seed2: int) -> RNNConfig:
    return rnn_config(c.L, c.H, c.I, c.rnn_mode, "linear_input", c.direction, c.num_proj, dropout, seed, seed2)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """bfloat16 is stored as bfloat16 and computed in float32 (numbarnn's ops have no bfloat16)."""
    return torch.float32 if t.dtype == torch.bfloat16 else t.dtype


# ---------------------------------------------------------------------------------------------------
# the operators: numbarnn::rnn and numbarnn::rnn_backward (torch.library custom ops)
# ---------------------------------------------------------------------------------------------------
#
# Custom operators are how PyTorch takes in kernels it cannot see into: torch.compile and torch.export keep
# them as single nodes (no graph break: dynamo never traces numba), their fake implementations give every
# output's shape and dtype (meta tensors, FakeTensor tracing), and autograd is registered on the operator.
# Arguments are what the schema language allows: tensors, ints, floats, bools, strings and lists of them.
# The Philox keys of dropout travel as an int64 tensor `seeds` [2] (drawn with torch.randint by the module), so
# that a compiled graph draws fresh keys at every call instead of baking one pair in.

_NONCE = [1024] * NONCE_SIZE      # the reserve's tag (numbarnn.reserve) in every call of the operator
_NO_SEEDS = torch.zeros(2, dtype=torch.int64)   # the Philox keys of a call without dropout (eager calls share it)


def _seeds(seeds: torch.Tensor) -> tuple:
    """The Philox keys as ints (a tensor read costs a dispatch: the shared zeros need none)."""
    return (0, 0) if seeds is _NO_SEEDS else tuple(int(v) for v in seeds.tolist())


def _rnn_impl(x: torch.Tensor, h0: torch.Tensor, c0: Optional[torch.Tensor], weights: List[torch.Tensor],
           lengths: Optional[List[int]], seeds: torch.Tensor, cell: str, num_layers: int, hidden_size: int,
           input_size: int, bidirectional: bool, proj_size: int, bias: bool, dropout: float, is_training: bool,
           backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """numbarnn's CudnnRNNV3 on tensors: x [T, B, I], h0 [L*D, B, P], c0 [L*D, B, H] (cells with a state, else
    None), weights in torch.nn's order -> (y [T, B, D*P], h_n [L*D, B, P], c_n [L*D, B, H] (empty without a
    cell state), reserve [R] (empty unless is_training)).  lengths: B ints (a packed batch) or None = all T."""
    layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    params = _opaque_params(layout.spans, weights, x, layout.size, _compute_dtype(x))                 # [N]
    y, hT, cT, reserve = _rnn_forward(x, h0, c0, params, lengths, seeds, cell, num_layers, hidden_size, input_size,
                                      bidirectional, proj_size, bias, dropout, is_training, backend)
    return (y, hT, x.new_empty((0,)) if cT is None else cT,
            params.new_empty((0,)) if reserve is None else reserve)


def _rnn_forward(x, h0, c0, params, lengths, seeds, cell, num_layers, hidden_size, input_size, bidirectional,
                 proj_size, bias, dropout, is_training, backend, layout: Optional[_Layout] = None) -> tuple:
    """`_rnn_impl` with the weights already gathered (params [N] in the compute dtype) -> (y, h_n, c_n or None
    without a cell state, reserve or None unless is_training): the eager calls' way in, which makes no empty
    tensors for outputs nobody reads.  (layout: `_layout` of these arguments when the caller has it.)"""
    if layout is None:
        layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    cfg = _call_config(layout, dropout, _seeds(seeds))
    lstm = layout.cell_state
    dtype = _compute_dtype(x)
    x_, h0_ = _as(x, dtype), _as(h0, dtype)
    c0_ = _as(c0, dtype) if lstm else None
    device = x.device
    with _device_scope(device):
        # a fixed reserve tag: the operator's outputs are a function of its inputs (torch.compile checks); the
        # backward operator rebuilds host_reserved
        y, hT, cT, reserve, _ = ops.cudnn_rnn_v3(
            _array(x_), _array(h0_), _array(c0_), _array(params), _lengths_array(lengths), is_training=is_training,
            _nonce=_NONCE, **_op_attrs(cfg, backend))
    out = x.dtype
    return (_as(_tensor(y, device), out), _as(_tensor(hT, device), out),
            _as(_tensor(cT, device), out) if lstm else None,
            _tensor(reserve, device) if is_training else None)


rnn_op = torch.library.custom_op("numbarnn::rnn", _rnn_impl, mutates_args=())


@rnn_op.register_fake
def _rnn_fake(x, h0, c0, weights, lengths, seeds, cell, num_layers, hidden_size, input_size, bidirectional,
              proj_size, bias, dropout, is_training, backend):
    layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    cfg = _call_config(layout, dropout, (0, 0))
    T, B = x.shape[0], x.shape[1]
    D, P, H = cfg.D, cfg.P, cfg.H
    dtype = _compute_dtype(x)
    n = reserve_size(RNNCall(cfg, T, B, np.dtype("float32"), is_training=True)) if is_training else 0
    return (x.new_empty((T, B, D * P)), x.new_empty((num_layers * D, B, P)),
            x.new_empty((num_layers * D, B, H)) if cfg.has_cell_state else x.new_empty((0,)),
            x.new_empty((n,), dtype=dtype))


def _rnn_backward_impl(x: torch.Tensor, h0: torch.Tensor, c0: Optional[torch.Tensor], params: torch.Tensor,
                    lengths: Optional[List[int]], seeds: torch.Tensor, y: torch.Tensor, hT: torch.Tensor,
                    cT: torch.Tensor, reserve: torch.Tensor, dy: torch.Tensor, dhT: torch.Tensor,
                    dcT: torch.Tensor, cell: str, num_layers: int, hidden_size: int, input_size: int,
                    bidirectional: bool, proj_size: int, bias: bool, dropout: float,
                    backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """numbarnn's CudnnRNNBackpropV3 for a call of `rnn_op` (its inputs, the weights as the opaque buffer params
    [N], its outputs and reserve; the upstream gradients dy, dhT, dcT) -> (dx, dh0, dc0 (empty without a cell
    state), dparams [N] in the opaque layout).  No tensor-list argument, so torch's per-example fallback batches
    it where no batching rule applies (gradcheck's batched gradients)."""
    dx, dh0, dc0, dparams = _rnn_backward_run(x, h0, c0, params, lengths, seeds, y, hT, cT, reserve, dy, dhT, dcT,
                                              cell, num_layers, hidden_size, input_size, bidirectional, proj_size,
                                              bias, dropout, backend)
    return dx, dh0, x.new_empty((0,)) if dc0 is None else dc0, dparams


def _rnn_backward_run(x, h0, c0, params, lengths, seeds, y, hT, cT, reserve, dy, dhT, dcT, cell, num_layers,
                      hidden_size, input_size, bidirectional, proj_size, bias, dropout, backend) -> tuple:
    """`_rnn_backward_impl` with dc0 None without a cell state: the eager backward's way in (no empty tensor for
    a gradient nobody reads)."""
    layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    cfg = _call_config(layout, dropout, _seeds(seeds))
    lstm = layout.cell_state
    dtype = _compute_dtype(x)
    x_, h0_, y_, hT_, dy_, dhT_ = (_as(t, dtype) for t in (x, h0, y, hT, dy, dhT))
    c0_, cT_, dcT_ = (_as(t, dtype) for t in (c0, cT, dcT)) if lstm else (None, None, None)
    params = _as(params, dtype)                                                    # [N]
    lens = _lengths_array(lengths)
    attrs = _op_attrs(cfg, backend)
    host = _host_reserved(cfg, x.shape[0], x.shape[1], _dtype_name(dtype),
                          None if lengths is None else tuple(lengths))
    with _device_scope(x.device):
        dx, dh0, dc0, dparams = ops.cudnn_rnn_backprop_v3(
            _array(x_), _array(h0_), _array(c0_), _array(params), lens, _array(y_), _array(hT_), _array(cT_),
            _array(dy_), _array(dhT_), _array(dcT_), _array(reserve), host, **attrs)
    out, device = x.dtype, x.device
    return (_as(_tensor(dx, device), out), _as(_tensor(dh0, device), out),
            _as(_tensor(dc0, device), out) if lstm else None, _as(_tensor(dparams, device), out))


rnn_backward_op = torch.library.custom_op("numbarnn::rnn_backward", _rnn_backward_impl, mutates_args=())


@rnn_backward_op.register_fake
def _rnn_backward_fake(x, h0, c0, params, lengths, seeds, y, hT, cT, reserve, dy, dhT, dcT, cell, num_layers,
                       hidden_size, input_size, bidirectional, proj_size, bias, dropout, backend):
    layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    return (torch.empty_like(x), torch.empty_like(h0),
            torch.empty_like(c0) if layout.config.has_cell_state else x.new_empty((0,)),
            torch.empty_like(params))


def _save(ctx, x, h0, c0, weights, lengths, seeds, net, output) -> None:
    """What backward needs of a call of `rnn_op` (net: its arguments from `cell` on).  The reserve has no
    gradient, and gradients of unused outputs stay None (`_grads` makes the small ones zeros): autograd would
    otherwise materialise a zero gradient for the reserve at every backward, as large as the saved activations
    (300 MB for a 2-layer LSTM of T=400 B=32 H=512)."""
    ctx.net, ctx.lengths, ctx.n_weights = tuple(net), lengths, len(weights)
    ctx.save_for_backward(x, h0, c0, seeds, *weights, *output)
    ctx.mark_non_differentiable(output[3])          # the reserve space
    ctx.set_materialize_grads(False)


def _grads(ctx, dy, dhT, dcT) -> tuple:
    """(dx, dh0, dc0 or None, [dweight, ...]) of a call saved by `_save`: numbarnn's backward kernels, or under
    create_graph=True gradients that are themselves differentiable (`_differentiable_grads`)."""
    cell, L, H, I, bidirectional, P, bias, dropout, is_training, backend = ctx.net
    x, h0, c0, seeds, *rest = ctx.saved_tensors
    weights, (y, hT, cT, reserve) = rest[:ctx.n_weights], rest[ctx.n_weights:]
    layout = _layout(cell, L, H, I, bidirectional, P, bias)
    lstm = layout.cell_state
    dy, dhT = (torch.zeros_like(o) if g is None else g for g, o in ((dy, y), (dhT, hT)))
    if lstm and dcT is None:
        dcT = torch.zeros_like(cT)                  # (without a cell state dcT is never read)
    if torch.is_grad_enabled():
        return _differentiable_grads(ctx.net, ctx.lengths, seeds, x, h0, c0, weights, dy, dhT, dcT)
    if not is_training:
        raise RuntimeError("numbarnn.torch: backward through a call made without gradients")
    views = getattr(ctx, "views", None)
    pieces = None if views is None else views.pieces(layout.spans, layout.size, weights)
    params = _opaque_params(layout.spans, weights, x, layout.size) if pieces is None else \
        _gathered(pieces, x.dtype, layout.size, x)                                      # [N]
    backward = _rnn_backward_run if _eager((x, h0, params, y, dy, dhT, dcT) if lstm else
                                           (x, h0, params, y, dy, dhT)) else rnn_backward_op
    if cT is None and backward is rnn_backward_op:   # (an eager forward without a cell state: the operator
        cT = x.new_empty((0,))                        # takes tensors)
    dx, dh0, dc0, dparams = backward(   # (rnn_backward_op takes tensors: cT, empty without a cell state, for dcT)
        x, h0, c0, params, ctx.lengths, seeds, y, hT, cT, reserve, dy, dhT, dcT if lstm else cT,
        cell, L, H, I, bidirectional, P, bias, dropout, backend)
    return dx, dh0, (dc0 if lstm else None), _weight_grads(layout.spans, dparams)


def _select(t, d, i):
    """Element i of a vmapped argument (d: its batched dimension, None: not batched; non-tensors pass)."""
    return t if d is None or t is None else t.select(d, i)


def _stacked(outs) -> tuple:
    """One call's 4 outputs per vmapped element -> the 4 outputs batched along dimension 0, and their dims."""
    return tuple(torch.stack([o[k] for o in outs]) for k in range(4)), (0, 0, 0, 0)


@torch.library.register_vmap("numbarnn::rnn_backward")
def _rnn_backward_vmap(info, in_dims, *args):
    """Batched upstream gradients (gradcheck's check_batched_grad, torch.func over a backward): one call each."""
    return _stacked([rnn_backward_op(*[_select(a, d, i) for a, d in zip(args, in_dims)])
                     for i in range(info.batch_size)])


def _rnn_setup_context(ctx, inputs, output):
    x, h0, c0, weights, lengths, seeds, *net = inputs
    _save(ctx, x, h0, c0, weights, lengths, seeds, net, output)


def _rnn_backward(ctx, dy, dhT, dcT, _dreserve):
    dx, dh0, dc0, dweights = _grads(ctx, dy, dhT, dcT)
    return (dx, dh0, dc0, dweights, None, None, *[None] * len(ctx.net))


torch.library.register_autograd("numbarnn::rnn", _rnn_backward, setup_context=_rnn_setup_context)


class _RNNFunction(torch.autograd.Function):
    """The modules' way into `rnn_op`: the same operator and gradients as its registered autograd, in an
    autograd.Function that torch.func's transforms accept (setup_context, vmap and jvp staticmethods; the
    autograd that torch.library generates for a custom op refuses them: "must override setup_context").
    apply(x, h0, c0, seeds, lengths, net, *weights); net: rnn_op's arguments from `cell` on."""

    @staticmethod
    def forward(x, h0, c0, seeds, lengths, net, *weights):
        return rnn_op(x, h0, c0, list(weights), lengths, seeds, *net)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, h0, c0, seeds, lengths, net, *weights = inputs
        _save(ctx, x, h0, c0, weights, lengths, seeds, net, output)
        ctx.save_for_forward(x, h0, c0, seeds, *weights)

    @staticmethod
    def backward(ctx, dy, dhT, dcT, _dreserve):
        dx, dh0, dc0, dweights = _grads(ctx, dy, dhT, dcT)
        return (dx, dh0, dc0, None, None, None, *dweights)

    @staticmethod
    def jvp(ctx, dx, dh0, dc0, _dseeds, _dlengths, _dnet, *dweights):
        """Forward mode (torch.func.jvp, jacfwd): the network in torch operations, differentiated by torch."""
        x, h0, c0, seeds, *weights = ctx.saved_tensors
        fn = _network_function(ctx.net, ctx.lengths, seeds)
        primals = (x, h0, c0, *weights)
        tangents = tuple(torch.zeros_like(p) if t is None else t
                         for p, t in zip(primals, (dx, dh0, dc0, *dweights)) if p is not None)
        primals = tuple(p for p in primals if p is not None)
        if torch._C._are_functorch_transforms_active():          # torch.func.jvp, jacfwd
            _, (dy, dhT, dcT) = torch.func.jvp(fn, primals, tangents)
            return dy, dhT, dcT, None
        # torch.autograd.forward_ad (dual tensors): its one level is open and torch.func.jvp would nest; the
        # double-vjp trick of torch.autograd.functional.jvp gives the same product by reverse mode
        with torch.enable_grad():
            _, (dy, dhT, dcT) = torch.autograd.functional.jvp(
                fn, tuple(p.detach() for p in primals), tangents, strict=False)
        return dy, dhT, dcT, None

    @staticmethod
    def vmap(info, in_dims, x, h0, c0, seeds, lengths, net, *weights):
        """A vmapped dimension becomes more batch rows when only x and the states carry it (and no dropout:
        its masks depend on the batch size); otherwise one call per element."""
        n = info.batch_size
        x_d, h_d, c_d, s_d, _, _, *w_d = in_dims
        dropout = net[7]
        if x_d is not None and s_d is None and lengths is None and not dropout and all(d is None for d in w_d):
            xs = x.movedim(x_d, 1)                                             # [T, n, B, I]
            T, B = xs.shape[0], xs.shape[2]
            xs = xs.reshape(T, n * B, -1)                                      # [T, n*B, I]

            def rows(t, d):                                                    # [L*D, B, W] -> [L*D, n*B, W]
                if t is None:
                    return None
                t = t.unsqueeze(1).expand(t.shape[0], n, *t.shape[1:]) if d is None else t.movedim(d, 1)
                return t.reshape(t.shape[0], n * B, t.shape[-1])

            y, hT, cT, reserve = _RNNFunction.apply(xs, rows(h0, h_d), rows(c0, c_d), seeds, lengths, net, *weights)
            split = (lambda t: t.reshape(t.shape[0], n, B, t.shape[-1]))
            return (split(y), split(hT), split(cT) if cT.numel() else cT.expand(n, 0), reserve), (1, 1, 1 if cT.numel() else 0, None)

        return _stacked([_RNNFunction.apply(_select(x, x_d, i), _select(h0, h_d, i), _select(c0, c_d, i),
                                            _select(seeds, s_d, i), lengths, net,
                                            *[_select(w, d, i) for w, d in zip(weights, w_d)]) for i in range(n)])


class _EagerRNNFunction(torch.autograd.Function):
    """The eager path of `_call`: the operator's implementation called directly, its gradients as the operator's.
    The old-style forward(ctx, ...) on purpose: with a setup_context, every apply binds the arguments through
    inspect.signature (~40 us)."""

    @staticmethod
    def forward(ctx, x, h0, c0, seeds, lengths, net, views, *weights):
        output = _eager_forward(x, h0, c0, weights, lengths, seeds, net, views)   # (c_n None: no cell state)
        _save(ctx, x, h0, c0, weights, lengths, seeds, net, output)
        ctx.views = views                 # backward gathers the weights through them again
        return output

    @staticmethod
    def backward(ctx, dy, dhT, dcT, _dreserve):
        dx, dh0, dc0, dweights = _grads(ctx, dy, dhT, dcT)
        return (dx, dh0, dc0, None, None, None, None, *dweights)


def _eager_forward(x, h0, c0, weights, lengths, seeds, net, views) -> tuple:
    """`_rnn_forward` of an eager call, the weights gathered through the module's `_WeightViews` (views: None
    gathers them afresh) -> (y, h_n, c_n or None, reserve or None)."""
    layout = _layout(*net[:7])
    dtype = _compute_dtype(x)
    params = views.array(layout.spans, layout.size, weights, dtype) if views is not None and x.is_cpu else None
    if params is None:                                       # (not CPU float32/float64 weights: torch gathers)
        pieces = None if views is None else views.pieces(layout.spans, layout.size, weights)
        params = _opaque_params(layout.spans, weights, x, layout.size, dtype) if pieces is None else \
            _gathered(pieces, dtype, layout.size, x)                                     # [N]
    return _rnn_forward(x, h0, c0, params, lengths, seeds, *net, layout=layout)


def _eager(tensors) -> bool:
    """Whether a call can skip torch's dispatcher: plain CPU or CUDA tensors, run eagerly (not compiled, traced
    or exported; no torch.func transform, forward-mode AD, dispatch mode, torch-function mode, tensor subclass
    or fake tensor).

    The dispatcher's round trip through the custom operator and its generated autograd costs ~100 us a call,
    as much as a whole T=1 forward of a small network; everything that needs the operator still gets it."""
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch._C._are_functorch_transforms_active() and torch._C._len_torch_dispatch_stack() == 0
            and torch.autograd.forward_ad._current_level < 0          # dual tensors: no forward-mode AD
            and not torch.overrides.has_torch_function(tensors)
            and all((t.is_cpu or t.is_cuda) and not torch._C._dispatch_isTensorSubclassLike(t)
                    for t in tensors))         # (subclass-like: also the batched tensors of gradcheck's vmap)


def _call(x, h0, c0, weights, lengths, seeds, net, views: Optional[_WeightViews] = None,
          needs_grad: Optional[bool] = None):
    """The operator with its registered autograd (what torch.compile and torch.export keep as one node); under
    torch.func's transforms or forward-mode AD the same operator through `_RNNFunction` (its jvp: dynamo cannot
    trace a custom jvp, and the generated autograd has none); in plain eager code (`_eager`) its implementation,
    through `_EagerRNNFunction` when a gradient may be needed, the weights gathered through `views` (the
    module's, when the weights are its own).  -> (y, h_n, c_n, reserve); eager calls without gradients give None
    for c_n without a cell state and for the reserve (nobody reads them).  needs_grad: `_needs_reserve` of these
    arguments when the caller has it (None: asked here)."""
    if not torch.compiler.is_compiling() and (torch._C._are_functorch_transforms_active()
                                              or torch.autograd.forward_ad._current_level >= 0):
        return _RNNFunction.apply(x, h0, c0, seeds, lengths, net, *weights)
    tensors = (x, h0, *weights) if c0 is None else (x, h0, c0, *weights)
    if _eager(tensors):
        if _needs_reserve(x, h0, c0, weights) if needs_grad is None else needs_grad:
            return _EagerRNNFunction.apply(x, h0, c0, seeds, lengths, net, views, *weights)
        return _eager_forward(x, h0, c0, weights, lengths, seeds, net, views)
    return rnn_op(x, h0, c0, weights, lengths, seeds, *net)


def _network_function(net, lengths, seeds):
    """(x, h0, c0 or absent, *weights) -> (y, hT, cT): the call's network in torch operations (torch_network)."""
    from . import torch_network
    cell, L, H, I, bidirectional, P, bias, dropout, _, _ = net
    layout = _layout(cell, L, H, I, bidirectional, P, bias)
    cfg = _call_config(layout, dropout, _seeds(seeds))
    lstm = cfg.has_cell_state
    keys = (cfg.seed, cfg.seed2) if cfg.L > 1 and dropout > 0 else None

    if cfg.cell.layer_norm:
        raise NotImplementedError(f"rnn_mode {cell!r}: a layer-normalised cell has no torch-operations network "
                                  f"(numbarnn.torch_network) yet, so no second derivatives")

    def fn(x, h0, *rest):
        c0 = rest[0] if lstm else None
        weights = rest[1:] if lstm else rest
        dtype = _compute_dtype(x)
        layers = [dict(W=None, R=None, bW=None, bR=None, W_proj=None, V=[None] * cfg.V) for _ in range(L * cfg.D)]
        for (p, slot), w in zip(layout.slots, weights):
            if isinstance(slot, str):
                layers[p][slot] = w.to(dtype)
            else:
                layers[p]["V"][slot[1]] = w.to(dtype)
        y, hT, cT = torch_network.forward(cfg, layers, x.to(dtype), h0.to(dtype),
                                          c0.to(dtype) if lstm else None, lengths, keys)
        out = x.dtype
        return y.to(out), hT.to(out), (cT.to(out) if lstm else x.new_empty((0,)))

    return fn


def _differentiable_grads(net, lengths, seeds, x, h0, c0, weights, dy, dhT, dcT):
    """First-order gradients as a graph autograd can differentiate again: the forward recomputed with torch
    operations from the cell's spec (numbarnn.torch_network), and its vector-Jacobian product by torch.func.vjp
    (which composes with autograd's create_graph and with torch.func's transforms alike)."""
    lstm = get_cell(net[0]).cell_state
    fn = _network_function(net, lengths, seeds)
    inputs = [x, h0] + ([c0] if lstm else []) + list(weights)
    _, vjp = torch.func.vjp(fn, *inputs)
    got = vjp((dy, dhT, dcT if lstm else x.new_zeros((0,))))
    return got[0], got[1], (got[2] if lstm else None), list(got[3 if lstm else 2:])


# ---------------------------------------------------------------------------------------------------
# the modules
# ---------------------------------------------------------------------------------------------------

def _check_sizes(minimum: int = 1, **sizes) -> None:
    """torch.nn's checks of sizes, its messages (the value after them): ints; every one but proj_size at least
    `minimum` (1 for RNNs; 0 for cells, which torch.nn builds with hidden_size 0)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} should be of type int, got: {type(value).__name__}")
    for name, value in sizes.items():
        if name != "proj_size" and value < minimum:
            raise ValueError(f"{name} must be {'greater than zero' if minimum else 'non-negative'} (got {value})")


def _reset_uniform(module: torch.nn.Module, hidden_size: int) -> None:
    """PyTorch's init of RNNs and cells: every parameter uniform(-1/sqrt(H), 1/sqrt(H)), in its order."""
    stdv = 1.0 / math.sqrt(hidden_size) if hidden_size > 0 else 0.0      # (torch.nn's cells allow H = 0)
    for weight in module.parameters():
        torch.nn.init.uniform_(weight, -stdv, stdv)


def _needs_reserve(x, h0, c0, weights) -> bool:
    """Whether a call may be differentiated: grad mode on and some input or weight requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, h0, c0, *weights))


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
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, backend=None):
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
        self.reset_parameters()

    def __setstate__(self, state):
        """Modules pickled whole before the per-call helpers existed get them (state_dicts need nothing)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_weight_views", _WeightViews())
        self.__dict__.setdefault("_cell_state", get_cell(self.rnn_mode).cell_state)

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
        needs_grad = _needs_reserve(x, h0, c0, weights)
        if dropout_active:
            seeds = torch.randint(0, 2 ** 32, (2,), dtype=torch.int64)
        elif torch.compiler.is_compiling():
            seeds = torch.zeros(2, dtype=torch.int64)
        else:
            seeds = _NO_SEEDS                   # (never written: the ops only read it)
        return seeds, (self.dropout if dropout_active else 0.0), bool(needs_grad or dropout_active), needs_grad

    def forward(self, input, hx=None):
        weights = self._flat_weights
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
               self.proj_size, self.bias, dropout, is_training, backend)
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


def _autocast_dtype(x: torch.Tensor):
    """The dtype torch.autocast computes RNNs in on x's device, or None when it is off (or x is not float)."""
    kind = "cpu" if x.is_cpu else "cuda" if x.is_cuda else None      # (no device object: ~1 us a call)
    if kind is not None and torch.is_autocast_enabled(kind) and x.is_floating_point():
        return torch.get_autocast_dtype(kind)
    return None


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


def _no_proj(proj_size) -> None:
    """torch.nn.GRU / RNN take proj_size (positionally after bidirectional) only as 0."""
    if proj_size != 0:
        raise ValueError(f"proj_size argument is only supported for LSTM, not RNN or GRU (got proj_size={proj_size})")


class RNNBase(_NumbaRNNBase):
    """A torch module of any registered cell, parameters named as torch.nn.RNNBase names them (plus one
    ``<vector>_l{k}[_reverse]`` per cell vector): ``RNNBase(cell, input_size, hidden_size, num_layers=1,
    bias=True, batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *,
    backend=None)``.  `cell` is an rnn_mode name or a `numbarnn.cells.CellSpec` (registered if need be).

    ``forward(input, hx=None) -> (output, (h_n, c_n))`` for cells with a cell state, ``(output, h_n)`` otherwise.
    """

    def __init__(self, cell, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None):
        from .cells import CellSpec, register
        if isinstance(cell, CellSpec):
            register(cell)
            cell = cell.name
        super().__init__(get_cell(cell).name, input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, proj_size, device, dtype, backend)


class GRU(_NumbaRNNBase):
    """torch.nn.GRU on numbarnn: ``GRU(input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
    dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None)`` (torch.nn's
    positional order; proj_size only 0, as torch.nn.GRU takes it).

    ``forward(input, hx=None) -> (output, h_n)``.
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, backend=None):
        _no_proj(proj_size)
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype, backend)


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


from .torch_cells import CellModule, GRUCell, LSTMCell, RNNCell  # noqa: E402  (the cells run the operator above)


from .torch_layer_norm import LayerNormGRU, LayerNormLSTM  # noqa: E402  (haste's modules: they use the above)

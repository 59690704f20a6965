"""numbarnn.torch's side of the torch boundary: tensors <-> the arrays numbarnn's ops take, the parameters' layout
(torch.nn's names -> numbarnn's opaque buffer), the thread and device scope of a call, and torch.nn's argument
checks shared by the RNN modules (numbarnn.torch) and the cells (numbarnn.torch_cells)."""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .config import RNNCall, RNNConfig, encode_host_reserved, rnn_config
from .params import params_size, unpack
from .reserve import NONCE_SIZE, reserve_size


class RNNShapeError(ValueError, RuntimeError):
    """A bad shape or argument at call time: a ValueError (numbarnn's rule) and a RuntimeError (torch.nn's)."""

    __module__ = "numbarnn.torch"            # (where users import it from)


class RNNDtypeError(TypeError, ValueError):
    """A bad or mixed dtype: a TypeError (numbarnn's rule) and a ValueError (torch.nn's)."""

    __module__ = "numbarnn.torch"


_NONCE = [1024] * NONCE_SIZE      # the reserve's tag (numbarnn.reserve) in every call of the operator
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
        from numba import cuda  # lazy: numba.cuda after the simulator switch
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
            numba, numba_threads, set_numba_threads = _numba()
            self.cuda = None
            self.threads, self.numba_threads = torch.get_num_threads(), numba_threads()
            self.wanted = max(1, min(self.threads, numba.config.NUMBA_NUM_THREADS))
            if self.wanted != self.numba_threads:   # (skipped when it would change nothing)
                set_numba_threads(self.wanted)
            return self
        self.cuda = _cuda_scope(self.device)      # pragma: no cover - needs a GPU
        self.cuda.__enter__()                     # pragma: no cover
        return self                               # pragma: no cover

    def __exit__(self, *exc):
        if self.cuda is not None:                 # pragma: no cover - needs a GPU
            return self.cuda.__exit__(*exc)
        if self.wanted != self.numba_threads:
            _numba()[2](self.numba_threads)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return False


@functools.cache
def _numba() -> tuple:
    """(numba, its thread count and its setter, without the locks of numba's get/set_num_threads once its threads
    are up): imported at the first CPU call."""
    import numba  # lazy: numba after the simulator switch

    from .cpu.threads import num_threads, set_num_threads  # lazy: cpu.threads imports numba
    return numba, num_threads, set_num_threads


@contextlib.contextmanager
def _cuda_scope(device: torch.device):  # pragma: no cover - needs a GPU
    """`_device_scope` on a GPU: numba's context on `device`, the default stream ordered with torch's current one."""
    from numba import cuda  # lazy: numba.cuda after the simulator switch
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
                seed=cfg.seed, seed2=cfg.seed2, num_proj=cfg.num_proj, time_major=True, backend=backend or None,
                **({"zoneout": cfg.zoneout} if cfg.zoneout else {}))


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


class _FastCalls:
    """Per module, per call signature (input shape, dtype, batch_first, zoneout, training): what an eager CPU call
    on the cpu backend needs and that depends only on the signature, made at its first call and reused: the
    checked `RNNCall`, the backend, zero initial states, the layout and the operator's network arguments.  Such a
    call then costs the backend's loops, the weights' gather and a few tensor conversions (a T=1 GRU of H=16
    inference: ~40 us against the general path's ~160, torch.nn's ~90).  Copies and pickles start empty."""

    __slots__ = ("entries",)

    def __init__(self):
        self.entries = {}   # (shape, dtype, batch_first, zoneout, training) -> (call, backend, h0 zeros [L*D, B, P],
        #                     c0 zeros [L*D, B, H] or None, batch_first, net: rnn_op's arguments from cell on)

    def __reduce__(self):
        return (_FastCalls, ())


_CPU = torch.device("cpu")

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


def _call_config(layout: _Layout, dropout: float, seeds, zoneout: float = 0.0) -> RNNConfig:
    """The network of one call: the layout's, with this call's dropout, zoneout and Philox keys."""
    return _config_with(layout.config, dropout, *seeds, zoneout) if dropout or zoneout else layout.config


@functools.lru_cache(maxsize=256)
def _config_with(c: RNNConfig, dropout: float, seed: int, seed2: int, zoneout: float = 0.0) -> RNNConfig:
    return rnn_config(c.L, c.H, c.I, c.rnn_mode, "linear_input", c.direction, c.num_proj, dropout, seed, seed2,
                      zoneout)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """bfloat16 is stored as bfloat16 and computed in float32 (numbarnn's ops have no bfloat16)."""
    return torch.float32 if t.dtype == torch.bfloat16 else t.dtype


def _autocast_dtype(x: torch.Tensor):
    """The dtype torch.autocast computes RNNs in on x's device, or None when it is off (or x is not float)."""
    kind = "cpu" if x.is_cpu else "cuda" if x.is_cuda else None      # (no device object: ~1 us a call)
    if kind is not None and torch.is_autocast_enabled(kind) and x.is_floating_point():
        return torch.get_autocast_dtype(kind)
    return None


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

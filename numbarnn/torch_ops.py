"""The operators numbarnn::rnn and numbarnn::rnn_backward (torch.library custom ops), their fake implementations
and autograd, and the eager way round torch's dispatcher: how numbarnn.torch's modules and cells call numbarnn's
ops (numbarnn.torch's docstring says what each path is for)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from . import ops, torch_network
from .cells import get_cell
from .config import RNNCall
from .reserve import reserve_size
from .torch_tensors import (_CPU, _NONCE, _Layout, _WeightViews, _array, _as, _call_config, _compute_dtype,
                            _device_scope, _dtype_name, _gathered, _host_reserved, _layout, _lengths_array,
                            _needs_reserve, _op_attrs, _opaque_params, _tensor, _weight_grads)


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

_NO_SEEDS = torch.zeros(2, dtype=torch.int64)   # the Philox keys of a call without dropout (eager calls share it)


def _seeds(seeds: torch.Tensor) -> tuple:
    """The Philox keys as ints (a tensor read costs a dispatch: the shared zeros need none)."""
    return (0, 0) if seeds is _NO_SEEDS else tuple(int(v) for v in seeds.tolist())


def _rnn_impl(x: torch.Tensor, h0: torch.Tensor, c0: Optional[torch.Tensor], weights: List[torch.Tensor],
           lengths: Optional[List[int]], seeds: torch.Tensor, cell: str, num_layers: int, hidden_size: int,
           input_size: int, bidirectional: bool, proj_size: int, bias: bool, dropout: float, is_training: bool,
           backend: str, zoneout: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """numbarnn's CudnnRNNV3 on tensors: x [T, B, I], h0 [L*D, B, P], c0 [L*D, B, H] (cells with a state, else
    None), weights in torch.nn's order -> (y [T, B, D*P], h_n [L*D, B, P], c_n [L*D, B, H] (empty without a
    cell state), reserve [R] (empty unless is_training)).  lengths: B ints (a packed batch) or None = all T.
    zoneout: haste's zoneout of h (SPEC 6.1; its masks from `seeds` when is_training, else the expectation)."""
    layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    params = _opaque_params(layout.spans, weights, x, layout.size, _compute_dtype(x))                 # [N]
    y, hT, cT, reserve = _rnn_forward(x, h0, c0, params, lengths, seeds, cell, num_layers, hidden_size, input_size,
                                      bidirectional, proj_size, bias, dropout, is_training, backend, zoneout)
    return (y, hT, x.new_empty((0,)) if cT is None else cT,
            params.new_empty((0,)) if reserve is None else reserve)


def _rnn_forward(x, h0, c0, params, lengths, seeds, cell, num_layers, hidden_size, input_size, bidirectional,
                 proj_size, bias, dropout, is_training, backend, zoneout=0.0, layout: Optional[_Layout] = None
                 ) -> tuple:
    """`_rnn_impl` with the weights already gathered (params [N] in the compute dtype) -> (y, h_n, c_n or None
    without a cell state, reserve or None unless is_training): the eager calls' way in, which makes no empty
    tensors for outputs nobody reads.  (layout: `_layout` of these arguments when the caller has it.)"""
    if layout is None:
        layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    cfg = _call_config(layout, dropout, _seeds(seeds), zoneout)
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
              proj_size, bias, dropout, is_training, backend, zoneout):
    layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    cfg = _call_config(layout, dropout, (0, 0), zoneout)
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
                    bidirectional: bool, proj_size: int, bias: bool, dropout: float, backend: str,
                    zoneout: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """numbarnn's CudnnRNNBackpropV3 for a call of `rnn_op` (its inputs, the weights as the opaque buffer params
    [N], its outputs and reserve; the upstream gradients dy, dhT, dcT) -> (dx, dh0, dc0 (empty without a cell
    state), dparams [N] in the opaque layout).  No tensor-list argument, so torch's per-example fallback batches
    it where no batching rule applies (gradcheck's batched gradients)."""
    dx, dh0, dc0, dparams = _rnn_backward_run(x, h0, c0, params, lengths, seeds, y, hT, cT, reserve, dy, dhT, dcT,
                                              cell, num_layers, hidden_size, input_size, bidirectional, proj_size,
                                              bias, dropout, backend, zoneout)
    return dx, dh0, x.new_empty((0,)) if dc0 is None else dc0, dparams


def _rnn_backward_run(x, h0, c0, params, lengths, seeds, y, hT, cT, reserve, dy, dhT, dcT, cell, num_layers,
                      hidden_size, input_size, bidirectional, proj_size, bias, dropout, backend,
                      zoneout=0.0) -> tuple:
    """`_rnn_backward_impl` with dc0 None without a cell state: the eager backward's way in (no empty tensor for
    a gradient nobody reads)."""
    layout = _layout(cell, num_layers, hidden_size, input_size, bidirectional, proj_size, bias)
    cfg = _call_config(layout, dropout, _seeds(seeds), zoneout)
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
                       hidden_size, input_size, bidirectional, proj_size, bias, dropout, backend, zoneout):
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
    if output[3] is not None:                       # (None: an eager call without one, zoneout's eval mode)
        ctx.mark_non_differentiable(output[3])      # the reserve space
    ctx.set_materialize_grads(False)


def _grads(ctx, dy, dhT, dcT) -> tuple:
    """(dx, dh0, dc0 or None, [dweight, ...]) of a call saved by `_save`: numbarnn's backward kernels, or under
    create_graph=True gradients that are themselves differentiable (`_differentiable_grads`)."""
    cell, L, H, I, bidirectional, P, bias, dropout, is_training, backend, zoneout = _net(ctx.net)
    x, h0, c0, seeds, *rest = ctx.saved_tensors
    weights, (y, hT, cT, reserve) = rest[:ctx.n_weights], rest[ctx.n_weights:]
    layout = _layout(cell, L, H, I, bidirectional, P, bias)
    lstm = layout.cell_state
    dy, dhT = (torch.zeros_like(o) if g is None else g for g, o in ((dy, y), (dhT, hT)))
    if lstm and dcT is None:
        dcT = torch.zeros_like(cT)                  # (without a cell state dcT is never read)
    if torch.is_grad_enabled() or (zoneout and not is_training):   # (zoneout's expectation: torch's gradients)
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
        cell, L, H, I, bidirectional, P, bias, dropout, backend, zoneout)
    return dx, dh0, (dc0 if lstm else None), _weight_grads(layout.spans, dparams)


def _net(net) -> tuple:
    """rnn_op's arguments from `cell` on: (cell, num_layers, hidden_size, input_size, bidirectional, proj_size,
    bias, dropout, is_training, backend, zoneout); every caller passes all eleven (the operator's inputs must be
    the arguments given: a default filled in by the schema would not be one of them for torch.compile)."""
    if len(net) != 11:
        raise TypeError(f"net: expected rnn_op's 11 arguments from cell on (zoneout last), got {len(net)}")
    return tuple(net)


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
        dropout = net[7] or net[10]                        # (zoneout's masks depend on the batch size too)
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


def _fast_forward(entry, x, h0, c0, params) -> tuple:
    """The cpu backend's forward of a fast-path call (`_FastCalls` entry: its checked `RNNCall`, the call is a
    training one when the entry is) -> ((y, h_n[, c_n]) as tensors, y in the caller's layout; (x, h0, c0
    time-major, params, reserve): the arrays its backward reads).  x as the caller laid it out, h0/c0 None for
    zeros, params [N] the weights gathered (NumPy)."""
    call, be, zeros_h, zeros_c, batch_first, _ = entry
    lstm = zeros_c is not None
    xn = _array(x)                                                             # [T, B, I] or [B, T, I]
    if batch_first:
        xn = be.swap01(xn)                                                     # [T, B, I]
    h0n = zeros_h if h0 is None else _array(h0)                                # [L*D, B, P]
    c0n = (zeros_c if c0 is None else _array(c0)) if lstm else None           # [L*D, B, H]
    with _device_scope(_CPU):
        y, hT, cT, reserve = be.rnn_forward(call, xn, h0n, c0n, params)
    y = torch.from_numpy(be.swap01(y) if batch_first else y)
    outputs = (y, torch.from_numpy(hT), torch.from_numpy(cT)) if lstm else (y, torch.from_numpy(hT))
    return outputs, (xn, h0n, c0n, params, reserve)


class _FastRNNFunction(torch.autograd.Function):
    """An eager CPU training call of a known signature (numbarnn.torch's per-signature fast path, `_FastCalls`):
    the cpu backend's forward and backward called directly with the signature's checked `RNNCall`, no checks,
    reserve tag or tensor round trips past the first call.  No masks are drawn (no dropout, no zoneout).
    apply(x, h0, c0, entry, params, *weights) -> (y, h_n[, c_n]); x as the caller laid it out, h0/c0 None for
    zeros, entry a `_FastCalls` entry, params [N] the weights gathered (NumPy)."""

    @staticmethod
    def forward(ctx, x, h0, c0, entry, params, *weights):
        outputs, ctx.arrays = _fast_forward(entry, x, h0, c0, params)
        ctx.entry = entry
        ctx.save_for_backward(x, h0, c0, *weights)    # (autograd's check of in-place changes; create_graph's inputs)
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx, dy, dhT, dcT=None):
        call, be, zeros_h, zeros_c, batch_first, net = ctx.entry
        x, h0, c0, *weights = ctx.saved_tensors
        lstm = zeros_c is not None
        if torch.is_grad_enabled() or not _eager([g for g in (dy, dhT, dcT) if g is not None]):
            # create_graph=True, or batched upstream gradients (gradcheck's vmap): torch operations
            return _FastRNNFunction._differentiable(ctx, x, h0, c0, weights, dy, dhT, dcT)
        xn, h0n, c0n, params, reserve = ctx.arrays
        dyn = np.zeros((call.T, call.B, call.config.D * call.config.P), xn.dtype) if dy is None else \
            (be.swap01(_array(dy)) if batch_first else _array(dy))            # [T, B, D*P]
        dhTn = np.zeros_like(zeros_h) if dhT is None else _array(dhT)          # [L*D, B, P]
        dcTn = (np.zeros_like(zeros_c) if dcT is None else _array(dcT)) if lstm else None   # [L*D, B, H]
        with _device_scope(_CPU):
            dx, dh0, dc0, dparams = be.rnn_backward(call, xn, h0n, c0n, params, dyn, dhTn, dcTn, reserve)
        dx = torch.from_numpy(be.swap01(dx) if batch_first else dx)
        return (dx, None if h0 is None else torch.from_numpy(dh0),
                None if c0 is None else torch.from_numpy(dc0), None, None,
                *_weight_grads(_layout(*net[:7]).spans, torch.from_numpy(dparams)))

    @staticmethod
    def _differentiable(ctx, x, h0, c0, weights, dy, dhT, dcT) -> tuple:
        """backward's result as a differentiable graph (`_differentiable_grads`, time-major, zeros for what is
        None) in the layout the caller gave."""
        call, be, zeros_h, zeros_c, batch_first, net = ctx.entry
        lstm = zeros_c is not None
        xt = x.transpose(0, 1) if batch_first else x                                          # [T, B, I]
        h0t = torch.from_numpy(zeros_h) if h0 is None else h0
        c0t = (torch.from_numpy(zeros_c) if c0 is None else c0) if lstm else None
        T, B = xt.shape[0], xt.shape[1]
        dy = xt.new_zeros((T, B, call.config.D * call.config.P)) if dy is None else \
            (dy.transpose(0, 1) if batch_first else dy)                                       # [T, B, D*P]
        dhT = torch.zeros_like(h0t) if dhT is None else dhT
        dcT = (torch.zeros_like(c0t) if dcT is None else dcT) if lstm else None
        dx, dh0, dc0, dweights = _differentiable_grads(net, None, _NO_SEEDS, xt, h0t, c0t, weights, dy, dhT, dcT)
        return (dx.transpose(0, 1) if batch_first else dx, None if h0 is None else dh0,
                None if c0 is None else dc0, None, None, *dweights)


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
    cell, L, H, I, bidirectional, P, bias, dropout, is_training, _, zoneout = _net(net)
    layout = _layout(cell, L, H, I, bidirectional, P, bias)
    cfg = _call_config(layout, dropout, _seeds(seeds), zoneout)
    lstm = cfg.has_cell_state
    keys = (cfg.seed, cfg.seed2) if cfg.L > 1 and dropout > 0 else None
    zoneout_keys = (cfg.seed, cfg.seed2) if zoneout and is_training else None    # else: the expectation

    def fn(x, h0, *rest):
        c0 = rest[0] if lstm else None
        weights = rest[1:] if lstm else rest
        dtype = _compute_dtype(x)
        layers = torch_network.layer_tensors(cfg, layout.slots, weights, dtype)
        y, hT, cT = torch_network.forward(cfg, layers, x.to(dtype), h0.to(dtype),
                                          c0.to(dtype) if lstm else None, lengths, keys, zoneout_keys)
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

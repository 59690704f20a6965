"""TensorFlow-style ops: one function per TF op, same argument names; validate, then dispatch to a backend.

NumPy arrays in -> NumPy arrays out (in the input's dtype).  On backend="cuda", device arrays in ->
device arrays out.  A torch.Tensor is refused, naming the argument (`numbarnn.torch` takes tensors).
`backend=None` uses the default backend (see `numbarnn.backends`).

    cudnn_rnn_params_size / cudnn_rnn_canonical_to_params / cudnn_rnn_params_to_canonical
    cudnn_rnn_v3 (CudnnRNNV3) and cudnn_rnn_backprop_v3 (CudnnRNNBackpropV3)
    block_lstm / block_lstm_v2 (BlockLSTM, BlockLSTMV2) and block_lstm_grad / block_lstm_grad_v2
"""
from __future__ import annotations

import numpy as np

from . import params as _params
from .backends import get_backend
from .block_lstm_config import validate_block_lstm, validate_block_lstm_grad
from .config import (RNNCall, array_keys, check_host_reserved, check_reserve_nonce, encode_host_reserved, output_shape,
                     rnn_config, state_shapes, validate_forward)

from .reserve import new_nonce, reserve_size
from .reserve import write_nonce as _write_nonce
from .validation import as_array, check_same_dtype, check_shape, shape_of

__all__ = ["cudnn_rnn_params_size", "cudnn_rnn_canonical_to_params", "cudnn_rnn_params_to_canonical",
           "cudnn_rnn_canonical_weight_shapes", "cudnn_rnn_canonical_bias_shapes",
           "cudnn_rnn_v3", "cudnn_rnn_backprop_v3", "block_lstm", "block_lstm_v2", "block_lstm_grad",
           "block_lstm_grad_v2"]


# ---------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------

def cudnn_rnn_params_size(num_layers, num_units, input_size, rnn_mode="lstm", input_mode="linear_input",
                          direction="unidirectional", num_proj=0, dropout=0.0, seed=0, seed2=0) -> int:
    """Length of the opaque params buffer (SPEC 4.2)."""
    return _params.params_size(rnn_config(num_layers, num_units, input_size, rnn_mode, input_mode, direction,
                                          num_proj, dropout, seed, seed2))


def cudnn_rnn_canonical_weight_shapes(num_layers, num_units, input_size, rnn_mode="lstm",
                                      input_mode="linear_input", direction="unidirectional", num_proj=0):
    """Shapes of `weights` in canonical order (SPEC 4.3), skip_input and projection included."""
    return _params.canonical_weight_shapes(rnn_config(num_layers, num_units, input_size, rnn_mode, input_mode,
                                                      direction, num_proj))


def cudnn_rnn_canonical_bias_shapes(num_layers, num_units, input_size, rnn_mode="lstm",
                                    input_mode="linear_input", direction="unidirectional", num_proj=0):
    return _params.canonical_bias_shapes(rnn_config(num_layers, num_units, input_size, rnn_mode, input_mode,
                                                    direction, num_proj))


def cudnn_rnn_canonical_to_params(num_layers, num_units, input_size, weights, biases, rnn_mode="lstm",
                                  input_mode="linear_input", direction="unidirectional", num_proj=0,
                                  dropout=0.0, seed=0, seed2=0):
    """Canonical weights and biases (lists, SPEC 4.3) -> the opaque 1-D params buffer."""
    cfg = rnn_config(num_layers, num_units, input_size, rnn_mode, input_mode, direction, num_proj, dropout, seed,
                     seed2)
    return _params.canonical_to_params(cfg, list(weights), list(biases))


def cudnn_rnn_params_to_canonical(num_layers, num_units, input_size, params, rnn_mode="lstm",
                                  input_mode="linear_input", direction="unidirectional", num_proj=0,
                                  dropout=0.0, seed=0, seed2=0):
    """The opaque params buffer -> (weights, biases), lists in canonical order (SPEC 4.3)."""
    cfg = rnn_config(num_layers, num_units, input_size, rnn_mode, input_mode, direction, num_proj, dropout, seed,
                     seed2)
    return _params.params_to_canonical(cfg, params)


# ---------------------------------------------------------------------------------------------------
# CudnnRNNV3 / CudnnRNNBackpropV3
# ---------------------------------------------------------------------------------------------------

def _time_major(be, call: RNNCall, *arrays):
    """Batch-major arrays ([B, T, ...] / [B, L*D, ...]) become time-major by a real transpose (SPEC 3)."""
    if call.time_major:
        return arrays
    return tuple(None if a is None else be.swap01(a) for a in arrays)


_back_to_layout = _time_major   # the same swap of the first two axes, applied on the way out


def _nonce_writer(be):
    """The backend's own way to write a reserve's nonce (cuda: a launch, without waiting for the device), else
    `numbarnn.reserve.write_nonce`."""
    return getattr(be, "write_nonce", _write_nonce)


def cudnn_rnn_v3(input, input_h, input_c, params, sequence_lengths=None, rnn_mode="lstm",
                 input_mode="linear_input", direction="unidirectional", dropout=0.0, seed=0, seed2=0, num_proj=0,
                 is_training=True, time_major=True, backend=None, _nonce=None, *, zoneout=0.0):
    """CudnnRNNV3: -> (output, output_h, output_c, reserve_space, host_reserved).

    output [T, B, D*P] (batch-major: [B, T, D*P]), output_h [L*D, B, P], output_c [L*D, B, H] (LSTM; other
    modes: empty (0,)), reserve_space 1-D (empty unless is_training), host_reserved int8 1-D fingerprint.
    (_nonce: a fixed reserve tag instead of a fresh random one: numbarnn.torch's operator, whose outputs must be
    a function of its inputs.)
    zoneout: haste's zoneout probability of h in [0, 1) (SPEC 6.1): training keeps h_prev where a Philox mask of
    (seed, seed2) is 0, inference takes the expectation p*h_prev + (1-p)*h_new.
    """
    call, a = validate_forward(input, input_h, input_c, params, sequence_lengths, rnn_mode=rnn_mode,
                               input_mode=input_mode, direction=direction, dropout=dropout, seed=seed, seed2=seed2,
                               num_proj=num_proj, is_training=is_training, time_major=time_major, zoneout=zoneout)
    be = get_backend(backend)
    lstm = call.config.has_cell_state
    x, h0, c0 = _time_major(be, call, a["input"], a["input_h"], a["input_c"] if lstm else None)
    y, hT, cT, reserve = be.rnn_forward(call, x, h0, c0, a["params"])
    y, hT = _back_to_layout(be, call, y, hT)
    if lstm:
        (cT,) = _back_to_layout(be, call, cT)
    if call.is_training:
        nonce = new_nonce() if _nonce is None else _nonce   # pairs this reserve with this host_reserved
        _nonce_writer(be)(reserve, nonce)
        host_reserved = encode_host_reserved(call, reserve_size(call), nonce)

    else:
        host_reserved = np.zeros((0,), dtype=np.int8)
    return y, hT, cT, reserve, host_reserved


def cudnn_rnn_backprop_v3(input, input_h, input_c, params, sequence_lengths, output, output_h, output_c,
                          output_backprop, output_h_backprop, output_c_backprop, reserve_space, host_reserved,
                          rnn_mode="lstm", input_mode="linear_input", direction="unidirectional", dropout=0.0,
                          seed=0, seed2=0, num_proj=0, time_major=True, backend=None, *, zoneout=0.0):
    """CudnnRNNBackpropV3: -> (input_backprop, input_h_backprop, input_c_backprop, params_backprop).

    Shaped like input, input_h, input_c, params; params_backprop is a fresh buffer in the opaque layout.
    For non-LSTM modes input_c_backprop is zeros shaped like input_c (empty if it was None).
    zoneout: the forward call's (its masks are read from reserve_space).
    """
    call, a = validate_forward(input, input_h, input_c, params, sequence_lengths, rnn_mode=rnn_mode,
                               input_mode=input_mode, direction=direction, dropout=dropout, seed=seed, seed2=seed2,
                               num_proj=num_proj, is_training=True, time_major=time_major, zoneout=zoneout)
    lstm = call.config.has_cell_state
    arrays = (output, output_h, output_c, output_backprop, output_h_backprop, output_c_backprop, reserve_space)
    key = _backward_signature(call, arrays, host_reserved)
    if key is None or key not in _BACKWARD_VALIDATED:
        _check_backward(call, a, *arrays, host_reserved)
        if key is not None:
            if len(_BACKWARD_VALIDATED) >= 256:
                _BACKWARD_VALIDATED.clear()
            _BACKWARD_VALIDATED.add(key)
    check_reserve_nonce(host_reserved, reserve_space)       # the pairing of this reserve: every call

    be = get_backend(backend)
    x, h0, c0, dy, dhT, dcT = _time_major(be, call, a["input"], a["input_h"], a["input_c"] if lstm else None,
                                          as_array("output_backprop", output_backprop),
                                          as_array("output_h_backprop", output_h_backprop),
                                          as_array("output_c_backprop", output_c_backprop) if lstm else None)
    dx, dh0, dc0, dparams = be.rnn_backward(call, x, h0, c0, a["params"], dy, dhT, dcT,
                                            as_array("reserve_space", reserve_space))
    dx, dh0, dc0 = _back_to_layout(be, call, dx, dh0, dc0)
    if not lstm:
        dc0 = be.zeros(shape_of(input_c) if input_c is not None else (0,), call.dtype, a["input"])
    return dx, dh0, dc0, dparams


#: signatures of backprop calls whose arguments passed `_check_backward` (shapes, dtypes, the host_reserved bytes)
_BACKWARD_VALIDATED: set = set()


def _backward_signature(call: RNNCall, arrays, host_reserved) -> tuple | None:
    """Everything `_check_backward` reads, as a hashable key (None: some argument has none, checked every time)."""
    key = array_keys(arrays)
    if key is None or type(host_reserved) is not np.ndarray:
        return None
    key += [call, call.config.cell, (host_reserved.dtype, host_reserved.shape, host_reserved.tobytes())]
    return tuple(key)


def _check_backward(call: RNNCall, a: dict, output, output_h, output_c, output_backprop, output_h_backprop,
                    output_c_backprop, reserve_space, host_reserved) -> None:
    """Backprop's own arguments against the forward call they claim to come from (SPEC 7, 11)."""
    lstm = call.config.has_cell_state
    h_shape, c_shape = state_shapes(call)
    y_shape = output_shape(call)
    h_legend = "[L*D, B, P]" if call.time_major else "[B, L*D, P]"
    c_legend = "[L*D, B, H]" if call.time_major else "[B, L*D, H]"
    y_legend = "[T, B, D*P]" if call.time_major else "[B, T, D*P]"
    grads = {"output": (output, y_shape, y_legend), "output_h": (output_h, h_shape, h_legend),
             "output_backprop": (output_backprop, y_shape, y_legend),
             "output_h_backprop": (output_h_backprop, h_shape, h_legend)}
    if lstm:
        grads.update({"output_c": (output_c, c_shape, c_legend),
                      "output_c_backprop": (output_c_backprop, c_shape, c_legend)})
    checked = {}
    for name, (arr, shape, legend) in grads.items():
        checked[name] = as_array(name, arr)
        check_shape(name, checked[name], shape, legend)
    check_same_dtype({"input": a["input"], **checked})
    check_host_reserved(call, host_reserved, reserve_space, reserve_size(call))
    reserve = as_array("reserve_space", reserve_space)
    check_same_dtype({"input": a["input"], "reserve_space": reserve})


# ---------------------------------------------------------------------------------------------------
# BlockLSTM family (SPEC 9)
# ---------------------------------------------------------------------------------------------------

def _block_lstm(layout, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, forget_bias, cell_clip,
                use_peephole, backend):
    call = validate_block_lstm(layout, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, forget_bias,
                               cell_clip, use_peephole)
    return get_backend(backend).block_lstm(call, x, cs_prev, h_prev, w, wci, wcf, wco, b)


def _block_lstm_grad(layout, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
                     cs_grad, h_grad, use_peephole, backend):
    call = validate_block_lstm_grad(layout, seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o,
                                    ci, co, h, cs_grad, h_grad, use_peephole)
    return get_backend(backend).block_lstm_grad(call, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci,
                                                co, h, cs_grad, h_grad)


def block_lstm(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, forget_bias=1.0, cell_clip=3.0,
               use_peephole=False, backend=None):
    """BlockLSTM (gate layout i, ci, f, o) -> (i, cs, f, o, ci, co, h), each [T, B, C]."""
    return _block_lstm("icfo", seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, forget_bias, cell_clip,
                       use_peephole, backend)


def block_lstm_v2(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, cell_clip=0.0, use_peephole=False,
                  backend=None):
    """BlockLSTMV2 (gate layout i, f, ci, o; no forget_bias) -> (i, cs, f, o, ci, co, h), each [T, B, C]."""
    return _block_lstm("ifco", seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, 0.0, cell_clip,
                       use_peephole, backend)


def block_lstm_grad(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h, cs_grad, h_grad,
                    use_peephole=False, backend=None):
    """BlockLSTMGrad -> (x_grad, cs_prev_grad, h_prev_grad, w_grad, wci_grad, wcf_grad, wco_grad, b_grad)."""
    return _block_lstm_grad("icfo", seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
                            cs_grad, h_grad, use_peephole, backend)


def block_lstm_grad_v2(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h, cs_grad,
                       h_grad, use_peephole=False, backend=None):
    """BlockLSTMGradV2 (layout i, f, ci, o) -> the same eight gradients as block_lstm_grad."""
    return _block_lstm_grad("ifco", seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
                            cs_grad, h_grad, use_peephole, backend)

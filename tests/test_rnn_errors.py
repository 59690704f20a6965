"""Bad input to the cuDNN-style RNN ops (SPEC section 11): a clear error, never a crash, hang or garbage.

Every check asserts the exception type (ValueError; TypeError for dtypes) and that the message starts with
the name of the offending argument (what was expected and what came follow it). Backprop is also given
reserve_space / host_reserved / arguments that do not match its forward call. Pure NumPy, backend="reference".
"""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from numbarnn import ops
from numbarnn.config import rnn_config
from numbarnn.reserve import reserve_contents
from numbarnn.testing import make_rnn_case

BACKEND = "reference"


def attrs(cfg, time_major=True) -> dict:
    return dict(rnn_mode=cfg.rnn_mode, input_mode=cfg.input_mode, direction=cfg.direction, dropout=cfg.dropout,
                seed=cfg.seed, seed2=cfg.seed2, num_proj=cfg.num_proj, time_major=time_major)


def forward_args(case) -> dict:
    return dict(input=case.x, input_h=case.h0, input_c=case.c0, params=case.params, sequence_lengths=case.lengths,
                **attrs(case.cfg, case.time_major))


def backward_args(case, out) -> dict:
    y, hT, cT, reserve, host_reserved = out
    return dict(forward_args(case), output=y, output_h=hT, output_c=cT, output_backprop=case.dy,
                output_h_backprop=case.dhT, output_c_backprop=case.dcT, reserve_space=reserve,
                host_reserved=host_reserved)


def forward(**kw):
    return ops.cudnn_rnn_v3(**kw, backend=BACKEND)


def backward(**kw):
    kw.pop("is_training", None)
    return ops.cudnn_rnn_backprop_v3(**kw, backend=BACKEND)


def raises(exc, name, fn, **kw):
    """fn(**kw) raises `exc` whose message starts with `name` (then ':' or ' ')."""
    with pytest.raises(exc) as info:
        fn(**kw)
    msg = str(info.value)
    assert re.match(rf"{re.escape(name)}(?!\w)", msg), f"message does not start with {name!r}: {msg}"
    return msg


# a bidirectional 2-layer LSTM with projection, and the same without: every tensor has a distinct shape
LSTM = rnn_config(2, 3, 2, "lstm", "linear_input", "bidirectional", num_proj=2, dropout=0.5, seed=1, seed2=2)
LSTM_NP = rnn_config(2, 3, 2, "lstm", "linear_input", "bidirectional")
GRU = rnn_config(2, 3, 2, "gru", "linear_input", "unidirectional")


@pytest.fixture(params=[LSTM, LSTM_NP, GRU], ids=["lstm-proj", "lstm", "gru"])
def case(request):
    return make_rnn_case(request.param, 4, 3, [4, 0, 2], seed=0)


@pytest.fixture
def lstm_case():
    return make_rnn_case(LSTM, 4, 3, [4, 0, 2], seed=0)


def test_valid_case_runs(case):
    """The base cases used below are valid (so every error below comes from the one thing changed)."""
    out = forward(**forward_args(case))
    backward(**backward_args(case, out))


# ----------------------------------------------------------------------------------------------
# ranks and shapes
# ----------------------------------------------------------------------------------------------
FORWARD_TENSORS = ("input", "input_h", "input_c", "params")
BACKWARD_TENSORS = ("output", "output_h", "output_c", "output_backprop", "output_h_backprop", "output_c_backprop",
                    "reserve_space", "host_reserved")


def bad_ranks(a):
    a = np.asarray(a)
    return [a.reshape(a.shape + (1,)), a.reshape(-1)[:1].reshape(())] + ([a.reshape(-1)] if a.ndim > 1 else
                                                                         [a.reshape(1, -1)])


@pytest.mark.parametrize("name", FORWARD_TENSORS + ("sequence_lengths",))
def test_forward_wrong_rank(case, name):
    kw = forward_args(case)
    if name == "input_c" and not case.cfg.has_cell_state:
        return
    if name == "sequence_lengths":
        for bad in (np.array([[4, 0, 2]], np.int32), np.int32(3)):
            raises(ValueError, name, forward, **dict(kw, sequence_lengths=bad))
        return
    for bad in bad_ranks(kw[name]):
        raises(ValueError, name, forward, **dict(kw, **{name: bad}))
        raises(ValueError, name, backward, **dict(backward_args(case, forward(**kw)), **{name: bad}))


@pytest.mark.parametrize("name", BACKWARD_TENSORS)
def test_backward_wrong_rank(case, name):
    kw = backward_args(case, forward(**forward_args(case)))
    if name in ("output_c", "output_c_backprop") and not case.cfg.has_cell_state:
        return   # ignored for other modes (SPEC 8)
    for bad in bad_ranks(kw[name]):
        if name == "host_reserved":
            bad = bad.astype(np.int8)
        raises(ValueError, name, backward, **dict(kw, **{name: bad}))


@pytest.mark.parametrize("name", ("input_h", "input_c", "params", "sequence_lengths"))
def test_every_input_as_1x1x1(case, name):
    """Each tensor given as [1, 1, 1] (TF's classic crash input): an error naming it."""
    if name == "input_c" and not case.cfg.has_cell_state:
        return
    one = np.ones((1, 1, 1), np.int32 if name == "sequence_lengths" else case.dtype)
    kw = dict(forward_args(case), **{name: one})
    if name == "input_c" and case.cfg.has_proj:
        # with a projection only input_c carries H (input_h carries P): its width 1 reads as num_units=1
        with pytest.raises(ValueError, match=r"^(input_c|num_proj|params)"):
            forward(**kw)
        return
    raises(ValueError, name, forward, **kw)


def test_input_as_1x1x1(case):
    """input [1,1,1] is rank 3 but disagrees with every other tensor: a ValueError naming the batch mismatch."""
    with pytest.raises(ValueError, match=r"^input"):
        forward(**dict(forward_args(case), input=np.ones((1, 1, 1)), sequence_lengths=None))


def test_all_tensors_1x1x1():
    """Every input [1,1,1] at once (incl. backprop's): an error, not a crash."""
    one = np.ones((1, 1, 1))
    with pytest.raises(ValueError):
        forward(input=one, input_h=one, input_c=one, params=one, sequence_lengths=np.ones((1, 1, 1), np.int32))
    with pytest.raises(ValueError):
        ops.cudnn_rnn_backprop_v3(one, one, one, one, np.ones((1, 1, 1), np.int32), one, one, one, one, one, one,
                                  one, np.ones((1, 1, 1), np.int8), backend=BACKEND)


def test_input_size_mismatch(case):
    """input's last dimension is I; a wrong one does not match the params (the error says where I came from)."""
    x = np.concatenate([case.x, case.x[..., :1]], axis=-1)
    msg = raises(ValueError, "params", forward, **dict(forward_args(case), input=x))
    assert re.search(r"\binput\b", msg) and "input_size=3" in msg


def perturb(shape, axis, by=1):
    s = list(shape)
    s[axis] += by
    return tuple(s)


@pytest.mark.parametrize("name", ("input_h", "input_c"))
@pytest.mark.parametrize("axis", (0, 1, 2))
@pytest.mark.parametrize("time_major", (True, False))
def test_state_shapes(name, axis, time_major):
    """input_h != [L*D, B, P] or input_c != [L*D, B, H] in any dimension (L*D off by D, i.e. still divisible):
    the error names the state that is off, with and without projection, in either layout."""
    for cfg in (LSTM, LSTM_NP):
        case = make_rnn_case(cfg, 4, 3, None, seed=0, time_major=time_major)
        kw = forward_args(case)
        ld_axis = 0 if time_major else 1
        by = 2 if axis == ld_axis else 1
        bad = np.zeros(perturb(kw[name].shape, axis, by))
        if name == "input_c" and axis == 2 and cfg.has_proj:
            # with a projection only input_c carries H: a wrong width reads as another num_units, which the
            # params length contradicts; the message says where num_units was read
            msg = raises(ValueError, "params", forward, **dict(kw, **{name: bad}))
            assert re.search(r"\binput_c\b", msg), msg
            continue
        raises(ValueError, name, forward, **dict(kw, **{name: bad}))
        if axis == ld_axis:   # L*D not divisible by D
            raises(ValueError, name, forward, **dict(kw, **{name: np.zeros(perturb(kw[name].shape, axis, 1))}))


@pytest.mark.parametrize("axis", (1, 2))
def test_state_shapes_non_lstm(axis):
    """GRU: B or P wrong in input_h: the error names input_h (P feeds the params size: named there too)."""
    case = make_rnn_case(GRU, 4, 3, None, seed=0)
    bad = np.zeros(perturb(case.h0.shape, axis))
    msg = str(pytest.raises(ValueError, forward, **dict(forward_args(case), input_h=bad)).value)
    assert re.search(r"\binput_h\b", msg), msg


def test_params_length(case):
    kw = forward_args(case)
    for bad in (case.params[:-1], np.concatenate([case.params, case.params[:1]]), case.params[:0]):
        raises(ValueError, "params", forward, **dict(kw, params=bad))
        raises(ValueError, "params", backward, **dict(backward_args(case, forward(**kw)), params=bad))


@pytest.mark.parametrize("time_major", (True, False))
@pytest.mark.parametrize("name", ("output", "output_h", "output_c", "output_backprop", "output_h_backprop",
                                  "output_c_backprop"))
def test_backward_shapes(name, time_major):
    """Backprop's output and upstream-gradient tensors must have the forward's shapes (no broadcasting)."""
    case = make_rnn_case(LSTM, 4, 3, [4, 0, 2], seed=0, time_major=time_major)
    kw = backward_args(case, forward(**forward_args(case)))
    a = kw[name]
    for axis in range(3):
        raises(ValueError, name, backward, **dict(kw, **{name: np.zeros(perturb(a.shape, axis))}))
    raises(ValueError, name, backward, **dict(kw, **{name: np.zeros((1,) + a.shape[1:])}))   # would broadcast
    raises(ValueError, name, backward, **dict(kw, **{name: None}))


# ----------------------------------------------------------------------------------------------
# sequence_lengths
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [[4, 0], [4, 0, 2, 1], [], [-1, 0, 2], [4, 5, 2], [4, 0, 2**31 - 1],
                                 [4, -2**31, 2]])
def test_lengths_values(case, bad):
    kw = forward_args(case)
    raises(ValueError, "sequence_lengths", forward, **dict(kw, sequence_lengths=np.asarray(bad, np.int64)))
    raises(ValueError, "sequence_lengths", backward,
           **dict(backward_args(case, forward(**kw)), sequence_lengths=np.asarray(bad, np.int64)))


@pytest.mark.parametrize("bad", [np.array([4.0, 0.0, 2.0]), [4.5, 0, 2], np.array([True, False, True]),
                                 ["4", "0", "2"], np.array([4, 0, 2], np.float32)])
def test_lengths_non_integer(case, bad):
    with pytest.raises((TypeError, ValueError)) as info:
        forward(**dict(forward_args(case), sequence_lengths=bad))
    assert str(info.value).startswith("sequence_lengths"), str(info.value)


def test_lengths_other_integer_dtypes_accepted(case):
    """int32 is TF's dtype; other integer arrays and lists mean the same lengths."""
    ref = forward(**forward_args(case))
    for lens in ([4, 0, 2], np.array([4, 0, 2], np.int64), np.array([4, 0, 2], np.uint8)):
        out = forward(**dict(forward_args(case), sequence_lengths=lens))
        for a, b in zip(out[:3] + (reserve_contents(out[3]),), ref[:3] + (reserve_contents(ref[3]),)):
            np.testing.assert_array_equal(a, b)



# ----------------------------------------------------------------------------------------------
# attributes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, bad", [("rnn_mode", "LSTM"), ("rnn_mode", "rnn"), ("rnn_mode", None),
                                       ("input_mode", "skip"), ("input_mode", 0), ("direction", "bi"),
                                       ("direction", "forward")])
def test_unknown_choices(case, name, bad):
    raises(ValueError, name, forward, **dict(forward_args(case), **{name: bad}))
    raises(ValueError, name, backward, **dict(backward_args(case, forward(**forward_args(case))), **{name: bad}))
    raises(ValueError, name, ops.cudnn_rnn_params_size, **dict(dict(num_layers=1, num_units=2, input_size=2),
                                                               **{name: bad}))


def test_skip_input_needs_input_size_equal_units():
    raises(ValueError, "input_mode", ops.cudnn_rnn_params_size, num_layers=1, num_units=3, input_size=2,
           input_mode="skip_input")
    case = make_rnn_case(LSTM_NP, 4, 3, None, seed=0)   # I=2, H=3
    raises(ValueError, "input_mode", forward, **dict(forward_args(case), input_mode="skip_input"))
    # auto_select picks linear_input then: valid
    forward(**dict(forward_args(case), input_mode="auto_select"))


@pytest.mark.parametrize("mode", ["gru", "rnn_tanh", "rnn_relu"])
def test_num_proj_for_non_lstm(mode):
    raises(ValueError, "num_proj", ops.cudnn_rnn_params_size, num_layers=1, num_units=3, input_size=2,
           rnn_mode=mode, num_proj=2)
    cfg = rnn_config(1, 3, 2, mode)
    case = make_rnn_case(cfg, 2, 2, None, seed=0)
    raises(ValueError, "num_proj", forward, **dict(forward_args(case), num_proj=2))


@pytest.mark.parametrize("bad", [4, 100, -1])
def test_num_proj_range(bad):
    raises(ValueError, "num_proj", ops.cudnn_rnn_params_size, num_layers=1, num_units=3, input_size=2,
           num_proj=bad)
    case = make_rnn_case(LSTM, 4, 3, None, seed=0)
    raises(ValueError, "num_proj", forward, **dict(forward_args(case), num_proj=bad))


@pytest.mark.parametrize("bad", [1.5, "2", True])
def test_num_proj_type(bad):
    with pytest.raises((TypeError, ValueError), match=r"^num_proj"):
        ops.cudnn_rnn_params_size(1, 3, 2, num_proj=bad)


@pytest.mark.parametrize("name", ["num_layers", "num_units", "input_size"])
@pytest.mark.parametrize("bad", [0, -1])
def test_sizes_positive(name, bad):
    kw = dict(num_layers=2, num_units=3, input_size=2)
    for fn in (ops.cudnn_rnn_params_size, ops.cudnn_rnn_canonical_weight_shapes):
        raises(ValueError, name, fn, **dict(kw, **{name: bad}))
    raises(ValueError, name, ops.cudnn_rnn_params_to_canonical, **dict(kw, params=np.zeros(10), **{name: bad}))


@pytest.mark.parametrize("name", ["num_layers", "num_units", "input_size"])
def test_sizes_integer(name):
    with pytest.raises(TypeError, match=rf"^{name}"):
        ops.cudnn_rnn_params_size(**dict(dict(num_layers=2, num_units=3, input_size=2), **{name: 2.5}))


@pytest.mark.parametrize("bad", [-0.1, 1.0000001, 2.0, float("nan"), float("inf")])
def test_dropout_range(case, bad):
    raises(ValueError, "dropout", forward, **dict(forward_args(case), dropout=bad))
    raises(ValueError, "dropout", ops.cudnn_rnn_params_size, num_layers=1, num_units=2, input_size=2, dropout=bad)


def test_dropout_bounds_accepted(case):
    for p in (0.0, 1.0, 0, 1):
        forward(**dict(forward_args(case), dropout=p))


@pytest.mark.parametrize("name", ["is_training", "time_major"])
def test_bool_flags(case, name):
    with pytest.raises(TypeError, match=rf"^{name}"):
        forward(**dict(forward_args(case), **{name: "yes"}))


# ----------------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["input_h", "input_c", "params"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_mixed_dtypes_forward(case, name, dtype):
    if name == "input_c" and not case.cfg.has_cell_state:
        return
    kw = forward_args(case)
    raises(TypeError, name, forward, **dict(kw, **{name: kw[name].astype(dtype)}))


@pytest.mark.parametrize("name", ["output_backprop", "output_h_backprop", "output_c_backprop", "reserve_space",
                                  "output", "output_h"])
def test_mixed_dtypes_backward(lstm_case, name):
    kw = backward_args(lstm_case, forward(**forward_args(lstm_case)))
    raises(TypeError, name, backward, **dict(kw, **{name: kw[name].astype(np.float32)}))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.complex128, np.bool_, object])
def test_unsupported_dtype(case, dtype):
    kw = forward_args(case)
    with pytest.raises(TypeError, match=r"^input"):
        forward(**dict(kw, input=kw["input"].astype(dtype)))
    args = {k: (v.astype(dtype) if k in FORWARD_TENSORS and v is not None else v) for k, v in kw.items()}
    with pytest.raises(TypeError, match=r"^input"):
        forward(**args)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # inf/NaN arithmetic warnings are expected
def test_nan_propagates_without_crash():
    """NaN in the input reaches the outputs and gradients of the affected rows; other rows stay finite."""
    case = make_rnn_case(LSTM, 4, 3, [4, 0, 2], seed=0)
    x = case.x.copy()
    x[1, 0, 0] = np.nan
    kw = dict(forward_args(case), input=x)
    y, hT, cT, reserve, host_reserved = out = forward(**kw)
    assert np.isnan(y[1:, 0]).all() and np.isfinite(y[:, 1:]).all()
    assert np.isnan(hT[:, 0]).any() and np.isfinite(hT[:, 1:]).all()
    dx, dh0, dc0, dparams = backward(**dict(backward_args(case, out), input=x))
    assert np.isnan(dparams).any()
    params = case.params.copy()
    params[0] = np.nan
    out = forward(**dict(forward_args(case), params=params))
    assert np.isnan(out[0][:, 0]).any()
    assert np.isfinite(out[0][:, 1]).all() and not np.any(out[0][:, 1])   # len 0 row: zeros, untouched
    h0 = case.h0.copy()
    h0[:] = np.inf
    forward(**dict(forward_args(case), input_h=h0))


# ----------------------------------------------------------------------------------------------
# backprop must match its forward (SPEC 7)
# ----------------------------------------------------------------------------------------------
def test_backprop_without_reserve_is_an_error(case):
    kw = backward_args(case, forward(**forward_args(case)))
    raises(ValueError, "reserve_space", backward, **dict(kw, reserve_space=None))
    raises(ValueError, "host_reserved", backward, **dict(kw, host_reserved=None))


def test_backprop_with_inference_reserve(case):
    """is_training=False returns an empty reserve_space and host_reserved: backprop refuses them."""
    kw = forward_args(case)
    out = forward(**kw, is_training=False)
    assert out[3].shape == (0,) and out[4].shape == (0,)
    with pytest.raises(ValueError, match=r"^(host_reserved|reserve_space)"):
        backward(**backward_args(case, out))
    train = forward(**kw)
    # an inference host_reserved with a training reserve, and a training host_reserved with an empty reserve
    raises(ValueError, "host_reserved", backward, **dict(backward_args(case, train), host_reserved=out[4]))
    raises(ValueError, "reserve_space", backward, **dict(backward_args(case, train), reserve_space=out[3]))


def test_backprop_truncated_or_padded_reserve(case):
    kw = backward_args(case, forward(**forward_args(case)))
    r = kw["reserve_space"]
    for bad in (r[:-1], np.concatenate([r, r[:1]]), r.reshape(1, -1), r[:0]):
        raises(ValueError, "reserve_space", backward, **dict(kw, reserve_space=bad))


def test_backprop_corrupted_host_reserved(case):
    kw = backward_args(case, forward(**forward_args(case)))
    hr = kw["host_reserved"]
    for bad in (hr[:-1], hr[:5], np.zeros(40, np.int8), hr.astype(np.int32), hr.astype(np.float64)):
        raises(ValueError, "host_reserved", backward, **dict(kw, host_reserved=bad))
    flipped = hr.copy()
    flipped[-3] ^= 1
    raises(ValueError, "host_reserved", backward, **dict(kw, host_reserved=flipped))


def test_backprop_different_lengths(lstm_case):
    kw = backward_args(lstm_case, forward(**forward_args(lstm_case)))
    for lens in ([4, 1, 2], None, [4, 4, 4]):
        raises(ValueError, "host_reserved", backward, **dict(kw, sequence_lengths=lens))


def test_backprop_different_seeds_with_dropout(lstm_case):
    """With dropout active the seeds and p define the mask: backprop with others is refused. Without dropout
    (p=0, or one layer) they are irrelevant and accepted."""
    kw = backward_args(lstm_case, forward(**forward_args(lstm_case)))
    for change in (dict(seed=2), dict(seed2=3), dict(dropout=0.25), dict(dropout=0.0)):
        raises(ValueError, "host_reserved", backward, **dict(kw, **change))
    case = make_rnn_case(rnn_config(2, 3, 2, "gru"), 3, 2, None, seed=0)
    kw = backward_args(case, forward(**forward_args(case)))
    backward(**dict(kw, seed=5, seed2=6))


def test_backprop_different_dtype(lstm_case):
    """All of backprop's arguments in float32 but host_reserved/reserve from the float64 forward."""
    out = forward(**forward_args(lstm_case))
    low = lstm_case.astype(np.float32)
    kw = backward_args(low, (out[0].astype(np.float32), out[1].astype(np.float32), out[2].astype(np.float32),
                             out[3].astype(np.float32), out[4]))
    raises(ValueError, "host_reserved", backward, **kw)
    # and the other way: a float64 reserve with float32 arguments
    kw32 = backward_args(low, forward(**forward_args(low)))
    raises(TypeError, "reserve_space", backward, **dict(kw32, reserve_space=out[3]))


def test_backprop_different_time_major():
    """T == B == L*D so the transposed arrays have the same shapes: only the fingerprint can tell."""
    case = make_rnn_case(LSTM, 4, 4, None, seed=0)
    kw = backward_args(case, forward(**forward_args(case)))
    raises(ValueError, "host_reserved", backward, **dict(kw, time_major=False))


def test_backprop_different_mode():
    """rnn_tanh and rnn_relu have identical shapes and params: only the fingerprint can tell."""
    case = make_rnn_case(rnn_config(2, 3, 2, "rnn_tanh", direction="bidirectional"), 3, 2, None, seed=0)
    kw = backward_args(case, forward(**forward_args(case)))
    raises(ValueError, "host_reserved", backward, **dict(kw, rnn_mode="rnn_relu"))
    # linear_input vs skip_input with I == H: different params sizes, named
    case = make_rnn_case(rnn_config(1, 2, 2, "gru"), 3, 2, None, seed=0)
    kw = backward_args(case, forward(**forward_args(case)))
    with pytest.raises(ValueError, match=r"^(params|host_reserved)"):
        backward(**dict(kw, input_mode="skip_input"))


def test_backprop_different_shapes(lstm_case):
    """A reserve from a forward call with another batch / time size."""
    kw = backward_args(lstm_case, forward(**forward_args(lstm_case)))
    other = make_rnn_case(LSTM, 2, 3, [2, 0, 1], seed=1)
    other_out = forward(**forward_args(other))
    raises(ValueError, "host_reserved", backward, **dict(kw, host_reserved=other_out[4]))
    raises(ValueError, "reserve_space", backward, **dict(kw, reserve_space=other_out[3]))


@pytest.mark.parametrize("backend, on_device", [("reference", False), ("cuda", False), ("cuda", True)],
                         ids=["reference", "cuda-host", "cuda-device"])
def test_backprop_reserve_from_another_forward_call_of_the_same_size(backend, on_device):
    """Issue 10: the right host_reserved with the reserve_space of another forward call with the same
    fingerprint (same config and lengths, other inputs) gave gradients silently wrong by ~50%."""
    cfg = rnn_config(2, 3, 2, "lstm", "linear_input", "bidirectional")
    case = make_rnn_case(cfg, 3, 2, [3, 2], seed=0)
    other = make_rnn_case(cfg, 3, 2, [3, 2], seed=1)                # same sizes, other inputs and params
    if on_device:
        from numba import cuda
        case, other = (replace(c, **{k: cuda.to_device(v) for k, v in vars(c).items()
                                     if isinstance(v, np.ndarray) and k in ("x", "h0", "c0", "params")})
                       for c in (case, other))
    run = dict(backend=backend)
    out = ops.cudnn_rnn_v3(**forward_args(case), **run)
    other_out = ops.cudnn_rnn_v3(**forward_args(other), **run)
    assert other_out[3].shape == out[3].shape and other_out[4].shape == out[4].shape
    kw = backward_args(case, out)
    ops.cudnn_rnn_backprop_v3(**kw, **run)                          # the matching pair is accepted
    for bad in (dict(reserve_space=other_out[3]), dict(host_reserved=other_out[4])):
        with pytest.raises(ValueError) as info:
            ops.cudnn_rnn_backprop_v3(**dict(kw, **bad), **run)
        msg = str(info.value)
        assert "reserve_space" in msg and "host_reserved" in msg and "different forward calls" in msg, msg
    # two calls on the very same inputs are two forward calls too: each reserve pairs with its own host_reserved
    again = ops.cudnn_rnn_v3(**forward_args(case), **run)
    with pytest.raises(ValueError, match="different forward calls"):
        ops.cudnn_rnn_backprop_v3(**dict(kw, reserve_space=again[3]), **run)
    if backend == "cuda" and not on_device:   # a reserve and its host_reserved also pair across backends
        ref_out = ops.cudnn_rnn_v3(**forward_args(case), backend="reference")
        ops.cudnn_rnn_backprop_v3(**backward_args(case, ref_out), **run)
        with pytest.raises(ValueError, match="different forward calls"):
            ops.cudnn_rnn_backprop_v3(**dict(kw, reserve_space=ref_out[3]), **run)


@pytest.mark.parametrize("with_lengths", [False, True])
def test_batch_major_input_without_time_major_false_says_so(case, with_lengths):
    """Issue 10: a [B, T, I] input with the default time_major=True blamed input_h's shape."""
    kw = dict(forward_args(case), input=np.ascontiguousarray(np.swapaxes(case.x, 0, 1)))
    if not with_lengths:
        kw["sequence_lengths"] = None
    msg = raises(ValueError, "input", forward, **kw)
    assert "did you mean time_major=False?" in msg, msg
    # and the other way round: time-major input with time_major=False
    bm = make_rnn_case(case.cfg, 4, 3, [4, 0, 2], seed=0, time_major=False)
    kw = dict(forward_args(bm), input=np.ascontiguousarray(np.swapaxes(bm.x, 0, 1)))
    if not with_lengths:
        kw["sequence_lengths"] = None
    msg = raises(ValueError, "input", forward, **kw)
    assert "did you mean time_major=True?" in msg, msg


@pytest.mark.parametrize("name", ["input", "input_h", "params"])
def test_python_list_is_rejected_naming_it(case, name):
    """Issue 10: a list as input gave a misleading dtype message about input_h."""
    kw = forward_args(case.astype(np.float32))
    kw[name] = kw[name].tolist()
    msg = raises(TypeError, name, forward, **kw)
    assert "list" in msg and "np.asarray" in msg, msg



# ----------------------------------------------------------------------------------------------
# canonical / params converters


# ----------------------------------------------------------------------------------------------
def test_canonical_errors():
    cfg = LSTM
    kw = dict(num_layers=cfg.L, num_units=cfg.H, input_size=cfg.I, rnn_mode="lstm", direction=cfg.direction,
              num_proj=cfg.num_proj)
    n = ops.cudnn_rnn_params_size(**kw)
    w, b = ops.cudnn_rnn_params_to_canonical(params=np.zeros(n), **kw)
    raises(ValueError, "params", ops.cudnn_rnn_params_to_canonical, params=np.zeros(n + 1), **kw)
    raises(ValueError, "params", ops.cudnn_rnn_params_to_canonical, params=np.zeros((n, 1)), **kw)
    raises(ValueError, "weights", ops.cudnn_rnn_canonical_to_params, weights=w[:-1], biases=b, **kw)
    raises(ValueError, "biases", ops.cudnn_rnn_canonical_to_params, weights=w, biases=b + b[:1], **kw)
    bad = list(w)
    bad[3] = bad[3].T
    raises(ValueError, "weights[3]", ops.cudnn_rnn_canonical_to_params, weights=bad, biases=b, **kw)
    bad = list(b)
    bad[5] = np.zeros((1,) + bad[5].shape)
    raises(ValueError, "biases[5]", ops.cudnn_rnn_canonical_to_params, weights=w, biases=bad, **kw)
    bad = list(w)
    bad[2] = bad[2].astype(np.float32)
    with pytest.raises(TypeError, match=r"^weights\[2\]"):
        ops.cudnn_rnn_canonical_to_params(weights=bad, biases=b, **kw)


# ----------------------------------------------------------------------------------------------
# torch tensors: the ops take NumPy (or device) arrays; a tensor is refused, naming the argument
# ----------------------------------------------------------------------------------------------

def torch_raises(name, fn, **kw):
    """fn(**kw) raises a TypeError (also a ValueError) that names `name` and points to numbarnn.torch."""
    msg = raises(TypeError, name, fn, **kw)
    assert "torch.Tensor" in msg and "numbarnn.torch" in msg and ".detach().cpu().numpy()" in msg, msg
    return msg


@pytest.mark.parametrize("requires_grad", [False, True], ids=["cpu-tensor", "requires-grad"])
@pytest.mark.parametrize("name", ["input", "input_h", "input_c", "params"])
def test_torch_tensor_is_refused_naming_it(lstm_case, name, requires_grad):
    """A plain CPU tensor used to come back as NumPy, detached; one that requires grad blamed its type."""
    torch = pytest.importorskip("torch")
    kw = forward_args(lstm_case)
    kw[name] = torch.from_numpy(kw[name]).requires_grad_(requires_grad)
    torch_raises(name, forward, **kw)


def test_torch_tensor_is_refused_by_every_op(lstm_case):
    """The same rule in backprop, the params converters and the BlockLSTM ops (integer arguments too)."""
    torch = pytest.importorskip("torch")
    t = torch.from_numpy
    kw = forward_args(lstm_case)
    torch_raises("sequence_lengths", forward, **dict(kw, sequence_lengths=t(lstm_case.lengths)))
    back = backward_args(lstm_case, forward(**kw))
    for name in ("output_backprop", "reserve_space", "host_reserved"):
        torch_raises(name, backward, **dict(back, **{name: t(back[name])}))
    cfg = lstm_case.cfg
    sizes = dict(num_layers=cfg.L, num_units=cfg.H, input_size=cfg.I, direction=cfg.direction, num_proj=cfg.num_proj)
    torch_raises("params", ops.cudnn_rnn_params_to_canonical, params=t(lstm_case.params), **sizes)
    w, b = ops.cudnn_rnn_params_to_canonical(params=lstm_case.params, **sizes)
    torch_raises("weights[0]", ops.cudnn_rnn_canonical_to_params, weights=[t(w[0])] + w[1:], biases=b, **sizes)
    T, B, I, C = 3, 2, 4, 5
    blk = dict(seq_len_max=T, x=np.zeros((T, B, I)), cs_prev=np.zeros((B, C)), h_prev=np.zeros((B, C)),
               w=np.zeros((I + C, 4 * C)), wci=np.zeros(C), wcf=np.zeros(C), wco=np.zeros(C), b=np.zeros(4 * C))
    ops.block_lstm(**blk, backend=BACKEND)
    torch_raises("x", ops.block_lstm, **dict(blk, x=t(blk["x"]).requires_grad_()), backend=BACKEND)
    torch_raises("seq_len_max", ops.block_lstm, **dict(blk, seq_len_max=torch.tensor(T)), backend=BACKEND)
    torch_raises("params", forward, **dict(kw, params=torch.nn.Parameter(t(lstm_case.params))))   # a subclass


# ---------------------------------------------------------------------------------------------------
# the checks are remembered per call signature: a signature that passed once must not let another one through
# ---------------------------------------------------------------------------------------------------

def test_a_validated_signature_does_not_pass_other_lengths_or_attribute_types(case):
    forward(**forward_args(case))                                    # valid: its signature is remembered
    forward(**forward_args(case))
    lens = np.full(case.B, case.T + 1, dtype=np.int32)               # same shapes, lengths past T
    with pytest.raises(ValueError, match=r"^sequence_lengths: expected every length in \[0, T="):
        forward(**dict(forward_args(case), sequence_lengths=lens))
    with pytest.raises(TypeError, match=r"^time_major: expected a bool, got 1"):   # 1 == True, but not a bool
        forward(**dict(forward_args(case), time_major=int(case.time_major)))
    with pytest.raises(TypeError, match=r"^seed: "):
        forward(**dict(forward_args(case), seed=float(case.cfg.seed)))
    bad = case.params.astype(np.float64 if case.params.dtype == np.float32 else np.float32)
    with pytest.raises(TypeError, match=r"^params: expected dtype"):
        forward(**dict(forward_args(case), params=bad))


def test_a_validated_backprop_signature_does_not_pass_other_arguments(case):
    """Backprop's checks are remembered per signature too (shapes, dtypes, host_reserved's bytes); after valid
    calls, a mismatched gradient shape, another forward's reserve (its nonce: checked at every call) or its
    host_reserved are still refused."""
    out = forward(**forward_args(case))
    kw = backward_args(case, out)
    backward(**kw)
    backward(**kw)                                                    # its signature is remembered now
    raises(ValueError, "output_backprop", backward, **dict(kw, output_backprop=case.dy[:, :1]))
    other = forward(**forward_args(case))                             # same call: another nonce
    with pytest.raises(ValueError, match=r"^reserve_space and host_reserved come from different forward calls"):
        backward(**dict(kw, reserve_space=other[3]))
    if case.B > 1:
        lens = np.asarray(case.lengths, dtype=np.int32).copy() if case.lengths is not None else \
            np.full(case.B, case.T, dtype=np.int32)
        lens[0] = max(0, lens[0] - 1)
        shorter = forward(**dict(forward_args(case), sequence_lengths=lens))
        raises(ValueError, "host_reserved", backward, **dict(kw, host_reserved=shorter[4]))


def test_a_cell_replaced_under_its_name_is_checked_again():
    import dataclasses

    from numbarnn import cells
    from numbarnn.cells import get_cell, register

    lstm = get_cell("lstm")
    name = "test_replaced_cell"
    register(dataclasses.replace(lstm, name=name))
    try:
        case = make_rnn_case(rnn_config(1, 3, 2, name), 2, 2, None, seed=0, dtype=np.float64)
        forward(**forward_args(case))
        register(dataclasses.replace(get_cell("gru"), name=name), replace=True)   # 3 gates now: params too short
        with pytest.raises(ValueError, match=r"^params: expected length params_size"):
            forward(**forward_args(case))
    finally:
        cells.spec._CELLS.pop(name, None)

"""The CUDA backend of the cuDNN-style RNN ops against the NumPy reference (SPEC sections 2-8, 10, 11).

Every test runs the same op twice, backend="cuda" (numba.cuda kernels; numba's CUDA simulator unless
NUMBARNN_REAL_GPU=1) and backend="reference", and compares the eight named results

    output, output_h, output_c, reserve_space                                  (cudnn_rnn_v3)
    input_backprop, input_h_backprop, input_c_backprop, params_backprop       (cudnn_rnn_backprop_v3)

as ‖cuda − reference‖/‖reference‖ with a per-output tolerance (SPEC 10: float64 1e-12; float32 1e-5 for
outputs and 1e-4 for gradients; float16 1e-2, against the reference run on the same float16 inputs).
A failure names the output and the case.

What is covered:
- a fixed table of the important cases (every mode, L 1-2, both directions, projection, skip/linear/auto input,
  ragged lengths with 0 and all-zero lengths, time/batch-major, dropout p 0.3 and 1.0 with seeds near 2**32 and
  negative, inference) plus hypothesis cases in float64, float32 and float16;
- the reserve layout is shared: the reference backprop reads the kernels' reserve and vice versa;
- dropout masks recorded in the reserve are bit-identical to `numbarnn.reference.philox.dropout_keep_mask`;
- two identical calls are bit-identical; inputs are not mutated; T == 0 and B == 0;
- device arrays in -> device arrays out with equal values (batch-major too: device swap01);
- the launch budget of `numbarnn.kernels.driver` (per step: forward 1, 2 with num_proj; backward 2), and
  launches scale with max(len), not T;
- bad input gives the same ValueError/TypeError message on both backends;
- the default backend is "cpu" in the simulator (no real GPU), and backend="cuda" runs the kernels.

The simulator is slow (one Python thread per CUDA thread): shapes stay tiny (H, B <= 5, T <= 4, except one
T=7, B=6 LSTM case), and results shared by several tests are computed once (`_fixed_run`).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
from conftest import (SIMULATOR, assert_close, backward_named, check_dropout_masks, compare_backends, describe,
                      examples, forward_named, host)
from hypothesis import given, settings

from numbarnn import ops
from numbarnn.backends import get_default_backend, real_gpu_available, set_default_backend
from numbarnn.config import rnn_config
from numbarnn.kernels import driver
from numbarnn.testing import make_rnn_case, rnn_cases, run_backward, run_forward
from numbarnn.verify import RNN_GRADIENTS as BACKWARD_NAMES
from numbarnn.verify import RNN_OUTPUTS as FORWARD_NAMES

numba_cuda = pytest.importorskip("numba.cuda")
is_cuda_ndarray = numba_cuda.devicearray.is_cuda_ndarray   # an attribute in the simulator, not a module

# ----------------------------------------------------------------------------------------------
# helpers (the comparison itself, `compare_backends`, is conftest's: test_step_v2/v3 use it too)
# ----------------------------------------------------------------------------------------------

def assert_bit_identical(got: dict, want: dict, context: str):
    for name, w in want.items():
        g, w = host(got[name]), host(w)
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: shape/dtype differ ({context})"
        assert g.tobytes() == w.tobytes(), f"{name}: not bit-identical ({context})"


# ----------------------------------------------------------------------------------------------
# the fixed table of important cases
# ----------------------------------------------------------------------------------------------
#          id: (rnn_config args, T, B, lengths, time_major, is_training)
FIXED = {
    # the big one: T=7, B=6 ragged (sorted, with repeats), bidirectional, projection, 2 layers, dropout
    "lstm-bi-proj-T7B6": (dict(num_layers=2, num_units=4, input_size=3, rnn_mode="lstm", direction="bidirectional",
                               num_proj=3, dropout=0.3, seed=2**32 - 1, seed2=2**32 - 2),
                          7, 6, [7, 5, 5, 2, 1, 1], True, True),
    "lstm-uni-zero-lengths": (dict(num_layers=1, num_units=3, input_size=2, rnn_mode="lstm"),
                              3, 3, [0, 0, 0], True, True),
    "lstm-bi-skip-proj-bm": (dict(num_layers=2, num_units=3, input_size=3, rnn_mode="lstm",
                                  input_mode="skip_input", direction="bidirectional", num_proj=2, dropout=0.3,
                                  seed=-1, seed2=2**32 + 5),
                             3, 4, [3, 0, 1, 2], False, True),
    "lstm-uni-projH": (dict(num_layers=2, num_units=3, input_size=2, rnn_mode="lstm", num_proj=3),
                       4, 3, [2, 4, 3], True, True),
    "gru-bi-skip": (dict(num_layers=2, num_units=3, input_size=3, rnn_mode="gru", input_mode="skip_input",
                         direction="bidirectional"),
                    3, 4, [3, 0, 2, 1], True, True),
    "gru-bi-auto-linear-bm": (dict(num_layers=1, num_units=3, input_size=2, rnn_mode="gru",
                                   input_mode="auto_select", direction="bidirectional"),
                              3, 5, [1, 3, 0, 2, 3], False, True),
    "rnn_tanh-auto-skip-bm": (dict(num_layers=1, num_units=3, input_size=3, rnn_mode="rnn_tanh",
                                   input_mode="auto_select"),
                              4, 3, [2, 4, 1], False, True),
    "rnn_relu-p1-neg-seeds": (dict(num_layers=2, num_units=3, input_size=2, rnn_mode="rnn_relu", dropout=1.0,
                                   seed=-(2**40) - 3, seed2=2**32 - 1),
                              3, 2, None, True, True),
    "rnn_relu-bi-T1B1": (dict(num_layers=1, num_units=2, input_size=2, rnn_mode="rnn_relu",
                              direction="bidirectional"),
                         1, 1, None, True, True),
    # 3 layers: the dropout mask of layer 2 starts at Philox element (2-1)*T*B*D*P, not 0
    "rnn_tanh-L3-dropout": (dict(num_layers=3, num_units=2, input_size=2, rnn_mode="rnn_tanh",
                                 direction="bidirectional", dropout=0.3, seed=2**32 + 1, seed2=2**32 - 1),
                            3, 2, [3, 1], True, True),
    "gru-p03-uni": (dict(num_layers=2, num_units=2, input_size=3, rnn_mode="gru", dropout=0.3, seed=12345,
                         seed2=-7),
                    3, 3, [3, 1, 2], True, True),
    "lstm-bi-infer-dropout": (dict(num_layers=2, num_units=3, input_size=2, rnn_mode="lstm",
                                   direction="bidirectional", num_proj=2, dropout=0.3, seed=2**32 - 1, seed2=3),
                              3, 3, [3, 0, 2], True, False),
    # H = 9 > the simulator's 8 threads per block: two blocks per row, the j >= H guards
    "lstm-bi-H9-multiblock": (dict(num_layers=1, num_units=9, input_size=2, rnn_mode="lstm",
                                   direction="bidirectional"),
                              2, 2, [2, 1], True, True),
    "rnn_tanh-bi-infer-bm": (dict(num_layers=2, num_units=2, input_size=3, rnn_mode="rnn_tanh",
                                  direction="bidirectional"),
                             3, 2, [1, 3], False, False),
}


def fixed_case(key, dtype=np.float64):
    args, T, B, lengths, time_major, training = FIXED[key]
    return make_rnn_case(rnn_config(**args), T, B, lengths, seed=sum(map(ord, key)), dtype=dtype,
                         time_major=time_major, is_training=training)


@functools.lru_cache(maxsize=None)
def _fixed_run(key):
    """(case, cuda forward, reference forward, cuda backprop, reference backprop), computed once per key."""
    case = fixed_case(key)
    return (case, *compare_backends(case))


@pytest.mark.parametrize("key", list(FIXED))
def test_fixed_cases_float64(key):
    """Every named output of the kernels equals the reference within 1e-12 (float64)."""
    case, fwd_cuda, fwd_ref, bwd_cuda, bwd_ref = _fixed_run(key)
    assert isinstance(fwd_cuda[0], np.ndarray), "NumPy in -> NumPy out"
    if case.lengths is not None:   # SPEC 5: zeros past each length, state of a len-0 row = initial state
        y = host(fwd_cuda[0]) if case.time_major else np.swapaxes(host(fwd_cuda[0]), 0, 1)
        for b, n in enumerate(case.lengths):
            assert not y[n:, b].any(), f"output: nonzero past length {n} in row {b} ({describe(case)})"


@pytest.mark.parametrize("key", ["lstm-bi-proj-T7B6", "gru-bi-skip", "rnn_relu-p1-neg-seeds",
                                 "lstm-bi-skip-proj-bm"])
def test_cuda_backprop_reads_reference_reserve(key):
    """Shared reserve layout, the other way round: the kernels' backprop on the reference's reserve."""
    case, fwd_cuda, fwd_ref, bwd_cuda, bwd_ref = _fixed_run(key)
    got = run_backward(case, fwd_ref, "cuda")
    assert_close(backward_named(got), backward_named(bwd_ref), case.dtype,
                 describe(case) + " [cuda backprop on the reference reserve]")


def test_dropout_masks_in_reserve_are_philox():
    checked = 0
    for key in FIXED:
        case, fwd_cuda, *_ = _fixed_run(key)
        if case.is_training:
            checked += check_dropout_masks(case, fwd_cuda[3])
    assert checked >= 6   # p 0.3 and 1.0, seeds near 2**32 and negative, layers 1 and 2


def test_p1_drops_everything_above_layer_0():
    """p = 1: layer 1 sees zeros, so its output is a function of the biases and h0 only."""
    case, fwd_cuda, *_ = _fixed_run("rnn_relu-p1-neg-seeds")
    other = replace(case, x=case.x * -3.0 + 1.0)        # a different input changes layer 0 only
    y2, hT2, *_ = run_forward(other, "cuda")
    np.testing.assert_array_equal(y2, fwd_cuda[0], err_msg="output: depends on x through p=1 dropout")


# ----------------------------------------------------------------------------------------------
# hypothesis: every feature, three dtypes
# ----------------------------------------------------------------------------------------------

@settings(max_examples=examples(20))
@given(rnn_cases(max_T=4, max_B=4))
def test_hypothesis_float64(case):
    fwd_cuda, *_ = compare_backends(case)
    check_dropout_masks(case, fwd_cuda[3])


@settings(max_examples=examples(10))
@given(rnn_cases(max_T=4, max_B=4))
def test_hypothesis_inference_float64(case):
    compare_backends(replace(case, is_training=False))


@settings(max_examples=examples(10))
@given(rnn_cases(max_T=4, max_B=4, dtype=np.float32))
def test_hypothesis_float32(case):
    """SPEC 10: float32 within 1e-5 (outputs) / 1e-4 (gradients) of the reference on the same inputs."""
    compare_backends(case)


@settings(max_examples=examples(10))
@given(rnn_cases(max_T=4, max_B=4, dtype=np.float16))
def test_hypothesis_float16(case):
    """SPEC 10: half is stored as half and computed in float32: within 1e-2 of the reference."""
    compare_backends(case)


def test_big_case_float16():
    """The T=7, B=6 ragged bidirectional projection LSTM in half, one layer (float32, and dropout masks in
    half, are covered by the hypothesis cases)."""
    case = fixed_case("lstm-bi-proj-T7B6", np.float16)
    case = make_rnn_case(replace(case.cfg, num_layers=1, dropout=0.0), case.T, case.B, case.lengths, seed=11,
                         dtype=np.float16)
    compare_backends(case, context=" [float16]")


# ----------------------------------------------------------------------------------------------
# determinism, no mutation, empty shapes
# ----------------------------------------------------------------------------------------------

def small_case(mode="lstm", dtype=np.float64, time_major=True, **kw):
    args = dict(num_layers=2, num_units=3, input_size=2, rnn_mode=mode, direction="bidirectional",
                num_proj=2 if mode == "lstm" else 0, dropout=0.3, seed=2**32 - 3, seed2=-5)
    args.update(kw)
    T, B = 3, 3
    return make_rnn_case(rnn_config(**args), T, B, [3, 1, 0], seed=7, dtype=dtype, time_major=time_major)


def test_two_identical_calls_are_bit_identical_and_inputs_not_mutated():
    case = small_case("lstm", np.float32, direction="unidirectional")   # 2 layers, projection, dropout
    before = {k: (None if v is None else np.array(v, copy=True)) for k, v in vars(case).items()
              if isinstance(v, np.ndarray)}
    f1 = run_forward(case, "cuda")
    f2 = run_forward(case, "cuda")
    assert_bit_identical(forward_named(f2), forward_named(f1), "forward twice")
    fwd_copy = tuple(np.array(a, copy=True) for a in f1)
    b1 = run_backward(case, f1, "cuda")
    b2 = run_backward(case, f1, "cuda")
    assert_bit_identical(backward_named(b2), backward_named(b1), "backprop twice")
    for name, arr in before.items():
        assert getattr(case, name).tobytes() == arr.tobytes(), f"{name}: mutated by the cuda backend"
    for name, a, b in zip(FORWARD_NAMES + ("host_reserved",), f1, fwd_copy):
        assert a.tobytes() == b.tobytes(), f"{name}: mutated by the cuda backprop"


def test_device_arrays_passed_again_with_new_contents():
    """The driver keeps the views it makes of a device array on the array (x, the states and params passed
    again make no new views): a second call on the same arrays, rewritten in between, computes from the new
    contents, in training and inference."""
    from numba import cuda

    a = small_case("lstm", np.float64, direction="unidirectional", dropout=0.0)
    b = make_rnn_case(a.cfg, a.T, a.B, a.lengths, seed=8, dtype=np.float64)
    arrays = [cuda.to_device(v) for v in (a.x, a.h0, a.c0, a.params)]
    attrs = dict(rnn_mode="lstm", num_proj=a.cfg.num_proj, backend="cuda")
    ops.cudnn_rnn_v3(*arrays, a.lengths, **attrs)
    for dev, new in zip(arrays, (b.x, b.h0, b.c0, b.params)):
        dev.copy_to_device(new)
    for training in (True, False):
        got = ops.cudnn_rnn_v3(*arrays, b.lengths, is_training=training, **attrs)
        want = run_forward(replace(b, is_training=training), "reference")
        assert_close(forward_named([host(v) for v in got]), forward_named(want), np.float64,
                     f"arrays rewritten, is_training={training}")


@pytest.mark.parametrize("mode,time_major", [("lstm", True), ("lstm", False), ("gru", True)])
@pytest.mark.parametrize("T,B", [(0, 3), (3, 0), (0, 0)])
def test_empty_time_or_batch(mode, time_major, T, B):
    cfg = rnn_config(2, 3, 2, mode, direction="bidirectional", num_proj=2 if mode == "lstm" else 0, dropout=0.3)
    case = make_rnn_case(cfg, T, B, None, seed=3, time_major=time_major)
    fwd_cuda, fwd_ref, bwd_cuda, bwd_ref = compare_backends(case)
    np.testing.assert_array_equal(fwd_cuda[1], case.h0, err_msg="output_h: != input_h with T == 0 or B == 0")
    if mode == "lstm":
        np.testing.assert_array_equal(fwd_cuda[2], case.c0, err_msg="output_c: != input_c")
    assert fwd_cuda[0].shape == ((T, B) if time_major else (B, T)) + (cfg.D * cfg.P,)
    np.testing.assert_array_equal(bwd_cuda[1], case.dhT, err_msg="input_h_backprop: != output_h_backprop")
    assert not bwd_cuda[3].any(), "params_backprop: nonzero with nothing to learn from"


def test_all_zero_lengths_pass_states_through():
    case, fwd_cuda, fwd_ref, bwd_cuda, bwd_ref = _fixed_run("lstm-uni-zero-lengths")
    assert not fwd_cuda[0].any(), "output: nonzero with all lengths 0"
    np.testing.assert_array_equal(fwd_cuda[1], case.h0, err_msg="output_h")
    np.testing.assert_array_equal(fwd_cuda[2], case.c0, err_msg="output_c")
    np.testing.assert_array_equal(bwd_cuda[1], case.dhT, err_msg="input_h_backprop")
    np.testing.assert_array_equal(bwd_cuda[2], case.dcT, err_msg="input_c_backprop")
    assert not bwd_cuda[0].any() and not bwd_cuda[3].any(), "input_backprop / params_backprop: nonzero"


def test_non_contiguous_numpy_inputs():
    """Strided / Fortran-ordered NumPy inputs give the same bits as contiguous ones."""
    case = small_case("gru", num_layers=1, dropout=0.0)
    want = run_forward(case, "cuda")
    x_strided = np.repeat(case.x, 2, axis=2)[:, :, ::2]           # a non-contiguous view with the same values
    assert not x_strided.flags.c_contiguous
    got = run_forward(case, "cuda", x=x_strided, params=np.asfortranarray(case.params),
                      h0=np.asfortranarray(case.h0))
    assert_bit_identical(forward_named(got), forward_named(want), "non-contiguous inputs")


# ----------------------------------------------------------------------------------------------
# device arrays in -> device arrays out
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,time_major", [("lstm", False), ("gru", True)])
def test_device_arrays_in_device_arrays_out(mode, time_major):
    cuda = numba_cuda
    case = small_case(mode, time_major=time_major, num_layers=1, dropout=0.0)
    to_dev = (lambda a: None if a is None else cuda.to_device(a))
    fwd_host = run_forward(case, "cuda")
    dev_in = dict(x=to_dev(case.x), h0=to_dev(case.h0), c0=to_dev(case.c0), params=to_dev(case.params))
    fwd_dev = run_forward(case, "cuda", **dev_in)
    for name, a in zip(FORWARD_NAMES, fwd_dev[:4]):
        assert is_cuda_ndarray(a), f"{name}: device arrays in, but {type(a).__name__} out"
    assert_bit_identical(forward_named(fwd_dev), forward_named(fwd_host), "device vs NumPy forward")

    y, hT, cT, reserve, host_reserved = fwd_dev
    bwd_dev = ops.cudnn_rnn_backprop_v3(
        dev_in["x"], dev_in["h0"], dev_in["c0"], dev_in["params"], case.lengths, y, hT, cT,
        to_dev(case.dy), to_dev(case.dhT), to_dev(case.dcT) if case.dcT is not None else None, reserve,
        host_reserved, backend="cuda", **case.attrs)
    for name, a in zip(BACKWARD_NAMES, bwd_dev):
        assert is_cuda_ndarray(a), f"{name}: device arrays in, but {type(a).__name__} out"
    bwd_host = run_backward(case, fwd_host, "cuda")
    assert_bit_identical(backward_named(bwd_dev), backward_named(bwd_host), "device vs NumPy backprop")
    # device input with host params and states: still device out, same values
    mixed = run_forward(case, "cuda", x=dev_in["x"])
    for name, a in zip(FORWARD_NAMES, mixed[:4]):
        assert is_cuda_ndarray(a), f"{name}: device input, but {type(a).__name__} out"
    assert_bit_identical(forward_named(mixed), forward_named(fwd_host), "device x + host params")
    # the device inputs were not mutated
    for name, d in dev_in.items():
        if d is not None:
            assert d.copy_to_host().tobytes() == getattr(case, name).tobytes(), f"{name}: device input mutated"
    # and the values are the reference's
    assert_close(backward_named(bwd_dev), backward_named(run_backward(case, run_forward(case, "reference"),
                                                                      "reference")), case.dtype, describe(case))


# ----------------------------------------------------------------------------------------------
# launch budget (numbarnn.kernels.driver.LaunchLog)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", driver.STEP_VERSIONS[:2])
@pytest.mark.parametrize("mode,num_proj", [("lstm", 0), ("lstm", 2), ("gru", 0), ("rnn_tanh", 0)])
def test_launch_budget(mode, num_proj, version, monkeypatch):
    """Per step: v1 one cell launch (+ the projection) forward, the cell + the recurrent product backward; v2 the
    same forward and one fused launch backward (+1 after the loop), except with a projection (v1's step +
    recurrent_backward_v2)."""
    monkeypatch.setenv(driver.STEP_VERSION_VAR, str(version))
    cfg = rnn_config(1, 3, 2, mode, num_proj=num_proj)
    T, B = 4, 2
    counts = {}
    for name, lengths in (("full", None), ("short", [1, 1])):
        case = make_rnn_case(cfg, T, B, lengths, seed=1)
        run_backward(case, run_forward(case, "cuda"), "cuda")   # forward's log is kept until the next forward
        counts[name] = driver.last_launch_count()
    fwd, bwd = counts["full"]["forward"], counts["full"]["backward"]
    assert fwd.per_step == (2 if num_proj else 1), f"forward launches per step: {fwd.by_kernel}"
    assert bwd.per_step == (1 if version == 2 and not num_proj else 2), f"backward per step: {bwd.by_kernel}"
    assert fwd.step_version == bwd.step_version == version, (fwd, bwd)
    assert fwd.steps == T and counts["short"]["forward"].steps == 1, "steps must be max(len)"
    # launches scale with max(len), not T: exactly (T - 1) steps' worth fewer
    for direction in ("forward", "backward"):
        full, short = counts["full"][direction], counts["short"][direction]
        assert short.total < full.total, f"{direction}: lengths all 1 did not reduce the launches"
        assert full.total - short.total == (T - 1) * full.per_step, \
            f"{direction}: {full.by_kernel} vs {short.by_kernel}"


def test_launches_are_per_step_for_both_directions(monkeypatch):
    """One launch serves both directions of a layer: per_step does not double with D = 2 or L = 2 (v1)."""
    monkeypatch.setenv(driver.STEP_VERSION_VAR, "1")
    case = small_case("lstm")                             # L=2, bidirectional, projection, lengths [3, 1, 0]
    run_backward(case, run_forward(case, "cuda"), "cuda")
    fwd, bwd = driver.last_launch_count()["forward"], driver.last_launch_count()["backward"]
    steps = int(max(case.lengths))
    assert (fwd.per_step, fwd.steps) == (2, steps), fwd
    assert (bwd.per_step, bwd.steps) == (2, steps), bwd
    assert fwd.by_kernel["forward_step"] == fwd.by_kernel["project"] == case.cfg.L * steps, fwd.by_kernel
    assert bwd.by_kernel["backward_step"] == bwd.by_kernel["recurrent_backward"] == case.cfg.L * steps, \
        bwd.by_kernel


# ----------------------------------------------------------------------------------------------
# bad input: the same errors as the reference
# ----------------------------------------------------------------------------------------------

def _error(fn, **kw):
    try:
        fn(**kw)
    except (ValueError, TypeError) as e:   # noqa: PERF203
        return type(e), str(e)
    raise AssertionError(f"{fn.__name__}({sorted(kw)}) raised nothing")


def _fwd_kwargs(case):
    return dict(input=case.x, input_h=case.h0, input_c=case.c0, params=case.params,
                sequence_lengths=case.lengths, **case.attrs)


BAD_FORWARD = {
    "lengths > T": lambda c: dict(sequence_lengths=np.array([9, 1, 0], np.int32)),
    "lengths count": lambda c: dict(sequence_lengths=np.array([1, 1], np.int32)),
    "params length": lambda c: dict(params=c.params[:-1]),
    "input_h shape": lambda c: dict(input_h=c.h0[:, :2]),
    "mixed dtypes": lambda c: dict(input_c=c.c0.astype(np.float32)),
    "dropout > 1": lambda c: dict(dropout=1.5),
    "unknown mode": lambda c: dict(rnn_mode="lstn"),
    "input rank": lambda c: dict(input=c.x[0]),
}


@pytest.mark.parametrize("what", list(BAD_FORWARD))
def test_bad_forward_input_same_error(what):
    case = small_case("lstm", num_layers=1, dropout=0.0)
    kw = dict(_fwd_kwargs(case), **BAD_FORWARD[what](case))
    want = _error(ops.cudnn_rnn_v3, backend="reference", **kw)
    got = _error(ops.cudnn_rnn_v3, backend="cuda", **kw)
    assert got == want
    # device arrays give the same message as NumPy arrays
    dev = {k: (numba_cuda.to_device(np.ascontiguousarray(v))
               if isinstance(v, np.ndarray) and k != "sequence_lengths" else v) for k, v in kw.items()}
    assert _error(ops.cudnn_rnn_v3, backend="cuda", **dev) == want


def test_bad_backprop_input_same_error():
    case = small_case("gru", num_layers=1, dropout=0.0)
    fwd = run_forward(case, "reference")
    y, hT, cT, reserve, host_reserved = fwd
    base = dict(_fwd_kwargs(case), output=y, output_h=hT, output_c=cT, output_backprop=case.dy,
                output_h_backprop=case.dhT, output_c_backprop=case.dcT, reserve_space=reserve,
                host_reserved=host_reserved)
    for over in (dict(reserve_space=reserve[:-1]), dict(host_reserved=np.zeros(0, np.int8)),
                 dict(output_backprop=case.dy[:, :, :-1]), dict(sequence_lengths=np.array([3, 1, 1], np.int32)),
                 dict(output_h_backprop=case.dhT.astype(np.float32))):
        kw = dict(base, **over)
        want = _error(ops.cudnn_rnn_backprop_v3, backend="reference", **kw)
        assert _error(ops.cudnn_rnn_backprop_v3, backend="cuda", **kw) == want, sorted(over)


# ----------------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------------

def test_default_backend_and_explicit_cuda(monkeypatch):
    monkeypatch.delenv("NUMBARNN_BACKEND", raising=False)
    set_default_backend(None)
    expected = "cuda" if real_gpu_available() else "cpu"
    if SIMULATOR:
        assert not real_gpu_available() and expected == "cpu"
    assert get_default_backend() == expected
    case = small_case("rnn_tanh", num_layers=1, dropout=0.0)
    run_forward(case, "cuda")
    marker = driver.last_launch_count()["forward"]
    default_out = run_forward(case)                         # backend=None
    if expected == "cpu":
        assert driver.last_launch_count()["forward"] is marker, "backend=None launched kernels in the simulator"
        assert_bit_identical(forward_named(default_out), forward_named(run_forward(case, "cpu")),
                             "backend=None vs cpu")
    run_forward(case, "cuda")
    assert driver.last_launch_count()["forward"] is not marker, "backend='cuda' launched no kernel"


@pytest.mark.parametrize("mode", ["rnn_relu", "rnn_tanh", "lstm", "gru"])
def test_nan_propagates_like_the_reference(mode):
    """SPEC 11: NaN inputs are not an error; NaN propagates, and to the same places on both backends
    (relu included: max(0, NaN) is NaN, as numpy.maximum)."""
    case = make_rnn_case(rnn_config(1, 3, 2, mode), 3, 2, None, seed=0)
    case.x[1, 0, 0] = np.nan
    where = {}
    for backend in ("reference", "cuda"):
        fwd = run_forward(case, backend)
        grads = run_backward(case, fwd, backend)
        where[backend] = [np.isnan(np.asarray(a)) for a in list(fwd[:3]) + list(grads)]
    assert where["reference"][0].any()                       # the NaN reached the output
    for name, ref, got in zip(("output", "output_h", "output_c", "input_backprop", "input_h_backprop",
                               "input_c_backprop", "params_backprop"), where["reference"], where["cuda"]):
        assert np.array_equal(ref, got), name


# ----------------------------------------------------------------------------------------------
# the driver's workspace (driver.SCRATCH, numbarnn/workspace.py): device scratch reused across calls
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [1, 2])
def test_workspace_is_never_read_before_it_is_written(version, monkeypatch):
    """Every device scratch buffer set to NaN before each call (after a first call of the same configuration
    has created them all): outputs and gradients still equal the reference's, so nothing reads a stale
    buffer.  The cases take every scratch name: dropout's masked copies, inner layers' dx, ragged lengths
    with 0 (dgx's fill), batch-major, projection (dh_total), an inference call's reserve."""
    monkeypatch.setenv(driver.STEP_VERSION_VAR, str(version))
    gru = make_rnn_case(rnn_config(2, 3, 2, "gru", direction="bidirectional", dropout=0.4, seed=3), 3, 3,
                        [3, 0, 2], seed=2, time_major=False)
    cases = [gru, replace(gru, is_training=False),
             make_rnn_case(rnn_config(1, 3, 3, "lstm", num_proj=2), 3, 2, [2, 1], seed=3)]
    for case in cases:                                             # create every buffer
        fwd = run_forward(case, "cuda")
        if case.is_training:
            run_backward(case, fwd, "cuda")
    for case in cases:
        driver.SCRATCH.poison(np.nan)
        fwd_cuda, fwd_ref = run_forward(case, "cuda"), run_forward(case, "reference")
        assert_close(forward_named(fwd_cuda), forward_named(fwd_ref), case.dtype, describe(case) + " [poisoned]")
        if case.is_training:
            driver.SCRATCH.poison(np.nan)
            assert_close(backward_named(run_backward(case, fwd_cuda, "cuda")),
                         backward_named(run_backward(case, fwd_ref, "reference")), case.dtype,
                         describe(case) + " [poisoned]")


def test_workspace_lengths_follow_the_call():
    """The device copy of the lengths is reused only while they are the same: a call with other lengths (same
    shape) right after gets its own."""
    cfg = rnn_config(1, 3, 2, "rnn_tanh")
    for lengths in ([3, 1], [1, 3], [3, 1], None):
        compare_backends(make_rnn_case(cfg, 3, 2, lengths, seed=4), context=f" lengths={lengths}")
    assert driver.SCRATCH.release() > 0 and driver.SCRATCH.held_bytes() == 0
    compare_backends(make_rnn_case(cfg, 3, 2, [2, 2], seed=5), context=" after release")


def test_a_call_of_a_known_shape_allocates_only_its_results(monkeypatch):
    """After the first call of a shape, forward (training), backward and inference each allocate exactly the
    arrays they return (y, hT, cT, reserve; dparams, dh0, dc0, dx): scratch, partial sums and the lengths come
    from the workspace.  (Before it: 14, 24 and 14 device allocations per call for such a configuration.)"""
    from numba import cuda
    cfg = rnn_config(2, 3, 2, "lstm", direction="bidirectional", dropout=0.3)
    case = make_rnn_case(cfg, 3, 2, [3, 2], seed=1, dtype=np.float32)
    dev = replace(case, **{k: cuda.to_device(getattr(case, k)) for k in ("x", "h0", "c0", "params", "dy", "dhT",
                                                                          "dcT")})
    counted = []
    for name in ("device_array", "to_device", "device_array_like", "pinned_array"):
        original = getattr(cuda, name)
        monkeypatch.setattr(cuda, name, lambda *a, _f=original, _n=name, **k: counted.append(_n) or _f(*a, **k))
    for call in range(2):
        counted.clear()
        fwd = run_forward(dev, "cuda")
        n_fwd = len(counted)
        bwd = run_backward(dev, fwd, "cuda")
        n_bwd = len(counted) - n_fwd
        run_forward(replace(dev, is_training=False), "cuda")
        n_inf = len(counted) - n_fwd - n_bwd
    assert (n_fwd, n_bwd, n_inf) == (4, 4, 4), (n_fwd, n_bwd, n_inf)
    assert_close(backward_named(bwd), backward_named(run_backward(case, run_forward(case, "reference"),
                                                                   "reference")), case.dtype, describe(case))

"""The launch plan `numbarnn explain` shows is the plan the driver runs, its launches are the ones counted, and the
per-step budget holds.

Budget: at most 2 launches per step per layer for both directions together (3 with a
projection); numbarnn does 1 forward (2 with projection) and 2 backward.
"""
import numpy as np
import pytest
from conftest import planned_and_launched, planned_launches

import numbarnn.contrib.peephole_lstm  # noqa: F401  (registers peephole_lstm: a cell with vectors)
from numbarnn.config import RNNCall, rnn_config
from numbarnn.kernels import common, driver
from numbarnn.testing import make_rnn_case, run_backward, run_forward

# The plans compared here are the simulator's (launch_plan(gpu=False): step version 1, the simulator's launch
# sizes and split-K choices); on a GPU the driver runs v3 with the GPU's. Seen on an H100: every comparison
# differs there by design, none is a wrong launch (the GPU's own plan is `numbarnn explain`'s, gpu=True).
pytestmark = pytest.mark.skipif(not common.SIMULATOR, reason="compares the simulator's launch plan (gpu=False) "
                                "with the launches the simulator makes; a GPU runs v3 with its own sizes")

CASES = [  # mode, direction, num_proj, input_mode, L, dropout, lengths (T=3, B=4)
    ("lstm", "bidirectional", 2, "linear_input", 2, 0.3, [3, 1, 0, 2]),
    ("gru", "unidirectional", 0, "skip_input", 2, 0.0, None),
    ("rnn_relu", "bidirectional", 0, "skip_input", 1, 0.0, [0, 0, 0, 0]),
    ("rnn_tanh", "unidirectional", 0, "linear_input", 3, 1.0, [1, 1, 1, 1]),
    ("peephole_lstm", "bidirectional", 0, "linear_input", 1, 0.0, [3, 0, 2, 1]),   # cell-vector sums too
]


@pytest.mark.parametrize("mode,direction,proj,input_mode,L,p,lengths", CASES)
def test_plan_matches_the_launches_the_driver_makes(mode, direction, proj, input_mode, L, p, lengths):
    H, T, B = 3, 3, 4
    cfg = rnn_config(L, H, 3 if input_mode == "skip_input" else 4, mode, input_mode, direction, proj, p, 5, 7)
    case = make_rnn_case(cfg, T, B, lengths=lengths, seed=1)
    plan, log, _, _ = planned_and_launched(case)
    steps = max(lengths) if lengths else T
    step_kernels = [r for r in plan if r["kernel"].endswith(("_step", "project", "recurrent_backward"))]
    assert sum(r["launches"] for r in step_kernels if r["phase"] == "forward") == steps * L * (2 if proj else 1)
    assert sum(r["launches"] for r in step_kernels if r["phase"] == "backward") == steps * L * 2
    if steps:
        assert log["forward"].per_step == (2 if proj else 1) and log["backward"].per_step == 2
    # bias sums: two launches (column_partials, column_totals) per direction and layer, two more with vectors
    sums = 2 if cfg.V and T * B else 1
    assert log["backward"].by_kernel["column_partials"] == log["backward"].by_kernel["column_totals"] == sums * L * cfg.D


@pytest.mark.parametrize("mode,direction,L,dtype", [("lstm", "bidirectional", 1, "float64"),
                                                     ("gru", "unidirectional", 2, "float32")])
def test_split_k_in_the_driver_is_planned_and_correct(monkeypatch, mode, direction, L, dtype):
    """With split-K allowed at the simulator's tiny shapes (a k-tile per slice is enough), the backward's thin
    products (dx = dgx W, dR = dgh^T h_prev) run in two stages: the plan lists both, the log counts both, the
    results still agree with the reference, and the partials come from the workspace."""
    from numbarnn.kernels import gemm
    from numbarnn.testing import relative_error
    monkeypatch.setattr(gemm, "SPLIT_MIN_K_TILES", 1)
    asked = set()
    real_scratch = driver.scratch
    monkeypatch.setattr(driver, "scratch", lambda name, shape, dt: asked.add(name) or real_scratch(name, shape, dt))
    H, T, B = 3, 3, 4
    cfg = rnn_config(L, H, 4, mode, "linear_input", direction, 0, 0.0, 5, 7)
    case = make_rnn_case(cfg, T, B, lengths=[3, 1, 0, 2], seed=1, dtype=np.dtype(dtype))
    plan, log, got_f, got_b = planned_and_launched(case)
    planned = sum(r["launches"] for r in plan if r["kernel"].startswith("split_k_sum"))
    assert planned == log["backward"].by_kernel.get("split_k_sum", 0) + log["forward"].by_kernel.get("split_k_sum", 0)
    assert planned >= 2 * cfg.L * cfg.D                     # dx and dR of every layer and direction at least
    assert any("split-K" in r["kernel"] for r in plan)
    assert "split_k_partials" in asked
    want_f = run_forward(case, "reference")
    want_b = run_backward(case, want_f, "reference")
    tol = 1e-12 if dtype == "float64" else 1e-4
    for got, want in zip(tuple(got_f[:3]) + tuple(got_b), tuple(want_f[:3]) + tuple(want_b)):
        if want is not None:
            assert relative_error(got, want) < tol


def test_a_device_reserve_gets_its_nonce_by_one_launch_the_plan_counts():
    """Device arrays in: the reserve stays on the device and ops writes its nonce by a launch (a copy from the
    host would wait for the kernels), counted with the forward's launches and in the plan."""
    from numba import cuda

    from numbarnn import ops
    from numbarnn.config import decode_host_reserved
    from numbarnn.reserve import read_nonce
    case = make_rnn_case(rnn_config(1, 3, 2, "gru"), 3, 2, None, seed=1)
    out = ops.cudnn_rnn_v3(*(cuda.to_device(a) for a in (case.x, case.h0, case.h0, case.params)), rnn_mode="gru",
                           backend="cuda")
    log = driver.last_launch_count()["forward"]
    call = RNNCall(case.cfg, 3, 2, np.dtype(case.dtype), True, True, (3, 3))
    assert log.by_kernel[driver.NONCE_KERNEL] == 1
    assert planned_launches(driver.launch_plan(call, gpu=False), "forward") == log.total
    assert [int(v) for v in read_nonce(out[3])] == decode_host_reserved(out[4])["nonce"]


def test_a_plan_is_data_built_without_compiling():
    """Given its step kernels, a GPU's plan is built in the simulator without compiling a kernel: entries that
    name their kernel by factory and key, one entry per step kernel for all its steps (backward: descending),
    and launch_plan's rows are the entries grouped."""
    from numbarnn.kernels import plan
    from numbarnn.kernels.common import jit
    cfg = rnn_config(2, 3, 4, "lstm", direction="bidirectional", num_proj=2)
    call = RNNCall(cfg, 4, 3, np.dtype(np.float32), True, True, (4, 2, 0))
    # which step kernels: decided first (v3's choice may ask a compiled kernel for its limits), then the plan
    fstep, bstep = (driver.step_plan(call, phase, simulator=False) for phase in ("forward", "backward"))
    compiled = jit.cache_info().currsize
    entries = (plan.forward_plan(call, simulator=False, device_reserve=True, step=fstep)
               + plan.backward_plan(call, simulator=False, step=bstep))
    assert jit.cache_info().currsize == compiled
    assert plan.plan_rows(entries) == driver.launch_plan(call, gpu=True)
    steps = [e for e in entries if e.steps is not None]
    assert steps and all(callable(e.kernel[0]) for e in steps)
    for e in steps:
        assert list(e.steps) == (list(range(4)) if e.phase == "forward" else [3, 2, 1, 0]), e
        assert e.launches == (4 if e.each_step else 1)
        assert e.why == driver.step_plan(call, e.phase, simulator=False).note


def test_the_driver_builds_a_plan_once_per_call_signature(monkeypatch):
    """The driver remembers a phase's plan per call, step plan, target and split-K knobs: the same call again runs
    the same entries without building them; another call, or a split-K knob changed (tests lower it), builds anew."""
    from numbarnn.kernels import gemm
    cfg = rnn_config(1, 3, 4, "gru", "linear_input", "unidirectional", 0, 0.0, 5, 7)
    case = make_rnn_case(cfg, 3, 2, seed=1)
    driver._planned.cache_clear()
    run_forward(case, backend="cuda")
    first = driver.last_launch_count()["forward"].plan
    run_forward(case, backend="cuda")
    info = driver._planned.cache_info()
    assert info.hits == 1 and info.misses == 1 and driver.last_launch_count()["forward"].plan == first
    run_forward(make_rnn_case(cfg, 2, 2, seed=1), backend="cuda")             # another call: built anew
    monkeypatch.setattr(gemm, "SPLIT_MIN_K_TILES", 1)
    run_forward(case, backend="cuda")                                         # another split-K threshold
    assert driver._planned.cache_info().misses == 3


CONTRIB = ("peephole_lstm", "cifg_lstm", "gru_v1", "mgu", "indrnn", "layer_norm_lstm", "layer_norm_gru")


@pytest.mark.parametrize("mode", ("lstm", "gru", "rnn_tanh", "rnn_relu") + CONTRIB)
def test_no_kernel_of_a_gpu_plan_is_passed_none(mode):
    """numba-cuda cannot pass None to a kernel (the simulator can: seen on an H100, where every layer-normalised GRU
    and every LSTM backward without cell vectors failed at launch). Every kernel entry of a GPU's plan, for every
    shipped cell with and without zoneout, a projection, dropout, skip_input and two directions, names an array or a
    value for each argument; what a cell lacks is an empty array of the argument's rank (steps.absent)."""
    import importlib
    from numbarnn.kernels import plan
    for name in CONTRIB:
        importlib.import_module(f"numbarnn.contrib.{name}")
    variants = [dict(), dict(direction="bidirectional", dropout=0.3, zoneout=0.2), dict(input_mode="skip_input")]
    if mode == "lstm":
        variants.append(dict(num_proj=2))
    for kw in variants:
        cfg = rnn_config(2, 3, 3, mode, **kw)
        call = RNNCall(cfg, 4, 3, np.dtype(np.float32), True, True, (4, 2, 0))
        entries = (plan.forward_plan(call, simulator=False, device_reserve=True)
                   + plan.backward_plan(call, simulator=False))
        kernels = [e for e in entries if e.run is plan.Run.KERNEL]
        assert kernels
        for e in kernels:
            assert None not in e.args, (mode, kw, e.name, e.args)

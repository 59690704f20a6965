"""Test set-up: kernels run in numba's CUDA simulator unless a real GPU is requested.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported (later it silently does nothing),
which is why it happens here, at collection time, before any test module imports numbarnn.
Set NUMBARNN_REAL_GPU=1 to run the same tests on a real GPU.
"""
import os

if os.environ.get("NUMBARNN_REAL_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
# the cpu backend's tile shapes by the static rule: the same loops in every worker, no measuring at first use
# (tests/test_cpu_fused.py tests the measurement, numbarnn/cpu/tuning.py)
os.environ.setdefault("NUMBARNN_CPU_TUNE", "0")
# OpenMP's idle threads (numba's parallel loops and torch share libgomp) sleep instead of spinning: pytest-xdist
# runs one worker per core, and a worker's spinning pool took both cores from its neighbour's simulator tests,
# whose Python threads hand off to each other thousands of times a launch (a simulator test beside a 2-thread
# torch loop: 4-5x its time alone with libgomp's default policy, 1.1x with "passive")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from hypothesis import HealthCheck, settings  # noqa: E402

# Simulator runs are slow and their time varies: no deadlines; a small, deterministic default budget
# (CI: ~10-11 minutes on 2 cores, a third of it compiling the CPU backend's loops into a cold numba cache).
# NUMBARNN_HYPOTHESIS_PROFILE=thorough for more examples.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("NUMBARNN_HYPOTHESIS_PROFILE", "ci"))


# ---------------------------------------------------------------------------------------------------------
# Simulator state: every test leaves it as it found it
# ---------------------------------------------------------------------------------------------------------
# The simulator keeps process-wide state (the module swapped into a kernel's globals while it runs, the
# kernel context of a launch), the profiler patches simulator classes while it records, and a tool may plan
# for a GPU in a scope (numbarnn.kernels.target.planning_for).  A test that leaks any of it makes a later test in the same xdist worker compute
# wrong numbers (an order-dependent failure).  This check names the test that leaked, at its teardown.

def _simulator_state() -> dict:
    import sys
    if "numba" not in sys.modules or os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        return {}
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi

    import numbarnn.kernels.common  # noqa: F401  (installs numbarnn's simulator fixes: a test that first imports
    #                                 the kernels did not leak them; seen in a worker whose first such test was one)
    state = {
        "kernel context": sim_kernel._kernel_context,
        "FakeCUDAKernel.__call__": sim_kernel.FakeCUDAKernel.__dict__["__call__"],
        "FakeCUDAShared.array": kernelapi.FakeCUDAShared.__dict__["array"],
        "FakeCUDAAtomic": dict(vars(kernelapi.FakeCUDAAtomic)),
        "swapped cuda modules": {k: v for k, v in kernelapi._swap_refcount.items() if v},
    }
    target = sys.modules.get("numbarnn.kernels.target")
    if target is not None:
        state["planned target"] = target.current()
    recorder = sys.modules.get("numbarnn.analysis.recorder")
    if recorder is not None:
        state["profiler recording"] = recorder._RECORDER
    return state


import pytest


@pytest.fixture(autouse=True)
def _simulator_state_is_restored():
    import sys
    before = _simulator_state()
    yield
    after = _simulator_state()
    changed = [k for k in before if k in after and after[k] is not before[k] and after[k] != before[k]]
    # and what must hold between tests whatever the test imported
    expected = {"kernel context": None, "swapped cuda modules": {}, "profiler recording": None}
    if "planned target" in after:
        expected["planned target"] = sys.modules["numbarnn.kernels.target"].PROCESS
    changed += [k for k, v in expected.items() if k in after and after[k] != v and k not in changed]
    assert not changed, f"this test left the CUDA simulator's state changed: {changed}"


# ---------------------------------------------------------------------------------------------------------
# Order: the longest tests first
# ---------------------------------------------------------------------------------------------------------
# The kernel report test compiles every kernel for sm_80 and sm_90 when its stored copy is out of date
# (numbarnn.analysis.report_cache: 7 minutes on 2 cores; seconds when read back): started first, the rest of the
# suite runs beside it.  Then the other long ones, longest first (a fresh clone's `--durations` on 2 cores,
# busy: the CPU backend's loops compiled into an empty numba cache, 208, 107, 85, 85, 82, 69 s ...), so that no
# long test is left for the end, when one worker would run it alone.
LONGEST_FIRST = ("test_every_kernel_compiles_for_sm80_and_sm90_without_spills",
                 "test_hypothesis_float64", "test_bench_cpu_cells_rows_compare_each_cell_with_the_lstm",
                 "test_check_cell_without_hypothesis", "test_base_install_has_no_cuda_toolkit_wheels_and_runs_check",
                 "test_other_vector_widths", "test_tutorial_runs_and_passes_its_checks",
                 "test_a_cell_file_loads_by_path_once_and_runs_everywhere", "test_gradgrad",
                 "test_check_cli_loads_the_cell_from_its_module_and_its_path",
                 "test_an_edit_to_the_library_recompiles_the_cached_loops",
                 "test_bench_cpu_runs_the_training_loop_and_memory_comparisons", "test_wide_shapes_with_projection",
                 "test_narrow_tiles_against_the_reference", "test_projection_panel_follows_the_forward_row_tiles",
                 "test_user_cell_network_gradients_by_finite_differences_on_cuda", "test_check_cell",
                 "test_cuda_several_blocks_with_a_partial_last_block",
                 "test_check_cli_runs_a_layer_normalised_cell_on_every_backend",
                 "test_persistent_on_many_blocks", "test_a_chosen_shape_other_than_the_rule_computes_the_same",
                 "test_check_cell_catches_a_wrong_gradient_through_m",
                 "test_installed_package_without_gpu_from_any_directory",
                 "test_ddp_two_processes_match_one_process_on_the_whole_batch",
                 "test_wide_shapes_against_the_reference",
                 "test_run_profile_of_the_persistent_v3_kernels", "test_workspace_is_never_read_before_it_is_written",
                 "test_v3_product_loops_issue_few_instructions_per_fma", "test_hypothesis_float32",
                 "test_run_profile_of_an_op_call", "test_readme_example_runs", "test_hypothesis_float16",
                 "test_row_groups_give_the_same_bits", "test_hypothesis_inference",
                 "test_cuda_several_blocks_with_a_partial_last_stride",
                 "test_numbarnn_torch_modules_take_hastes_names_and_compute_hastes_equations")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.originalname, len(rank)))   # stable: the rest keep their order
    workers = int(getattr(config, "workerinput", {}).get("workercount", 0) or 0)
    if workers > 1:
        items[:] = deal_long_tests(items, [item.originalname in rank for item in items], workers,
                                   config.getoption("maxschedchunk", None))


def deal_long_tests(items: list, long: list, workers: int, maxschedchunk=None) -> list:
    """The order that gives each pytest-xdist worker its share of the long tests at the start of its first batch.

    xdist's default scheduler (`--dist load`, what `-n auto` runs) sends each worker a block of CONSECUTIVE tests
    first (xdist/scheduler/load.py: N // workers // 4 of them, at most --maxschedchunk), and every later batch to
    whichever worker runs short.  Sorted longest first, every long test landed in the first worker's block:
    in a fresh-clone run one worker ran them all one after another (~1000 s of its ~1060) while the other took
    the short ones.  Here the long tests (in `items`' order, longest first) are dealt round-robin, each worker's
    share at the start of its block, the other tests after them in their order."""
    chunk = max(min(len(items) // workers // 4, maxschedchunk or len(items)), 2)
    longs = [item for item, is_long in zip(items, long) if is_long]
    rest = [item for item, is_long in zip(items, long) if not is_long]
    blocks = [longs[w::workers] for w in range(workers)]
    if any(len(b) > chunk for b in blocks):        # more long tests than a first batch holds: leave the order
        return items
    out = []
    for block in blocks:
        out += block
        take = chunk - len(block)
        out += rest[:take]
        rest = rest[take:]
    return out + rest


# ---------------------------------------------------------------------------------------------------------
# Helpers shared by test modules: `from conftest import compare_backends, ...` (tests/ is on sys.path)
# ---------------------------------------------------------------------------------------------------------
# Nothing here imports numba at module level (NUMBA_ENABLE_CUDASIM is set above, but a test that checks what
# an import pulls in must not find numba already there); the cuda driver is imported where it is used.

import importlib  # noqa: E402

import numpy as np  # noqa: E402

from numbarnn.cells import CellSpec, dsigmoid, dtanh, register, sigmoid, tanh  # noqa: E402
from numbarnn.config import decode_host_reserved, validate_forward  # noqa: E402
from numbarnn.reference.philox import dropout_keep_mask  # noqa: E402
from numbarnn.reserve import reserve_contents, reserve_views  # noqa: E402
from numbarnn.testing import relative_error, run_backward, run_forward  # noqa: E402
from numbarnn.verify import RNN_GRADIENTS as BACKWARD_NAMES  # noqa: E402
from numbarnn.verify import RNN_OUTPUTS as FORWARD_NAMES  # noqa: E402
from numbarnn.verify import TOLERANCES as TOL  # noqa: E402  ‖backend − reference‖/‖reference‖: (outputs, gradients)

#: the kernels run in numba's CUDA simulator (no NUMBARNN_REAL_GPU=1)
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
#: hypothesis settings for slow property tests: no deadline, no too-slow / too-much-data health checks
QUICK = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def examples(n: int) -> int:
    """n hypothesis examples under the default (ci) profile, proportionally more under 'thorough'."""
    return int(n * max(1.0, settings.default.max_examples / 25))


def describe(case) -> str:
    """A case in one line, for failure messages."""
    c = case.cfg
    lens = None if case.lengths is None else case.lengths.tolist()
    return (f"{c.rnn_mode} L={c.L} H={c.H} I={c.I} {c.input_mode} {c.direction} num_proj={c.num_proj} "
            f"dropout={c.dropout} seeds=({c.seed}, {c.seed2}) T={case.T} B={case.B} lengths={lens} "
            f"time_major={case.time_major} training={case.is_training} dtype={case.dtype}")


def host(a):
    """NumPy copy of a host or device array."""
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def forward_named(out) -> dict:
    """Named forward outputs; reserve_space without its per-call nonce (numbarnn.reserve), which differs by design."""
    named = dict(zip(FORWARD_NAMES, out[:4]))
    named["reserve_space"] = reserve_contents(named["reserve_space"])
    return named


def backward_named(out) -> dict:
    return dict(zip(BACKWARD_NAMES, out))


def named(fwd, bwd=None) -> dict:
    """`forward_named(fwd)`, and with `bwd` its four backprop results too."""
    return {**forward_named(fwd), **(backward_named(bwd) if bwd is not None else {})}


def fingerprint(host_reserved) -> dict:
    """host_reserved's record without the per-call nonce."""
    return {k: v for k, v in decode_host_reserved(host(host_reserved)).items() if k != "nonce"}


def assert_close(got: dict, want: dict, dtype, context: str, tol=None):
    """Every named output: same shape and dtype, relative error within its tolerance; the message names it."""
    t_out, t_grad = tol if tol is not None else TOL[np.dtype(dtype)]
    for name, w in want.items():
        g = got[name]
        assert g is not None and w is not None, f"{name}: missing ({context})"
        g, w = host(g), host(w)
        assert g.shape == w.shape, f"{name}: shape {g.shape} != reference {w.shape} ({context})"
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != reference {w.dtype} ({context})"
        assert np.isfinite(np.asarray(g, np.float64)).all(), f"{name}: non-finite values ({context})"
        limit = t_out if name in FORWARD_NAMES else t_grad
        err = relative_error(g, w)
        assert err <= limit, f"{name}: relative error {err:.3g} > {limit:g} vs the reference ({context})"


def check_dropout_masks(case, reserve) -> int:
    """keep flags in the reserve == dropout_keep_mask, bit for bit (SPEC 6); -> the layers checked."""
    call, _ = validate_forward(case.x, case.h0, case.c0, case.params, case.lengths, is_training=case.is_training,
                               **case.attrs)
    if not call.dropout_active:
        return 0
    cfg = case.cfg
    views = reserve_views(call, host(reserve))
    for layer in range(1, cfg.L):
        want = dropout_keep_mask(cfg.seed, cfg.seed2, layer, case.T, case.B, cfg.D * cfg.P, cfg.dropout)
        got = views[f"keep{layer}"]
        assert got.tobytes() == want.astype(case.dtype).tobytes(), \
            f"reserve_space: dropout keep mask of layer {layer} differs from dropout_keep_mask ({describe(case)})"
        if cfg.dropout >= 1.0:
            assert not got.any(), f"reserve_space: p=1 must drop everything ({describe(case)})"
    return cfg.L - 1


def compare_backends(case, backward: bool = True, context: str = ""):
    """Run `case` on the cuda and reference backends, assert every named output agrees, and that the reference
    backprop reads the cuda reserve.

    -> (cuda forward, reference forward, cuda backprop, reference backprop); backprops None in inference.
    """
    ctx = describe(case) + context
    fwd_cuda = run_forward(case, "cuda")
    fwd_ref = run_forward(case, "reference")
    assert_close(forward_named(fwd_cuda), forward_named(fwd_ref), case.dtype, ctx)
    if not case.is_training:
        assert host(fwd_cuda[3]).shape == (0,), f"reserve_space: not empty in inference ({ctx})"
        assert host(fwd_cuda[4]).shape == (0,), f"host_reserved: not empty in inference ({ctx})"
        return fwd_cuda, fwd_ref, None, None
    assert fingerprint(fwd_cuda[4]) == fingerprint(fwd_ref[4]), f"host_reserved differs ({ctx})"
    if not backward:
        return fwd_cuda, fwd_ref, None, None
    bwd_cuda = run_backward(case, fwd_cuda, "cuda")
    bwd_ref = run_backward(case, fwd_ref, "reference")
    assert_close(backward_named(bwd_cuda), backward_named(bwd_ref), case.dtype, ctx)
    # the reserve layout is shared: the reference backprop reads the kernels' reserve
    bwd_ref_on_cuda = run_backward(case, fwd_cuda, "reference")
    assert_close(backward_named(bwd_ref_on_cuda), backward_named(bwd_ref), case.dtype,
                 ctx + " [reference backprop on the cuda reserve]")
    return fwd_cuda, fwd_ref, bwd_cuda, bwd_ref


def compare_cpu(case):
    """cpu vs reference, forward and backward, dropout masks, and each backprop on the other backend's reserve.
    -> (cpu forward, cpu backprop); the backprop None in inference."""
    ctx = describe(case)
    f_cpu, f_ref = run_forward(case, "cpu"), run_forward(case, "reference")
    assert isinstance(f_cpu[0], np.ndarray)
    if not case.is_training:
        assert_close(named(f_cpu), named(f_ref), case.dtype, ctx)
        assert f_cpu[3].shape == (0,) and f_cpu[4].shape == (0,), f"reserve not empty in inference ({ctx})"
        return f_cpu, None
    b_cpu, b_ref = run_backward(case, f_cpu, "cpu"), run_backward(case, f_ref, "reference")
    assert_close(named(f_cpu, b_cpu), named(f_ref, b_ref), case.dtype, ctx)
    check_dropout_masks(case, f_cpu[3])
    # the reserve layout is shared: each backend's backprop reads the other's reserve
    assert_close(backward_named(run_backward(case, f_cpu, "reference")), backward_named(b_ref), case.dtype,
                 ctx + " [reference backprop, cpu reserve]")
    assert_close(backward_named(run_backward(case, f_ref, "cpu")), backward_named(b_ref), case.dtype,
                 ctx + " [cpu backprop, reference reserve]")
    return f_cpu, b_cpu


def _mingru_forward(wx, rh, v, h, c, saved):
    z = sigmoid(wx[0] + rh[0])
    n = tanh(wx[1])                  # the candidate ignores h: only the gate is recurrent
    saved[0] = z
    saved[1] = n
    return n + z * (h - n), c


def _mingru_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    z, n = saved[0], saved[1]
    dwx[0] = dm * (h - n) * dsigmoid(z)
    dwx[1] = dm * (1.0 - z) * dtanh(n)
    drh[1] = 0.0 * dm                # R_n never reaches the cell
    return dm * z, dc


#: a user cell of the cpu backend's tests (registered by `cpu_cells`): a split recurrent gate whose R side gets
#: no gradient
MINGRU = CellSpec(name="test_cpu_mingru", gates=("z", "n"), saved=("z", "n"), forward=_mingru_forward,
                  backward=_mingru_backward, split_recurrent=("n",))


def cpu_cells() -> tuple:
    """Every cell the cpu backend's tests run: the built-ins, the contrib cells and MINGRU, registered (only by
    the modules that call this: other tests see the registry without MINGRU)."""
    for module in ("numbarnn.contrib.cifg_lstm", "numbarnn.contrib.peephole_lstm"):   # they register their cells
        importlib.import_module(module)
    register(MINGRU)                 # the same spec again is accepted
    return ("lstm", "gru", "rnn_tanh", "rnn_relu", "peephole_lstm", "cifg_lstm", MINGRU.name)


def planned_launches(plan, phase) -> int:
    """Launches a launch plan (`driver.launch_plan`) lists for one phase."""
    return sum(r["launches"] for r in plan if r["phase"] == phase)


def planned_and_launched(case):
    """Run `case` forward and backward on the cuda backend -> (the launch plan of that call at this process's
    launch sizes, the launch logs, forward outputs, backward outputs), after checking that the driver executed
    exactly that plan and that the launches it counted are the plan's, kernel by kernel."""
    from collections import Counter

    from numbarnn.config import RNNCall
    from numbarnn.kernels import driver
    from numbarnn.kernels.plan import plan_rows
    fwd = run_forward(case, "cuda")
    bwd = run_backward(case, fwd, "cuda")
    log = driver.last_launch_count()
    lengths = tuple(int(n) for n in case.lengths) if case.lengths is not None else (case.T,) * case.B
    call = RNNCall(case.cfg, case.T, case.B, np.dtype(case.dtype), True, True, lengths)
    plan = driver.launch_plan(call, gpu=False, device_reserve=False)      # NumPy in: the nonce on the host
    for phase in ("forward", "backward"):
        assert planned_launches(plan, phase) == log[phase].total, (phase, plan, log[phase])
        assert plan_rows(log[phase].plan) == [r for r in plan if r["phase"] == phase], phase   # the plan executed
        counted = Counter()
        for e in log[phase].plan:                    # a gemm() / column_sums() entry counts as its kernel's name
            counted[e.name] += e.launches
        assert dict(counted) == log[phase].by_kernel, (phase, dict(counted), log[phase].by_kernel)
    return plan, log, fwd, bwd


def assert_agrees_with_the_reference(case, got_f, got_b, tol: float = 1e-12) -> None:
    """A backend's forward outputs (y, hT) and backward results (run_forward's, run_backward's) against the
    reference backend's on the same case, within `tol`."""
    want_f = run_forward(case, "reference")
    want_b = run_backward(case, want_f, "reference")
    for got, want in zip(tuple(got_f[:2]) + tuple(got_b), tuple(want_f[:2]) + tuple(want_b)):
        if want is not None:
            assert relative_error(got, want) < tol


def assert_layer_runs_like_the_reference(spec):
    """numbarnn.CudnnRNN(spec, ...) (2 layers, bidirectional, H=4, lengths with 0) on the cpu backend gives the
    reference's outputs to 1e-12; returns the cpu layer (for checks of its weights)."""
    import numbarnn
    x = np.random.default_rng(0).standard_normal((5, 3, 2))
    lengths = np.array([5, 0, 3], np.int32)
    outs, layers = {}, {}
    for backend in ("cpu", "reference"):
        layer = layers[backend] = numbarnn.CudnnRNN(spec, 2, 4, direction="bidirectional", dtype="float64", seed=1,
                                                    backend=backend)
        y, (h,) = layer(x, sequence_lengths=lengths)
        assert y.shape == (5, 3, 8) and h.shape == (4, 3, 4)
        outs[backend] = (np.asarray(y), np.asarray(h))
    for got, want in zip(outs["cpu"], outs["reference"]):
        assert relative_error(got, want) < 1e-12
    return layers["cpu"]


def assert_v1_fallback(mode: str, version: int, why: str) -> None:
    """A cell whose recurrence the v2/v3 step kernels cannot run (a diagonal one, a modulated one): asked for
    `version`, the cuda backend runs v1 and says so in the launch log and the step plan (`why` + ", so v1 runs
    instead of v{version}"), and its results equal the reference's (bidirectional, ragged)."""
    from numbarnn import settings
    from numbarnn.config import RNNCall, rnn_config
    from numbarnn.kernels import driver
    from numbarnn.testing import make_rnn_case
    cfg = rnn_config(1, 5, 3, mode, direction="bidirectional")
    case = make_rnn_case(cfg, 3, 2, [3, 1], seed=2)
    with settings.override(step_version=version):
        got_f = run_forward(case, "cuda")
        got_b = run_backward(case, got_f, "cuda")
        log = driver.last_launch_count()
        plan = driver.step_plan(RNNCall(cfg, 3, 2, np.dtype(np.float64), True, True, (3, 1)), "backward")
    for phase in ("forward", "backward"):
        assert log[phase].step_version == 1
        assert log[phase].note == f"v1: {why}, so v1 runs instead of v{version}"
    assert plan.version == 1 and plan.slice is None
    assert_agrees_with_the_reference(case, got_f, got_b)


def assert_agrees_with_torch_network(mode: str, backend: str, time_major: bool, torch_network) -> None:
    """`mode` on `backend` against an independent implementation in plain torch operations, to 1e-10 in float64
    (2 layers, bidirectional, lengths with 0, either layout): outputs, and the gradients of one loss by autograd.
    torch_network(torch, x, h0, tw, tb, lengths, L, D) -> (y [T, B, D*H], hT [L*D, B, H]), time-major, from the
    canonical weights and biases as tensors (tw, tb: `params_to_canonical`'s order) and x, h0 [time-major]."""
    import torch
    from numbarnn.config import rnn_config
    from numbarnn.params import params_to_canonical
    from numbarnn.testing import make_rnn_case
    L, D, H, I, T, B = 2, 2, 3, 2, 4, 3
    lengths = [4, 0, 2]
    cfg = rnn_config(L, H, I, mode, direction="bidirectional")
    case = make_rnn_case(cfg, T, B, lengths, seed=3, time_major=time_major)
    tm = (lambda a: a) if time_major else (lambda a: np.swapaxes(a, 0, 1))   # the call's layout <-> time-major
    fwd = run_forward(case, backend)
    dx, dh0, _, dparams = run_backward(case, fwd, backend)

    x = torch.tensor(tm(case.x), requires_grad=True)
    h0 = torch.tensor(tm(case.h0), requires_grad=True)
    weights, biases = params_to_canonical(cfg, case.params)
    tw = [torch.tensor(w, requires_grad=True) for w in weights]
    tb = [torch.tensor(b, requires_grad=True) for b in biases]
    y, hT = torch_network(torch, x, h0, tw, tb, lengths, L, D)
    loss = (y * torch.tensor(tm(case.dy))).sum() + (hT * torch.tensor(tm(case.dhT))).sum()
    loss.backward()

    assert relative_error(tm(np.asarray(fwd[0])), y.detach().numpy()) < 1e-10
    assert relative_error(tm(np.asarray(fwd[1])), hT.detach().numpy()) < 1e-10
    assert relative_error(tm(np.asarray(dx)), x.grad.numpy()) < 1e-10
    assert relative_error(tm(np.asarray(dh0)), h0.grad.numpy()) < 1e-10
    dw, db = params_to_canonical(cfg, np.asarray(dparams))
    for got, want in zip(dw + db, tw + tb):
        assert relative_error(got, want.grad.numpy()) < 1e-10


def assert_cpu_agrees_in_lower_precision(mode: str, dtype, tol: float) -> None:
    """The cpu backend in float32 / float16 against the reference on the same inputs (2 layers, bidirectional,
    lengths with 0): outputs within `tol`, gradients within 10 * tol."""
    from numbarnn.config import rnn_config
    from numbarnn.testing import make_rnn_case
    cfg = rnn_config(2, 5, 3, mode, direction="bidirectional")
    case = make_rnn_case(cfg, 4, 3, [4, 0, 2], seed=4, dtype=dtype)
    want_f = run_forward(case, "reference")
    got_f = run_forward(case, "cpu")
    for got, want in zip(got_f[:2], want_f[:2]):
        assert relative_error(got, want) < tol
    for got, want in zip(run_backward(case, got_f, "cpu"), run_backward(case, want_f, "reference")):
        if want is not None:
            assert relative_error(got, want) < 10 * tol


def assert_zoneout_masks_drawn_per_call(module, plain, x) -> None:
    """A training-mode zoneout module's masks: a function of the keys drawn from torch's generator (the same seed,
    the same output), fresh keys per call, and not the module without zoneout."""
    import torch
    torch.manual_seed(3)
    a = module(x)[0]
    torch.manual_seed(3)
    assert torch.equal(a, module(x)[0])                       # masks a function of the drawn keys
    assert not torch.equal(a, module(x)[0])                   # fresh keys per call
    assert not torch.equal(a, plain(x)[0])


def assert_fused_forward_equals_the_blas_loop(monkeypatch, cell: str, fused_module) -> None:
    """A cell family's fused cpu forward (`fused_module`'s forward_loop), in one row group and in 3 (each group
    on its own thread), gives the BLAS loop's outputs and reserve (NUMBARNN_CPU_FUSED=0; the backward reads that
    reserve), the reference's gradients, and the same outputs at inference (no reserve written): H = 9 (a partial
    unit tile), B = 7 with lengths 0 (a partial row tile, rows ending at different steps), 2 layers,
    bidirectional."""
    from dataclasses import replace

    from numbarnn.config import rnn_config
    from numbarnn.cpu import fused
    from numbarnn.reserve import NONCE_SIZE
    from numbarnn.testing import make_rnn_case
    case = make_rnn_case(rnn_config(2, 9, 5, cell, direction="bidirectional"), 4, 7, [4, 0, 2, 4, 1, 3, 0], seed=4)
    monkeypatch.setenv("NUMBARNN_CPU_FUSED", "0")
    want = run_forward(case, "cpu")
    monkeypatch.delenv("NUMBARNN_CPU_FUSED")
    ran, loop = [], fused_module.forward_loop
    monkeypatch.setattr(fused_module, "forward_loop", lambda *a: ran.append(a[2]) or loop(*a))

    def same(got, want):
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (b is None or relative_error(a, b) < 1e-12)

    for groups in (1, 3):
        monkeypatch.setattr(fused, "row_groups", lambda *a, n=groups: n)
        got = run_forward(case, "cpu")
        same(got[:3] + (got[3][:-NONCE_SIZE],), want[:3] + (want[3][:-NONCE_SIZE],))   # (the reserve's random tag)
        assert_agrees_with_the_reference(case, got, run_backward(case, got, "cpu"))
        same(run_forward(replace(case, is_training=False), "cpu")[:3], want[:3])       # (no reserve written)
    assert ran == [False] * 8 + [True] * 8        # 2 layers x 2 directions x (training, inference), serial, parallel

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

from hypothesis import HealthCheck, settings  # noqa: E402

# Simulator runs are slow and their time varies: no deadlines; a small, deterministic default budget
# (CI: ~16-18 minutes on 2 cores, much of it compiling: the kernel report, the CPU backend's cold numba cache).
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
# kernel context of a launch), and the profiler patches simulator classes and numbarnn's launch geometry
# while it records.  A test that leaks any of it makes a later test in the same xdist worker compute
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
    kernels = sys.modules.get("numbarnn.kernels.common"), sys.modules.get("numbarnn.kernels.gemm")
    if kernels[0] is not None:
        state["common.SIMULATOR"] = kernels[0].SIMULATOR
    if kernels[1] is not None:
        state["GemmVersion.default_config"] = kernels[1].GemmVersion.__dict__["default_config"]
    profiler = sys.modules.get("numbarnn.analysis.profiler")
    if profiler is not None:
        state["profiler recording"] = profiler._RECORDER
    return state


import pytest


@pytest.fixture(autouse=True)
def _simulator_state_is_restored():
    before = _simulator_state()
    yield
    after = _simulator_state()
    changed = [k for k in before if k in after and after[k] is not before[k] and after[k] != before[k]]
    # and what must hold between tests whatever the test imported
    expected = {"kernel context": None, "swapped cuda modules": {}, "common.SIMULATOR": True,
                "profiler recording": None}
    changed += [k for k, v in expected.items() if k in after and after[k] != v and k not in changed]
    assert not changed, f"this test left the CUDA simulator's state changed: {changed}"


# ---------------------------------------------------------------------------------------------------------
# Order: the longest tests first
# ---------------------------------------------------------------------------------------------------------
# The kernel report test compiles every kernel for sm_80 and sm_90 (5 minutes alone on 2 cores, 8 beside the rest).
# Collected in file order it started mid-run, and the other worker ran out of tests while it finished; started
# first, the rest of the suite runs beside it.  Then the other long ones, longest first (a fresh clone's durations
# on 2 cores, `--durations`: the CPU backend's hypothesis tests compile its loops into an empty numba cache,
# 249, 142 and 48 s), so that no long test is left for the end, when one worker would run it alone.
LONGEST_FIRST = ("test_every_kernel_compiles_for_sm80_and_sm90_without_spills",
                 "test_hypothesis_float64", "test_hypothesis_float32", "test_run_profile_of_the_persistent_v3_kernels",
                 "test_v3_product_loops_issue_few_instructions_per_fma", "test_hypothesis_float16",
                 "test_base_install_has_no_cuda_toolkit_wheels_and_runs_check", "test_row_groups_give_the_same_bits",
                 "test_hypothesis_inference",
                 "test_workspace_is_never_read_before_it_is_written")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.originalname, len(rank)))   # stable: the rest keep their order

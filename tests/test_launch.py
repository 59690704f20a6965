"""numbarnn.kernels.launch: numba's launch with its per-launch typing and packing done once (issue 8, host cost).

Without a GPU the fast path is checked where it can go wrong: the parameters, LaunchConfig and kernel it hands to
cuda.core's launch must be exactly what numba-cuda's own `kernel[grid, block](*args)` hands it, for every kind of
argument the driver passes.  Both run in a subprocess without the simulator, on device arrays at made-up
addresses, the driver call recorded instead of made (`launch.driverless`).  In the simulator `launch` is numba's
own path.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import cuda

from numbarnn.kernels import common, launch
from numbarnn.kernels.driver import fill

REAL_GPU = os.environ.get("NUMBARNN_REAL_GPU") == "1"


@pytest.mark.skipif(REAL_GPU, reason="the simulator's path (on a GPU: test_fast_launch_on_a_gpu)")
def test_simulator_launches_take_numbas_path():
    assert common.SIMULATOR and not launch.enabled()
    before = dict(launch.STATS)
    a = cuda.to_device(np.zeros(300, np.float32))
    fill(a, 2.5)
    assert np.all(a.copy_to_host() == 2.5)
    assert launch.STATS["numba"] == before["numba"] + 1 and launch.STATS["fast"] == before["fast"]


NO_SIMULATOR_CHECKS = textwrap.dedent('''
    import ctypes, os, warnings
    import numpy as np
    from numba.cuda import types
    from numbarnn.kernels import common, launch as L
    from numbarnn.kernels.common import arr, nb, step_signatures
    warnings.simplefilter("ignore")
    assert not common.SIMULATOR and L.enabled()
    dev = L.fake_device_array

    def both(kernel, grid, block, args, **kw):
        """numba's recorded driver call, after L.launch (preparing, then prepared) made the same one."""
        with L.driverless() as rec:
            return L.check_against_numba(rec, kernel, grid, block, args, **kw)

    # the driver's step kernel: 12 arrays and the step, at two shapes (a new array object, the same kind)
    def step(s, lens, gx, bias, R_fwd, R_rev, h_in, h_out, c, y, acts, cs, ms):
        pass
    for dtype in ("float32", "float64", "float16"):
        sig = step_signatures(dtype)[0]
        kernel = L.driverless_kernel(step, sig)
        for H, B, T, D in ((768, 16, 1024, 1), (5, 3, 7, 2)):
            shapes = [(B,), (D, T, B, 4 * H), (D, 9, H), (4 * H, H), (4 * H, H), (D, B, H), (D, B, H), (D, B, H),
                      (T, B, D * H), (T, B, D, 4 * H), (T, B, D, H), (T, B, D, H)]
            args = [T - 1] + [dev(sh, str(ty.dtype), 0x100000 * (i + 1) + 64 * H) for i, (sh, ty) in
                              enumerate(zip(shapes, sig[1:]))]
            call = both(kernel, (24, 2), 64, args)
            assert call[2].grid == (24, 2, 1) and call[2].block == (64, 1, 1) and not call[2].is_cooperative
            assert call[4][0].value == T - 1 and call[4][1:10] == [0, 0, B, 4, 0x100000 + 64 * H, B, 4, 0, 0]
            # a step loop: only the step's parameter changes
            with L.driverless() as rec:
                for s in range(3):
                    L.launch(kernel, (24, 2), 64, s, *args[1:])
            assert [c[4][0].value for c in rec.calls] == [0, 1, 2]
            assert all(c[4][1:] == rec.calls[0][4][1:] for c in rec.calls)

    # views: a strided one into an A-layout parameter, a broadcast one (stride 0), an F-ordered one, offsets;
    # scalars of every kind the driver passes; a cooperative kernel; dynamic shared memory
    def k(n, a, b, x, u, w, f, flag, c):
        pass
    sig = (nb("int64"), arr("float32", 2, "A"), arr("float64", 3, "A"), types.float64, types.uint64,
           types.uint32, types.float32, types.boolean, arr("float32", 2, "F"))
    for cooperative in (False, True):
        kernel = L.driverless_kernel(k, sig, cooperative=cooperative)
        args = [7, dev((4, 6), "float32", 0x2000, (48, 8)), dev((3, 2, 5), "float64", 0x3008, (0, 40, 8)), 0.25,
                np.uint64(2 ** 63 + 5), np.uint32(7), np.float32(1.5), True, dev((4, 6), "float32", 0x9000, (4, 16))]
        call = both(kernel, 6, (32, 2), args, stream=0, sharedmem=1024)
        assert call[2].is_cooperative == cooperative and call[2].shmem_size == 1024 and call[2].grid == (6, 1, 1)

    # the kind of an array is the layout numba types it with: C, F, A, and A when broadcast (stride 0)
    for a in (dev((4, 6), "float32", 0x100), dev((4, 6), "float32", 0x100, (4, 16)), dev((4, 6), "float32", 0x100,
              (48, 8)), dev((1, 2, 5), "float64", 0x100, (0, 40, 8)), dev((3, 2), "float64", 0x100, (0, 8)),
              dev((1, 5), "float32", 0x100, (0, 4)), dev((5,), "int32", 0x100)):
        kind = L.argument_kinds([a], L._internals()["DeviceNDArray"])[0]
        assert kind[1:] == (a.dtype, a.ndim, kernel.typeof_pyval(a).layout), (kind, a.strides)

    # what keeps numba's path: a kind not compiled yet (None: numba compiles it), host arrays, float16 scalars
    kernel = L.driverless_kernel(k, sig)
    c_order = [7, dev((4, 6), "float32", 0x2000), dev((3, 2, 5), "float64", 0x3000), 0.25, np.uint64(1),
               np.uint32(7), np.float32(1.5), True, dev((4, 6), "float32", 0x9000)]     # last one C, not F
    assert L.prepare(kernel, c_order) is None
    assert L.argument_kinds([np.zeros(3)], L._internals()["DeviceNDArray"]) is None
    assert L.argument_kinds([1 << 64], L._internals()["DeviceNDArray"]) is None
    def h(x, v):
        pass
    half = L.driverless_kernel(h, (arr("float16", 1), types.float16))
    assert L.prepare(half, [dev((8,), "float16", 0x5000), np.float16(1)]) is L._NUMBA

    os.environ[L.FAST_LAUNCH_VAR] = "0"
    assert not L.enabled()
    print("ok")
''')


@pytest.mark.skipif(not REAL_GPU, reason="needs a GPU (NUMBARNN_REAL_GPU=1)")
def test_fast_launch_on_a_gpu():
    """On a GPU: the fast path runs (after a kind's first launch) and computes what numba's launch computes."""
    from numbarnn.kernels.common import jit, make_cast_copy
    assert launch.enabled()
    k = jit(make_cast_copy, "float32", "float64")
    src = cuda.to_device(np.arange(1000, dtype=np.float32))
    via_numba, via_launch = cuda.device_array(1000, np.float64), cuda.device_array(1000, np.float64)
    k[4, 256](src, via_numba)
    before = dict(launch.STATS)
    for _ in range(3):
        launch.launch(k, 4, 256, src, via_launch)
    assert launch.STATS["fast"] >= before["fast"] + 2
    np.testing.assert_array_equal(via_launch.copy_to_host(), via_numba.copy_to_host())
    big = cuda.to_device(np.arange(5000, dtype=np.float32))
    out = cuda.device_array(5000, np.float64)
    launch.launch(k, 20, 256, big, out)                    # a new array object and geometry, the same kind
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(5000))


def test_fast_launch_hands_the_driver_what_numba_does():
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.pop(launch.FAST_LAUNCH_VAR, None)
    proc = subprocess.run([sys.executable, "-c", NO_SIMULATOR_CHECKS], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_same_params_is_exact():
    import ctypes
    assert launch.same_params([0, ctypes.c_int64(3)], [0, ctypes.c_int64(3)])
    assert not launch.same_params([0, ctypes.c_int64(3)], [0, ctypes.c_int32(3)])
    assert not launch.same_params([0, ctypes.c_int64(3)], [0, ctypes.c_int64(4)])
    assert not launch.same_params([0, 1], [0, 1, 2])
    assert not launch.same_params([True], [1])


@pytest.mark.parametrize("value", ["0", " 0 "])
def test_switched_off_by_the_environment(monkeypatch, value):
    monkeypatch.setenv(launch.FAST_LAUNCH_VAR, value)
    assert not launch.enabled()


def test_the_host_cost_bench_runs_and_validates():
    """bench/bench_launch_host.py (the numbers in bench/results/gpu_h100.md), shortened: it validates both paths'
    parameters before timing, so a wrong packing fails it."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_launch_host.py")
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, bench, "--launches", "20"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| step", "| gemm", "| fill"))]
    assert len(rows) == 3 and all(len(r.split("|")) == 7 for r in rows), proc.stdout

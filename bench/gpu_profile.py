"""Where the time of numbarnn's cuda backend goes on a real GPU (run by bench/gpu_run.sh; needs a GPU).

    python bench/gpu_profile.py launch                 # host microseconds per launch: numba's ways of launching
    python bench/gpu_profile.py call [V HxBxT]         # one warm host-bound call: launches, host profile, wall
    ncu --profile-from-start off --csv --metrics gpu__time_duration.sum \
        python bench/gpu_profile.py kernels            # device time of every kernel of one forward+backward

`launch` times the host side of a kernel launch with 13 arguments (12 arrays, like a step kernel) four ways:
a lazily typed @cuda.jit kernel (numba types every argument at every launch), the same kernel compiled with an
explicit signature, a configured kernel object reused across launches, and numbarnn.kernels.launch (what the
driver uses: numba's launch with the typing and packing done once per argument kind).  `kernels` runs one warm
forward+backward per step version between cuda.profile_start/stop, so ncu records only those launches.
"""
from __future__ import annotations

import sys
import time

import numpy as np


def launch_costs(n: int = 2000) -> None:
    import numbarnn.kernels  # noqa: F401 (its NumPy 2.5 shim for numba-cuda)
    from numba import cuda, float32, int32, void

    arrays = [cuda.device_array((64, 64), np.float32) for _ in range(12)]

    def body(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, t):
        i = cuda.grid(1)
        if i < 0:
            a0[0, 0] = t

    lazy = cuda.jit(body)
    sig = void(*([float32[:, ::1]] * 12), int32)
    eager = cuda.jit(sig)(body)
    ways = {"lazy @cuda.jit (types each argument per launch)": lambda: lazy[1, 32](*arrays, 3),
            "explicit signature": lambda: eager[1, 32](*arrays, 3)}
    configured = eager[1, 32]
    ways["explicit signature, configured once"] = lambda: configured(*arrays, 3)
    from numbarnn.kernels import launch as fast
    ways["numbarnn.kernels.launch (typed + packed once per kind)"] = lambda: fast.launch(lazy, 1, 32, *arrays, 3)
    for name, launch in ways.items():
        for _ in range(50):
            launch()
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            launch()
        t1 = time.perf_counter()
        cuda.synchronize()
        print(f"launch  {name:55s} {1e6 * (t1 - t0) / n:8.1f} us per launch (host)")
    print(f"launch  numbarnn.kernels.launch paths taken: {fast.STATS} (all but the first should be 'fast')")


def kernels(versions=(1, 2, 3), shapes=((768, 16), (512, 32), (64, 1)), T_profile: int = 8) -> None:
    """shapes: (H, B) or (H, B, T) tuples, run for T (default T_profile) steps (the per-step kernels are the
    same at any T; the persistent v3 kernel's time grows with T)."""
    from numba import cuda
    from numbarnn import measure
    from numbarnn.kernels import driver

    for version in versions:
        for H, B, *T in shapes:
            T = T[0] if T else T_profile
            case = measure.make_case("lstm", H, B, T, H, np.float32)
            forward, backward, _ = measure.CudaAdapter(version).calls(case)     # pins the step version
            backward(forward())
            cuda.synchronize()
            getattr(cuda, "profile_start", lambda: None)()     # the simulator has no profiler API
            backward(forward())
            cuda.synchronize()
            getattr(cuda, "profile_stop", lambda: None)()
            log = driver.last_launch_count()
            print(f"kernels v{version} {H}x{B}x{T}: forward launches {log['forward'].total} "
                  f"{log['forward'].note}; backward {log['backward'].total}", flush=True)


def call(version: int = 3, H: int = 64, B: int = 1, T: int = 200, n: int = 50) -> None:
    """Where the time of one warm forward and forward+backward call goes at a host-bound shape (64x1x200 runs
    cuDNN's forward in ~0.2 ms): the launches the driver makes, the wall time per call (synchronised), and the
    host functions that take it (cProfile of n calls, by own time)."""
    import cProfile
    import pstats

    from numba import cuda
    from numbarnn import measure
    from numbarnn.kernels import driver

    case = measure.make_case("lstm", H, B, T, H, np.float32)
    forward, backward, _ = measure.CudaAdapter(version).calls(case)
    for _ in range(3):
        backward(forward())
    cuda.synchronize()
    log = driver.last_launch_count()
    for phase in ("forward", "backward"):
        print(f"call v{version} {H}x{B}x{T} {phase}: {log[phase].total} launches {dict(log[phase].by_kernel)}")
    for what, fn in (("forward", forward), ("forward+backward", lambda: backward(forward()))):
        times, host = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()             # the host has queued every launch (and waited where it must)
            cuda.synchronize()
            times.append(time.perf_counter() - t0)
            host.append(t1 - t0)
        print(f"call v{version} {H}x{B}x{T} {what}: median {1e3 * sorted(times)[n // 2]:.3f} ms wall, "
              f"{1e3 * sorted(host)[n // 2]:.3f} ms until the host returns (before synchronising)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        forward()
        cuda.synchronize()
    prof.disable()
    print(f"host profile of {n} warm forward calls (synchronised), by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "launch"
    if what == "kernels" and len(sys.argv) > 2:       # kernels VERSIONS HxB ...: e.g. kernels 23 768x16
        kernels(tuple(int(v) for v in sys.argv[2]),
                tuple(tuple(int(n) for n in s.split("x")) for s in sys.argv[3:]) or ((768, 16),))
    elif what == "call" and len(sys.argv) > 3:       # call V HxBxT: e.g. call 3 64x1x200
        call(int(sys.argv[2]), *(int(n) for n in sys.argv[3].split("x")))
    else:
        {"launch": launch_costs, "kernels": kernels, "call": call}[what]()

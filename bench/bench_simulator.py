"""The CUDA simulator's block barrier: numba-cuda's polling loop against numbarnn's condition variable.

    python bench/bench_simulator.py [--launches 3]

numbarnn/kernels/simulator.py replaces the simulator's BlockManager.run / BlockThread.syncthreads (a loop
that polls every thread of a block without sleeping) with a barrier on a condition variable, and makes its
static shared arrays thread-safe.  This times GEMM v4 (40 x 30 x 24, float32: 40 blocks of 4 threads, 13
barriers each) under both, alternating, after checking each result against NumPy.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda.simulator import kernel as K  # noqa: E402

POLLING = (K.BlockManager.run, K.BlockThread.run, K.BlockThread.syncthreads)   # before numbarnn installs its own

from numbarnn.kernels import gemm as G  # noqa: E402
from numbarnn.kernels import simulator as S  # noqa: E402

BARRIER = (S._run_block, S._thread_run, S._syncthreads)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((40, 24)).astype(np.float32), rng.standard_normal((24, 30)).astype(np.float32)
    d_a, d_b, d_c = cuda.to_device(a), cuda.to_device(b), cuda.device_array((40, 30), np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    times = {"numba-cuda's polling loop": [], "numbarnn's barrier": []}
    try:
        for _ in range(2):
            for (name, fns) in zip(times, (POLLING, BARRIER)):
                K.BlockManager.run, K.BlockThread.run, K.BlockThread.syncthreads = fns
                start = time.perf_counter()
                for _ in range(args.launches):
                    G.gemm(d_a, d_b, d_c, version=4)
                times[name].append(time.perf_counter() - start)
                assert np.abs(d_c.copy_to_host() - want).max() < 1e-4, name
    finally:
        K.BlockManager.run, K.BlockThread.run, K.BlockThread.syncthreads = BARRIER
    print(f"GEMM v4 40 x 30 x 24 float32 in the simulator, {args.launches} launches, two alternating rounds:")
    for name, ts in times.items():
        print(f"  {name:<26} " + ", ".join(f"{t:.2f} s" for t in ts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host time of one kernel launch: numba-cuda's `kernel[grid, block](*args)` against numbarnn's `launch`.

    python bench/bench_launch_host.py [--launches 5000]

No GPU needed: both paths run all their host work (numba's typing, argument packing, launch configuration,
cuda.core's LaunchConfig) on device arrays at made-up addresses, and the driver call at the end is recorded
instead of made (`numbarnn.kernels.launch.driverless`), so the times here leave out cuda.core's parameter
array and the driver (measured on an H100 host: 63-135 us per launch in all, bench/results/gpu_h100.md).
Before timing, each kernel's launch is validated: both paths must hand the driver the same parameters, the
same LaunchConfig and the same kernel.  Kernels: the driver's step kernel (its real argument list: 12 arrays
and the step, LSTM H=768 B=16 T=1024 float32), a GEMM (3 arrays, 5 scalars) and the fill kernel (1 array,
1 scalar).  Median of 5 rounds of --launches launches each, microseconds per launch.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)      # numba's real launch path, not the simulator's

from numba import types

from numbarnn.kernels import launch as L
from numbarnn.kernels.common import arr, nb
from numbarnn.measure import per_call_us


def step_case():
    """The forward step kernel's launch as the driver makes it (LSTM H=768 B=16 T=1024 float32)."""
    kernel, grid, block, args = L.step_kernel_case()
    return "step (13 args: 12 arrays)", kernel, grid, block, args


def gemm_case(M=16384, N=3072, K=768):
    def gemm(M, N, K, alpha, a, b, beta, c):
        pass
    sig = (nb("int64"),) * 3 + (types.float64, arr("float32", 2), arr("float32", 2), types.float64,
                                arr("float32", 2))
    args = [M, N, K, 1.0, L.fake_device_array((M, K), "float32", 0x1000000),
            L.fake_device_array((N, K), "float32", 0x2000000), 0.0, L.fake_device_array((M, N), "float32", 0x3000000)]
    return "gemm (8 args: 3 arrays)", L.driverless_kernel(gemm, sig), (24, 128, 1), 256, args


def fill_case(n=1 << 20):
    def fill(dst, value):
        pass
    sig = (arr("float32", 1), types.float64)
    return ("fill (2 args: 1 array)", L.driverless_kernel(fill, sig), (n // 256,), 256,
            [L.fake_device_array((n,), "float32", 0x4000000), 0.0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=5000)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")               # numba's low-occupancy warning (once per geometry)
    print(f"host time per launch, microseconds (median of 5 x {args.launches}; driver call not included)")
    print("| kernel | numba kernel[grid, block](*args) | of which typing | of which packing | numbarnn launch |")
    print("| --- | --- | --- | --- | --- |")
    with L.driverless() as rec:
        for case in (step_case(), gemm_case(), fill_case()):
            print(time_case(rec, *case, launches=args.launches))
    return 0


def time_case(rec, name, kernel, grid, block, kargs, launches: int) -> str:
    """Validate, then time one kernel's launch both ways (under `rec`, a launch.driverless()): a table row."""
    (overload,) = kernel.overloads.values()
    L.check_against_numba(rec, kernel, grid, block, kargs)
    typing = per_call_us(lambda: [kernel.typeof_pyval(a) for a in kargs], launches)
    packing = per_call_us(lambda: L.numba_params(overload, kargs), launches)
    numba = per_call_us(lambda: kernel[grid, block](*kargs), launches)
    fast = per_call_us(lambda: L.launch(kernel, grid, block, *kargs), launches)
    rec.calls.clear()
    return f"| {name} | {numba:.1f} | {typing:.1f} | {packing:.1f} | {fast:.1f} |"


if __name__ == "__main__":
    sys.exit(main())

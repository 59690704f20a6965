"""Tutorial 09: the host side of a kernel launch, or why a time loop of small launches is slow from Python.

    python tutorials/09_launch_cost.py            # full run
    python tutorials/09_launch_cost.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
A launch costs twice: on the GPU (a few microseconds from one kernel to the next) and on the host, whose CPU
hands the kernel its arguments.  On an H100, cuDNN's whole LSTM forward at H = 768, B = 16, T = 1024 took
20.8 ms, ~20 us a step, while one numba-cuda launch of a step kernel cost 63-135 us of host time
(bench/results/gpu_h100.md).  A time loop that launches once per step is then bound by Python, not by the GPU.
numbarnn answers twice:

    launch less        the persistent v3 kernels (tutorial 07) run a layer's whole time loop in one launch;
    launch cheaper     numbarnn/kernels/launch.py, for the launches that remain (v2 where v3 cannot run, the
                       GEMMs, casts, fills): numba's launch with its per-launch Python done once per argument kind.

This script takes numba's launch apart on the step kernel's real argument list (13 arguments, 12 of them
arrays), shows what a kernel actually receives for an array, checks that launch.py hands the driver exactly what
numba does, and times both.  It needs no GPU and never runs a kernel: both launch paths run up to the driver
call, which is recorded instead of made (`numbarnn.kernels.launch.driverless`), so numba runs outside its
simulator here and the times are the host's work alone, on this machine's CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)     # numba's real launch path (no kernel runs: see the docstring)

from numbarnn.kernels import launch
from numbarnn.measure import per_call_us

# ---------------------------------------------------------------------------------------------------
# 1. What a kernel receives for an array
# ---------------------------------------------------------------------------------------------------

def what_a_kernel_receives():
    """numba passes an array as 5 + 2*ndim scalars: the kernel rebuilds its array view from them."""
    from numba.cuda import types
    h = launch.fake_device_array((16, 768), "float32", 0x7F0000000)        # [B, H] at a made-up device address
    column = launch.fake_device_array((16,), "float32", 0x7F0000000 + 4 * 5, strides=(768 * 4,))    # h[:, 5]
    kernel = launch.driverless_kernel(lambda a, b: None, (types.Array(types.float32, 2, "C"),
                                                          types.Array(types.float32, 1, "A")))
    (overload,) = kernel.overloads.values()
    params = launch.numba_params(overload, [h, column])
    names = ["meminfo", "parent", "size", "itemsize", "data", "shape[0]", "shape[1]", "strides[0]", "strides[1]"]
    print("  h [16, 768] float32 C-ordered:", ", ".join(f"{n}={v:#x}" if n == "data" else f"{n}={v}"
                                                        for n, v in zip(names, params[:9])))
    print("  h[:, 5], a strided column:    ", ", ".join(f"{n}={v:#x}" if n == "data" else f"{n}={v}" for n, v in
                                                        zip(["meminfo", "parent", "size", "itemsize", "data",
                                                             "shape[0]", "strides[0]"], params[9:])))
    assert params[:9] == [0, 0, 16 * 768, 4, 0x7F0000000, 16, 768, 768 * 4, 4]
    assert params[9:] == [0, 0, 16, 4, 0x7F0000000 + 20, 16, 768 * 4]
    print("  (a C-ordered parameter's strides are known at compile time; they are passed all the same)")


# ---------------------------------------------------------------------------------------------------
# 2. numba's launch, taken apart, and launch.py's
# ---------------------------------------------------------------------------------------------------

def both_launches(quick: bool) -> tuple[float, float]:
    """The step kernel's launch: numba's path piece by piece, then launch.py's; -> (numba us, launch.py us)."""
    n = 300 if quick else 3000
    with launch.driverless() as rec:
        kernel, grid, block, args = launch.step_kernel_case()      # LSTM H=768 B=16 T=1024 float32
        (overload,) = kernel.overloads.values()
        # numba's launch, then launch.py's twice (it prepares this kind, checks it against numba's packing and
        # goes; then it takes the prepared path): the same parameters, config and kernel at the driver call
        theirs = launch.check_against_numba(rec, kernel, grid, block, args)
        print(f"  the driver gets {len(theirs[4])} parameters from either path, identical "
              f"(12 arrays x (5 + 2*ndim) + the step)")
        typing = per_call_us(lambda: [kernel.typeof_pyval(a) for a in args], n)
        packing = per_call_us(lambda: launch.numba_params(overload, args), n)
        numba = per_call_us(lambda: kernel[grid, block](*args), n)
        ours = per_call_us(lambda: launch.launch(kernel, grid, block, *args), n)
        rec.calls.clear()
    print(f"  numba kernel[grid, block](*args): {numba:7.1f} us per launch on this CPU (without the driver call)")
    print(f"    of which typing the 13 arguments   {typing:7.1f} us   (picks the compiled overload)")
    print(f"    of which packing them              {packing:7.1f} us   (wrap_arg(a).to_device, then the fields above)")
    print(f"  numbarnn.kernels.launch.launch:    {ours:7.1f} us per launch (typed and packed once per kind)")
    return numba, ours


# ---------------------------------------------------------------------------------------------------
# 3. What that means for a time loop
# ---------------------------------------------------------------------------------------------------

def time_loop(numba: float, ours: float):
    T = 1024
    cudnn_ms = 20.79                                 # cuDNN, LSTM 768x16x1024 forward, H100 (gpu_h100.md)
    print(f"  host time of one layer's forward at T = {T} (one launch per step; GPU time not included):")
    print(f"    v2 with numba's launch   {T * numba / 1e3:8.1f} ms")
    print(f"    v2 with launch.py        {T * ours / 1e3:8.1f} ms")
    print(f"    v3 (persistent)          {ours / 1e3:8.3f} ms   (one launch for all {T} steps)")
    print(f"    cuDNN's whole forward on an H100, for scale: {cudnn_ms} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed launches (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    warnings.simplefilter("ignore")                  # numba's low-occupancy warning for small grids
    print("1. what a kernel receives for an array")
    what_a_kernel_receives()
    print("2. numba's launch and launch.py's, on the step kernel's 13 arguments")
    numba, ours = both_launches(quick)
    assert ours < numba / 2, (numba, ours)            # ~12x on the machines measured; 2x even on a loaded one
    print("3. a time loop")
    time_loop(numba, ours)
    print("tutorial 09: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The layer-normalised cells' backward on the cpu backend, T=100 B=32 I=H=256 float32: the fused time loop
(the setting cpu_fused True: layer_norm_fused.backward_group, row groups in parallel) against the BLAS loop (False:
a BLAS product and a serial row loop per step), the forward fused in both; the built-in LSTM beside them for the
ratio the cells bench reports (`bench_cpu.py --cells`).  Interleaved rounds in one process, a pause before each
forward+backward (OpenBLAS's threads spin after a product: see bench_cpu.py).  Validated first: each variant's
gradients against the float64 reference; the first calls (compiling) are reported apart.

    PYTHONPATH=$PWD python bench/bench_cpu_layer_norm.py [rounds, default 9]
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import CELLS, make_case, numbarnn_runner, validate  # noqa: E402

import numbarnn.contrib.layer_norm_gru  # noqa: E402,F401  (registers the cells)
import numbarnn.contrib.layer_norm_lstm  # noqa: E402,F401
from numbarnn import settings  # noqa: E402
from numbarnn.testing import run_backward, run_forward  # noqa: E402

REPS, PAUSE = int(sys.argv[1]) if len(sys.argv) > 1 else 9, 0.3
SHAPES = {s.mode: s for s in CELLS if s.mode in ("lstm", "layer_norm_lstm", "layer_norm_gru") and not s.zoneout}
cases = {mode: make_case(shape) for mode, shape in SHAPES.items()}
RUNS = [("lstm", True), ("layer_norm_lstm", True), ("layer_norm_lstm", False), ("layer_norm_gru", True),
        ("layer_norm_gru", False)]


def fwdbwd(mode: str, fused: bool) -> tuple[float, float]:
    """(forward+backward, backward) seconds of one training call, the backward's loops chosen by `fused`."""
    case = cases[mode]
    t0 = time.perf_counter()
    out = run_forward(case, "cpu")
    t1 = time.perf_counter()
    with settings.override(cpu_fused=fused):
        run_backward(case, out, "cpu")
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


for mode, fused in RUNS:                      # the first call compiles (or loads numba's cache), then validate
    first = fwdbwd(mode, fused)[0]
    ref = numbarnn_runner(cases[mode].astype(np.float64), "reference")[1]()
    with settings.override(cpu_fused=fused):
        err = validate(numbarnn_runner(cases[mode], "cpu")[1](), ref)
    print(f"{SHAPES[mode].label} {'fused' if fused else 'BLAS'} backward: first call {first:.2f} s, "
          f"max rel. err vs float64 {err:.1e}")
times = {run: [] for run in RUNS}
for _ in range(REPS):
    for run in RUNS:
        time.sleep(PAUSE)
        times[run].append(fwdbwd(*run))
print(f"\nms, median (best) of {REPS} interleaved rounds")
print("| cell | backward loops | forward+backward | backward | forward+backward / LSTM's |")
print("| --- | --- | --- | --- | --- |")
lstm = np.array(times[("lstm", True)]) * 1e3
for run in RUNS:
    t = np.array(times[run]) * 1e3
    print(f"| {SHAPES[run[0]].label} | {'fused' if run[1] else 'BLAS'} | {np.median(t[:, 0]):.1f} ({t[:, 0].min():.1f})"
          f" | {np.median(t[:, 1]):.1f} ({t[:, 1].min():.1f}) | {np.median(t[:, 0]) / np.median(lstm[:, 0]):.2f}x "
          f"({t[:, 0].min() / lstm[:, 0].min():.2f}x) |")

"""One cell's training forward and its backward on the cpu backend, timed apart (the cells bench's shape, T=100
B=32 I=H=256 float32): for A/B runs of two source trees in alternating processes, where one process cannot hold
both versions.  Validated first against the float64 reference; the first call (compiling, or loading numba's
cache) reported apart.  Prints one line: medians (best) in ms.

    PYTHONPATH=<tree> python bench/bench_cpu_phases.py [mode, default layer_norm_lstm] [calls, default 15]
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import CELLS, make_case, numbarnn_runner, validate  # noqa: E402

from numbarnn.testing import run_backward, run_forward  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "layer_norm_lstm"
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 15
if MODE not in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
    __import__(f"numbarnn.contrib.{MODE}")                      # registers the cell (gru_v1, mgu, indrnn, ...)
shape = next(s for s in CELLS if s.mode == MODE and not s.zoneout)
case = make_case(shape)
t0 = time.perf_counter()
run_backward(case, run_forward(case, "cpu"), "cpu")
first = time.perf_counter() - t0
err = validate(numbarnn_runner(case, "cpu")[1](), numbarnn_runner(case.astype(np.float64), "reference")[1]())
fwd, bwd = [], []
for _ in range(CALLS):
    time.sleep(0.2)                                           # (OpenBLAS's threads go idle: see bench_cpu.py)
    t0 = time.perf_counter()
    out = run_forward(case, "cpu")
    t1 = time.perf_counter()
    run_backward(case, out, "cpu")
    fwd.append(t1 - t0)
    bwd.append(time.perf_counter() - t1)
fwd, bwd = np.array(fwd) * 1e3, np.array(bwd) * 1e3
print(f"{shape.label} [{os.environ.get('PYTHONPATH', '')}]: forward {np.median(fwd):.1f} ({fwd.min():.1f}) ms, "
      f"backward {np.median(bwd):.1f} ({bwd.min():.1f}) ms; first call {first:.2f} s, "
      f"max rel. err vs float64 {err:.1e}")

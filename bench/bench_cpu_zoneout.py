"""Zoneout on the cpu backend, LSTM T=100 B=32 I=H=256 float32: zoneout=0.1 and none, each in the fused loops
(the setting cpu_fused True) and the BLAS loops (False), forward (inference: the expectation) and forward+backward
(training: the mask), interleaved rounds in one process, a pause before each turn (OpenBLAS's threads spin
after a product: see bench_cpu.py).  Validated first: fused and BLAS agree.

    PYTHONPATH=$PWD python bench/bench_cpu_zoneout.py [rounds, default 7]
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import Shape, make_case, numbarnn_runner  # noqa: E402

from numbarnn import settings  # noqa: E402
from numbarnn.testing import relative_error  # noqa: E402

REPS, PAUSE = int(sys.argv[1]) if len(sys.argv) > 1 else 7, 0.2
runs = {}
for z in (0.0, 0.1):
    case = make_case(Shape(f"LSTM zoneout={z}", "lstm", 100, 32, 256, 256, zoneout=z))
    fwd, fwdbwd = numbarnn_runner(case, "cpu")
    for fused in (True, False):
        runs[(z, fused)] = (fwd, fwdbwd)
# validate: fused and BLAS agree
for z in (0.0, 0.1):
    got = {}
    for fused in (True, False):
        with settings.override(cpu_fused=fused):
            got[fused] = runs[(z, fused)][1]()
    for k in got[True]:
        err = relative_error(got[True][k], got[False][k])
        assert err < 1e-4, (z, k, err)
times = {(key, ph): [] for key in runs for ph in ("fwd", "fwd+bwd")}
for _ in range(REPS):
    for key, (fwd, fwdbwd) in runs.items():
        for ph, f in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
            time.sleep(PAUSE)
            with settings.override(cpu_fused=key[1]):
                t0 = time.perf_counter()
                f()
                times[(key, ph)].append(1e3 * (time.perf_counter() - t0))
print(f"LSTM T=100 B=32 I=H=256 float32, ms, median (best) of {REPS} interleaved rounds")
for (key, ph), v in times.items():
    z, fused = key
    print(f"  zoneout={z:<4} {'fused' if fused else 'BLAS '} {ph:8s} {np.median(v):7.1f} ({min(v):7.1f})")

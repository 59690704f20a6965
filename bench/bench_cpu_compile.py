"""Cold compile time of the CPU backend's fused loops: the first calls of a process with an empty numba cache.

Each order runs in a fresh subprocess with its own empty NUMBA_CACHE_DIR: the serial loop (a call too small for
row groups, fused.PARALLEL_MIN_MACS) and the parallel one (row groups), one after the other, then the same
process order reversed.  What is timed is each first forward and backward call (compile + a tiny run); a
second process on the same cache shows the load time.  Validation is the test suite's (tests/test_cpu_fused.py
checks serial and parallel give the same bits); this measures compile only.

    python bench/bench_cpu_compile.py [--mode lstm] [--dtype float32]     # --mode: any shipped cell (contrib too)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import numpy as np
from numbarnn import testing
from numbarnn.config import RNNConfig
import numbarnn.contrib.gru_v1, numbarnn.contrib.indrnn, numbarnn.contrib.mgu  # (register the contrib cells)
import numbarnn.contrib.layer_norm_gru, numbarnn.contrib.layer_norm_lstm, numbarnn.contrib.peephole_lstm
mode, dtype, order = sys.argv[1], np.dtype(sys.argv[2]).type, sys.argv[3]
SHAPES = {"serial": (4, 3, 5), "parallel": (40, 16, 256)}     # (T, B, H): 40*16 rows x 4*256*512 MACs > 2^24
out = {}
for kind in order.split(","):
    T, B, H = SHAPES[kind]
    case = testing.make_rnn_case(RNNConfig(num_layers=1, num_units=H, input_size=H, rnn_mode=mode), T, B, dtype=dtype)
    t0 = time.perf_counter()
    fwd = testing.run_forward(case, "cpu")
    t1 = time.perf_counter()
    testing.run_backward(case, fwd, "cpu")
    out[kind] = (t1 - t0, time.perf_counter() - t1)
print(json.dumps(out))
"""


def run(order: str, mode: str, dtype: str, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, dtype, order], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="lstm")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    print(f"{args.mode} {args.dtype}: seconds of the first forward / backward call (compile included)")
    for order in ("serial,parallel", "parallel,serial"):
        with tempfile.TemporaryDirectory() as cache:
            cold = run(order, args.mode, args.dtype, cache)
            warm = run(order, args.mode, args.dtype, cache)
        for kind in order.split(","):
            (f, b), (wf, wb) = cold[kind], warm[kind]
            print(f"  {order:16s} {kind:8s} empty cache: forward {f:6.2f} backward {b:6.2f}   "
                  f"cached: forward {wf:5.2f} backward {wb:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

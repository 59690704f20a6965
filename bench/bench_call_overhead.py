"""What one small op call costs: the per-call overhead a sampling loop pays (T = 1, one character at a time).

    python bench/bench_call_overhead.py            # LSTM H=128 I=58 (examples/char_lstm.py), B=1, T=1

Times ops.cudnn_rnn_v3 (inference) and forward+backward (training) per call on the reference and cpu
backends, and when torch is installed torch.nn.LSTM on the CPU for scale and numbarnn.torch.LSTM (the drop-in:
numbarnn's torch operator around the default backend; same thread count); median of
--calls calls after 20 warm ones, every result validated against the float64 reference first.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cpu  # noqa: E402  (this checkout's numbarnn, on sys.path through bench_cpu)

from numbarnn.config import rnn_config  # noqa: E402
from numbarnn.testing import make_rnn_case  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--H", type=int, default=128)
    ap.add_argument("--I", type=int, default=58)
    args = ap.parse_args(argv)
    case = make_rnn_case(rnn_config(1, args.H, args.I, "lstm"), 1, 1, None, seed=1, dtype=np.float32, scale=0.1)
    ref = bench_cpu.numbarnn_runner(case.astype(np.float64), "reference")[1]()
    backends = ["reference", "cpu"]
    try:
        import numba
        import torch
        torch.set_num_threads(numba.get_num_threads())      # the same thread count for everyone
        backends += ["torch", "numbarnn.torch"]
    except ImportError:
        pass
    print(f"LSTM H={args.H} I={args.I} B=1 T=1 float32, median of {args.calls} calls, microseconds per call")
    print("| backend | inference forward | training forward+backward |")
    print("| --- | --- | --- |")
    for backend in backends:
        fwd, fwdbwd = bench_cpu.runner(replace(case, is_training=True), backend)
        bench_cpu.validate(fwdbwd(), ref)
        print(f"| {backend} | {bench_cpu.per_call_us(fwd, args.calls):.0f} | {bench_cpu.per_call_us(fwdbwd, args.calls):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU backend with and without its workspace (numbarnn/cpu/workspace.py), interleaved in one process.

    python bench/bench_cpu_workspace.py              # LSTM T=100 B=32 I=H=512 and the 2-layer bidirectional LSTM
    python bench/bench_cpu_workspace.py --rounds 9

"fresh" swaps the workspace for a new np.empty per request (what the backend did before it had one); each
round runs both variants, in alternating order, each after one untimed inference call and a 0.2 s pause, and
times an inference forward and a training forward+backward.  Outputs are validated against the float64
reference first (bench_cpu.validate).  Medians and minimums in ms.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cpu  # noqa: E402  (this checkout's numbarnn, on sys.path through bench_cpu)

from numbarnn.cpu import network  # noqa: E402


def fresh(name, shape, dtype):
    return np.empty(shape, dtype=dtype)


def measure(shape, rounds: int) -> dict:
    case = bench_cpu.make_case(shape)
    infer = replace(case, is_training=False)
    ref = bench_cpu.numbarnn_runner(case.astype(np.float64), "reference")[1]()
    variants = {"workspace": network.scratch, "fresh": fresh}
    times = {name: ([], []) for name in variants}
    fwd, fwdbwd = bench_cpu.numbarnn_runner(case, "cpu")
    try:
        for name, fn in variants.items():
            network.scratch = fn
            bench_cpu.validate(fwdbwd(), ref)
        for r in range(rounds):
            for name in (variants if r % 2 == 0 else reversed(list(variants))):
                network.scratch = variants[name]
                fwd()
                time.sleep(0.2)
                t0 = time.perf_counter()
                fwd()
                t1 = time.perf_counter()
                fwdbwd()
                t2 = time.perf_counter()
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
    finally:
        network.scratch = variants["workspace"]
    return {name: tuple((1e3 * float(np.median(t)), 1e3 * min(t)) for t in pair) for name, pair in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="small shapes, 2 rounds (a smoke run)")
    args = ap.parse_args(argv)
    shapes = bench_cpu.QUICK if args.quick else (bench_cpu.SHAPES[0], bench_cpu.SHAPES[3])
    rounds = 2 if args.quick else args.rounds
    print("| shape | variant | fwd median (ms) | fwd min (ms) | fwd+bwd median (ms) | fwd+bwd min (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in shapes:
        for name, ((fm, fb), (bm, bb)) in measure(shape, rounds).items():
            print(f"| {shape.label} | {name} | {fm:.1f} | {fb:.1f} | {bm:.1f} | {bb:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

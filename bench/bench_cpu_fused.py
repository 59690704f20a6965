"""The cpu backend's fused loops against the BLAS loops they replaced (issue 9), in one process.

1. The per-step recurrent product alone, R h^T for all rows, T steps: `microkernel.product_tile` (the LLVM-IR
   micro-kernel; one thread, then the rows split over numba's threads) against OpenBLAS (np.matmul out=).
2. The whole op, forward (inference) and backward, with the setting cpu_fused True (the fused loops) and False (the
   BLAS loops), interleaved rounds with a pause before each turn (OpenBLAS's threads spin for ~0.1 s after a
   product: see bench_cpu.py).  Both validated against each other first.

3. `--tile-shapes`: the micro-kernel alone on one thread for several V x NR tiles (`microkernel.tile_shape`).

    python bench/bench_cpu_fused.py [--reps 7] [--pause 0.2] [--tile-shapes]
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from numbarnn import settings
from numbarnn.cpu import fused, microkernel, tuning
from numbarnn.testing import relative_error, run_backward, run_forward


def product_only(T=100, B=32, H=512, G=4, reps=7, pause=0.2):
    """ms per T steps of R h^T: micro-kernel on 1 thread, on all threads (rows split), OpenBLAS."""
    ct = np.float32
    LANES, NR = microkernel.lanes_for(ct), microkernel.rows_for(G)
    tile = microkernel.product_tile("float32", G, NR, LANES)
    NT = -(-H // LANES)
    rng = np.random.default_rng(0)
    R = (rng.standard_normal((G * H, H)) * 0.05).astype(ct)     # [G*H, H]
    NB = -(-B // NR)                                            # row tiles (a partial last one: NR=3 on AVX2)
    h = np.zeros((NB * NR, H), ct)                              # [NB*NR, H] rows past B are zeros
    h[:B] = rng.standard_normal((B, H))
    Rp = np.empty(microkernel.panel_shape(NT, H, G, ct), ct)          # [NT, G//V, H, V, LANES]
    microkernel.pack(R, Rp)
    rows = np.array([[h[i + r].ctypes.data for r in range(NR)] for i in range(0, NB * NR, NR)], np.int64)  # [NB, NR]
    out = np.empty((NT, NB, G, NR, LANES), ct)

    one, par = _steps_runner(tile, False), _steps_runner(tile, True)
    ghT, hT = np.empty((G * H, B), ct), np.ascontiguousarray(h[:B].T)
    want = R @ hT
    one(Rp, rows, out, 1)
    got = out.transpose(2, 0, 4, 1, 3).reshape(G * H, NB * NR)[:, :B]   # [g, jt, u] x [bt, r]
    assert relative_error(got, want) < 1e-5
    variants = {"micro-kernel, 1 thread": lambda: one(Rp, rows, out, T),
                f"micro-kernel, {numba.get_num_threads()} threads": lambda: par(Rp, rows, out, T),
                "OpenBLAS np.matmul": lambda: [np.matmul(R, hT, out=ghT) for _ in range(T)]}
    par(Rp, rows, out, 1)
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, f in variants.items():
            time.sleep(pause)
            t0 = time.perf_counter()
            f()
            times[k].append(1e3 * (time.perf_counter() - t0))
    flops = 2.0 * G * H * H * B * T
    print(f"R h^T, T={T} B={B} H={H} G={G} float32, median (min) of {reps}:")
    for k, v in times.items():
        print(f"  {k:28s} {np.median(v):7.1f} ({min(v):6.1f}) ms  {flops / min(v) / 1e6:6.0f} GFLOP/s at best")


#: (G, V, NR) micro-kernel shapes `tile_shapes` times: the LSTM's one and two passes, GRU's, RNN's
SHAPES_TRIED = ((4, 4, 2), (4, 4, 3), (4, 4, 4), (4, 2, 4), (4, 2, 6), (3, 3, 4), (1, 1, 4), (1, 1, 8), (1, 1, 12))


def tile_shapes(K=512, B=48, steps=20, reps=5):
    """GFLOP/s of the micro-kernel alone on one thread for several V x NR tiles (G // V passes over k):
    panels of 2048 rows (all of them in L2/L3 as in the op), B rows, product_tile called as in the fused loop.
    Shapes whose registers (V*NR accumulators + V panel vectors + a broadcast) exceed the ISA's spill."""
    ct = np.float32
    LANES = microkernel.lanes_for(ct)
    rng = np.random.default_rng(0)
    print(f"micro-kernel alone, one thread, K={K}, B={B} rows, {microkernel.registers()} vector registers, best of {reps}:")
    for G, V, NR in SHAPES_TRIED:
        tile = microkernel.product_tile("float32", G, NR, LANES, V)
        NT = 2048 // (G * LANES)
        R = rng.standard_normal((G * NT * LANES, K)).astype(ct)
        Rp = np.empty((NT, G // V, K, V, LANES), ct)
        microkernel.pack(R, Rp)
        NB = -(-B // NR)
        h = rng.standard_normal((NB * NR, K)).astype(ct)
        rows = np.array([[h[i + r].ctypes.data for r in range(NR)] for i in range(0, NB * NR, NR)], np.int64)
        out = np.empty((NT, NB, G, NR, LANES), ct)

        run = _steps_runner(tile)
        run(Rp, rows, out, 1)
        got = out.transpose(2, 0, 4, 1, 3).reshape(G * NT * LANES, NB * NR)      # [g, jt, u] x [bt, r]
        assert relative_error(got, R @ h.T) < 1e-5
        best = min(_timed(run, Rp, rows, out, steps) for _ in range(reps))
        fits = "fits" if microkernel.fits(V, NR) else "spills"
        passes = f"{G // V} pass{'es' if G > V else ''}"
        print(f"  G={G} V={V} NR={NR:2d} ({passes}, {V * NR + V + 1:2d} registers, {fits:6s})"
              f" {2.0 * G * NT * LANES * K * NB * NR * steps / best / 1e9:6.1f} GFLOP/s")


_steps_runner = tuning.steps_runner      # the micro-kernel called as the fused loop calls it


def _timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def whole_op(reps=7, pause=0.2):
    from bench_cpu import (  # the bench's shapes and contracting weights
        SHAPES,
        make_case,
    )
    print(f"whole op, float32, median (min) of {reps} interleaved rounds, ms:")
    for shape in (SHAPES[0], SHAPES[3], SHAPES[1]):
        label, case = shape.label, make_case(shape)
        times, outs = {}, {}
        for flag in (True, False):
            with settings.override(cpu_fused=flag):
                outs[flag] = run_forward(case, "cpu")
                run_backward(case, outs[flag], "cpu")
        assert relative_error(outs[True][0], outs[False][0]) < 2e-6, label
        for _ in range(reps):
            for flag in (True, False):
                with settings.override(cpu_fused=flag):
                    time.sleep(pause)
                    t0 = time.perf_counter()
                    run_forward(case, "cpu")
                    t1 = time.perf_counter()
                    time.sleep(pause)
                    t2 = time.perf_counter()
                    run_backward(case, outs[flag], "cpu")
                    t3 = time.perf_counter()
                times.setdefault(flag, ([], []))[0].append(1e3 * (t1 - t0))
                times[flag][1].append(1e3 * (t3 - t2))
        for flag, (f, b) in times.items():
            print(f"  {label:46s} {'fused' if flag else 'BLAS ':5s} forward {np.median(f):6.1f} ({min(f):6.1f})"
                  f"  backward {np.median(b):6.1f} ({min(b):6.1f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pause", type=float, default=0.2)
    ap.add_argument("--tile-shapes", action="store_true", help="only the micro-kernel's V x NR tile shapes")
    args = ap.parse_args(argv)
    print(f"numba threads {numba.get_num_threads()}, {microkernel.simd_bytes() * 8}-bit vectors, "
          f"LANES={microkernel.lanes_for(np.float32)} V x NR={microkernel.tile_shape(4)} (float32 LSTM)")
    if args.tile_shapes:
        tile_shapes(reps=args.reps)
        return
    product_only(reps=args.reps, pause=args.pause)
    whole_op(reps=args.reps, pause=args.pause)


if __name__ == "__main__":
    main()

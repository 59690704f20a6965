"""Benchmark of the numbered GEMM kernels (numbarnn.kernels.gemm v1..v4), llm.c dev/cuda style.

    python bench/bench_gemm.py                          # float32, default shapes
    python bench/bench_gemm.py --dtype float16 --shapes 4096x4096x4096 20x800x400 --reps 20

Every version is first checked against NumPy (float64 reference, SPEC section 10 tolerances) on an odd
shape and on each benchmark shape; then each is timed with CUDA events after a warm-up launch (the
compile stays out of the timing).  The baseline is cuBLAS through CuPy or torch when one is installed,
else NumPy on the host.  Shapes are MxNxK: C [M, N] = A [M, K] @ B [K, N].

Without a real GPU (CUDA simulator, or no CUDA driver) it says so, validates every version on tiny
shapes in the simulator, and exits 0.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

RTOL = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}
DEFAULT_SHAPES = ["1024x1024x1024", "4096x4096x4096", "20x800x400", "640x1024x256"]


def parse_shape(text: str) -> tuple:
    try:
        M, N, K = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK like 1024x1024x512, got {text!r}") from None
    if min(M, N, K) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return M, N, K


def rel_error(out, ref) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def validate(versions, dtype: str, shapes, rng) -> bool:
    """Every version against numpy (float64) on each shape, with both transposes; prints and returns ok."""
    from numbarnn.kernels import gemm as G

    ok = True
    for M, N, K in shapes:
        for trans_a, trans_b in ((False, False), (True, True)):
            a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(dtype)
            b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(dtype)
            c = rng.standard_normal((M, N)).astype(dtype)
            A = a.T if trans_a else a
            B = b.T if trans_b else b
            ref = 1.5 * (A.astype(np.float64) @ B.astype(np.float64)) - 0.5 * c.astype(np.float64)
            for v in versions:
                out = G.matmul(a, b, c, alpha=1.5, beta=-0.5, trans_a=trans_a, trans_b=trans_b, version=v)
                err = rel_error(out, ref)
                good = err <= RTOL[dtype]
                ok &= good
                flags = ("t" if trans_a else "n") + ("t" if trans_b else "n")
                print(f"  check v{v} {dtype} {M}x{N}x{K} {flags}: rel. error {err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def cublas_baseline():
    """(name, fn(d_a, d_b, d_c)) computing C = A @ B with cuBLAS on numba device arrays, or None."""
    try:
        import cupy

        def run(d_a, d_b, d_c):
            cupy.matmul(cupy.asarray(d_a), cupy.asarray(d_b), out=cupy.asarray(d_c))

        return "cuBLAS (CuPy)", run
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            def run(d_a, d_b, d_c):
                ta = torch.as_tensor(d_a, device="cuda")
                tb = torch.as_tensor(d_b, device="cuda")
                torch.matmul(ta, tb, out=torch.as_tensor(d_c, device="cuda"))

            return "cuBLAS (torch)", run
    except Exception:
        pass
    return None


def time_device(fn, reps: int) -> float:
    """Mean milliseconds per call of fn() on the default stream: one warm-up call, then CUDA events."""
    from numba import cuda

    fn()  # warm-up: compiles / loads the kernel, allocates workspaces
    cuda.synchronize()
    start, stop = cuda.event(), cuda.event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def time_host(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def bench(args) -> int:
    from numba import cuda

    from numbarnn.kernels import gemm as G

    rng = np.random.default_rng(0)
    dtype = args.dtype
    versions = args.versions
    name = getattr(cuda.get_current_device(), "name", "simulator")
    print(f"device: {name.decode() if isinstance(name, bytes) else name}")
    print("validation against numpy (float64 reference):")
    if not validate(versions, dtype, [(37, 29, 19)] + [s for s in args.shapes if s[0] * s[1] * s[2] <= 2**31], rng):
        print("validation FAILED: no timings")
        return 1
    baseline = cublas_baseline()
    base_name = baseline[0] if baseline else "numpy (host)"
    print(f"\ntimings: mean of {args.reps} launches after a warm-up; baseline {base_name}")
    header = f"{'shape MxNxK':>18}  {'kernel':<24} {'ms':>9} {'GFLOP/s':>9} {'vs base':>8}"
    print(header)
    print("-" * len(header))
    for M, N, K in args.shapes:
        a = rng.standard_normal((M, K)).astype(dtype)
        b = rng.standard_normal((K, N)).astype(dtype)
        d_a, d_b = cuda.to_device(a), cuda.to_device(b)
        d_c = cuda.device_array((M, N), dtype)
        flops = 2.0 * M * N * K
        if baseline:
            base_ms = time_device(lambda: baseline[1](d_a, d_b, d_c), args.reps)
        else:
            base_ms = time_host(lambda: np.matmul(a, b), max(1, min(args.reps, 3)))
        rows = [(base_name, base_ms)]
        for v in versions:
            if v == 1 and flops > 2 * 2**33 and not args.all:
                rows.append((f"v{v} (skipped)", float("nan")))  # the naive kernel takes seconds here
                continue
            ms = time_device(lambda: G.gemm(d_a, d_b, d_c, version=v), args.reps)
            rows.append((f"v{v} {G.VERSIONS[v].title}", ms))
        for name, ms in rows:
            gflops = flops / (ms * 1e6) if ms == ms else float("nan")
            ratio = base_ms / ms if ms == ms else float("nan")
            print(f"{f'{M}x{N}x{K}':>18}  {name:<24} {ms:9.3f} {gflops:9.1f} {ratio:8.2f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES])
    p.add_argument("--versions", nargs="+", type=int, default=[1, 2, 3, 4], choices=[1, 2, 3, 4])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--all", action="store_true", help="also time v1 on the big shapes")
    p.add_argument("--tiny-validation", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import numba
    from numba import cuda

    if numba.config.ENABLE_CUDASIM or args.tiny_validation:
        print("no real GPU here (numba CUDA simulator): validating every version on tiny shapes, no timings")
        ok = validate(args.versions, args.dtype, [(5, 7, 3), (9, 4, 11)], np.random.default_rng(0))
        return 0 if ok else 1
    if not cuda.is_available():
        print("no real GPU here (no CUDA driver / device): tiny validation in the simulator, no timings", flush=True)
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--tiny-validation", "--dtype", args.dtype,
               "--versions", *map(str, args.versions)]
        return subprocess.run(cmd, env=env).returncode
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())

"""Tutorial 03: the GEMM kernels v1, v2, v3, v4 -- what changed from one to the next, and why.

    python tutorials/03_gemm_versions.py            # full run
    python tutorials/03_gemm_versions.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
Everything in an RNN layer that is NOT in the sequential time loop is a matrix product, and it is
where the arithmetic is:

    forward    gx = x_l @ W^T                  [T*B, I_l] x [I_l, G*H]   all steps at once
    backward   dx_l = dgx @ W                  [T*B, G*H] x [G*H, I_l]
               dW = dgx^T @ x_l, dR = dgh^T @ h_prev, dW_proj = dh^T @ m

`numbarnn/kernels/gemm.py` has one GEMM, C = alpha * op(A) @ op(B) + beta * C, written four times
in the style of llm.c's dev/cuda: each version keeps the previous one's interface and changes one
idea.  A transposed operand is read through swapped indices (flags trans_a / trans_b), never copied.

    v1 naive                one thread per element of C; every multiply-add reads both operands from
                            global memory: 2 global loads per FMA.
    v2 shared-memory tiles  a TILE x TILE block stages TILE x TILE tiles of op(A) and op(B) in shared
                            memory once, then every thread reads them from there: global loads drop by
                            a factor TILE, but each FMA still costs 2 shared-memory loads.
    v3 register blocking    each thread owns TM x TN outputs; per k it loads TM values of A and TN of B
                            into registers and does TM*TN FMAs: (TM+TN)/(TM*TN) shared loads per FMA,
                            and block tiles BM x BN cut global loads to (1/BM + 1/BN) per FMA.
    v4 double buffering     8 x 8 outputs per thread in 128 x 128 block tiles: 16 shared loads feed 64
                            FMAs (4 per load, v3: 2) and 64 FMAs per global load (v3: 32); two shared
                            buffers per operand: the next k-tile's global loads are issued into
                            registers before this tile's FMAs and parked in the other buffer after
                            them, so their latency hides behind the arithmetic and one barrier per
                            k-tile suffices (v3: two).  numba has no float4 loads from Python: the lever
                            for wide transactions is consecutive threads reading consecutive addresses.
                            The gemm entry point (so every driver) uses v4; version=3 selects v3.

v3 against v4 with the GPU tiles (FMAs per load counted from the tile sizes; registers, shared memory
and occupancy from `python -m numbarnn.analysis.report --only gemm_v`, sm_80 / sm_90, 256 threads):

                              v3 (64x64x8, 4x4)        v4 (128x128x4, 8x8)
    FMAs per shared load      16 / 8 = 2               64 / 16 = 4
    FMAs per global load      32                       64
    barriers per 1K FMAs      15.6 (2 per 8 x 16)      3.9 (1 per 4 x 64)
    registers float32/16      60-70                    124-128 (sm_80), 118 (sm_90)
    registers float64         78-92                    188-214
    shared memory float32     4096 B                   8704 B (2 buffers, padded rows)
    occupancy float32/16      38-50 %                  25 %
    occupancy float64         25-38 %                  12.5 %
    spills                    0                        0
v4 trades occupancy for instruction-level parallelism: 64 independent FMAs per k step per thread.

Split-K (v4, for thin outputs).  A GPU runs one block per 128 x 128 tile of C; when C has fewer tiles than
the GPU has SMs, most SMs idle while each block walks all of K alone.  The backward's dx = dgx @ W at a small
T*B is such a product (measured on an H100, LSTM H=768 B=16 T=8: M=128, N=768, K=3072, 6 blocks, 752 us).
Split-K gives grid dimension z to slices of K: each block computes its tile over one slice into a partial
buffer, and a second launch (`split_k_sum`) adds the partials in a fixed order, so results do not depend
on timing.  `gemm(split_k=None)` decides with `split_k_for` (about one block per SM, at least 16 k-tiles per
slice); section 4 shows the choice for the LSTM products and checks the split product.

This script prints each version's own one-line rationale from the source, the load counts of that
model for the tile sizes in use, validates every version against NumPy (transposes, alpha/beta,
batches, the three dtypes), and times them.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys

from numbarnn.device import use_simulator_unless_gpu  # imports no numba

# numba reads NUMBA_ENABLE_CUDASIM once, at import: without a GPU, choose the simulator before importing it.
use_simulator_unless_gpu()

import numpy as np  # noqa: E402
from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from numbarnn.kernels import gemm as G  # noqa: E402
from numbarnn.verify import TOLERANCES, relative_error  # noqa: E402
from numbarnn.bench import timed_ms  # noqa: E402

SIM = bool(numba_config.ENABLE_CUDASIM)
TOL = {dt.name: out for dt, (out, _) in TOLERANCES.items()}     # ‖C − C_ref‖/‖C_ref‖, SPEC 10 (numbarnn.verify)


def device_name() -> str:
    if SIM:
        return "numba CUDA simulator (no GPU: one Python thread per CUDA thread, timings are not GPU timings)"
    name = cuda.get_current_device().name
    return "GPU " + (name.decode() if isinstance(name, bytes) else str(name))


# ---------------------------------------------------------------------------------------------------
# 1. What changed, from the source
# ---------------------------------------------------------------------------------------------------

def rationale(version) -> str:
    """The '# vN ...:' comment that opens each factory in gemm.py."""
    for line in inspect.getsource(version.make_pyfunc).splitlines():
        if line.strip().startswith(f"# v{version.number}"):
            return line.strip()[2:]
    return f"v{version.number} {version.title} (no rationale comment found in {version.make_pyfunc.__name__})"


def load_model(number: int, config: tuple) -> dict:
    """Loads (and barriers) per fused multiply-add (FMA) in the simple model above, for the given tiles."""
    if number == 1:
        return {"global": 2.0, "shared": 0.0, "outputs/thread": 1, "barriers": 0.0}
    if number == 2:
        (tile,) = config
        return {"global": 2.0 / tile, "shared": 2.0, "outputs/thread": 1, "barriers": 2.0 / tile}
    BM, BN, BK, TM, TN = config   # v3 and v4: a thread does TM*TN FMAs per k, BK k per k-tile
    per_tile = 2 if number == 3 else 1
    return {"global": 1.0 / BM + 1.0 / BN, "shared": (TM + TN) / (TM * TN), "outputs/thread": TM * TN,
            "barriers": per_tile / (BK * TM * TN)}


def show_versions():
    print(f"  tiles in use ({'simulator' if SIM else 'GPU'}): each version's default config")
    print(f"    {'version':<28} {'config':<20} {'threads':>7} {'out/thr':>7} {'global/FMA':>10} {'shared/FMA':>10}")
    models = {}
    for number, v in G.VERSIONS.items():
        config = v.default_config()
        m = load_model(number, config)
        models[number] = m
        print(f"    v{number} {v.title:<25} {str(config):<20} {v.threads(config):>7} {m['outputs/thread']:>7} "
              f"{m['global']:>10.3f} {m['shared']:>10.3f}")
    for number, v in G.VERSIONS.items():
        print(f"    {rationale(v)}")
    # the point of each step, as asserts on the model with the GPU tiles
    gpu = {n: load_model(n, v.gpu_config) for n, v in G.VERSIONS.items()}
    assert gpu[2]["global"] < gpu[1]["global"] / 8, "v2 should cut global loads by the tile size"
    assert gpu[3]["global"] < gpu[2]["global"], "v3's larger block tiles should cut global loads further"
    assert gpu[3]["shared"] < gpu[2]["shared"] / 3, "v3 should cut shared loads per FMA (register reuse)"
    assert gpu[4]["shared"] <= gpu[3]["shared"] / 2, "v4's 8x8 micro-tile should halve shared loads per FMA"
    assert gpu[4]["global"] <= gpu[3]["global"] / 2, "v4's 128x128 block tile should halve global loads per FMA"
    assert gpu[4]["barriers"] <= gpu[3]["barriers"] / 2, "double buffering: one barrier per k-tile"
    print(f"  with the GPU tiles: global loads per FMA {gpu[1]['global']:.2f} (v1) -> {gpu[2]['global']:.3f} (v2) "
          f"-> {gpu[3]['global']:.3f} (v3) -> {gpu[4]['global']:.4f} (v4); shared loads per FMA "
          f"{gpu[2]['shared']:.1f} (v2) -> {gpu[3]['shared']:.2f} (v3) -> {gpu[4]['shared']:.2f} (v4)")
    print(f"  FMAs per load: shared {1 / gpu[3]['shared']:.0f} (v3) -> {1 / gpu[4]['shared']:.0f} (v4), "
          f"global {1 / gpu[3]['global']:.0f} (v3) -> {1 / gpu[4]['global']:.0f} (v4)")


# ---------------------------------------------------------------------------------------------------
# 2. Validation against NumPy
# ---------------------------------------------------------------------------------------------------

def reference(a, b, c, alpha, beta, trans_a, trans_b):
    """alpha * op(A) @ op(B) + beta * C in float64 (batched when 3-D)."""
    A = np.swapaxes(a, -1, -2) if trans_a else a
    B = np.swapaxes(b, -1, -2) if trans_b else b
    return alpha * (A.astype(np.float64) @ B.astype(np.float64)) + beta * c.astype(np.float64)


def validate(quick: bool, rng):
    M, N, K = (7, 5, 9) if SIM else (333, 257, 129)       # odd sizes: partial tiles on every edge
    cases = [("float64", False, False, 1.0, 0.0, None), ("float32", True, True, 1.5, -0.5, None),
             ("float16", False, True, 1.0, 1.0, None), ("float64", True, False, 0.5, 2.0, 3)]
    if not quick:
        cases += [("float32", False, False, 1.0, 0.0, 2), ("float64", False, True, -1.0, 0.25, None)]
    for dtype, trans_a, trans_b, alpha, beta, Z in cases:
        batch = () if Z is None else (Z,)
        a = rng.standard_normal(batch + ((K, M) if trans_a else (M, K))).astype(dtype)
        b = rng.standard_normal(batch + ((N, K) if trans_b else (K, N))).astype(dtype)
        c = rng.standard_normal(batch + (M, N)).astype(dtype)
        ref = reference(a, b, c, alpha, beta, trans_a, trans_b)
        errs = []
        for number in G.VERSIONS:
            out = G.matmul(a, b, c, alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b, version=number)
            assert out.dtype == np.dtype(dtype) and out.shape == ref.shape
            err = relative_error(out, ref)
            assert err < TOL[dtype], f"v{number} {dtype}: relative error {err:.1e} > {TOL[dtype]:.0e}"
            errs.append(err)
        ops = ("t" if trans_a else "n") + ("t" if trans_b else "n")
        what = f"{dtype:<7} {ops} alpha={alpha:<4} beta={beta:<5} {'Z=' + str(Z) if Z else 'unbatched':<9}"
        shown = "  ".join(f"v{n} {e:.0e}" for n, e in zip(G.VERSIONS, errs))
        print(f"    {what} [{M}x{N}x{K}]  rel. error {shown}  (tolerance {TOL[dtype]:.0e})")


def check_beta_zero(rng):
    """BLAS rule: beta == 0 never reads C, so NaN in an uninitialised C cannot leak into the result."""
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((3, 4))
    c = np.full((5, 4), np.nan)
    for number in G.VERSIONS:
        out = G.matmul(a, b, c, beta=0.0, version=number)
        assert np.isfinite(out).all(), f"v{number}: NaN from C leaked through beta = 0"
        assert relative_error(out, a @ b) < 1e-14
    print("    beta = 0 with C full of NaN: every version returns A @ B (C is never read)")


def check_small_tiles(rng):
    """Tile sizes are compile-time constants: other tiles, same results (several k-tiles, ragged edges)."""
    a, b = rng.standard_normal((6, 11)), rng.standard_normal((11, 5))
    for number, config in ((1, (2, 3)), (2, (2,)), (3, (4, 4, 2, 2, 2)), (4, (4, 2, 2, 2, 1))):
        out = G.matmul(a, b, version=number, config=config)
        assert relative_error(out, a @ b) < 1e-13, (number, config)
    print("    other tile sizes (v1 2x3, v2 TILE=2, v3 4x4x2 / 2x2, v4 4x2x2 / 2x1): same product")


# ---------------------------------------------------------------------------------------------------
# 3. Benchmark
# ---------------------------------------------------------------------------------------------------

def benchmark(quick: bool, rng):
    dtype = "float32"
    if SIM:
        shapes = [(16, 16, 16)] if quick else [(16, 16, 16), (24, 32, 8)]
        reps = 1
    else:
        shapes = [(1024, 1024, 1024), (640, 1024, 256)] if quick else [(2048, 2048, 2048), (640, 1024, 256),
                                                                        (20, 800, 400)]
        reps = 3 if quick else 10
    print(f"  device: {device_name()}; {dtype}, median of {reps} after a warm-up; host baseline: NumPy matmul")
    print(f"    {'M x N x K':>16}  {'kernel':<28} {'ms':>10} {'GFLOP/s':>9}")
    for M, N, K in shapes:
        a = rng.standard_normal((M, K)).astype(dtype)
        b = rng.standard_normal((K, N)).astype(dtype)
        d_a, d_b, d_c = cuda.to_device(a), cuda.to_device(b), cuda.device_array((M, N), dtype)
        flops = 2.0 * M * N * K
        rows = [("NumPy (host)", timed_ms(lambda: a @ b, reps))]
        for number, v in G.VERSIONS.items():
            rows.append((f"v{number} {v.title}", timed_ms(lambda: G.gemm(d_a, d_b, d_c, version=number), reps)))
            err = relative_error(d_c.copy_to_host(), a.astype(np.float64) @ b.astype(np.float64))
            assert err < TOL[dtype], f"v{number} {M}x{N}x{K}: relative error {err:.1e}"
        for name, ms in rows:
            print(f"    {f'{M} x {N} x {K}':>16}  {name:<28} {ms:10.3f} {flops / (ms * 1e6):9.2f}")


# ---------------------------------------------------------------------------------------------------
# 4. Split-K for thin outputs
# ---------------------------------------------------------------------------------------------------

def split_k(quick: bool, rng):
    v4, sms = G.VERSIONS[4], G.sm_count(simulator=False)
    print(f"  GPU tiles {v4.gpu_config[:2]}, {sms} SMs ({'this GPU' if not SIM else 'the H100 of the model'}):")
    for what, (M, N, K) in (("LSTM H=768 B=16 T=8, dx = dgx W", (128, 768, 3072)),
                            ("LSTM H=768 B=16 T=8, gx = x W^T", (128, 3072, 768)),
                            ("LSTM H=512 B=32 T=100, dx = dgx W", (3200, 512, 2048)),
                            ("LSTM H=1024 B=64 T=100, dx = dgx W", (6400, 1024, 4096))):
        grid, _ = v4.launch(M, N, 1, v4.gpu_config)          # one block per output tile
        tiles = grid[0] * grid[1]
        n = G.split_k_for(M, N, K, v4.gpu_config, sms)
        print(f"    {what:<36} {M:>5} x {N:>4} x {K:>4}: {tiles:>4} tiles -> split_k {n:>2}: {tiles * n:>4} blocks")
    # a thin product with a long K, split and not split: the same numbers, the same bits on every run
    M, N, K = (5, 3, 48) if SIM else (128, 768, 3072)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c = rng.standard_normal((M, N)).astype(np.float32)
    d_a, d_b = cuda.to_device(a), cuda.to_device(b)
    ref = reference(a, b, c, 1.0, 0.5, False, False)
    outs = {}
    for n in (1, 4, 4):
        d_c = cuda.to_device(c)
        G.gemm(d_a, d_b, d_c, beta=0.5, split_k=n)
        out = d_c.copy_to_host()
        assert relative_error(out, ref) < TOL["float32"], n
        assert n not in outs or outs[n].tobytes() == out.tobytes(), "split-K must be deterministic"
        outs[n] = out
    print(f"    {M} x {N} x {K}, beta = 0.5: split_k 1 and 4 agree with NumPy; split_k 4 twice gives the same bits")
    if not SIM:
        d_c = cuda.device_array((M, N), np.float32)
        for n in (1, None):
            ms = timed_ms(lambda: G.gemm(d_a, d_b, d_c, split_k=n), 3 if quick else 10)
            label = n if n else f"auto ({G.split_k_for(M, N, K, v4.gpu_config, sms)})"
            print(f"    {M} x {N} x {K} split_k={label}: {ms:.3f} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    rng = np.random.default_rng(3)
    print(f"running on: {device_name()}")
    print("1. what changed from v1 to v4")
    show_versions()
    print("2. validation against NumPy (float64 reference)")
    validate(quick, rng)
    check_beta_zero(rng)
    check_small_tiles(rng)
    print("3. benchmark")
    benchmark(quick, rng)
    print("4. split-K for thin outputs")
    split_k(quick, rng)
    print("tutorial 03: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tutorial 08: the CPU backend's fused time loop -- a register-blocked micro-kernel in LLVM IR, then the cell.

    python tutorials/08_cpu_fused_loop.py            # full run
    python tutorials/08_cpu_fused_loop.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
On a CPU an LSTM step is a product and a little pointwise math:

    gh = R h            [G*H, P] x [P, B]      2*G*H*P*B flops per step: LSTM H=512 B=32: 67 MFLOP
    cell(W x_t + gh)    G*H*B values           a few nanoseconds per unit

The obvious code calls BLAS for the product at every step (numbarnn/cpu/network.py's BLAS loop; so does
the NumPy reference).  Three things go wrong: OpenBLAS packs R into its own layout again at every call
(4 MB at H=512), W x_t for all steps goes through DRAM between one big GEMM and the per-step loop, and the
pointwise loop runs on one core while OpenBLAS's other threads spin.

numbarnn/cpu/fused.py packs W and R once per call and runs the whole time loop in one numba function.  Its
product (numbarnn/cpu/microkernel.py) is a *micro-kernel*, the innermost piece of every fast GEMM: a tile of
NR batch rows times G gates of LANES units, kept as G*NR vector accumulators in registers while k runs over
the reduction:

    for k in 0..K-1:
        w[g]  = panel[k, g, 0:LANES]          G vector loads (R packed: gates of LANES units side by side)
        for r in 0..NR-1:
            hb = broadcast(row_r[k])          one scalar, splat into a vector
            acc[g][r] += w[g] * hb            G*NR fused multiply-adds, no memory traffic

LLVM does not find this register blocking in a scalar Python loop, so numbarnn writes the loop in LLVM IR
through llvmlite (numba's own code generator, no C compiler).  The accumulators, the G loaded vectors and
the broadcast must all fit in the vector registers: 4 gates x 4 rows = 21 of AVX-512's 32, but with AVX2's 16
the LSTM runs two passes over k of 2 gates x 6 rows each (15 registers; the panel is packed pass by pass,
`microkernel.panel_shape`).  One pass of 4 x 3 on AVX2 needs 17: LLVM spills, and the kernel runs at 43% of the
core's peak.  The tile's results then go straight into the
cell's own pointwise code (the CellSpec's `forward`, compiled by numba) while they are in L1.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import numpy as np
from numba import njit

from numbarnn.config import rnn_config
from numbarnn import settings
from numbarnn.cpu import fused, microkernel
from numbarnn.testing import make_rnn_case, relative_error, run_backward, run_forward


def show_micro_kernel():
    src = inspect.getsource(microkernel.product_tile)
    body = src[src.index("                builder.position_at_end(body)"):
               src.index("                builder.position_at_end(done)")]
    print("  the loop body as it builds the IR (numbarnn/cpu/microkernel.py, product_tile):")
    for line in body.rstrip().splitlines():
        print("    " + line[12:])
    G, compute = 4, "float32"
    LANES, (V, NR) = microkernel.lanes_for(compute), microkernel.tile_shape(G)
    print(f"  this CPU: {microkernel.simd_bytes() * 8}-bit vectors, {microkernel.registers()} registers -> LANES = {LANES} "
          f"float32 units per vector; {G // V} pass(es) of V = {V} gates x NR = {NR} rows: {V * NR} accumulators")
    one_tile = tile_runner(microkernel.product_tile(compute, G, NR, LANES))
    panel = np.ones(microkernel.panel_shape(1, 8, G, compute)[1:], np.float32)    # [G//V, K, V, LANES]
    rows = np.array([panel.ctypes.data] * NR, np.int64)
    out = np.empty((G, NR, LANES), np.float32)
    one_tile(panel, rows, out)
    asm = next(iter(one_tile.inspect_asm().values()))
    fmas = [line.strip() for line in asm.splitlines() if "vfmadd" in line]
    print(f"  the machine code numba made of it: {len(fmas)} vector fused multiply-adds ({G * NR} per k over the "
          f"passes; LLVM unrolls the k loops), e.g.")
    for line in fmas[:3]:
        print(f"    {line}")
    assert len(fmas) >= G * NR, f"expected {G * NR} vector FMAs per k, found {len(fmas)}"


def tile_runner(tile):
    """An njit function running one micro-kernel call on arrays (the kernel takes addresses)."""
    @njit
    def run(panel, rows, out):                # panel [G//V, K, V, LANES]
        tile(panel.ctypes.data, rows.ctypes.data, panel.shape[1], out.ctypes.data)
    return run


def check_micro_kernel(rng):
    for compute in ("float32", "float64"):
        for G, K in ((4, 37), (3, 5), (1, 1)):
            LANES, NR = microkernel.lanes_for(compute), microkernel.rows_for(G)
            run = tile_runner(microkernel.product_tile(compute, G, NR, LANES))
            panel = rng.standard_normal(microkernel.panel_shape(1, K, G, compute)[1:]).astype(compute)  # [G//V, K, V, LANES]
            source = rng.standard_normal((2 * NR, K)).astype(compute)
            picked = rng.permutation(2 * NR)[:NR]                  # rows anywhere: given by address
            out = np.empty((G, NR, LANES), compute)
            run(panel, np.array([source[i].ctypes.data for i in picked], np.int64), out)
            want = np.einsum("pkvu,rk->pvru", panel.astype(np.float64),
                             source[picked].astype(np.float64)).reshape(G, NR, LANES)
            err = relative_error(out, want)
            assert err < (1e-12 if compute == "float64" else 1e-6), (compute, G, K, err)
            print(f"    {compute} G={G} NR={NR} K={K:>2}: out[g, r, u] = sum_k panel[g//V, k, g%V, u] row_r[k], "
                  f"rel. error {err:.1e}")


def check_whole_op(quick):
    H, B, T = (20, 6, 5) if quick else (40, 9, 12)
    lengths = [T, 0, 3, T, 1, 2, 4, T, 2][:B]
    for mode in ("lstm", "gru"):
        cfg = rnn_config(2, H, 7, mode, direction="bidirectional")
        case = make_rnn_case(cfg, T, B, lengths, seed=4, dtype=np.float32)
        ref = run_forward(case, "reference")
        fused_out = run_forward(case, "cpu")
        with settings.override(cpu_fused=False):             # the BLAS loops (NUMBARNN_CPU_FUSED=0)
            blas_out = run_forward(case, "cpu")
        e_f, e_b = relative_error(fused_out[0], ref[0]), relative_error(blas_out[0], ref[0])
        assert e_f < 1e-5 and e_b < 1e-5, (e_f, e_b)
        grads = [relative_error(a, b) for a, b in zip(run_backward(case, fused_out, "cpu"),
                                                      run_backward(case, ref, "reference")) if a is not None]
        assert max(grads) < 1e-4, grads
        print(f"    {mode} 2 layers bidirectional H={H} B={B} lengths={lengths}: output rel. error fused "
              f"{e_f:.1e}, BLAS loop {e_b:.1e}; gradients {max(grads):.1e}")


def benchmark(quick):
    T, B, H, G = (20, 8, 128, 4) if quick else (100, 32, 512, 4)
    reps = 3 if quick else 7
    ct = np.float32
    LANES, NR = microkernel.lanes_for(ct), microkernel.rows_for(G)
    tile = microkernel.product_tile("float32", G, NR, LANES)
    rng = np.random.default_rng(0)
    R = (rng.standard_normal((G * H, H)) * 0.05).astype(ct)
    h = rng.standard_normal((B, H)).astype(ct)
    Rp = np.empty(microkernel.panel_shape(-(-H // LANES), H, G, ct), ct)   # [NT, G//V, H, V, LANES]
    microkernel.pack(R, Rp)
    rows = np.array([[h[min(i + r, B - 1)].ctypes.data for r in range(NR)] for i in range(0, B, NR)], np.int64)
    out = np.empty((Rp.shape[0], rows.shape[0], G, NR, LANES), ct)

    @njit
    def steps(Rp, rows, out, T):
        panel = Rp[0].size * 4
        for _ in range(T):
            for bt in range(rows.shape[0]):
                for jt in range(Rp.shape[0]):
                    tile(Rp.ctypes.data + jt * panel, rows[bt].ctypes.data, Rp.shape[2], out[jt, bt].ctypes.data)

    hT, ghT = np.ascontiguousarray(h.T), np.empty((G * H, B), ct)
    steps(Rp, rows, out, 1)

    def best(fn):
        times = []
        for _ in range(reps):
            time.sleep(0.1)                       # OpenBLAS's threads spin ~0.1 s after a call
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    flops = 2.0 * G * H * H * B * T
    mk = best(lambda: steps(Rp, rows, out, T))
    ob = best(lambda: [np.matmul(R, hT, out=ghT) for _ in range(T)])
    print(f"  R h^T for {T} steps, H={H} B={B} float32, best of {reps}:")
    print(f"    micro-kernel, one thread        {mk:8.2f} ms  {flops / mk / 1e6:6.1f} GFLOP/s")
    print(f"    OpenBLAS np.matmul (its threads) {ob:8.2f} ms  {flops / ob / 1e6:6.1f} GFLOP/s")
    print("  (`python bench/bench_cpu_fused.py`, H=512 B=32 T=100: on a Zen 4 core (AVX-512) one thread 58.9 ms ="
          " 114 GFLOP/s, two 29.6 ms, OpenBLAS 39.0 ms; on Zen 3 (AVX2) one thread 73.7 ms, two 38.6 ms, OpenBLAS"
          " 47.6 ms; `--tile-shapes` times the tile shapes one by one)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    rng = np.random.default_rng(8)
    print("1. the micro-kernel")
    show_micro_kernel()
    print("2. the micro-kernel against NumPy")
    check_micro_kernel(rng)
    print("3. the fused loops in the whole op, against the reference and the BLAS loop")
    check_whole_op(quick)
    print("4. benchmark")
    benchmark(quick)
    print("tutorial 08: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

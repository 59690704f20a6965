"""Tutorial 07: the step kernels v1 -> v2 -> v3, or who reads the recurrent matrix, and how often.

    python tutorials/07_step_kernel_versions.py            # full run
    python tutorials/07_step_kernel_versions.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
Everything in an RNN layer parallelises over time except the recurrent product: at every step s

    gh[b, g*H + j] = sum_k R[g*H + j, k] h_{s-1}[b, k]        (forward: R is [G*H, P])
    dh[b, k]       = sum_{g,j} dgh_{s+1}[b, g*H + j] R[g*H + j, k]   (backward: the same R, the other way)

and step s needs step s-1's h.  R is the one large operand (G*H*P values: 4 MB for an fp32 LSTM at H = 512),
and it is the same at every step.  So the question that separates a slow step kernel from a fast one is how
many times each step moves R from memory, and how many launches the time loop costs:

    v1  cell_steps.py   one thread per (row b, unit j) walks its G rows of R alone: every batch row re-reads
                        all of R (B x |R| per step), and neighbouring threads read addresses a row apart
    v2  step_v2.py      a block computes a tile of units x all gates x a tile of rows as a small GEMM, staging
                        R and h through shared memory with coalesced loads: ceil(B / TB) x |R| per step
    v3  step_v3.py      persistent: one launch per layer, each block keeps its slice of R (forward: the rows of
                        its units; backward: the columns) in shared memory for ALL steps, with a grid-wide
                        barrier between steps: |R| once per layer; the same slice in a wider block (more
                        row groups: a small batch splits K over them) where that is co-resident

Where the versions plug in: for one call the driver first builds its launch plan (numbarnn/kernels/plan.py: a
list of launches as data, the step launches from the version's row of steps.STEP_KERNELS), then runs that list;
`numbarnn explain` prints the same plan's rows.  Section 3 below shows a plan's step rows next to the launches
the driver counted.

This script prints what changed at each version (from the modules' own docstrings), COUNTS the reads of R
(in the CUDA simulator every element read of R goes through a Python object that records it), runs the whole
op at every version against the NumPy reference with the launches per layer, and times the versions.
Letters: T time, B batch, H units, P = H (no projection), G gates, D directions.
"""
from __future__ import annotations

import argparse
import os
import sys

from numbarnn.device import use_simulator_unless_gpu  # imports no numba

# numba reads NUMBA_ENABLE_CUDASIM once, at import: without a GPU, choose the simulator before importing it.
use_simulator_unless_gpu()

import numpy as np  # noqa: E402
from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from numbarnn.cells import get_cell  # noqa: E402
from numbarnn.config import rnn_config  # noqa: E402
from numbarnn.kernels import driver, step_v2, step_v3, v3_slices  # noqa: E402
from numbarnn.kernels.plan import plan_rows  # noqa: E402
from numbarnn.kernels.cell_steps import FORWARD_ARGS, make_forward_step, used_args  # noqa: E402
from numbarnn.kernels.common import acc_dtype, jit  # noqa: E402
from numbarnn.kernels.simulator import CountingMatrix  # noqa: E402  (R as an object that records each read)
from numbarnn.measure import timed_ms  # noqa: E402
from numbarnn.testing import make_rnn_case, relative_error, run_backward, run_forward  # noqa: E402
from numbarnn.verify import TOLERANCES  # noqa: E402

SIM = bool(numba_config.ENABLE_CUDASIM)
LSTM = get_cell("lstm")


def device_name() -> str:
    if SIM:
        return "numba CUDA simulator (no GPU: one Python thread per CUDA thread, timings are not GPU timings)"
    name = cuda.get_current_device().name
    return "GPU " + (name.decode() if isinstance(name, bytes) else str(name))


# ---------------------------------------------------------------------------------------------------
# 1. What changed, from the source
# ---------------------------------------------------------------------------------------------------

def what_changed(module) -> str:
    """The paragraph of a module's docstring that starts with 'What changed from'."""
    doc = module.__doc__
    start = doc.index("What changed from")
    return " ".join(doc[start:doc.index("\n\n", start)].split())


def show_versions():
    print("  v1 (numbarnn/kernels/cell_steps.py): one thread per (direction, row, unit); its loop over k reads "
          "R[g*H+j, k] for its own unit, so every row's threads read all of R again")
    for number, module in ((2, step_v2), (3, step_v3)):
        text = what_changed(module)
        print(f"  v{number} (numbarnn/kernels/{module.__name__.rsplit('.', 1)[1]}.py): {text[:600]}"
              + (" ..." if len(text) > 600 else ""))


# ---------------------------------------------------------------------------------------------------
# 2. Who reads R: counted in the simulator
# ---------------------------------------------------------------------------------------------------

def layer_arrays(H, B, T, rng):
    """Device arrays of one LSTM layer's forward (one direction, every row T steps long), R counted."""
    G, dt, acc = LSTM.G, "float64", acc_dtype("float64")
    to = cuda.to_device
    R = rng.standard_normal((G * H, H)) * 0.5                                   # [G*H, P]
    return dict(lens=to(np.full(B, T, np.int32)), gx=to(rng.standard_normal((1, T, B, G * H))),
                unit_params=to(0.1 * rng.standard_normal((1, 2 * G, H))), R_fwd=CountingMatrix(R), R_rev=CountingMatrix(R),
                h_in=to(rng.standard_normal((1, B, H)).astype(acc)), h_out=to(np.zeros((1, B, H), acc)),
                c=to(rng.standard_normal((1, B, H)).astype(acc)), y=to(np.zeros((T, B, H), dt)),
                acts=to(np.zeros((1, T, B, LSTM.S * H), dt)), cs=to(np.zeros((1, T, B, H), dt)), ms=None)


def count_forward_reads(H, B, T, rng):
    """R reads of T forward steps at each version; the h each leaves behind, to compare."""
    names = used_args(FORWARD_ARGS, LSTM, False)
    t2, sl = step_v2.SIM_TILES, v3_slices.SIM_SLICE
    versions = {
        "v1": (jit(make_forward_step, LSTM, "float64", False), (1, B, 1), H),
        "v2": (jit(step_v2.make_forward_step_v2, LSTM, "float64", False, t2), step_v2.grid(H, B, 1, t2), t2.threads),
        "v3 per step": (jit(step_v3.make_forward_step_v3, LSTM, "float64", sl), (-(-H // sl.TJ), 1, 1), sl.threads),
    }
    out = {}
    for name, (kernel, grid, block) in versions.items():
        a = layer_arrays(H, B, T, np.random.default_rng(rng))
        for s in range(T):
            a.update(s=s)
            kernel[grid, block](*[a[n] for n in names])
            a["h_in"], a["h_out"] = a["h_out"], a["h_in"]
        out[name] = (len(a["R_fwd"].reads), a["h_in"].copy_to_host())
    out["v3 persistent"] = run_persistent_forward(H, B, T, rng, sl)
    return out


def run_persistent_forward(H, B, T, rng, sl):
    """All T forward steps in one cooperative launch of v3's persistent kernel with slice `sl`: (R reads, h)."""
    a = layer_arrays(H, B, T, np.random.default_rng(rng))
    a.update(steps=T, h_a=a["h_in"], h_b=a["h_out"])
    kernel = jit(step_v3.make_forward_persistent_v3, LSTM, "float64", sl)
    kernel[(-(-H // sl.TJ), 1, 1), sl.threads](*[a[n] for n in used_args(step_v3.PERSISTENT_ARGS, LSTM, False)])
    return len(a["R_fwd"].reads), (a["h_b"] if T % 2 else a["h_a"]).copy_to_host()


def count_backward_reads(H, B, T, rng):
    """R reads of a layer's backward time loop (T steps + the pass that finishes dh0): v2's fused step kernel,
    one launch per step, and v3's persistent kernel, one launch; and the dh0 each leaves."""
    G, S, acc = LSTM.G, LSTM.S, acc_dtype("float64")
    t2, sl = step_v2.SIM_TILES, v3_slices.SIM_SLICE
    to = cuda.to_device
    out = {}
    for name in ("v2", "v3 persistent"):
        r = np.random.default_rng(rng)
        R = CountingMatrix(r.standard_normal((G * H, H)) * 0.5)
        a = dict(lens=to(np.full(B, T, np.int32)), dy=to(r.standard_normal((T, B, H))),
                 y=to(r.standard_normal((T, B, H))),
                 h0=to(r.standard_normal((1, B, H))), c0=to(r.standard_normal((1, B, H))),
                 acts=to(r.uniform(0.1, 0.9, (1, T, B, S * H))), cs=to(r.standard_normal((1, T, B, H))),
                 unit_params=None, R_fwd=R, R_rev=R, dh=to(np.zeros((1, B, H), acc)), dc=to(np.zeros((1, B, H), acc)),
                 dgx=to(np.zeros((1, T, B, G * H))), dgh=to(np.zeros((1, T, B, G * H))), dvec=None,
                 h_prev=to(np.zeros((1, T, B, H))))
        if name == "v2":
            kernel = jit(step_v2.make_backward_step_v2, LSTM, "float64", t2)
            for s in range(T - 1, -2, -1):
                a.update(s=s)
                kernel[step_v2.grid(H, B, 1, t2), t2.threads](*[a[n] for n in step_v2.backward_v2_args(LSTM)])
        else:
            a.update(steps=T)
            kernel = jit(step_v3.make_backward_persistent_v3, LSTM, "float64", sl)
            kernel[(-(-H // sl.TJ), 1, 1), sl.threads](
                *[a[n] for n in used_args(step_v3.PERSISTENT_BACKWARD_ARGS, LSTM, False)])
        out[name] = (len(R.reads), a["dh"].copy_to_host())
    return out


def count_reads(quick: bool, rng_seed: int):
    if not SIM:
        print("  (counting needs the simulator, which hands the kernels a Python object for R: run with "
              "NUMBARNN_REAL_GPU=0; on a GPU `numbarnn profile --step-version 1|2` measures the same)")
        return
    sl, t2 = v3_slices.SIM_SLICE, step_v2.SIM_TILES
    H, B, T = sl.TJ, 5, 3                     # H = TJ: one block of units, the whole R in one slice
    size = LSTM.G * H * H
    got = count_forward_reads(H, B, T, rng_seed)
    print(f"  LSTM H = P = {H}, B = {B}, T = {T} forward steps, |R| = {size} elements; simulator tiles: v2 TB = "
          f"{t2.TB} rows per block, v3 TJ = {sl.TJ} units per block")
    expected = {"v1": T * B * size, "v2": T * -(-B // t2.TB) * size, "v3 per step": T * size,
                "v3 persistent": size}
    why = {"v1": "B x |R| per step", "v2": "ceil(B/TB) x |R| per step",
           "v3 per step": "|R| per launch (the slice is loaded by every launch)",
           "v3 persistent": "|R| once for all T steps"}
    h_ref = got["v1"][1]
    for name, (reads, h) in got.items():
        assert reads == expected[name], f"{name}: {reads} reads of R, expected {expected[name]}"
        assert relative_error(h, h_ref) < 1e-13, f"{name}: h differs from v1's"
        print(f"    {name:<14} {reads:>5} element reads of R = {reads / size:4.1f} x |R| in {T} steps  ({why[name]})")
    print("    every version leaves the same h (to 1e-13)")
    got = count_backward_reads(H, B, T, rng_seed)
    expected = {"v2": (T + 1) * -(-B // t2.TB) * size, "v3 persistent": size}
    why = {"v2": f"ceil(B/TB) x |R| per launch, {T} + 1 launches", "v3 persistent": "R's columns once"}
    assert relative_error(got["v3 persistent"][1], got["v2"][1]) < 1e-13, "v3's dh0 differs from v2's"
    print(f"  the backward's dh = dgh R over the same {T} steps (+ the pass that finishes dh0):")
    for name, (reads, _) in got.items():
        assert reads == expected[name], f"backward {name}: {reads} reads of R, expected {expected[name]}"
        print(f"    {name:<14} {reads:>5} element reads of R = {reads / size:4.1f} x |R|  ({why[name]})")
    print("    both leave the same dh0 (to 1e-13)")


# ---------------------------------------------------------------------------------------------------
# 2b. The same slice in a wider block
# ---------------------------------------------------------------------------------------------------

def wider_blocks(rng):
    """v3's block of THREADS threads holds TJ units x THREADS // TJ rows.  A batch smaller than that leaves row
    groups idle, which split K instead (each sums a share of the chunks, then the shares are added); a wider
    block of the same slice has more row groups, so more splits and fewer rounds of products a thread, and an SM
    more warps to hide their latency.  v3_slices.widths lists the widths that help; step_v3.choose runs the widest
    that is co-resident on the device.  Here: what it picks on an H100 (from the register estimate, as choose
    does before compiling), then the persistent forward run both ways, which must leave the same h."""
    from numbarnn.kernels.gpus import GPUS
    gpu = GPUS["H100 SXM"]
    print(f"  on an {gpu.name} ({gpu.sms} SMs), LSTM float32 forward: rounds of products a thread runs per step")
    for H, B in ((768, 16), (256, 4), (512, 32), (1024, 64)):
        base = v3_slices.plan(LSTM.G, H, H, "float32", simulator=False)
        wide = v3_slices.v3_co_residency(gpu, H, H, LSTM.G, 1, "float32", B=B)[0]
        print(f"    H = {H:<4} B = {B:<3} TJ = {base.TJ}: {base.threads} threads {v3_slices.v3_rounds(B, base):>3} "
              f"rounds -> {wide.threads} threads {v3_slices.v3_rounds(B, wide):>3} rounds")
    # in the simulator: one block of TJ = 3 units, B = 2 rows; 2 row groups of 1 row (6 threads, no idle row
    # group: 3 rounds of chunks) against 4 (12 threads: 2 splits, 2 rounds)
    narrow = v3_slices.SIM_SLICE._replace(RG=2, RB=1)
    wide = narrow._replace(RG=4)
    H, B, T = narrow.TJ, 2, 3
    h = {}
    for sl in (narrow, wide):
        h[sl.threads] = run_persistent_forward(H, B, T, rng, sl)[1]
        splits = v3_slices.v3_splits(B, sl)[0][1]
        print(f"    simulator, H = {H}, B = {B}: {sl.threads} threads, {splits} split(s) of K, "
              f"{v3_slices.v3_rounds(B, sl)} rounds a thread")
    assert relative_error(h[wide.threads], h[narrow.threads]) < 1e-13, "the wider block's h differs"
    print("    both leave the same h (to 1e-13)")


# ---------------------------------------------------------------------------------------------------
# 3. The whole op at every version: same answers, fewer launches
# ---------------------------------------------------------------------------------------------------

def check_versions(quick: bool):
    """Forward + backward of a 2-layer LSTM with ragged lengths (one of them 0) at each step version, against
    the float64 NumPy reference; the launches per layer each version makes."""
    H = v3_slices.SIM_SLICE.TJ + 2 if SIM else 96      # simulator: 2 blocks of TJ = 3 units per direction
    T, B = (4, 5) if SIM else (20, 7)
    lengths = [T, 1, 0, T - 1, 2][:B] + [T] * max(0, B - 5)
    direction = "bidirectional"
    cfg = rnn_config(2, H, 4, "lstm", direction=direction)
    case = make_rnn_case(cfg, T, B, lengths, seed=7)
    ref_fwd = run_forward(case, "reference")
    ref_bwd = run_backward(case, ref_fwd, "reference")
    tol, _ = TOLERANCES[np.dtype(np.float64)]
    print(f"  2-layer {direction} LSTM, H = {H}, T = {T}, B = {B}, lengths {lengths}, float64:")
    for v in driver.STEP_VERSIONS:
        with driver.pinned_step_version(v):
            fwd = run_forward(case, "cuda")
            bwd = run_backward(case, fwd, "cuda")
        for name, got, want in (("y", fwd[0], ref_fwd[0]), ("hT", fwd[1], ref_fwd[1]), ("cT", fwd[2], ref_fwd[2]),
                                ("dx", bwd[0], ref_bwd[0]), ("dh0", bwd[1], ref_bwd[1]), ("dc0", bwd[2], ref_bwd[2]),
                                ("dparams", bwd[3], ref_bwd[3])):
            err = relative_error(got, want)
            assert err <= tol, f"v{v} {name}: relative error {err:.1e} against the reference"
        log = driver.last_launch_count()
        lf, lb = log["forward"], log["backward"]
        step_f = sum(n for k, n in lf.by_kernel.items() if "step" in k or "persistent" in k) // cfg.L
        step_b = sum(n for k, n in lb.by_kernel.items() if "step" in k or "persistent" in k or "recurrent" in k)
        assert lf.step_version == lb.step_version == v, (lf, lb)
        print(f"    v{v}: every output and gradient equals the reference to {tol:.0e}; time-loop launches per layer: "
              f"forward {step_f}, backward {step_b // cfg.L} (max len {max(lengths)})"
              + (f"; {lf.note}" if lf.note else ""))
        # the plan the driver ran: a step kernel is one entry for all its steps (e.steps), whatever its launches
        step_kernels = {e.label for e in lf.plan + lb.plan if e.steps is not None}
        rows = [r for r in plan_rows(lf.plan + lb.plan) if r["layer"] == 0 and r["kernel"] in step_kernels]
        print("      layer 0's step launches, from its plan: "
              + ", ".join(f"{r['kernel']} x {r['launches']} ({'x'.join(map(str, r['grid']))} blocks of {r['block']})"
                          for r in rows))
        if v == 3:
            assert step_f == 1 and step_b == cfg.L, "v3: one persistent launch per layer and phase"
    # with a projection (h' = W_proj m) v3 still makes one launch per layer and phase: each step runs in two
    # phases, the cell for the block's units, then h' for its share of the P projected outputs, with a grid
    # barrier after each (a second slice in shared memory: W_proj's rows forward, R's columns backward)
    cfg2 = rnn_config(1, H, 4, "lstm", num_proj=2)
    case2 = make_rnn_case(cfg2, 3, 4, [3, 1, 0, 2], seed=8)
    ref2 = run_forward(case2, "reference")
    ref2_bwd = run_backward(case2, ref2, "reference")
    with driver.pinned_step_version(3):
        got2 = run_forward(case2, "cuda")
        got2_bwd = run_backward(case2, got2, "cuda")
    lf, lb = driver.last_launch_count()["forward"], driver.last_launch_count()["backward"]
    for got_, want_ in ((got2[0], ref2[0]), (got2_bwd[0], ref2_bwd[0]), (got2_bwd[3], ref2_bwd[3])):
        assert relative_error(got_, want_) <= tol, "v3 with a projection differs from the reference"
    assert lf.step_version == lb.step_version == 3 and "project" not in lf.by_kernel, (lf, lb)
    print(f"    v3 with a projection (num_proj = 2): y, dx, dparams equal the reference; {lf.note}")
    # where v3 cannot run, the driver says so and runs v2: here the R slice does not fit in shared memory
    # (the simulator's slices hold 6 columns; a GPU's 40 KiB); also when the blocks cannot all be co-resident
    H3 = v3_slices.SIM_SLICE.KMAX + 1 if SIM else 4096
    case3 = make_rnn_case(rnn_config(1, H3, 4, "lstm"), 2, 3, [2, 1, 0], seed=8)
    with driver.pinned_step_version(3):
        run_forward(case3, "cuda")
    note = driver.last_launch_count()["forward"]
    assert note.step_version == 2, note
    print(f"    v3 at H = {H3} falls back to v2: {note.note}")


# ---------------------------------------------------------------------------------------------------
# 4. Benchmark
# ---------------------------------------------------------------------------------------------------

def benchmark(quick: bool):
    if SIM:
        shapes, reps = [(v3_slices.SIM_SLICE.TJ, 2, 4 if quick else 8)], 1
    else:
        shapes = [(256, 8, 100)] if quick else [(512, 32, 100), (256, 4, 1000), (768, 16, 256)]
        reps = 3 if quick else 5
    print(f"  device: {device_name()}; LSTM float32, one layer, I = H; median of {reps}"
          + ("" if SIM else " after a warm-up") + "; the reference backend (NumPy, float64 inside) alongside")
    print(f"    {'H x B x T':>14}  {'backend':<14} {'fwd ms':>9} {'fwd+bwd ms':>11}")
    for H, B, T in shapes:
        cfg = rnn_config(1, H, H, "lstm")
        case = make_rnn_case(cfg, T, B, seed=1, dtype=np.float32)
        rows = []
        for label, backend, version in [("reference", "reference", None)] + [(f"cuda v{v}", "cuda", v)
                                                                             for v in driver.STEP_VERSIONS]:
            with driver.pinned_step_version(version):
                fwd_ms = timed_ms(lambda c=case, b=backend: run_forward(c, b), reps)
                both_ms = timed_ms(lambda c=case, b=backend: run_backward(c, run_forward(c, b), b), reps)
                ran = driver.last_launch_count()["forward"].step_version if backend == "cuda" else None
            rows.append((label + (f" (ran v{ran})" if ran not in (None, version) else ""), fwd_ms, both_ms))
        for label, f, fb in rows:
            print(f"    {f'{H} x {B} x {T}':>14}  {label:<14} {f:9.2f} {fb:11.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    print(f"running on: {device_name()}")
    print("1. what changed from v1 to v3")
    show_versions()
    print("2. who reads R, counted")
    count_reads(quick, 11)
    print("2b. the same slice in a wider block")
    wider_blocks(12)
    print("3. the whole op at every version: the same answers, fewer launches")
    check_versions(quick)
    print("4. benchmark")
    benchmark(quick)
    print("tutorial 07: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

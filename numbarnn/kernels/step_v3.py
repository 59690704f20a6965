"""Step kernel v3: persistent forward and backward, one launch per layer for all T steps (issue 8 item 3).

What changed from v2 and why: v2 reads R from global memory once per step (ceil(B/TB) x |R|) and pays a launch
per step.  v3 gives each block a fixed slice of TJ hidden units (x all G gates, x every batch row, one
direction) and loads that slice of R into shared memory once; then the block loops over the steps itself,
with a grid-wide barrier (`cuda.cg.this_grid().sync()`, a cooperative launch) between steps, because step
s+1 needs every unit's h from step s.  R crosses the memory bus once per layer instead of once per step.

    forward_persistent_v3     grid (ceil(H/TJ), 1, D), TJ*RG threads, one launch per layer
        R_slice = R[g*H + j0 .. j0+TJ-1, :] for every gate g               once, coalesced along k
        for s in 0 .. steps-1:  step_body(s, h_a or h_b -> h_b or h_a) ; grid.sync()
    forward_step_v3           the same step body, one launch per step (loads its slice every launch): the
                              body tested step by step against v1 on many blocks.  (numba's simulator runs
                              cooperative grids of one block only; numbarnn's fix to it, kernels/simulator.py,
                              runs all blocks of a cooperative launch at once, so the persistent loop is
                              tested on many blocks too.)

step_body: for each tile of TB rows, h is staged through shared memory in K-chunks of KC (coalesced, loads in
flight: `step_v2.make_stage_rows`), the product comes from the R slice in shared memory (rows padded by one
column, like the h tile's: no bank conflicts), and the cell's pointwise forward is v2's epilogue
(`step_v2.make_forward_epilogue`).

The backward mirrors it (`make_backward_body`): dh = dgh_{s+1} R needs the COLUMNS of R for the block's units,
kept in the same layout, so the product loop is the forward's; dgh of step s+1 (every gate, written by every
block before the barrier) is staged like h (`step_v2.make_stage_steps`), and the cell's backward is v2's
epilogue (`step_v2.make_backward_epilogue`).  Steps run s = steps-1 .. 0, then s = -1 finishes dh0.

    backward_persistent_v3    grid (ceil(H/TJ), 1, D), one launch per layer, v2's arguments with steps for s
        R_slice[g*TJ + jj, k] = R[g*H + k, j0+jj]                           once
        for s in steps-1 .. -1:  step_body(s) ; grid.sync() (not after -1)
    backward_step_v3          the same body, one launch per step (the many-block test)

On an H100 (bench/results/gpu_h100.md) v3 ran correctly from the first launch (384 co-resident blocks at
H=768) and was faster than v2 at every measured shape (768x16x1024 forward: 80 ms, v2 184 ms, cuDNN 21 ms), so
the driver runs it by default on a GPU.  What limits it now: ~95 us per step at H=768 B=16, each thread's
serial K loop and the h staging of every step (a split of K over more threads is the next version).

The slice must fit: G*TJ*(KMAX+1) compute-dtype values of static shared memory (at most 48 KiB, 40 KiB
used here), and every block must be resident at once (a cooperative launch of more blocks fails).
`plan(...)` picks TJ for a shape; the driver asks the device how many blocks can be co-resident and falls
back to v2 otherwise, saying why (per phase: the backward kernel has its own registers).  No projection
(h' = W_proj m would need a second barrier per step): v2.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from numba import cuda

from ..cells import get_cell
from .cell_steps import FORWARD_ARGS, REPORTED_CELLS, _wrap, signature
from . import common  # common.SIMULATOR read at call time (the profiler's GPU geometry sets it)
from .common import DTYPES, SIMULATOR, acc_dtype
from .step_v2 import (BACKWARD_V2_ARGS, LOADS_IN_FLIGHT, make_backward_epilogue, make_forward_epilogue,
                      make_stage_rows, make_stage_steps)


if SIMULATOR:
    @cuda.jit(device=True, inline="always")
    def grid_sync():
        cuda.cg.this_grid().sync()
else:
    # what `cuda.cg.this_grid().sync()` lowers to; the public overloads compile "for the current device",
    # which needs a GPU, so the kernel report (no GPU) could not compile them; the intrinsics need none
    from numba.cuda.cg import _grid_group_sync, _this_grid

    @cuda.jit(device=True, inline="always")
    def grid_sync():
        _grid_group_sync(_this_grid())


def _cooperative(kernel):
    """Mark a kernel function as a cooperative launch (a grid barrier): numba's CUDA simulator, with numbarnn's
    fix (numbarnn/kernels/simulator.py), then runs all its blocks at once.  Nothing changes on a GPU."""
    kernel.cooperative = True
    return kernel


class Slice(NamedTuple):
    """A v3 block: TJ units x all gates, rows TB = RG*RB at a time, h staged KC columns at a time, R slice
    capacity KMAX columns (>= P)."""

    TJ: int
    RG: int
    RB: int
    KC: int
    KMAX: int

    @property
    def TB(self) -> int:
        return self.RG * self.RB

    @property
    def threads(self) -> int:
        return self.TJ * self.RG


SIM_SLICE = Slice(TJ=3, RG=2, RB=2, KC=2, KMAX=6)
SMEM_BUDGET = 40 * 1024          # bytes of static shared memory for the R slice (the limit is 48 KiB)
THREADS = 64


def slice_bytes(G: int, sl: Slice, dtype) -> int:
    """Shared memory of a block: the R slice (padded rows) and the h tile, in the compute dtype."""
    size = acc_dtype(dtype).itemsize
    return (G * sl.TJ * (sl.KMAX + 1) + sl.TB * h_pitch(sl)) * size


def h_pitch(sl: Slice) -> int:
    """Words between rows of the h tile: KC + 1.  A warp's 32 / TJ row groups read column kk of different rows
    at once; with rows KC = 32 words apart they would all hit one bank (a 32/TJ-way conflict, 16-way at TJ = 2,
    found by the profiler's model); one word of padding puts each row in its own bank."""
    return sl.KC + 1


def plan(G: int, H: int, P: int, dtype, simulator: bool | None = None) -> Slice | None:
    """The slice for a layer: the largest TJ (16, 8, 4, 2, 1) whose R slice fits SMEM_BUDGET, or None.
    In the simulator: SIM_SLICE when P fits it."""
    if common.SIMULATOR if simulator is None else simulator:
        return SIM_SLICE if P <= SIM_SLICE.KMAX else None
    kmax = -(-P // 32) * 32
    for TJ in (16, 8, 4, 2, 1):
        sl = Slice(TJ=TJ, RG=THREADS // TJ, RB=1, KC=32, KMAX=kmax)
        if slice_bytes(G, sl, dtype) <= SMEM_BUDGET and TJ <= max(H, 1):
            return sl
    return None


def blocks_needed(H: int, D: int, sl: Slice) -> int:
    return -(-H // sl.TJ) * D


PERSISTENT_ARGS = tuple(
    {"s": ("steps", "i64", 0, "steps to run: max(len)", row[4]),
     "h_in": ("h_a", "a", 3, "[D, B, P] h entering even steps (h0 in; hT out when steps is even)", row[4]),
     "h_out": ("h_b", "a", 3, "[D, B, P] h entering odd steps", row[4])}.get(row[0], row)
    for row in FORWARD_ARGS if row[0] != "ms")


@functools.lru_cache(maxsize=None)
def make_step_body(cell, dtype, sl: Slice):
    """Device functions (load_slice, step_body) shared by the per-step and the persistent kernel."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G = cell.G
    TJ, RB, KC, TB, NT, U = sl.TJ, sl.RB, sl.KC, sl.TB, sl.threads, LOADS_IN_FLIGHT
    GJ = G * TJ
    RS = NT // KC                                       # staging h: rows apart of one thread's elements
    assert NT % KC == 0, "staging needs whole rows of KC columns per pass"
    stage_h = make_stage_rows(dtype, TB, RS)
    epilogue = make_forward_epilogue(cell, dtype, RB)

    @cuda.jit(device=True, inline="always")
    def load_slice(R, R_slice, j0, H, P):
        """R_slice[g*TJ + jj, k] = R[g*H + j0+jj, k]: consecutive threads read consecutive k."""
        tid = cuda.threadIdx.x
        buf = cuda.local.array(U, acc)
        for e0 in range(tid, GJ * P, NT * U):           # U loads in flight, then U stores
            for u in range(U):
                e = e0 + u * NT
                j = j0 + e // P % TJ
                buf[u] = acc(R[e // P // TJ * H + j, e % P]) if e < GJ * P and j < H else zero
            for u in range(U):
                e = e0 + u * NT
                if e < GJ * P:
                    R_slice[e // P, e % P] = buf[u]
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def step_body(s, lens, gx, unit_params, R_slice, h_in, h_out, c, y, acts, cs, h_tile, rh, r_k, j0, d):
        tid = cuda.threadIdx.x
        jj = tid % TJ
        rg = tid // TJ
        H = unit_params.shape[2]
        P = h_in.shape[2]
        B = lens.shape[0]
        buf = cuda.local.array(U, acc)                  # staged loads in flight (step_v2.LOADS_IN_FLIGHT)
        kc = tid % KC                                   # this thread's column of each staged h chunk
        r0 = tid // KC                                  # and its first row, then every RS-th row
        for b0 in range(0, B, TB):                      # every row of the batch, TB rows at a time
            for g in range(G):
                for r in range(RB):
                    rh[g, r] = zero
            for k0 in range(0, P, KC):
                k = k0 + kc
                stage_h(h_in, h_tile, buf, d, b0, k, kc, r0, B, P)   # coalesced along k, loads in flight
                cuda.syncthreads()
                for kk in range(min(KC, P - k0)):
                    for g in range(G):
                        r_k[g] = R_slice[g * TJ + jj, k0 + kk]
                    for r in range(RB):
                        hk = h_tile[rg * RB + r, kk]
                        for g in range(G):
                            rh[g, r] += r_k[g] * hk
                cuda.syncthreads()
            j = j0 + jj
            if j < H:
                epilogue(s, lens, gx, unit_params, h_in, h_out, c, y, acts, cs, None, rh, d, j, b0 + rg * RB)

    return load_slice, step_body


@functools.lru_cache(maxsize=None)
def make_forward_step_v3(cell, dtype, sl: Slice = SIM_SLICE):
    """The v3 step body as one launch per step (grid (ceil(H/TJ), 1, D)): the many-block test of the body."""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KMAX1, TB, HP, RB = G * sl.TJ, sl.KMAX + 1, sl.TB, h_pitch(sl), sl.RB
    load_slice, step_body = make_step_body(cell, dtype, sl)

    @cuda.jit(device=True, inline="always")
    def forward_body(s, lens, gx, unit_params, R_fwd, R_rev, h_in, h_out, c, y, acts, cs, ms):
        R_slice = cuda.shared.array((GJ, KMAX1), acc)
        h_tile = cuda.shared.array((TB, HP), acc)
        rh = cuda.local.array((G, RB), acc)
        r_k = cuda.local.array(G, acc)
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * sl.TJ
        load_slice(R_fwd if d == 0 else R_rev, R_slice, j0, unit_params.shape[2], h_in.shape[2])
        step_body(s, lens, gx, unit_params, R_slice, h_in, h_out, c, y, acts, cs, h_tile, rh, r_k, j0, d)

    return _wrap(f"{cell.name}_forward_step_v3", forward_body, FORWARD_ARGS, cell, False)


@functools.lru_cache(maxsize=None)
def make_forward_persistent_v3(cell, dtype, sl: Slice = SIM_SLICE):
    """All steps of a layer in one cooperative launch; h ping-pongs between h_a and h_b."""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KMAX1, TB, HP, RB = G * sl.TJ, sl.KMAX + 1, sl.TB, h_pitch(sl), sl.RB
    load_slice, step_body = make_step_body(cell, dtype, sl)

    @cuda.jit(device=True, inline="always")
    def persistent_body(steps, lens, gx, unit_params, R_fwd, R_rev, h_a, h_b, c, y, acts, cs):
        R_slice = cuda.shared.array((GJ, KMAX1), acc)   # this block's R, kept for all steps
        h_tile = cuda.shared.array((TB, HP), acc)
        rh = cuda.local.array((G, RB), acc)
        r_k = cuda.local.array(G, acc)
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * sl.TJ
        load_slice(R_fwd if d == 0 else R_rev, R_slice, j0, unit_params.shape[2], h_a.shape[2])
        for s in range(steps):
            h_in = h_a if s % 2 == 0 else h_b
            h_out = h_b if s % 2 == 0 else h_a
            step_body(s, lens, gx, unit_params, R_slice, h_in, h_out, c, y, acts, cs, h_tile, rh, r_k, j0, d)
            grid_sync()                                # every unit's h' is written before step s+1 reads it

    return _cooperative(_wrap(f"{cell.name}_forward_persistent_v3", persistent_body, PERSISTENT_ARGS, cell, False))


# ---------------------------------------------------------------------------------------------------
# backward: the same slices, the columns of R instead of its rows
# ---------------------------------------------------------------------------------------------------

PERSISTENT_BACKWARD_ARGS = tuple(
    ("steps", "i64", 0, "steps to run: max(len); the kernel runs s = steps-1 .. 0, then -1 (dh0)", row[4])
    if row[0] == "s" else row for row in BACKWARD_V2_ARGS)


@functools.lru_cache(maxsize=None)
def make_backward_body(cell, dtype, sl: Slice):
    """Device functions (load_columns, step_body) of the backward, shared by its per-step and persistent
    kernels.  A block owns the same TJ units as in the forward, but the backward's product runs the other
    way: dh[b, j] = sum_{g,k} dgh_{s+1}[b, g*H+k] R[g*H+k, j] needs the COLUMNS j0 .. j0+TJ-1 of R, again
    G*TJ*H values, kept as R_slice[g*TJ + jj, k] = R[g*H + k, j0+jj] (the forward slice's layout, so the
    product loop and its bank pattern are the forward's).  Then the cell's backward for those units is v2's
    epilogue (`step_v2.make_backward_epilogue`)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G = cell.G
    TJ, RB, KC, TB, NT, U = sl.TJ, sl.RB, sl.KC, sl.TB, sl.threads, LOADS_IN_FLIGHT
    RS = NT // KC                                       # staging dgh: rows apart of one thread's elements
    assert NT % KC == 0, "staging needs whole rows of KC columns per pass"
    stage_dgh = make_stage_steps(dtype, TB, RS)
    epilogue = make_backward_epilogue(cell, dtype, RB)

    @cuda.jit(device=True, inline="always")
    def load_columns(R, R_slice, j0, H):
        """R_slice[g*TJ + jj, k] = R[g*H + k, j0+jj]: consecutive threads read runs of TJ consecutive j (a
        one-off per launch: sector efficiency TJ*size/32 at worst, against T steps that read no R at all)."""
        tid = cuda.threadIdx.x
        buf = cuda.local.array(U, acc)
        n = G * H * TJ
        for e0 in range(tid, n, NT * U):                # U loads in flight, then U stores
            for u in range(U):
                e = e0 + u * NT
                j = j0 + e % TJ
                buf[u] = acc(R[e // TJ, j]) if e < n and j < H else zero
            for u in range(U):
                e = e0 + u * NT
                if e < n:
                    gk = e // TJ                        # the row of R: gate gk // H, unit k = gk % H
                    R_slice[gk // H * TJ + e % TJ, gk % H] = buf[u]
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def step_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, R_slice,
                  g_tile, from_R, j0, d):
        tid = cuda.threadIdx.x
        jj = tid % TJ
        rg = tid // TJ
        H = dgx.shape[3] // G
        B = lens.shape[0]
        buf = cuda.local.array(U, acc)                  # staged loads in flight (step_v2.LOADS_IN_FLIGHT)
        kc = tid % KC                                   # this thread's column of each staged dgh chunk
        r0 = tid // KC                                  # and its first row, then every RS-th row
        j = j0 + jj
        for b0 in range(0, B, TB):                      # every row of the batch, TB rows at a time
            for r in range(RB):
                from_R[r] = zero
            for g in range(G):
                for k0 in range(0, H, KC):
                    k = k0 + kc
                    # dgh of step s+1 (zeros where s+1 >= len[b]): written by every block before the barrier
                    stage_dgh(s + 1, lens, dgh, g_tile, buf, d, b0, g * H + k, k < H, kc, r0)
                    cuda.syncthreads()
                    for kk in range(min(KC, H - k0)):
                        rk = R_slice[g * TJ + jj, k0 + kk]
                        for r in range(RB):
                            from_R[r] += rk * g_tile[rg * RB + r, kk]   # a broadcast within the row group
                    cuda.syncthreads()
            if j < H:
                epilogue(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, from_R,
                         d, j, b0 + rg * RB)

    return load_columns, step_body


@functools.lru_cache(maxsize=None)
def make_backward_step_v3(cell, dtype, sl: Slice = SIM_SLICE):
    """The v3 backward body as one launch per step (grid (ceil(H/TJ), 1, D)), v2's arguments: the many-block
    test of the body (s = T-1 .. 0, then -1 to finish dh0, as v2's fused backward)."""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KMAX1, TB, HP, RB = G * sl.TJ, sl.KMAX + 1, sl.TB, h_pitch(sl), sl.RB
    load_columns, step_body = make_backward_body(cell, dtype, sl)

    @cuda.jit(device=True, inline="always")
    def backward_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, R_fwd, R_rev, dh, dc, dgx, dgh, dvec,
                      h_prev):
        R_slice = cuda.shared.array((GJ, KMAX1), acc)
        g_tile = cuda.shared.array((TB, HP), acc)
        from_R = cuda.local.array(RB, acc)
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * sl.TJ
        load_columns(R_fwd if d == 0 else R_rev, R_slice, j0, dgx.shape[3] // G)
        step_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, R_slice, g_tile,
                  from_R, j0, d)

    return _wrap(f"{cell.name}_backward_step_v3", backward_body, BACKWARD_V2_ARGS, cell, False)


@functools.lru_cache(maxsize=None)
def make_backward_persistent_v3(cell, dtype, sl: Slice = SIM_SLICE):
    """All steps of a layer's backward in one cooperative launch: s = steps-1 .. 0 with a grid barrier after
    each (step s reads every block's dgh of step s+1), then s = -1 finishes dh0.  dh stays in one buffer:
    the thread of (b, j) alone reads and writes it (v2's convention)."""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KMAX1, TB, HP, RB = G * sl.TJ, sl.KMAX + 1, sl.TB, h_pitch(sl), sl.RB
    load_columns, step_body = make_backward_body(cell, dtype, sl)

    @cuda.jit(device=True, inline="always")
    def persistent_body(steps, lens, dy, y, h0, c0, acts, cs, unit_params, R_fwd, R_rev, dh, dc, dgx, dgh, dvec,
                        h_prev):
        R_slice = cuda.shared.array((GJ, KMAX1), acc)   # this block's columns of R, kept for all steps
        g_tile = cuda.shared.array((TB, HP), acc)
        from_R = cuda.local.array(RB, acc)
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * sl.TJ
        load_columns(R_fwd if d == 0 else R_rev, R_slice, j0, dgx.shape[3] // G)
        for i in range(steps + 1):
            s = steps - 1 - i
            step_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, R_slice,
                      g_tile, from_R, j0, d)
            if s >= 0:
                grid_sync()                             # every unit's dgh of step s is written before s-1

    return _cooperative(_wrap(f"{cell.name}_backward_persistent_v3", persistent_body, PERSISTENT_BACKWARD_ARGS, cell,
                              False))


def gpu_slices(G: int, dtype) -> dict:
    """{H: Slice} of the report's shapes (H = P = 256, 512, 1024)."""
    return {H: plan(G, H, H, dtype, simulator=False) for H in (256, 512, 1024)}


def kernel_specs():
    """The persistent kernels (forward, backward) and their per-step variants for REPORTED_CELLS (no
    projection) at the slice of H = P = 512 (block = 64 threads).  The persistent ones link libcudadevrt.a
    (the report does that for every kernel with a grid barrier)."""
    import numbarnn.contrib.cifg_lstm  # registers the shipped user cells
    import numbarnn.contrib.peephole_lstm  # noqa: F401
    specs = []
    for dt in DTYPES:
        for cell in map(get_cell, REPORTED_CELLS):
            sl = plan(cell.G, 512, 512, dt, simulator=False)
            specs.append((f"{cell.name}_forward_step_v3", dt, make_forward_step_v3(cell, dt, sl),
                          signature(FORWARD_ARGS, cell, dt, False), sl.threads))
            specs.append((f"{cell.name}_forward_persistent_v3", dt, make_forward_persistent_v3(cell, dt, sl),
                          signature(PERSISTENT_ARGS, cell, dt, False), sl.threads))
            specs.append((f"{cell.name}_backward_step_v3", dt, make_backward_step_v3(cell, dt, sl),
                          signature(BACKWARD_V2_ARGS, cell, dt, False), sl.threads))
            specs.append((f"{cell.name}_backward_persistent_v3", dt, make_backward_persistent_v3(cell, dt, sl),
                          signature(PERSISTENT_BACKWARD_ARGS, cell, dt, False), sl.threads))
    return specs


__all__ = ["Slice", "SIM_SLICE", "plan", "blocks_needed", "slice_bytes", "make_forward_step_v3",
           "make_forward_persistent_v3", "make_backward_step_v3", "make_backward_persistent_v3", "PERSISTENT_ARGS",
           "PERSISTENT_BACKWARD_ARGS", "gpu_slices", "kernel_specs", "choose"]


#: the persistent kernel of each phase and its argument table
PERSISTENT = {"forward": (make_forward_persistent_v3, PERSISTENT_ARGS),
              "backward": (make_backward_persistent_v3, PERSISTENT_BACKWARD_ARGS)}


def choose(cell, dtype, H: int, P: int, D: int, has_proj: bool, simulator: bool | None = None,
           phase: str = "forward"):
    """(Slice, why) when the persistent kernel of `phase` ("forward" or "backward") can run this layer, else
    (None, why not).

    It can when there is no projection, the R slice fits (`plan`; the backward's column slice has the same
    size) and every block is co-resident: on a GPU the device says how many blocks of the compiled kernel fit
    at once (max_cooperative_grid_blocks, from its registers and shared memory and the SM count: the two
    phases' kernels differ in registers); the simulator runs cooperative grids of up to
    simulator.COOPERATIVE_BLOCKS blocks (with numbarnn's fix installed; one block without it)."""
    sim = common.SIMULATOR if simulator is None else simulator
    factory, table = PERSISTENT[phase]
    if has_proj:
        return None, (f"v3 has no projection step (h' = W_proj m would need a second grid barrier per step); "
                      f"the {phase} runs v2")
    sl = plan(cell.G, H, P, dtype, simulator=sim)
    if sl is None:
        return None, f"the R slice for P={P} does not fit {SMEM_BUDGET} bytes of shared memory"
    n = blocks_needed(H, D, sl)
    if sim:                                # all blocks at once: numbarnn's simulator fix, else one block
        from .simulator import cooperative_blocks
        limit = cooperative_blocks()
    else:
        try:
            from .common import jit
            kernel = jit(factory, cell, str(dtype), sl)
            compiled = kernel.compile(signature(table, cell, dtype, False))
            limit = compiled.max_cooperative_grid_blocks(sl.threads)
        except Exception as exc:           # no cooperative launch here: say why and run v2
            return None, f"co-residency unknown ({type(exc).__name__}: {exc})"
    if n > limit:
        return None, f"{n} blocks of {sl.threads} threads needed, only {limit} can be co-resident"
    return sl, (f"{n} block{'s' if n != 1 else ''} of {sl.threads} threads, TJ={sl.TJ} units each, all "
                f"co-resident (limit {limit})")

"""Step kernel v3: persistent forward and backward, one launch per layer for all T steps.

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

step_body: for each tile of TB rows, h is staged through shared memory in K-chunks of KC (coalesced:
`make_fetch`, `make_put_rows`), the product comes from the R slice in shared memory, and the cell's pointwise
forward is v2's epilogue (`epilogues.make_forward_epilogue`).

The backward mirrors it (`make_backward_body`): dh = dgh_{s+1} R needs the COLUMNS of R for the block's units,
kept in the same layout, so the product loop is the forward's; dgh of step s+1 (every gate, written by every
block before the barrier) is staged like h (`make_fetch`, row times and offsets looked up once per tile), and the
cell's backward is v2's epilogue (`epilogues.make_backward_epilogue`).  Steps run s = steps-1 .. 0, then s = -1
finishes dh0.

With a projection each step has two phases, a grid barrier after each (each needs every block's results of
the one before): forward A, the cell for the block's TJ units -> m; B, h' = W_proj m for the block's TQ
projected outputs (W_proj's rows in shared memory).  Backward P, dh = dgh_s R for the block's TQ columns of R;
U, dm = W_proj^T (dy + dh) for the block's TJ units (W_proj's columns in shared memory), then the cell's
backward (`make_backward_proj_phases`).

The product loops: the H100 measured v3 latency bound at about one warp per scheduler, so the instructions a
thread issues per step are its time (`python -m numbarnn.analysis.sass --per-step` counts them, no GPU needed):
  - the slices are zero-padded to whole chunks (KMAX, HMAX), so the k loop has a constant trip count: KC // KU
    trips of KU = 8 unrolled ks (`staging.unroll`: NVVM unrolls 8, not 32), unsigned shared indices (`common.U`);
  - the next chunk's global loads are issued before this chunk's products (registers, `Slice.PF`; not where
    they would not fit: float64 at TJ = 1); a staged row's time index and flat offset are computed once per row
    tile (`staging.make_fetch`); the backward adds even and odd k in two accumulators (two FMA chains);
  - a row tile with fewer rows than the block holds splits its chunks of K over the row groups its rows leave
    idle (`make_split_k`), the splits' partial sums added through shared memory (`red`);
  - the slices and tiles are 16-byte aligned, rows KMAX + 4 and KC + 4 words apart (`staging.pitch`): a thread
    reads V = 4 consecutive k of a row as one LDS.128, and a warp's rows fall on distinct banks;
  - `plan` sizes the slices for blocks of THREADS = 64; given the batch, `choose` runs the same slice with more
    row groups (96 to 256 threads, `widen`, `widths`) where that cuts a thread's rounds and the grid stays
    co-resident: more warps an SM, fewer instructions each.

Each revision's instruction counts and timings: bench/results/gpu_h100.md.

Why one file (over 500 lines): the forward and backward persistent kernels share their slice geometry, the
choice of width and their launch; the arithmetic of the slices is in v3_slices.py, the device functions in
v3_parts.py.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from .. import settings
from ..cells import get_cell
from .cell_steps import ALWAYS, BACKWARD_ARGS, FORWARD_ARGS, NO_PROJ, _wrap, reported_cells, signature
from . import target
from .common import DTYPES, SIMULATOR, U, acc_dtype, arr, device, jit
from .gpus import GPUS
from .simulator import cooperative_blocks
from .staging import (LOADS_IN_FLIGHT, VECTOR_BYTES, make_fetch, make_put_rows, make_row_offsets, make_stage_rows,
                      make_tile_rows, rows_per_thread, unroll, vector_ks)
from .epilogues import BACKWARD_V2_ARGS, make_backward_epilogue, make_forward_epilogue
from .v3_slices import (SIM_SLICE, SMEM_BUDGET, Slice, blocks_needed, plan, shared_dims, v3_co_residency, v3_limit,
                        v3_registers, widths)
from .v3_parts import make_load_columns, make_load_rows, make_reduce_splits, make_split_k, make_staged_product


if SIMULATOR:
    @device
    def grid_sync():
        cuda.cg.this_grid().sync()
else:
    # what `cuda.cg.this_grid().sync()` lowers to; the public overloads compile "for the current device",
    # which needs a GPU, so the kernel report (no GPU) could not compile them; the intrinsics need none
    from numba.cuda.cg import _grid_group_sync, _this_grid

    @device
    def grid_sync():
        _grid_group_sync(_this_grid())


def _cooperative(kernel):
    """Mark a kernel function as a cooperative launch (a grid barrier): numba's CUDA simulator, with numbarnn's
    fix (numbarnn/kernels/simulator.py), then runs all its blocks at once.  Nothing changes on a GPU."""
    kernel.cooperative = True
    return kernel


#: v1's rows for the projection's arrays (used by (cell, has_proj): with a projection only)
_V1_ROWS = {row[0]: row for row in BACKWARD_ARGS}
WP_ROWS = (_V1_ROWS["Wp_fwd"], _V1_ROWS["Wp_rev"])


def _persistent_forward_table():
    """FORWARD_ARGS with steps for s, h ping-ponging between h_a and h_b (both written with a projection too:
    phase B writes h'), y always, and W_proj beside R with a projection."""
    rows = []
    for row in FORWARD_ARGS:
        name = row[0]
        if name == "s":
            rows.append(("steps", "i64", 0, "steps to run: max(len)", ALWAYS))
        elif name == "h_in":
            rows.append(("h_a", "a", 3, "[D, B, P] h entering even steps (h0 in; hT out when steps is even)",
                         ALWAYS))
        elif name == "h_out":
            rows.append(("h_b", "a", 3, "[D, B, P] h entering odd steps", ALWAYS))
        elif name == "y":
            rows.append(row[:4] + (ALWAYS,))
        else:
            rows.append(row)
        if name == "R_rev":
            rows.extend(WP_ROWS)
    return tuple(rows)


PERSISTENT_ARGS = _persistent_forward_table()


# ---------------------------------------------------------------------------------------------------
# the kernels: the step body and its phases, per step and persistent
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_step_body(cell, dtype, sl: Slice):
    """Device functions (load_slice, step_body) shared by the per-step and the persistent kernel.  With a
    projection step_body is phase A (h_out and y None: m goes to ms; h is P wide).

    The product runs KMAX // KC whole chunks (the slice's columns from P on are zeros, and so are the staged
    h's), so its k loop has a constant trip count KC: unrolled, every shared load at a constant offset from
    the chunk's base, no index arithmetic per k.  A tile with fewer rows than row groups (B = 16 on the 32 of
    H = 768's slice) splits the chunks over the idle row groups (`make_split_k`: rounds of KS chunks, one per
    split, then a reduction through shared memory `red`); the next round of h is fetched into registers before
    this round's products (its global-memory latency overlaps them)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G = cell.G
    TJ, RG, RB, KC, TB, NT = sl.TJ, sl.RG, sl.RB, sl.KC, sl.TB, sl.threads
    RS = NT // KC                                       # staging h: rows apart of one thread's elements
    RH = rows_per_thread(TB, RS)                        # a thread's rows of the h tile
    NCH = sl.KMAX // KC                                 # chunks of the slice's columns
    KU = unroll(KC, G * RB)                             # ks per trip of the k loop: G*RB FMAs each
    V = vector_ks(dtype, KU)                            # ks of one shared load (4 fp32 words: an LDS.128)
    PREFETCH = sl.PF
    NBUF = max(RH, LOADS_IN_FLIGHT)
    assert NT % KC == 0, "staging needs whole rows of KC columns per pass"
    assert sl.KMAX % KC == 0, "the slice's capacity is whole chunks"
    split_k = make_split_k(RG, RB, TB, RS)
    tile_rows = make_tile_rows(TB, RS)
    row_offsets = make_row_offsets(TB, RS)
    fetch_h = make_fetch(dtype, TB, RS)
    put_h = make_put_rows(TB, RS)
    stage_h = make_stage_rows(dtype, TB, RS)
    reduce = make_reduce_splits(dtype, RB, G, TJ)
    epilogue = make_forward_epilogue(cell, dtype, RB)
    load_slice = make_load_rows(dtype, G, TJ, NT, sl.KMAX)

    @device
    def step_body(s, lens, gx, unit_params, R_slice, h_in, h_out, c, y, acts, cs, ms, h_tile, red, rh, j0, d):
        tid = cuda.threadIdx.x
        jj = tid % TJ
        rg = tid // TJ
        P = h_in.shape[2]
        B = lens.shape[0]
        H = unit_params.shape[2]
        buf = cuda.local.array(NBUF, acc)               # the next round of h, in flight
        rb = cuda.local.array(RH, types.int32)          # the batch row of each staged row, -1: none
        off = cuda.local.array(RH, types.int64)         # the flat index of h[d, that row, 0], -1: none
        r_k = cuda.local.array((G, V), acc)             # R_slice[g*TJ + jj, k .. k+V-1], every gate
        h_k = cuda.local.array((RB, V), acc)            # h_tile[rg*RB + r, k .. k+V-1], every row
        kc = tid % KC                                   # this thread's column of each staged h chunk
        r0 = tid // KC                                  # and its block of staged rows
        for b0 in range(0, B, TB):                      # every row of the batch, TB rows at a time
            RGN, KS, NR = split_k(b0, B, NCH, PREFETCH)
            sp = rg // RGN                              # this thread's split: chunks sp, sp + KS, ...
            live = sp < KS                              # a row group past the batch and the splits only stages
            for g in range(G):
                for r in range(RB):
                    rh[g, r] = zero
            kq = kc                                     # the column this thread stages of a round's first chunk
            if PREFETCH:
                kq += tile_rows(rb, b0, B, RGN * RB, KS, r0) * KC
                row_offsets(h_in, rb, off, d)
                fetch_h(h_in, off, buf, kq, kq < P)     # round 0
            for rnd in range(NR):
                ch = rnd * KS + sp                      # this thread's chunk
                if PREFETCH:
                    put_h(h_tile, buf, kc, r0)
                else:                                   # this chunk's loads, now (nothing kept between chunks)
                    stage_h(h_in, h_tile, buf, d, b0, ch * KC + kc, kc, r0, B, P)
                cuda.syncthreads()
                if PREFETCH and rnd + 1 < NR:           # the next round's loads, in flight during the products
                    kn = (rnd + 1) * KS * KC + kq
                    fetch_h(h_in, off, buf, kn, kn < P)
                if live and ch < NCH:
                    for k8 in range(0, KC, KU):
                        for kv in range(0, KU, V):      # unrolled: constant offsets, no loop code
                            for g in range(G):          # V consecutive k of a row: one vector load (LDS.128)
                                for v in range(V):
                                    r_k[g, v] = R_slice[U(g * TJ + jj), U(ch * KC + k8 + kv + v)]
                            for r in range(RB):
                                for v in range(V):
                                    h_k[r, v] = h_tile[U(rg * RB + r), U(k8 + kv + v)]
                            for v in range(V):
                                for r in range(RB):
                                    for g in range(G):
                                        rh[g, r] += r_k[g, v] * h_k[r, v]
                cuda.syncthreads()
            reduce(rh, red, rg, jj, RGN, KS, live)
            j = j0 + jj
            if j < H and rg < RGN:
                epilogue(s, lens, gx, unit_params, h_in, h_out, c, y, acts, cs, ms, rh, d, j, b0 + rg * RB)

    return load_slice, step_body


@functools.lru_cache(maxsize=None)
def make_project_body(dtype, sl: Slice):
    """Device function (forward phase B): h_out[d, b, p] = sum_j W_proj[p, j] m[b, j] for the block's TQ outputs
    p = p0 + q (Wp_slice[q, j] = W_proj[p0+q, j] in shared memory), m of step s staged from the reserve ms at
    each row's time index; y[t, b, d*P + p] too; rows past their length carry h."""
    TJ, RB, TB = sl.TJ, sl.RB, sl.TB
    product = make_staged_product(dtype, sl, 1, sl.TQ, sl.HMAX)

    @device
    def project_body(s, lens, ms, Wp_slice, h_in, h_out, y, tile, red, out, p0, d):
        q = cuda.threadIdx.x % TJ
        rg = cuda.threadIdx.x // TJ
        H = ms.shape[3]
        P = h_in.shape[2]
        B = lens.shape[0]
        p = p0 + q
        for b0 in range(0, B, TB):
            product(s, lens, ms, Wp_slice, tile, red, out, d, b0, H)
            if q < sl.TQ and p < P:
                for r in range(RB):
                    b = b0 + rg * RB + r
                    if b >= B:
                        break
                    if s >= lens[b]:                    # past the length: carry h
                        h_out[d, b, p] = h_in[d, b, p]
                    else:
                        t_ = s if d == 0 else lens[b] - 1 - s
                        h_out[d, b, p] = out[r]
                        y[t_, b, d * P + p] = out[r]

    return project_body


@functools.lru_cache(maxsize=None)
def make_forward_step_v3(cell, dtype, sl: Slice = SIM_SLICE):
    """The v3 step body as one launch per step (grid (ceil(H/TJ), 1, D)): the many-block test of the body."""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KP, _, HP, RP = shared_dims(G, sl, dtype)
    TB, RB = sl.TB, sl.RB
    load_slice, step_body = make_step_body(cell, dtype, sl)

    @device
    def forward_body(s, lens, gx, unit_params, R_fwd, R_rev, h_in, h_out, c, y, acts, cs, ms):
        R_slice = cuda.shared.array((GJ, KP), acc, alignment=VECTOR_BYTES)
        h_tile = cuda.shared.array((TB, HP), acc, alignment=VECTOR_BYTES)
        red = cuda.shared.array((TB, RP), acc)          # the splits' partial sums
        rh = cuda.local.array((G, RB), acc)
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * sl.TJ
        load_slice(R_fwd if d == 0 else R_rev, R_slice, j0, unit_params.shape[2], h_in.shape[2])
        step_body(s, lens, gx, unit_params, R_slice, h_in, h_out, c, y, acts, cs, None, h_tile, red, rh, j0, d)

    return _wrap(f"{cell.name}_forward_step_v3", forward_body, FORWARD_ARGS, cell, False)


@functools.lru_cache(maxsize=None)
def make_forward_persistent_v3(cell, dtype, sl: Slice = SIM_SLICE, has_proj: bool = False):
    """All steps of a layer in one cooperative launch; h ping-pongs between h_a and h_b.  With a projection
    (sl.TQ > 0) each step is phase A (the cell -> m) and phase B (h' = W_proj m), a grid barrier after each.
    (Two bodies chosen here rather than one with `if Wp_fwd is None`: numba inlines both branches before it
    prunes one, which tripled the compile time.)"""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KP, HMP, HP, RP = shared_dims(G, sl, dtype)
    TB, RB = sl.TB, sl.RB
    load_slice, step_body = make_step_body(cell, dtype, sl)
    name = f"{cell.name}_forward_persistent_v3" + ("_proj" if has_proj else "")

    if not has_proj:
        @device
        def persistent_body(steps, lens, gx, unit_params, R_fwd, R_rev, Wp_fwd, Wp_rev, h_a, h_b, c, y, acts, cs,
                            ms):
            R_slice = cuda.shared.array((GJ, KP), acc, alignment=VECTOR_BYTES)   # this block's R, kept for all steps
            h_tile = cuda.shared.array((TB, HP), acc, alignment=VECTOR_BYTES)
            red = cuda.shared.array((TB, RP), acc)          # the splits' partial sums
            rh = cuda.local.array((G, RB), acc)
            d = cuda.blockIdx.z
            j0 = cuda.blockIdx.x * sl.TJ
            load_slice(R_fwd if d == 0 else R_rev, R_slice, j0, unit_params.shape[2], h_a.shape[2])
            for s in range(steps):
                h_in = h_a if s % 2 == 0 else h_b
                h_out = h_b if s % 2 == 0 else h_a
                step_body(s, lens, gx, unit_params, R_slice, h_in, h_out, c, y, acts, cs, None, h_tile, red, rh, j0, d)
                grid_sync()                            # every unit's h' is written before step s+1 reads it

        return _cooperative(_wrap(name, persistent_body, PERSISTENT_ARGS, cell, False))

    assert sl.TQ > 0, "a projection needs a slice with TQ > 0"
    TQ = sl.TQ
    load_wp = make_load_rows(dtype, 1, TQ, sl.threads, sl.HMAX)
    project_body = make_project_body(dtype, sl)

    @device
    def persistent_proj_body(steps, lens, gx, unit_params, R_fwd, R_rev, Wp_fwd, Wp_rev, h_a, h_b, c, y, acts, cs,
                             ms):
        R_slice = cuda.shared.array((GJ, KP), acc, alignment=VECTOR_BYTES)   # this block's R, kept for all steps
        Wp_slice = cuda.shared.array((TQ, HMP), acc, alignment=VECTOR_BYTES)  # its W_proj rows
        h_tile = cuda.shared.array((TB, HP), acc, alignment=VECTOR_BYTES)
        red = cuda.shared.array((TB, RP), acc)          # the splits' partial sums
        rh = cuda.local.array((G, RB), acc)
        h_proj = cuda.local.array(RB, acc)              # phase B's products
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * sl.TJ
        p0 = cuda.blockIdx.x * TQ
        H = unit_params.shape[2]
        P = h_a.shape[2]
        load_slice(R_fwd if d == 0 else R_rev, R_slice, j0, H, P)
        load_wp(Wp_fwd if d == 0 else Wp_rev, Wp_slice, p0, P, H)
        for s in range(steps):
            h_in = h_a if s % 2 == 0 else h_b
            h_out = h_b if s % 2 == 0 else h_a
            step_body(s, lens, gx, unit_params, R_slice, h_in, None, c, None, acts, cs, ms, h_tile, red, rh, j0, d)
            grid_sync()                                # every unit's m is written before phase B reads it
            project_body(s, lens, ms, Wp_slice, h_in, h_out, y, h_tile, red, h_proj, p0, d)
            grid_sync()                                # every h' is written before step s+1 reads it

    return _cooperative(_wrap(name, persistent_proj_body, PERSISTENT_ARGS, cell, True))


# ---------------------------------------------------------------------------------------------------
# backward: the same slices, the columns of R instead of its rows
# ---------------------------------------------------------------------------------------------------

def _persistent_backward_table():
    """BACKWARD_V2_ARGS with steps for s, and with a projection W_proj beside R and dh_total at the end."""
    rows = []
    for row in BACKWARD_V2_ARGS:
        name = row[0]
        if name == "s":
            rows.append(("steps", "i64", 0, "steps to run: max(len); s = steps-1 .. 0, then -1 (dh0)", ALWAYS))
            continue
        rows.append(row[:4] + (NO_PROJ,) if name == "h_prev" else row)    # projection: `record_h_prev`
        if name == "R_rev":
            rows.extend(WP_ROWS)
    rows.append(_V1_ROWS["dh_total"])
    return tuple(rows)


PERSISTENT_BACKWARD_ARGS = _persistent_backward_table()


@functools.lru_cache(maxsize=None)
def make_backward_body(cell, dtype, sl: Slice):
    """Device functions (load_columns, step_body) of the backward, shared by its per-step and persistent
    kernels.  A block owns the same TJ units as in the forward, but the backward's product runs the other
    way: dh[b, j] = sum_{g,k} dgh_{s+1}[b, g*H+k] R[g*H+k, j] needs the COLUMNS j0 .. j0+TJ-1 of R, again
    G*TJ*H values, kept as R_slice[g*TJ + jj, k] = R[g*H + k, j0+jj] (the forward slice's layout, so the
    product loop and its bank pattern are the forward's).  Then the cell's backward for those units is v2's
    epilogue (`epilogues.make_backward_epilogue`)."""
    G = cell.G
    TJ, RB, TB = sl.TJ, sl.RB, sl.TB
    product = make_staged_product(dtype, sl, G, TJ, sl.KMAX)
    epilogue = make_backward_epilogue(cell, dtype, RB)
    load_columns = make_load_columns(dtype, G, TJ, sl.threads, sl.KMAX)

    @device
    def step_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, R_slice,
                  g_tile, red, from_R, j0, d):
        H = dgx.shape[3] // G
        B = lens.shape[0]
        j = j0 + cuda.threadIdx.x % TJ
        for b0 in range(0, B, TB):                      # every row of the batch, TB rows at a time
            # dgh of step s+1 (zeros where s+1 >= len[b]): written by every block before the barrier
            product(s + 1, lens, dgh, R_slice, g_tile, red, from_R, d, b0, H)
            if j < H:
                epilogue(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, from_R,
                         d, j, b0 + cuda.threadIdx.x // TJ * RB)

    return load_columns, step_body


@functools.lru_cache(maxsize=None)
def make_backward_proj_phases(cell, dtype, sl: Slice):
    """Device functions (dh_phase, unit_phase) of the backward with a projection (see the module docstring).

    dh_phase(s): for the block's TQ columns p of R: dh[b, p] = (dgh_s R)[b, p] for rows active at s (s < steps),
    else dh carries; then for rows active at s-1: dh_total[t', b, p] = dy[t', b, p] + dh[b, p] (dht of step
    s-1, at its time index t').  At s = 0 dh is dh0.
    unit_phase(s): dm[b, j] = sum_p W_proj[p, j] dht_s[b, p] for the block's TJ units, then the cell's backward.
    h_prev (h entering each step, for dR) is left to `record_h_prev`: written here too, its loads of y and h0
    took the float16/32 peephole kernel past 255 registers on sm_80 (spills; 234 without them)."""
    acc = acc_dtype(dtype).type
    G = cell.G
    TJ, RB, TB, TQ = sl.TJ, sl.RB, sl.TB, sl.TQ
    dgh_R = make_staged_product(dtype, sl, G, TQ, sl.HMAX)
    wp_dht = make_staged_product(dtype, sl, 1, TJ, sl.KMAX)
    epilogue = make_backward_epilogue(cell, dtype, RB, True)

    @device
    def dh_phase(s, steps, lens, dy, dgh, R_cols, dh, dh_total, tile, red, out, p0, d):
        q = cuda.threadIdx.x % TJ
        rg = cuda.threadIdx.x // TJ
        H = dgh.shape[3] // G
        P = dh.shape[2]
        B = lens.shape[0]
        p = p0 + q
        for b0 in range(0, B, TB):
            if s < steps:                               # (at s = steps no row is active: dh is dhT)
                dgh_R(s, lens, dgh, R_cols, tile, red, out, d, b0, H)
            if q < TQ and p < P:
                for r in range(RB):
                    b = b0 + rg * RB + r
                    if b >= B:
                        break
                    dh_new = out[r] if s < lens[b] else dh[d, b, p]
                    dh[d, b, p] = dh_new
                    sp = s - 1                          # the step the unit phase runs next
                    if sp >= 0 and sp < lens[b]:
                        t_ = sp if d == 0 else lens[b] - 1 - sp
                        dh_total[d, t_, b, p] = acc(dy[t_, b, d * P + p]) + dh_new

    @device
    def unit_phase(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, dh_total, WpT,
                   tile, red, out, j0, d):
        H = dgx.shape[3] // G
        P = dh.shape[2]
        B = lens.shape[0]
        j = j0 + cuda.threadIdx.x % TJ
        for b0 in range(0, B, TB):
            wp_dht(s, lens, dh_total, WpT, tile, red, out, d, b0, P)
            if j < H:
                epilogue(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, out, d, j,
                         b0 + cuda.threadIdx.x // TJ * RB)

    return dh_phase, unit_phase


@functools.lru_cache(maxsize=None)
def make_backward_step_v3(cell, dtype, sl: Slice = SIM_SLICE):
    """The v3 backward body as one launch per step (grid (ceil(H/TJ), 1, D)), v2's arguments: the many-block
    test of the body (s = T-1 .. 0, then -1 to finish dh0, as v2's fused backward)."""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KP, _, HP, RP = shared_dims(G, sl, dtype)
    TB, RB = sl.TB, sl.RB
    load_columns, step_body = make_backward_body(cell, dtype, sl)

    @device
    def backward_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, R_fwd, R_rev, dh, dc, dgx, dgh, dvec,
                      h_prev):
        R_slice = cuda.shared.array((GJ, KP), acc, alignment=VECTOR_BYTES)
        g_tile = cuda.shared.array((TB, HP), acc, alignment=VECTOR_BYTES)
        red = cuda.shared.array((TB, RP), acc)          # the splits' partial sums
        from_R = cuda.local.array(RB, acc)
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * sl.TJ
        load_columns(R_fwd if d == 0 else R_rev, R_slice, j0, dgx.shape[3] // G)
        step_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, R_slice, g_tile,
                  red, from_R, j0, d)

    return _wrap(f"{cell.name}_backward_step_v3", backward_body, BACKWARD_V2_ARGS, cell, False)


@functools.lru_cache(maxsize=None)
def make_backward_persistent_v3(cell, dtype, sl: Slice = SIM_SLICE, has_proj: bool = False):
    """All steps of a layer's backward in one cooperative launch: s = steps-1 .. 0 with a grid barrier after
    each (step s reads every block's dgh of step s+1), then s = -1 finishes dh0.  dh stays in one buffer:
    the thread of (b, j) alone reads and writes it (v2's convention).  With a projection: the dh phase at
    s = steps .. 0 and the unit phase at s-1 between them, a grid barrier after each (module docstring)."""
    acc = acc_dtype(dtype).type
    G = cell.G
    GJ, KP, HMP, HP, RP = shared_dims(G, sl, dtype)
    TB, RB = sl.TB, sl.RB
    name = f"{cell.name}_backward_persistent_v3" + ("_proj" if has_proj else "")

    if not has_proj:
        load_columns, step_body = make_backward_body(cell, dtype, sl)

        @device
        def persistent_body(steps, lens, dy, y, h0, c0, acts, cs, unit_params, R_fwd, R_rev, Wp_fwd, Wp_rev, dh,
                            dc, dgx, dgh, dvec, h_prev, dh_total):
            # this block's columns of R, kept for all steps
            R_slice = cuda.shared.array((GJ, KP), acc, alignment=VECTOR_BYTES)
            g_tile = cuda.shared.array((TB, HP), acc, alignment=VECTOR_BYTES)
            red = cuda.shared.array((TB, RP), acc)          # the splits' partial sums
            from_R = cuda.local.array(RB, acc)
            d = cuda.blockIdx.z
            j0 = cuda.blockIdx.x * sl.TJ
            load_columns(R_fwd if d == 0 else R_rev, R_slice, j0, dgx.shape[3] // G)
            for i in range(steps + 1):
                s = steps - 1 - i
                step_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, R_slice,
                          g_tile, red, from_R, j0, d)
                if s >= 0:
                    grid_sync()                         # every unit's dgh of step s is written before s-1

        return _cooperative(_wrap(name, persistent_body, PERSISTENT_BACKWARD_ARGS, cell, False))

    assert sl.TQ > 0, "a projection needs a slice with TQ > 0"
    TQ, TJ = sl.TQ, sl.TJ
    GQ = G * TQ                                         # rows of R_cols: gate g of projected output q at g*TQ + q
    dh_phase, unit_phase = make_backward_proj_phases(cell, dtype, sl)
    load_r_cols = make_load_columns(dtype, G, TQ, sl.threads, sl.HMAX)
    load_wp_cols = make_load_columns(dtype, 1, TJ, sl.threads, sl.KMAX)

    @device
    def persistent_proj_body(steps, lens, dy, y, h0, c0, acts, cs, unit_params, R_fwd, R_rev, Wp_fwd, Wp_rev, dh,
                             dc, dgx, dgh, dvec, h_prev, dh_total):
        WpT = cuda.shared.array((TJ, KP), acc, alignment=VECTOR_BYTES)       # W_proj's columns of this block's units
        R_cols = cuda.shared.array((GQ, HMP), acc, alignment=VECTOR_BYTES)    # R's columns of its projected outputs
        g_tile = cuda.shared.array((TB, HP), acc, alignment=VECTOR_BYTES)
        red = cuda.shared.array((TB, RP), acc)          # the splits' partial sums
        out = cuda.local.array(RB, acc)
        d = cuda.blockIdx.z
        j0 = cuda.blockIdx.x * TJ
        p0 = cuda.blockIdx.x * TQ
        load_wp_cols(Wp_fwd if d == 0 else Wp_rev, WpT, j0, dh.shape[2])
        load_r_cols(R_fwd if d == 0 else R_rev, R_cols, p0, dgx.shape[3] // G)
        for i in range(steps + 1):
            s = steps - i
            dh_phase(s, steps, lens, dy, dgh, R_cols, dh, dh_total, g_tile, red, out, p0, d)
            if s > 0:
                grid_sync()                             # all of dht of step s-1 is written
                unit_phase(s - 1, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, None,
                           dh_total, WpT, g_tile, red, out, j0, d)
                grid_sync()                             # every unit's dgh of step s-1 is written

    return _cooperative(_wrap(name, persistent_proj_body, PERSISTENT_BACKWARD_ARGS, cell, True))


@functools.lru_cache(maxsize=None)
def make_record_h_prev(dtype):
    """h_prev[d, t, b, k] = h entering row b's step at time t (h0 at its first step, else y at the time before),
    for every step the row runs; one thread per (d, b, k < P), looping over the row's steps.  The dR of the
    projection backward (its persistent kernel leaves h_prev out, see `make_backward_proj_phases`)."""

    def record_h_prev(
        lens,      # [B] int32
        y,         # [T, B, D*P]   layer output (reserve)
        h0,        # [D, B, P]     initial h of this layer
        h_prev,    # [D, T, B, P]  out
    ):
        k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        d = cuda.blockIdx.z
        P = h0.shape[2]
        if k >= P:
            return
        step = 1 if d == 0 else -1
        for s in range(lens[b]):
            t = s if d == 0 else lens[b] - 1 - s
            h_prev[d, t, b, k] = h0[d, b, k] if s == 0 else y[t - step, b, d * P + k]

    return record_h_prev


def kernel_specs():
    """The persistent kernels (forward, backward) and their per-step variants for REPORTED_CELLS at the slice
    of H = P = 512 (block = 64 threads), the persistent pair with a projection (H = 512, P = 256),
    record_h_prev, and the LSTM's persistent pair at the wider blocks of H = 768, B = 16 (`_wide`).  The
    persistent ones link libcudadevrt.a (the report does that for every kernel with a grid barrier)."""
    specs = []
    for dt in DTYPES:
        for cell in reported_cells("matrix"):
            sl = plan(cell.G, 512, 512, dt, simulator=False)
            specs.append((f"{cell.name}_forward_step_v3", dt, make_forward_step_v3(cell, dt, sl),
                          signature(FORWARD_ARGS, cell, dt, False), sl.threads))
            specs.append((f"{cell.name}_forward_persistent_v3", dt, make_forward_persistent_v3(cell, dt, sl),
                          signature(PERSISTENT_ARGS, cell, dt, False), sl.threads))
            specs.append((f"{cell.name}_backward_step_v3", dt, make_backward_step_v3(cell, dt, sl),
                          signature(BACKWARD_V2_ARGS, cell, dt, False), sl.threads))
            specs.append((f"{cell.name}_backward_persistent_v3", dt, make_backward_persistent_v3(cell, dt, sl),
                          signature(PERSISTENT_BACKWARD_ARGS, cell, dt, False), sl.threads))
            if cell.projection:                 # with a projection: the slice of H = 512, P = 256
                sl = plan(cell.G, 512, 256, dt, simulator=False, has_proj=True)
                for phase, (factory, table) in PERSISTENT.items():
                    specs.append((f"{cell.name}_{phase}_persistent_v3_proj", dt, factory(cell, dt, sl, True),
                                  signature(table, cell, dt, True), sl.threads))
        specs.append(("record_h_prev", dt, make_record_h_prev(dt),
                      (arr("int32", 1), arr(dt, 3), arr(dt, 3), arr(dt, 4)), 128))
    # the wider blocks `choose` runs on an H100 at H = 768, B = 16 (LSTM, float32): 96 threads forward, 128
    # backward, the TJ = 2 slice whose threads stage the most rows
    lstm = get_cell("lstm")
    for phase, (factory, table) in PERSISTENT.items():
        sl = v3_co_residency(GPUS["H100 SXM"], 768, 768, lstm.G, 1, "float32", B=16, phase=phase)[0]
        specs.append((f"lstm_{phase}_persistent_v3_wide", "float32", factory(lstm, "float32", sl),
                      signature(table, lstm, "float32", False), sl.threads))
    return specs


__all__ = ["make_forward_step_v3", "make_forward_persistent_v3", "make_backward_step_v3", "make_backward_persistent_v3",
           "PERSISTENT_ARGS", "PERSISTENT_BACKWARD_ARGS", "kernel_specs", "choose", "make_record_h_prev"]


#: the persistent kernel of each phase and its argument table
PERSISTENT = {"forward": (make_forward_persistent_v3, PERSISTENT_ARGS),
              "backward": (make_backward_persistent_v3, PERSISTENT_BACKWARD_ARGS)}


def device_cooperative_limit(phase: str, cell, dtype, sl: Slice, has_proj: bool) -> int:
    """Blocks of the persistent kernel of `phase` that this process's GPU holds at once (its registers and
    shared memory as compiled, the SM count); raises without a GPU.  The profiler's GPU geometry replaces it
    with the simulator's cooperative limit (it runs the GPU's slices in the simulator)."""
    factory, table = PERSISTENT[phase]
    compiled = jit(factory, cell, str(dtype), sl, has_proj).compile(signature(table, cell, dtype, has_proj))
    return compiled.max_cooperative_grid_blocks(sl.threads)


def choose(cell, dtype, H: int, P: int, D: int, has_proj: bool, simulator: bool | None = None,
           phase: str = "forward", B: int | None = None):
    """`_choose`, remembered per layer shape, setting and GPU in a process on a GPU (compiling and asking the
    device took ~0.3 ms of a host-bound call); in the simulator, worked out every time."""
    sim = target.simulator(simulator)
    if sim or SIMULATOR:                     # (the simulator's tests change devices and limits)
        return _choose(cell, dtype, H, P, D, has_proj, sim, phase, B)
    return _choose_on_gpu(cell, np.dtype(dtype), H, P, D, has_proj, phase, B, settings.get("v3_wide"),
                          cuda.get_current_device().id)


@functools.lru_cache(maxsize=256)
def _choose_on_gpu(cell, dtype, H, P, D, has_proj, phase, B, wide, device):
    return _choose(cell, dtype, H, P, D, has_proj, False, phase, B)


def _choose(cell, dtype, H: int, P: int, D: int, has_proj: bool, sim: bool, phase: str = "forward",
            B: int | None = None):
    """(Slice, why) when the persistent kernel of `phase` ("forward" or "backward") can run this layer, else
    (None, why not).

    It can when its slices fit (`plan`; with a projection the larger pair of the two phases) and every block
    is co-resident: on a GPU the device says how many blocks of the compiled kernel fit at once
    (max_cooperative_grid_blocks, from its registers and shared memory and the SM count: the two phases'
    kernels differ in registers); the simulator runs cooperative grids of up to simulator.COOPERATIVE_BLOCKS
    blocks (with numbarnn's fix installed; one block without it).

    Given the batch B, on a GPU it runs the slice with the widest block that helps and is co-resident
    (`widths`: fewer rounds of products a thread, more warps an SM): a width the register estimate
    (`v3_limit`, `v3_registers`) says cannot be co-resident is not compiled; one it says can
    is compiled and asked (the device decides); `plan`'s block of THREADS is the fallback (and the only block
    with NUMBARNN_V3_WIDE=0: `bash bench/gpu_run.sh wide` times both).  The simulator keeps SIM_SLICE (its
    tests run the wider row groups explicitly)."""
    sl = plan(cell.G, H, P, dtype, simulator=sim, has_proj=has_proj)
    if sl is None:
        what = f"P={P}, H={H} (projection)" if has_proj else f"P={P}"
        room = (f"the simulator's slices ({SIM_SLICE.KMAX} columns)" if sim else
                f"{SMEM_BUDGET} bytes of shared memory")
        return None, f"the slices for {what} do not fit {room}"
    n = blocks_needed(H, D, sl)                # the same for every width (the same TJ)
    candidates = [sl]
    if not sim and B is not None and settings.get("v3_wide"):
        geometry = target.device_geometry_or_none()   # no device to estimate with: THREADS only
        if geometry is not None:               # a wider block only where the estimate says it fits
            candidates = [c for c in widths(cell.G, sl, B, dtype) if c is sl or n <= (
                v3_limit(*geometry, cell.G, c, dtype, v3_registers(c.TJ, phase)) or 0)]
    # the simulator runs all blocks of a cooperative grid at once (numbarnn's fix), else one
    for c in candidates:
        try:
            limit = (cooperative_blocks() if sim or target.current().gpu_model
                     else device_cooperative_limit(phase, cell, dtype, c, has_proj))
        except Exception as exc:               # no cooperative launch here: say why and run v2
            if c is not sl:
                continue
            return None, f"co-residency unknown ({type(exc).__name__}: {exc})"
        if n <= limit:
            proj = f", TQ={c.TQ} projected outputs, 2 grid barriers per step" if has_proj else ""
            return c, (f"{n} block{'s' if n != 1 else ''} of {c.threads} threads, TJ={c.TJ} units each{proj}, all "
                       f"co-resident (limit {limit})")
    return None, f"{n} blocks of {sl.threads} threads needed, only {limit} can be co-resident"

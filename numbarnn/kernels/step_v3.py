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
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, types

from .. import settings
from ..cells import get_cell
from ..util import cdiv
from .cell_steps import ALWAYS, BACKWARD_ARGS, FORWARD_ARGS, NO_PROJ, _wrap, reported_cells, signature
from . import target
from .common import DTYPES, SIMULATOR, U, acc_dtype, arr, device
from .gpus import ARCH, GPU, GPUS, SM_LIMITS_EXTRA, resident_blocks
from .staging import (LOADS_IN_FLIGHT, VECTOR_BYTES, make_fetch, make_put_rows, make_row_offsets, make_stage_rows,
                      make_stage_steps, make_step_offsets, make_tile_rows, pitch, rows_per_thread, unroll,
                      vector_ks)
from .epilogues import BACKWARD_V2_ARGS, make_backward_epilogue, make_forward_epilogue


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


class Slice(NamedTuple):
    """A v3 block: TJ units x all gates, rows TB = RG*RB at a time, h staged KC columns at a time, R slice
    capacity KMAX columns (>= P).  With a projection also TQ projected outputs (<= TJ: P <= H) and HMAX (>= H)
    columns for the W_proj rows (forward) and R's columns (backward); 0 without.  PF: whether the products
    prefetch (`prefetches`)."""

    TJ: int
    RG: int
    RB: int
    KC: int
    KMAX: int
    TQ: int = 0
    HMAX: int = 0
    PF: bool = True     # fetch the next chunk into registers during this chunk's products (`prefetches`)

    @property
    def TB(self) -> int:
        return self.RG * self.RB

    @property
    def threads(self) -> int:
        return self.TJ * self.RG


def prefetches(dtype, sl: Slice) -> bool:
    """Whether a slice's products fetch the next chunk during this one's products: a thread's staged values
    (ceil(TB / RS) rows) and their rows' time indexes stay live in registers meanwhile, so only where they are
    few (at most 16 words: float64 at TJ = 1 stages 32 rows a thread, and its backward spilled 180 bytes on
    sm_80 with them); else each chunk is staged just before it is stored, as in v2."""
    RS = sl.threads // sl.KC
    return cdiv(sl.TB, RS) * max(1, acc_dtype(dtype).itemsize // 4) <= 16

SIM_SLICE = Slice(TJ=3, RG=2, RB=2, KC=2, KMAX=6)
SMEM_BUDGET = 40 * 1024          # bytes of static shared memory for the R slice (the limit is 48 KiB)
THREADS = 64                     # the block `plan` sizes the slices for (TJ units x THREADS // TJ row groups)
#: the blocks `choose` considers (multiples of the warp and of KC = 32): more row groups for the same slice
WIDTHS = (64, 96, 128, 192, 256)


def shared_dims(G: int, sl: Slice, dtype) -> tuple:
    """(GJ, KP, HMP, HP, RP), in words of the compute dtype: the R slice's G*TJ rows and their pitch (KMAX padded:
    `staging.pitch`, rows 16-byte aligned), the pitch of the rows of HMAX (W_proj's rows, R's columns: with a
    projection), the h tile's (`h_pitch`) and red's (`red_pitch`).  What the kernels declare and `slice_bytes`
    counts."""
    return G * sl.TJ, pitch(sl.KMAX, dtype), pitch(sl.HMAX, dtype), h_pitch(sl, dtype), red_pitch(G, sl)


def slice_bytes(G: int, sl: Slice, dtype) -> int:
    """Shared memory of a block: the R slice (padded rows), the h tile and the splits' partial sums (TB x G*TJ),
    in the compute dtype; with a projection the larger phase pair: forward R rows + W_proj rows, backward
    W_proj columns + R columns."""
    GJ, KP, HMP, HP, RP = shared_dims(G, sl, dtype)
    words = GJ * KP
    if sl.TQ:
        words = max(words + sl.TQ * HMP, sl.TJ * KP + G * sl.TQ * HMP)
    return (words + sl.TB * HP + sl.TB * RP) * acc_dtype(dtype).itemsize   # + `red`: the splits' partial sums


def projected_per_block(H: int, P: int, TJ: int) -> int:
    """TQ: the projected outputs a block owns when ceil(H / TJ) blocks share P (<= TJ since P <= H)."""
    return max(1, cdiv(P, cdiv(H, TJ)))


def h_pitch(sl: Slice, dtype) -> int:
    """Words between rows of the h tile: `pitch(KC)`, KC + 4 in float32."""
    return pitch(sl.KC, dtype)


def red_pitch(G: int, sl: Slice) -> int:
    """Words between rows of `red`, the splits' partial sums (a thread's G gates x TJ units per row): G*TJ + 1,
    padded by one word like the h tile, so the 32 / TJ row groups of a warp spread over the banks (G*TJ words
    apart, 8 at TJ = 2, they would fall on 4 banks; the profiler's model counts the wavefronts,
    roofline.v3_product_wavefronts)."""
    return G * sl.TJ + 1


def plan(G: int, H: int, P: int, dtype, simulator: bool | None = None, has_proj: bool = False) -> Slice | None:
    """The slice for a layer: the largest TJ (16, 8, 4, 2, 1) whose slices fit SMEM_BUDGET, or None.
    In the simulator: SIM_SLICE when P (and with a projection H) fits its KMAX."""
    if target.simulator(simulator):
        if P > SIM_SLICE.KMAX or (has_proj and H > SIM_SLICE.KMAX):
            return None
        return SIM_SLICE._replace(TQ=projected_per_block(H, P, SIM_SLICE.TJ),
                                  HMAX=SIM_SLICE.KMAX) if has_proj else SIM_SLICE
    kmax = cdiv(P, 32) * 32
    for TJ in (16, 8, 4, 2, 1):
        sl = Slice(TJ=TJ, RG=THREADS // TJ, RB=1, KC=32, KMAX=kmax)
        if has_proj:
            sl = sl._replace(TQ=projected_per_block(H, P, TJ), HMAX=cdiv(H, 32) * 32)
        if slice_bytes(G, sl, dtype) <= SMEM_BUDGET and TJ <= max(H, 1):
            return sl._replace(PF=prefetches(dtype, sl))
    return None


def blocks_needed(H: int, D: int, sl: Slice) -> int:
    return cdiv(H, sl.TJ) * D


def widen(G: int, sl: Slice, dtype, threads: int) -> Slice | None:
    """`sl` run by a block of `threads` threads: the same TJ units and R slice (so the same blocks, and a
    thread's work the same: about the same registers), RG = threads // TJ row groups, a row tile of TB = RG
    rows.  A batch smaller than TB splits its chunks of K over the row groups it leaves idle (`make_split_k`),
    a larger one needs fewer row tiles: either way a thread runs fewer rounds of products per step, and an SM
    holds more warps to hide their latency (the H100 measured v3 latency bound, at about one warp per
    scheduler: bench/results/gpu_h100.md).  None where the larger h tile and `red` would not fit
    SMEM_BUDGET, or where threads is not a multiple of TJ and KC."""
    if threads % sl.TJ or threads % sl.KC or sl.RB != 1:
        return None
    wide = sl._replace(RG=threads // sl.TJ)
    if slice_bytes(G, wide, dtype) > SMEM_BUDGET:
        return None
    return wide._replace(PF=prefetches(dtype, wide))


def widths(G: int, sl: Slice, B: int, dtype) -> list:
    """The slices `choose` tries for a batch of B rows, best first: the widths of WIDTHS `widen` allows that cut
    the rounds of products a thread runs per step (`v3_rounds`), fewest rounds first, then fewest
    threads (less to sum through `red`, fewer warps at each barrier); `sl` itself, the fallback, last."""
    base = v3_rounds(B, sl)
    wide = [w for w in (widen(G, sl, dtype, t) for t in WIDTHS if t != sl.threads)
            if w is not None and v3_rounds(B, w) < base]
    return sorted(wide, key=lambda w: (v3_rounds(B, w), w.threads)) + [sl]


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
# the pieces: slices loaded once, one staged product, the phases
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_load_rows(dtype, G: int, TJ: int, NT: int, KCAP: int):
    """Device function load_rows(R, R_slice, j0, H, K): R_slice[g*TJ + jj, k] = R[g*H + j0+jj, k] for k < K,
    zeros for k in K .. KCAP-1 (the products run whole chunks up to the capacity KCAP) and for units
    j0+jj >= H: consecutive threads read consecutive k (coalesced).  R's rows of the block's units (G gates),
    or W_proj's rows of its projected outputs (G = 1, TQ rows, H = P)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    GJ, U = G * TJ, LOADS_IN_FLIGHT

    @device
    def load_rows(R, R_slice, j0, H, K):
        tid = cuda.threadIdx.x
        buf = cuda.local.array(U, acc)
        for e0 in range(tid, GJ * KCAP, NT * U):        # U loads in flight, then U stores
            for u in range(U):
                e = e0 + u * NT
                row = e // KCAP
                k = e % KCAP
                j = j0 + row % TJ
                buf[u] = acc(R[row // TJ * H + j, k]) if e < GJ * KCAP and j < H and k < K else zero
            for u in range(U):
                e = e0 + u * NT
                if e < GJ * KCAP:
                    R_slice[e // KCAP, e % KCAP] = buf[u]
        cuda.syncthreads()

    return load_rows


@functools.lru_cache(maxsize=None)
def make_load_columns(dtype, G: int, TJ: int, NT: int, KCAP: int):
    """Device function load_columns(R, R_slice, j0, H): R_slice[g*TJ + jj, k] = R[g*H + k, j0+jj] for k < H,
    zeros for columns j0+jj >= R's width and for k in H .. KCAP-1 (the capacity the products run to).
    R's columns of the block's units (backward, no projection), R's columns of its projected outputs (G gates,
    TQ columns), or W_proj's columns of its units (G = 1, H = P).  Consecutive threads read runs of TJ
    consecutive columns (a one-off per launch: sector efficiency TJ*size/32 at worst, against T steps that read
    no R at all)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    U = LOADS_IN_FLIGHT

    @device
    def load_columns(R, R_slice, j0, H):
        tid = cuda.threadIdx.x
        buf = cuda.local.array(U, acc)
        n = G * H * TJ
        W = R.shape[1]
        for e0 in range(tid, n, NT * U):                # U loads in flight, then U stores
            for u in range(U):
                e = e0 + u * NT
                j = j0 + e % TJ
                buf[u] = acc(R[e // TJ, j]) if e < n and j < W else zero
            for u in range(U):
                e = e0 + u * NT
                if e < n:
                    gk = e // TJ                        # the row of R: gate gk // H, k = gk % H
                    R_slice[gk // H * TJ + e % TJ, gk % H] = buf[u]
        for e in range(tid, G * TJ * KCAP, NT):         # the padding columns H .. KCAP-1
            if e % KCAP >= H:
                R_slice[e // KCAP, e % KCAP] = zero
        cuda.syncthreads()

    return load_columns


@functools.lru_cache(maxsize=None)
def make_split_k(RG: int, RB: int, TB: int, RS: int):
    """Device function split_k(b0, B, NCH, pf) -> (RGN, KS, NR): a tile of rows b0 .. with fewer rows than the
    TB a block holds splits its NCH chunks of K over the row groups the rows leave idle.  Split s works on tile
    rows s*RN .. s*RN + RN-1 (the batch rows b0 ..; RN = the rows rounded up to a multiple of lcm(RH, RB), so
    a staging thread's rows and a row group's rows lie in one split) and on chunks s, s + KS, ...: RGN = RN / RB
    row groups per split, KS = TB // RN splits, NR = ceil(NCH / KS) rounds of KS chunks.  A batch smaller than
    the tile (B = 16 on the 32 rows of H = 768's slice, B = 4 on H = 256's 8) would otherwise leave half the row
    groups idle while the others run every chunk.  Without prefetching (pf False): one split."""
    RH = rows_per_thread(TB, RS)
    L = RH * RB // math.gcd(RH, RB)

    @device
    def split_k(b0, B, NCH, pf):
        RN = (min(TB, B - b0) + L - 1) // L * L if pf else TB
        KS = max(1, TB // RN)
        return RN // RB, KS, (NCH + KS - 1) // KS

    return split_k


@functools.lru_cache(maxsize=None)
def make_reduce_splits(dtype, RB: int, NV: int, TX: int):
    """Device function reduce(vals, red, rg, x, RGN, KS, live): the NV x RB partial sums vals[v, r] of the KS splits
    summed into split 0's threads (rg < RGN) through shared memory red[rg*RB + r, v*TX + x]; a no-op with one
    split.  Every thread of the block calls it (two barriers)."""

    @device
    def reduce(vals, red, rg, x, RGN, KS, live):
        if KS > 1:                                      # the same for the whole block
            if live:
                for v in range(NV):
                    for r in range(RB):
                        red[U(rg * RB + r), U(v * TX + x)] = vals[v, r]
            cuda.syncthreads()
            if rg < RGN:
                for sp in range(1, KS):
                    for v in range(NV):
                        for r in range(RB):
                            vals[v, r] += red[U((sp * RGN + rg) * RB + r), U(v * TX + x)]
            cuda.syncthreads()

    return reduce


@functools.lru_cache(maxsize=None)
def make_staged_product(dtype, sl: Slice, NG: int, TX: int, KCAP: int):
    """Device function: out[r] = sum_{g < NG} sum_{k < K} slice_[g*TX + x, k] * src[d, t_b, b, g*K + k] for the
    thread's RB rows b = b0 + rg*RB + r, where t_b is row b's time index at step s_src (rows not active then
    give 0) and x = threadIdx % TJ (clamped below TX: with TX < TJ the extra threads compute a copy and discard
    it).  slice_ holds KCAP columns, zeros from K on (`make_load_rows`, `make_load_columns`).  A tile with fewer
    rows than row groups splits each gate's KCAP/KC chunks over them (`make_split_k`) and sums the splits through
    shared memory `red` into split 0 (rg < RGN): the other row groups' rows b lie past the batch, as before.

    src is staged KC columns at a time through `tile` (coalesced), a round of KS chunks (one per split) at a
    time; rows, time indexes and offsets are looked up once per row tile (`make_tile_rows`, `make_step_offsets`), and the
    next round's loads are issued before this round's products (they land while it runs).  The k loop has a
    constant trip count KC (unrolled: shared loads at constant offsets, no index arithmetic per k); even and
    odd k accumulate apart (two chains of dependent FMAs instead of one: with RB = 1 a thread has no other
    independent work).  The slice_ reads are a broadcast per row group.  Without prefetching (sl.PF False) each
    chunk is staged by `staging.make_stage_steps` just before it is stored, one split."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    TJ, RG, RB, KC, TB, NT = sl.TJ, sl.RG, sl.RB, sl.KC, sl.TB, sl.threads
    RS = NT // KC                                       # staging: rows apart of one thread's elements
    RH = rows_per_thread(TB, RS)                        # a thread's rows of the tile
    NCH = KCAP // KC                                    # chunks per gate
    KU = unroll(KC, RB)                                 # ks per trip of the k loop: RB FMAs each
    PREFETCH = sl.PF
    NBUF = max(RH, LOADS_IN_FLIGHT)
    assert NT % KC == 0, "staging needs whole rows of KC columns per pass"
    assert KCAP % KC == 0, "the slice's capacity is whole chunks"
    split_k = make_split_k(RG, RB, TB, RS)
    tile_rows = make_tile_rows(TB, RS)
    step_offsets = make_step_offsets(TB, RS)
    fetch = make_fetch(dtype, TB, RS)
    put = make_put_rows(TB, RS)
    stage = make_stage_steps(dtype, TB, RS)
    reduce = make_reduce_splits(dtype, RB, 1, TJ)

    @device
    def product(s_src, lens, src, slice_, tile, red, out, d, b0, K):
        tid = cuda.threadIdx.x
        x = min(tid % TJ, TX - 1)
        rg = tid // TJ
        kc = tid % KC                                   # this thread's column of each staged chunk
        r0 = tid // KC                                  # and its block of staged rows
        RGN, KS, NR = split_k(b0, lens.shape[0], NCH, PREFETCH)   # NR rounds per gate
        sp = rg // RGN                                  # this thread's split: chunks sp, sp + KS, ... of a gate
        live = sp < KS                                  # a row group past the batch and the splits only stages
        buf = cuda.local.array(NBUF, acc)               # the next round, in flight
        rb = cuda.local.array(RH, types.int32)          # the batch row of each staged row, -1: none
        off = cuda.local.array(RH, types.int64)         # the flat index of src[d, its time at s_src, row, 0], -1
        part = cuda.local.array((2, RB), acc)           # even and odd k: two chains of FMAs, not one
        for r in range(RB):
            part[0, r] = zero
            part[1, r] = zero
        kq = kc                                         # the column this thread stages of a round's first chunk
        if PREFETCH:                                    # its rows and their time indexes, once
            kq += tile_rows(rb, b0, lens.shape[0], RGN * RB, KS, r0) * KC
            step_offsets(s_src, lens, src, rb, off, d)
            fetch(src, off, buf, kq, kq < K)            # gate 0, round 0
        for g in range(NG):
            for c in range(NR):
                k0 = (c * KS + sp) * KC                 # this thread's chunk: columns k0 .. of gate g
                if PREFETCH:
                    put(tile, buf, kc, r0)
                else:                                   # this chunk's loads, now (nothing kept between chunks)
                    stage(s_src, lens, src, tile, buf, d, b0, g * K + k0 + kc, k0 + kc < K, kc, r0)
                cuda.syncthreads()
                gn = g                                  # the next round: (g, c + 1), or the next gate's first
                kn = (c + 1) * KS * KC + kq
                if c + 1 == NR:
                    gn = g + 1
                    kn = kq
                if PREFETCH and gn < NG:                # its loads, in flight during this round's products
                    fetch(src, off, buf, gn * K + kn, kn < K)
                if live and k0 < KCAP:
                    for k8 in range(0, KC, KU):
                        for k1 in range(KU):            # unrolled: constant offsets, no loop code
                            kk = k8 + k1
                            w = slice_[U(g * TX + x), U(k0 + kk)]
                            for r in range(RB):         # tile: a broadcast within the row group
                                part[k1 % 2, r] += w * tile[U(rg * RB + r), U(kk)]
                cuda.syncthreads()
        for r in range(RB):
            part[0, r] += part[1, r]
        reduce(part, red, rg, tid % TJ, RGN, KS, live)
        for r in range(RB):
            out[r] = part[0, r]

    return product


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


def gpu_slices(G: int, dtype) -> dict:
    """{H: Slice} of the report's shapes (H = P = 256, 512, 1024)."""
    return {H: plan(G, H, H, dtype, simulator=False) for H in (256, 512, 1024)}


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


__all__ = ["Slice", "SIM_SLICE", "plan", "widen", "widths", "blocks_needed", "slice_bytes", "make_forward_step_v3",
           "make_forward_persistent_v3", "make_backward_step_v3", "make_backward_persistent_v3", "PERSISTENT_ARGS",
           "PERSISTENT_BACKWARD_ARGS", "gpu_slices", "kernel_specs", "choose", "make_record_h_prev",
           "projected_per_block", "make_staged_product", "v3_splits", "v3_rounds", "v3_registers", "v3_limit",
           "v3_co_residency"]


#: the persistent kernel of each phase and its argument table
PERSISTENT = {"forward": (make_forward_persistent_v3, PERSISTENT_ARGS),
              "backward": (make_backward_persistent_v3, PERSISTENT_BACKWARD_ARGS)}


def device_cooperative_limit(phase: str, cell, dtype, sl: Slice, has_proj: bool) -> int:
    """Blocks of the persistent kernel of `phase` that this process's GPU holds at once (its registers and
    shared memory as compiled, the SM count); raises without a GPU.  The profiler's GPU geometry replaces it
    with the simulator's cooperative limit (it runs the GPU's slices in the simulator)."""
    from .common import jit
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
    from .simulator import cooperative_blocks
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


# ---------------------------------------------------------------------------------------------------
# without a device: the rounds of products a block runs (what `widths` ranks), and the blocks a GPU of
# gpus.GPUS holds at once (the estimate `choose` makes before it compiles a wider block; the `_wide` kernel
# specs; the compile report and the roofline model)
# ---------------------------------------------------------------------------------------------------

def v3_splits(B: int, sl) -> list[tuple[int, int]]:
    """(RN, KS) of each row tile of a v3 block (`make_split_k`): a tile of fewer rows than TB splits its
    chunks of K over KS = TB // RN splits of RN rows (the rows rounded up to a multiple of lcm(RH, RB)); one split
    without prefetching."""
    RS = sl.threads // sl.KC
    RH = -(-sl.TB // RS)
    L = RH * sl.RB // math.gcd(RH, sl.RB)
    out = []
    for b0 in range(0, B, sl.TB):
        RN = -(-min(sl.TB, B - b0) // L) * L if sl.PF else sl.TB
        out.append((RN, max(1, sl.TB // RN)))
    return out


def v3_rounds(B: int, sl) -> int:
    """Rounds of staged products one thread of a v3 block runs per gate and step for a batch of B rows: over
    its row tiles, the KMAX / KC chunks of K shared by each tile's KS splits (`v3_splits`)."""
    nch = sl.KMAX // sl.KC
    return sum(-(-nch // KS) for _, KS in v3_splits(B, sl))


#: registers per thread of lstm_forward_persistent_v3 (float32, sm_90) as ptxas allocates them:
#: `numbarnn kernels --cc 90 --only persistent_v3` (compiled at the H = 512 slice, TJ = 4).  The co-residency
#: estimate below (`v3_registers`) uses it for every GPU and slice of TJ > 2; the TJ = 2 slices take
#: V3_REGISTERS_TJ2.  The driver on a GPU asks the device with the compiled kernel
#: (`device_cooperative_limit`).
#: 138 before the k loop's vector loads (4 words of every gate's row and of h live at once), 168 with them.
V3_REGISTERS = 168
#: the same for lstm_backward_persistent_v3 (`numbarnn kernels --cc 90 --only backward_persistent_v3`; 163
#: before the vector loads)
V3_BACKWARD_REGISTERS = 168
#: the TJ = 2 slices (H = 768, 1024: 16 staged rows a thread), sm_90, forward and backward, at 64 and at 128
#: threads alike (a thread's work does not depend on the block's width, `widen`; ptxas gave the forward
#: 168 at 96 threads); sm_80 takes 222 / 225 there.  Measured with the compile report's link_info_log of the
#: H = 768 slice's kernels.
V3_REGISTERS_TJ2 = {"forward": 172, "backward": 168}


def v3_registers(TJ: int, phase: str = "forward") -> int:
    """The registers a thread of the persistent v3 kernel of `phase` is estimated to take at a slice of TJ
    units (sm_90 figures, the estimate for every GPU: the device decides on a GPU)."""
    if TJ <= 2:
        return V3_REGISTERS_TJ2[phase]
    return V3_REGISTERS if phase == "forward" else V3_BACKWARD_REGISTERS


def v3_limit(cc, sms: int, G: int, sl, dtype="float32", registers: int = V3_REGISTERS) -> int | None:
    """Blocks of a v3 slice `sl` co-resident on a GPU of compute capability cc with `sms` SMs (SMs x resident
    blocks per SM, from the per-SM limits of gpus.ARCH / gpus.SM_LIMITS_EXTRA, the slice's shared memory and
    `registers` a thread); None for a compute capability neither table has."""
    arch = ARCH.get(tuple(cc)) or SM_LIMITS_EXTRA.get(tuple(cc))
    if arch is None:
        return None
    shared = slice_bytes(G, sl, dtype)
    if tuple(cc) >= (9, 0):
        shared += arch["smem_reserved"]        # gpus.resident_blocks takes the linker's count (reserve in)
    return resident_blocks(tuple(cc), sl.threads, registers, shared, arch=arch) * sms


def v3_co_residency(gpu: GPU, H: int, P: int, G: int = 4, D: int = 1, dtype="float32",
                    registers: int | None = None, B: int | None = None, phase: str = "forward") -> tuple:
    """(Slice or None, blocks needed, co-resident limit, why) of the persistent v3 kernel of `phase` on `gpu`,
    as `choose` decides on a device: the slice from `plan` (the largest TJ whose R slice fits), all
    `blocks_needed` blocks co-resident, and given the batch B the first of `widths` (wider blocks)
    that is.  choose asks the device (max_cooperative_grid_blocks); here the limit is `v3_limit`, with
    `registers` a thread (default `v3_registers`)."""
    base = plan(G, H, P, dtype, simulator=False)
    if base is None:
        return None, 0, 0, f"the R slice for P={P} does not fit {SMEM_BUDGET} bytes of shared memory"
    n = blocks_needed(H, D, base)
    fallback = None
    for sl in ([base] if B is None else widths(G, base, B, dtype)):
        regs = v3_registers(sl.TJ, phase) if registers is None else registers
        limit = v3_limit(gpu.cc, gpu.sms, G, sl, dtype, regs)
        per_sm = limit // gpu.sms
        if n <= limit:
            return sl, n, limit, (f"v3: {n} blocks (TJ={sl.TJ}, {sl.threads} threads) co-resident, limit "
                                  f"{per_sm} per SM x {gpu.sms} = {limit}")
        fallback = (f"v3 not co-resident: {n} blocks of {sl.threads} threads needed, {per_sm} per SM "
                    f"x {gpu.sms} SMs = {limit}: v2 runs")
    return None, n, limit, fallback

"""v3's building blocks (device functions): the R slice loaded once into shared memory, by rows (forward) or by
columns (backward), and one staged product of a row tile against it, its chunks of K split over idle row groups
and the splits' partial sums added through shared memory.  step_v3.py assembles the kernels from them."""
from __future__ import annotations

import functools
import math

from numba import cuda, types

from .common import U, acc_dtype, device
from .staging import (LOADS_IN_FLIGHT, make_fetch, make_put_rows, make_stage_steps, make_step_offsets, make_tile_rows,
                      rows_per_thread, unroll)
from .v3_slices import Slice


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

"""Staging tiles through shared memory: the global loads the tiled step kernels (v2, v3) share.

A block computes a small product out of shared memory, so every chunk of its operands is first copied there
("staged") by all its threads together.  Two shapes of staging:

  rows of an operand that every step indexes by batch row (h, or dgh of one step): thread tid owns column
      kc = tid % KC of each chunk and RH = ceil(TB / RS) consecutive tile rows r0*RH .. r0*RH + RH-1
      (r0 = tid // KC, RS = threads // KC).  The batch rows (`make_tile_rows`), their time indexes and the
      flat index of each row's first element (`make_row_offsets`, `make_step_offsets`) are computed once per
      row tile, not per element; a chunk's loads (`make_fetch`: `src.flat[off + col]`, one add each) are
      all in flight before the first store (`make_put_rows`), so a caller can issue the next chunk's loads
      before this chunk's products (v3's prefetch) or before its other staging (v2).  Where registers are tight (v3 without prefetch), `make_stage_rows` and
      `make_stage_steps` do the same with nothing kept between chunks.
  rows of a weight matrix (`make_stage_matrix`): thread tid owns one column and every RS-th row,
      LOADS_IN_FLIGHT loads before their stores.

Both read consecutive columns with consecutive threads (coalesced), index with unsigned integers
(`common.U`: Python's negative-index wrap-around costs a shift, a mask and an add per index otherwise), and
loop with constant trip counts (unrolled by NVVM).  What that bought, counted in the SASS (`python -m
numbarnn.analysis.sass`, sm_90, LSTM float32), is in bench/results/gpu_h100.md.
"""
from __future__ import annotations

import functools
import math

from ..util import cdiv
from .common import U, acc_dtype, device
#: VECTOR_BYTES: an LDS.128, the widest shared load (numbarnn.kernels.gpus: the profiler counts the vector loads
#: the k loops compile to with the same figure)
from .gpus import VECTOR_BYTES

#: loads each thread issues before its first store when it stages a tile: a staging loop that stores each load
#: before the next one waits one full global-memory latency per element (measured on an H100: the v2 forward
#: step at H=768 B=16 took 808 us, 69% of it stalled on L1TEX, with 64 threads each walking 64 elements of R
#: per chunk one at a time).  A fixed trip count, so numba unrolls it and the loads are in flight together.
LOADS_IN_FLIGHT = 8
#: the k loop of a chunk (v2 and v3) runs KC // KU trips of KU ks, KU = unroll(...): NVVM unrolls a constant
#: trip count of 8 fully (every shared load at a constant offset, no loop code), not 16 or 32 (by 2-4, with a
#: counter and selects per k): v3's LSTM forward k loop, H = 512 slice, sm_90 (python -m numbarnn.analysis.sass),
#: 86 SASS instructions per 32 FMAs at 8, 88 per 16 at 16.  The tiles are zero past the product's width, so
#: every chunk runs all KC (a run-time trip count was neither unrolled nor free of numba's range-iterator code).
UNROLL = 8
#: ... and only while the unrolled body is small: v2's LSTM forward k (4 gates x 4 rows = 16 FMAs) at 8 ks a
#: trip was unrolled by 2 only (77 instructions per 32 FMAs, 2.4 a FMA), at 4 fully (108 per 64, 1.7)
MAX_UNROLLED_FMA = 64


def unroll(KC: int, fma_per_k: int) -> int:
    """ks per trip of a chunk's k loop: UNROLL, halved while the body would hold more than MAX_UNROLLED_FMA
    multiply-adds, at most KC (a power of two, so it divides the chunk)."""
    ku = UNROLL
    while ku > 1 and ku * fma_per_k > MAX_UNROLLED_FMA:
        ku //= 2
    return min(KC, ku)


def vector_words(dtype) -> int:
    """VW: words of the compute dtype in one 16-byte shared load (4 float32, 2 float64)."""
    return VECTOR_BYTES // acc_dtype(dtype).itemsize


def vector_ks(dtype, KU: int) -> int:
    """V: the consecutive k a k loop of KU unrolled ks reads from a row at once, one 16-byte shared load
    (gcd(VW, KU): 4 float32 or 2 float64 words on a GPU, fewer where the simulator's chunks are smaller)."""
    return math.gcd(vector_words(dtype), KU)


def pitch(n: int, dtype) -> int:
    """Words between rows of a shared array of n-word rows (R's tile or slice, the h tile): n rounded up to VW,
    + VW.  A row then starts on a 16-byte boundary (the arrays are 16-byte aligned), so NVVM fuses a thread's VW
    consecutive k into one LDS.128 (4 float32 or 2 float64 words): a quarter (float64: half) of the loads.
    The extra VW words move each row 16 bytes further along the banks: the TJ rows of R (or the row groups'
    rows of h) a warp reads at one k cover distinct banks, up to 32 / VW rows a wavefront (rows KC words apart
    would all start in bank 0: a 32/TJ-way conflict, the layout the profiler's model caught at first)."""
    VW = vector_words(dtype)
    return cdiv(n, VW) * VW + VW


def rows_per_thread(TB: int, RS: int) -> int:
    """RH: the tile rows one staging thread owns (ceil(TB / RS))."""
    return cdiv(TB, RS)


@functools.cache
def make_tile_rows(TB: int, RS: int):
    """Device function tile_rows(rb, b0, B, RN, KS, r0) -> split: this thread stages the RH = ceil(TB/RS)
    consecutive tile rows bb = r0*RH + i.  A row tile of b0 .. runs KS splits of K side by side (v3's
    `make_split_k`; RN, the rows per split, is a multiple of RH, so a thread's rows lie in one split), split s
    on tile rows s*RN .. s*RN + RN-1, which hold batch rows b0 .. b0+RN-1; without splits RN = TB, KS = 1.
    rb[i] = the batch row of tile row bb, -1 past the splits, the tile or the batch; returns the thread's split.
    Once per row tile: a chunk's loads then test one register, and all of a thread's rows share one column."""
    RH = rows_per_thread(TB, RS)

    @device
    def tile_rows(rb, b0, B, RN, KS, r0):
        sp = r0 * RH // RN
        for i in range(RH):
            b = b0 + r0 * RH + i - sp * RN
            rb[i] = b if sp < KS and b < B and r0 * RH + i < TB else -1
        return sp

    return tile_rows


@functools.cache
def make_row_offsets(TB: int, RS: int):
    """Device function row_offsets(h, rb, off, d): off[i] = the flat (C-order) index of h[d, rb[i], 0] in an
    operand h[D, B, W], -1 where rb[i] < 0.  Once per row tile: a staged element is then h.flat[off[i] + k]."""
    RH = rows_per_thread(TB, RS)

    @device
    def row_offsets(h, rb, off, d):
        B = h.shape[1]
        W = h.shape[2]
        for i in range(RH):
            b = rb[i]
            off[i] = (d * B + b) * W if b >= 0 else -1

    return row_offsets


@functools.cache
def make_step_offsets(TB: int, RS: int):
    """Device function step_offsets(s_src, lens, src, rb, off, d): off[i] = the flat (C-order) index of
    src[d, t_i, rb[i], 0] in an operand src[D, T, B, W] written per step, where t_i is row rb[i]'s time index at
    step s_src (s_src forward, len[b]-1-s_src in reverse); -1 where rb[i] < 0 or the row is not active at s_src
    (s_src < 0 or >= len[b]).  Once per row tile, not per staged element."""
    RH = rows_per_thread(TB, RS)

    @device
    def step_offsets(s_src, lens, src, rb, off, d):
        T = src.shape[1]
        B = src.shape[2]
        W = src.shape[3]
        for i in range(RH):
            b = rb[i]
            e = -1
            if b >= 0:
                n = lens[b]
                if s_src >= 0 and s_src < n:
                    t_ = s_src if d == 0 else n - 1 - s_src
                    e = ((d * T + t_) * B + b) * W
            off[i] = e

    return step_offsets


@functools.cache
def make_fetch(dtype, TB: int, RS: int):
    """Device function fetch(src, off, buf, col, ok): buf[i] = src.flat[off[i] + col], zeros where off[i] < 0
    (no row, or not active) or `ok` is False (a column past the product's width); every load in flight before
    any is used (stored with `make_put_rows`).  One add and an address per load: the row's part of the index
    (`make_row_offsets`, `make_step_offsets`) is computed once, not a 64-bit product per row and chunk (v3's
    backward recomputed 8 of them a round, ~12 instructions each, with the array's strides reloaded)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    RH = rows_per_thread(TB, RS)

    @device
    def fetch(src, off, buf, col, ok):
        for i in range(RH):
            e = off[i]
            buf[i] = acc(src.flat[U(e + col)]) if ok and e >= 0 else zero

    return fetch


@functools.cache
def make_put_rows(TB: int, RS: int):
    """Device function put(tile, buf, kc, r0): tile[r0*RH + i, kc] = buf[i] (the rows of `make_tile_rows`)."""
    RH = rows_per_thread(TB, RS)
    FULL = TB % RS == 0                         # every thread's rows lie in the tile: no check

    @device
    def put(tile, buf, kc, r0):
        for i in range(RH):
            bb = r0 * RH + i
            if FULL or bb < TB:
                tile[U(bb), U(kc)] = buf[i]

    return put


@functools.cache
def make_stage_rows(dtype, TB: int, RS: int):
    """Device function stage_rows(h, tile, buf, d, b0, k, kc, r0, B, P): tile[bb, kc] = h[d, b0 + bb, k] for this
    thread's rows bb = r0, r0 + RS, ... < TB (zeros past the batch B or the width P), all ceil(TB / RS) loads in
    flight before the stores.  The register-lean form of `make_tile_rows` + `make_fetch_rows` + `make_put_rows`:
    nothing stays live between chunks (v3's kernels that do not prefetch, float64 at TJ = 1, where keeping a
    thread's rows in registers spilled)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    RH = rows_per_thread(TB, RS)
    FULL = TB % RS == 0                         # every thread's rows lie in the tile (r0 < RS): no check

    @device
    def stage_rows(h, tile, buf, d, b0, k, kc, r0, B, P):
        for i in range(RH):
            bb = r0 + i * RS
            b = b0 + bb
            buf[i] = h[d, U(b), U(k)] if (FULL or bb < TB) and b < B and k < P else zero
        for i in range(RH):
            bb = r0 + i * RS
            if FULL or bb < TB:
                tile[U(bb), U(kc)] = buf[i]

    return stage_rows


@functools.cache
def make_stage_steps(dtype, TB: int, RS: int):
    """Device function stage_steps(s_src, lens, dgh, tile, buf, d, b0, col, ok, kc, r0): tile[bb, kc] =
    dgh[d, t_b, b0 + bb, col] of step s_src for this thread's rows bb = r0, r0 + RS, ... < TB, t_b row b's time
    index then; zeros for rows past B, rows not active at s_src and `ok` False.  The register-lean form of
    `make_tile_rows` + `make_row_times` + `make_fetch_steps` + `make_put_rows` (lengths looked up per element,
    nothing live between chunks: see `make_stage_rows`)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    NL = LOADS_IN_FLIGHT
    RH = rows_per_thread(TB, RS)

    @device
    def stage_steps(s_src, lens, dgh, tile, buf, d, b0, col, ok, kc, r0):
        B = lens.shape[0]
        for i0 in range(0, RH, NL):
            for u in range(NL):
                bb = r0 + (i0 + u) * RS
                b = b0 + bb
                buf[u] = zero
                if ok and bb < TB and b < B and s_src >= 0 and s_src < lens[b]:
                    t_ = s_src if d == 0 else lens[b] - 1 - s_src
                    buf[u] = acc(dgh[d, U(t_), U(b), U(col)])
            for u in range(NL):
                bb = r0 + (i0 + u) * RS
                if bb < TB:
                    tile[U(bb), U(kc)] = buf[u]

    return stage_steps


@functools.cache
def make_stage_matrix(dtype, NG: int, NR: int, RS: int):
    """Device function stage(M, tile, buf, row0, stride, lim, k, kin, col, r):
    tile[g*NR + rr, col] = M[g*stride + row0 + rr, k] for each of NG groups of NR rows and this thread's rows
    rr = r, r + RS, ... < NR; zeros where row0 + rr >= lim or kin is False.  A weight matrix's rows that a block
    multiplies (v2: R's G*TJ rows of the block's units, stride H; or KC rows of R, NG = 1), one column per
    thread (consecutive threads, consecutive k: coalesced), min(LOADS_IN_FLIGHT, rows) loads before their
    stores.  buf holds at least that many values.

    M is read through its flat iterator (`M.flat[e]`: C order; for a C-contiguous array, which every kernel
    signature declares, numba indexes the data pointer directly): a thread's next element is RS*W further on
    (the same for every thread), so a load costs one add and its address, not a 64-bit row x width product.
    (`M.reshape` would call numba's run-time helper numba_attempt_nocopy_reshape.)"""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    RJ = cdiv(NR, RS)                           # a thread's rows per group
    NL = min(LOADS_IN_FLIGHT, RJ)
    FULL = NR % RS == 0 and RJ % NL == 0        # every row a thread visits lies in the tile: no check

    @device
    def stage(M, tile, buf, row0, stride, lim, k, kin, col, r):
        W = M.shape[1]
        step = RS * W                           # elements between a thread's rows (the same for all threads)
        left = lim - row0 - r                   # rows rr = r + i*RS exist while i*RS < left
        for g in range(NG):
            e = (g * stride + row0 + r) * W + k     # element (g*stride + row0 + r, k): this thread's first
            for i0 in range(0, RJ, NL):
                for u in range(NL):
                    i = i0 + u
                    ok = (FULL or r + i * RS < NR) and i * RS < left and kin
                    buf[u] = acc(M.flat[U(e)]) if ok else zero
                    e += step
                for u in range(NL):
                    rr = r + (i0 + u) * RS
                    if FULL or rr < NR:
                        tile[U(g * NR + rr), U(col)] = buf[u]

    return stage

"""Once-per-layer kernels around the time loop: dropout, skip input, bias-gradient sums.

    dropout_forward   x_l = y_{l-1} * keep * scale, keep from Philox4x32-10 (SPEC 6), flags saved
    apply_mask        out = src * keep * scale (dropout backward, and x_l again for dW)
    tile_gates        skip_input: gx[., g*H + j] = x[., j] for every gate g (W = identity)
    sum_gates         skip_input backward: dx[., j] = sum_d sum_g dgx[d, ., g*H + j]
    column_sums       bias gradients (and cell-vector gradients): out[s, c] = sum_r src_s[r, c] over the
                      T*B rows, deterministic (no float atomics: two identical calls are bit-identical)

Column sums, numbered like the GEMMs:
    v1 column_sums / row_sum   one thread per column runs serially over all N = T*B rows: 2*G*H threads
                               (a few blocks) each doing N dependent adds, so a GPU is mostly idle.
    v2 column_partials +       two stages, both in a fixed order: (1) a grid of (column tiles x row chunks
       column_totals           x sources) blocks; a block sums ROWS rows of TC columns: thread (ty, tx)
                               adds rows ty, ty + TR, ... of its chunk for column tx (coalesced: a warp reads
                               TC consecutive columns), then a shared-memory tree over ty (fixed pairs)
                               gives partial[s, chunk, c]; (2) one thread per column adds the
                               ceil(N / ROWS) partials in chunk order.  The result depends on the tile
                               constants (a different but fixed rounding order from v1), never on timing.
`column_sums` (host) launches v2 through the driver's launch log; `column_sums_launches` lists the launches
for the launch plan.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, uint64

from . import target
from .common import DTYPES, acc_dtype, arr, blocks, jit, nb, threads
from .philox import dropout_keep


@functools.cache
def make_dropout_forward(dtype):
    t = acc_dtype(dtype).type
    one, zero = t(1.0), t(0.0)

    def dropout_forward(
        y,          # [N] = [T*B*W] flat   previous layer's output
        base,       # uint64               Philox element index of y[0]: (l-1)*T*B*W
        k0,         # uint32               key low word  (seed2)
        k1,         # uint32               key high word (seed)
        threshold,  # uint32               keep iff (bits >> 8) >= threshold
        scale,      # acc                  1/(1-p) (0 when p == 1)
        keep,       # [N] out              keep flags 0/1 (reserve)
        x,          # [N] out              dropped-out layer input
    ):
        n = cuda.grid(1)
        if n < y.shape[0]:
            if dropout_keep(base + uint64(n), k0, k1, threshold):
                keep[n] = one
                x[n] = t(y[n]) * scale
            else:
                keep[n] = zero
                x[n] = zero
    return dropout_forward


@functools.cache
def make_apply_mask(dtype):
    t = acc_dtype(dtype).type

    def apply_mask(
        src,    # [N]
        keep,   # [N]  0/1
        scale,  # acc
        out,    # [N]
    ):
        n = cuda.grid(1)
        if n < src.shape[0]:
            out[n] = t(src[n]) * t(keep[n]) * scale
    return apply_mask


@functools.cache
def make_tile_gates(dtype):
    def tile_gates(
        x,    # [N, H]     layer input (skip_input: I == H)
        gx,   # [N, G*H]   out
    ):
        n = cuda.grid(1)
        N, GH = gx.shape[0], gx.shape[1]
        H = x.shape[1]
        if n < N * GH:
            r = n // GH
            gx[r, n % GH] = x[r, (n % GH) % H]
    return tile_gates


@functools.cache
def make_sum_gates(dtype):
    t = acc_dtype(dtype).type

    def sum_gates(
        dgx,   # [D, N, G*H]
        dx,    # [N, H]  out
    ):
        n = cuda.grid(1)
        N, H = dx.shape[0], dx.shape[1]
        D, GH = dgx.shape[0], dgx.shape[2]
        if n < N * H:
            r = n // H
            j = n % H
            total = t(0.0)
            for d in range(D):
                for g in range(GH // H):
                    total += t(dgx[d, r, g * H + j])
            dx[r, j] = total
    return sum_gates


@functools.cache
def make_column_sums(dtype):
    """v1: one thread per column of a or b, serially over all rows (kept for teaching; the driver runs v2)."""
    t = acc_dtype(dtype).type

    def column_sums(
        a,     # [N, C]
        b,     # [N, C]
        out,   # [2, C]  out[0] = sum_rows a, out[1] = sum_rows b
    ):
        col = cuda.grid(1)
        N, C = a.shape[0], a.shape[1]
        if col < 2 * C:
            src = a if col < C else b
            c = col % C
            total = t(0.0)
            for r in range(N):               # fixed order: deterministic
                total += t(src[r, c])
            out[col // C, c] = total
    return column_sums


@functools.cache
def make_row_sum(dtype):
    """out[c] = sum_r a[r, c] in a fixed order (the cell-vector gradients; column_sums for two sources)."""
    t = acc_dtype(dtype).type

    def row_sum(
        a,     # [N, C]
        out,   # [C]
    ):
        col = cuda.grid(1)
        N, C = a.shape[0], a.shape[1]
        if col < C:
            total = t(0.0)
            for r in range(N):
                total += t(a[r, col])
            out[col] = total
    return row_sum


# ---------------------------------------------------------------------------------------------------
# column sums v2: deterministic two-stage reduction
# ---------------------------------------------------------------------------------------------------

#: (TC columns, TR thread rows, ROWS rows per chunk) of column_partials; a block has TC * TR threads
COLUMN_SUMS_GPU = (32, 8, 256)
COLUMN_SUMS_SIM = (4, 2, 4)      # the simulator: several column tiles, chunks and tree levels at tiny sizes


def column_sums_config(simulator: bool | None = None) -> tuple:
    return COLUMN_SUMS_SIM if target.simulator(simulator) else COLUMN_SUMS_GPU


@functools.cache
def make_column_partials(dtype, TC: int, TR: int, ROWS: int):
    # v2 stage 1: a block reduces a chunk of ROWS rows for TC columns (serial adds, then a shared-memory tree in fixed order).
    if TR & (TR - 1) or ROWS % TR:
        raise ValueError(f"config: TR={TR} must be a power of two and ROWS={ROWS} a multiple of it")
    t = acc_dtype(dtype).type
    ACC_T = nb(acc_dtype(dtype))
    PER_THREAD = ROWS // TR

    def column_partials(
        a,        # [N, C]        source 0
        b,        # [N, C]        source 1 (read only when the grid has 2 sources in z)
        partial,  # [S, R, C] out partial[s, r, c] = sum of rows r*ROWS .. r*ROWS + ROWS - 1 of source s
    ):
        sh = cuda.shared.array((TR, TC), ACC_T)   # [TR, TC]: one sum per thread, then the tree
        tid = cuda.threadIdx.x                     # block: TC * TR threads, flat
        tx = tid % TC                              # column within the tile (fastest: coalesced reads)
        ty = tid // TC                             # row lane within the chunk
        col = cuda.blockIdx.x * TC + tx
        chunk = cuda.blockIdx.y
        s = cuda.blockIdx.z
        src = a if s == 0 else b
        N, C = src.shape[0], src.shape[1]
        total = t(0.0)
        if col < C:
            for k in range(PER_THREAD):            # rows chunk*ROWS + ty, + TR, + 2 TR, ... (fixed order)
                r = chunk * ROWS + ty + k * TR
                if r < N:
                    total += t(src[r, col])
        sh[ty, tx] = total
        cuda.syncthreads()
        half = TR // 2
        while half > 0:                            # tree over ty: lane ty adds lane ty + half (fixed pairs)
            if ty < half:
                sh[ty, tx] += sh[ty + half, tx]
            cuda.syncthreads()
            half //= 2
        if ty == 0 and col < C:
            partial[s, chunk, col] = sh[0, tx]
    return column_partials


@functools.cache
def make_column_totals(dtype):
    # v2 stage 2: one thread per (source, column) adds the per-chunk partials in chunk order.
    t = acc_dtype(dtype).type
    out_t = np.dtype(dtype).type

    def column_totals(
        partial,  # [S, R, C]  from column_partials (compute dtype)
        out,      # [S, C]     out[s, c] = sum_r partial[s, r, c]
    ):
        n = cuda.grid(1)
        S, R, C = partial.shape[0], partial.shape[1], partial.shape[2]
        if n < S * C:
            s = n // C
            c = n % C
            total = t(0.0)
            for r in range(R):
                total += partial[s, r, c]
            out[s, c] = out_t(total)
    return column_totals


def column_sums_launches(N: int, C: int, S: int, simulator: bool | None = None) -> list[tuple]:
    """[(kernel name, grid, block)] of the two launches of column_sums for N rows, C columns, S sources."""
    TC, TR, ROWS = column_sums_config(simulator)
    R = max(1, math.ceil(N / ROWS))            # N == 0: one empty chunk, so the totals are written (zeros)
    t = threads(S * C, 256, simulator=simulator)
    return [("column_partials", (blocks(C, TC), R, S), TC * TR),
            ("column_totals", (blocks(S * C, t),), t)]


def column_sums(launch, a, b, out, scratch=None):
    """out[0] = sum over rows of a, out[1] = of b (b None: out[0] only), deterministic (v2, two stages).

    launch(kernel, name, grid, block, *args): the driver's LaunchLog (or any launcher with that call).
    a, b: device arrays [N, C] of one dtype; out: device array [S, C] (S = 2, or 1 without b), same dtype.
    scratch(name, shape, dtype) -> the partial sums' buffer (the driver's workspace); None: a new array.
    """
    dt = str(np.dtype(a.dtype))
    S = 1 if b is None else 2
    N, C = a.shape
    if tuple(out.shape) != (S, C):
        raise ValueError(f"out: expected shape {(S, C)}, got {tuple(out.shape)}")
    (name1, grid1, block1), (name2, grid2, block2) = column_sums_launches(N, C, S)
    shape = (S, grid1[1], C)                                               # [S, R, C] partial sums
    partial = (cuda.device_array(shape, dtype=acc_dtype(dt)) if scratch is None
               else scratch("column_partials", shape, acc_dtype(dt)))
    launch(jit(make_column_partials, dt, *column_sums_config()), name1, grid1, block1,
           a, a if b is None else b, partial)
    launch(jit(make_column_totals, dt), name2, grid2, block2, partial, out)
    return out


def kernel_specs():
    specs = []
    for dt in DTYPES:
        a = str(acc_dtype(dt))
        f1, f2, f3 = arr(dt, 1), arr(dt, 2), arr(dt, 3)
        specs += [
            ("dropout_forward", dt, make_dropout_forward(dt),
             (f1, nb("uint64"), nb("uint32"), nb("uint32"), nb("uint32"), nb(a), f1, f1), 128),
            ("apply_mask", dt, make_apply_mask(dt), (f1, f1, nb(a), f1), 128),
            ("tile_gates", dt, make_tile_gates(dt), (f2, f2), 128),
            ("sum_gates", dt, make_sum_gates(dt), (f3, f2), 128),
            ("column_sums", dt, make_column_sums(dt), (f2, f2, f2), 128),
            ("row_sum", dt, make_row_sum(dt), (f2, f1), 128),
            ("column_partials", dt, make_column_partials(dt, *COLUMN_SUMS_GPU), (f2, f2, arr(a, 3)),
             COLUMN_SUMS_GPU[0] * COLUMN_SUMS_GPU[1]),
            ("column_totals", dt, make_column_totals(dt), (arr(a, 3), f2), 256),
        ]
    return specs

"""Once-per-layer kernels around the time loop: dropout, skip input, bias-gradient sums.

    dropout_forward   x_l = y_{l-1} * keep * scale, keep from Philox4x32-10 (SPEC 6), flags saved
    apply_mask        out = src * keep * scale (dropout backward, and x_l again for dW)
    tile_gates        skip_input: gx[., g*H + j] = x[., j] for every gate g (W = identity)
    sum_gates         skip_input backward: dx[., j] = sum_d sum_g dgx[d, ., g*H + j]
    column_sums       bias gradients: a deterministic sum over the T*B rows (no float atomics), so two
                      identical calls give bit-identical results
"""
from __future__ import annotations

import functools

from numba import cuda, uint64

from .common import DTYPES, acc_dtype, arr, nb
from .philox import dropout_keep


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
def make_column_sums(dtype):
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


@functools.lru_cache(maxsize=None)
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
        ]
    return specs

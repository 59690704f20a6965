"""The cell's pointwise code inside the tiled (v2) and persistent (v3) step kernels: their shared epilogues.

A v2 or v3 step computes the recurrent products for a tile of units and rows, then hands each unit j its rows'
products; the epilogue runs the cell's own forward (or backward) on them, exactly as v1's per-thread step does,
and writes the state, the output and what backward needs.  One definition for both versions keeps their cell
math identical (the simulator tests compare v2 and v3 with v1 and the reference).  The backward's argument table
(`BACKWARD_V2_ARGS`, v1's with R joined and dh one buffer) is theirs too.
"""
from __future__ import annotations

import functools

from numba import cuda, int64

from .cell_steps import BACKWARD_ARGS, device_function
from .common import acc_dtype, device


# ---------------------------------------------------------------------------------------------------
# argument table of the fused backward (derived from v1's BACKWARD_ARGS: R joins, dh is one buffer)
# ---------------------------------------------------------------------------------------------------

def _backward_v2_table():
    by_name = {row[0]: row for row in BACKWARD_ARGS}
    ALWAYS = by_name["s"][4]
    rows = []
    for row in BACKWARD_ARGS:
        name = row[0]
        if name in ("Wp_fwd", "Wp_rev", "dh_total", "dh_in"):   # no projection: no W_proj, no dh_total
            continue
        if name == "dh_out":
            rows.append(("dh", "a", 3, "[D, B, P] dh, in place: dh reaching step s, then the direct term",
                         ALWAYS))
            continue
        if name == "s":
            rows.append(("s", "i64", 0, "step index (runs T-1 .. 0, then -1: finish dh0)", ALWAYS))
            continue
        rows.append(row)
        if name == "unit_params":
            rows.append(("R_fwd", "s", 2, "[G*H, P] recurrent matrices, forward direction", ALWAYS))
            rows.append(("R_rev", "s", 2, "[G*H, P] ... reverse direction", ALWAYS))
    return tuple(rows)


BACKWARD_V2_ARGS = _backward_v2_table()


@functools.lru_cache(maxsize=None)
def make_forward_epilogue(cell, dtype, RB: int):
    """Device function: the cell's pointwise forward at unit j for rows b_first .. b_first+RB-1 (those < B),
    given their recurrent products rh[g, r] (no bias yet).  Shared by v2 and v3."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    pointwise = device_function(cell.forward, dtype)

    @device
    def epilogue(s, lens, gx, unit_params, h_in, h_out, c, y, acts, cs, ms, rh, d, j, b_first):
        H = unit_params.shape[2]
        P = h_in.shape[2]
        B = lens.shape[0]
        wx = cuda.local.array(G, acc)
        rh_b = cuda.local.array(G, acc)
        v = cuda.local.array(VL, acc)
        saved = cuda.local.array(S, acc)
        for k in range(V):
            v[k] = acc(unit_params[d, 2 * G + k, j])
        for r in range(RB):
            b = b_first + r
            if b >= B:
                break
            if s >= lens[b]:                    # past the length: carry the state, no output
                if h_out is not None:
                    h_out[d, b, j] = h_in[d, b, j]
                continue
            t_ = s if d == 0 else lens[b] - 1 - s
            for g in range(G):
                wx[g] = acc(gx[d, t_, b, g * H + j]) + acc(unit_params[d, g, j])
                rh_b[g] = rh[g, r] + acc(unit_params[d, G + g, j])
            h_unit = h_in[d, b, j] if h_out is not None else zero   # with a projection the cell never reads h
            c_prev = c[d, b, j] if c is not None else zero
            m, c_new = pointwise(wx, rh_b, v, h_unit, c_prev, saved)
            for k in range(S):
                acts[d, t_, b, k * H + j] = saved[k]
            if c is not None:
                c[d, b, j] = c_new
                cs[d, t_, b, j] = c_new
            if h_out is not None:
                h_out[d, b, j] = m
                y[t_, b, d * P + j] = m
            if ms is not None:
                ms[d, t_, b, j] = m

    return epilogue


@functools.lru_cache(maxsize=None)
def make_backward_epilogue(cell, dtype, RB: int, has_proj: bool = False):
    """Device function: the cell's pointwise backward at step s, unit j, rows b_first .. b_first+RB-1 (those
    < B), given from_R[r] = (dgh_{s+1} R)[b, j].  dh[d, b, j] holds the direct term (or the carry) and leaves
    with the next one.  Shared by v2 and v3 (cells without a projection: P == H).

    has_proj (v3's projection kernel): from_R[r] is then dm itself, W_proj^T (dy + dh) at (b, j), computed
    by the caller; the cell never reads h, nothing bypasses R, dh is another phase's business and h_prev
    (None) another kernel's: only rows active at s run (s >= 0)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    SPLIT = cell.split_mask
    PROJ = has_proj
    pointwise = device_function(cell.backward, dtype)

    @device
    def epilogue(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, from_R, d, j,
                 b_first):
        H = dgx.shape[3] // G
        P = h0.shape[2]                         # == H (read only without a projection)
        B = lens.shape[0]
        step = int64(1) if d == 0 else int64(-1)
        saved = cuda.local.array(S, acc)
        v = cuda.local.array(VL, acc)
        dwx = cuda.local.array(G, acc)
        drh = cuda.local.array(G, acc)
        dv = cuda.local.array(VL, acc)
        if unit_params is not None:
            for k in range(V):
                v[k] = acc(unit_params[d, 2 * G + k, j])
        for r in range(RB):
            b = b_first + r
            if b >= B:
                break
            if PROJ:
                if s < 0 or s >= lens[b]:       # dh is [D, B, P]: not this phase's (j runs to H)
                    continue
            else:
                dh_now = dh[d, b, j] + from_R[r]    # dh reaching step s (direct term + R's part, or the carry)
                if s < 0 or s >= lens[b]:       # no cell at this step: dh carries (s = -1: it is dh0)
                    dh[d, b, j] = dh_now
                    continue
            t_ = s if d == 0 else lens[b] - 1 - s
            first = s == 0
            if PROJ:                            # dm = W_proj^T (dy + dh), from the caller; h is never read
                hp = zero
                dm = from_R[r]
            else:
                hp = acc(h0[d, b, j]) if first else acc(y[t_ - step, b, d * P + j])
                if h_prev is not None:          # (None in the projection kernel, which types this branch too)
                    h_prev[d, t_, b, j] = hp
                dm = acc(dy[t_, b, d * P + j]) + dh_now
            for k in range(S):
                saved[k] = acc(acts[d, t_, b, k * H + j])
            c_prev = zero
            c_new = zero
            dcell = zero
            if cs is not None:
                c_prev = acc(c0[d, b, j]) if first else acc(cs[d, t_ - step, b, j])
                c_new = acc(cs[d, t_, b, j])
                dcell = dc[d, b, j]
            dh_direct, dc_prev = pointwise(dm, dcell, saved, v, hp, c_prev, c_new, dwx, drh, dv)
            for g in range(G):
                dgx[d, t_, b, g * H + j] = dwx[g]
                dgh[d, t_, b, g * H + j] = drh[g] if SPLIT[g] else dwx[g]
            if dvec is not None:
                for k in range(V):
                    dvec[d, t_, b, k * H + j] = dv[k]
            if dc is not None:
                dc[d, b, j] = dc_prev
            if not PROJ:
                dh[d, b, j] = acc(dh_direct)

    return epilogue

"""The forward of a layer-normalised cell (SPEC 13) as one fused time loop: no BLAS and no Python per step.

Why: `layer_norm.forward_direction` made a BLAS product R h per step on one thread and a serial row loop after
it (T=100 B=32 I=H=256 float32 on 2 cores: ~60% of its time in the per-step products, ~25% in the row loop),
where the built-in cells run `fused.py`'s loops, both cores at the micro-kernel's speed.  Layer normalisation
needs the whole row of a product (its G*H values) before any unit's cell can run, and a row depends on no other
row, so the loop here works row tile by row tile (NR rows, `microkernel.rows_for(G)`), per step:

    products   for every unit tile: W x_t and R h of the tile's rows (`microkernel.product_tile` over the packed W and
               R, `microkernel.pack`), kept by unit tile in the group's scratch (the micro-kernel's own layout)
    statistics "wx", "rh": mean and rstd of each row over its G*H values (the reserve's lnstat; the raw W x and R h
               to wx_raw and rh_raw)
    cell       per unit tile: wx = LN(W x) γ_x + bW, rh = LN(R h) γ_r + bR (or the product + bias where not
               normalised), the cell's own `forward` on NR*LANES lanes; acts, c' (with "c" also to the scratch)
    "c"        mean and rstd of each row's c'; per unit tile m = output(LN(c') γ_c + β_c) ; h', y

An inference call writes no reserve (acts, cs, lnstat, wx_raw, rh_raw), as `fused.forward_group`.

A row's products read only its own h, and the row tile writes its h' after all of them: h needs no double
buffer.  Threads split the row tiles into groups, each its own time loop (as `fused.row_groups`).  Not here
(layer_norm.forward_direction runs them): zoneout, skip input.

The backward's time loop (`backward_group`) is `fused.backward_group`'s shape: per step layer_norm's row loop
over the group's rows, then dh += dgh_s R by the micro-kernel over R's packed columns.  Why: the BLAS loop's
per-step product (B x G*H x H) and its serial row loop were two thirds of a LayerNormLSTM backward, and OpenBLAS's
two threads lost most of their speed when another process held a core (bench/results/cpu.md).
"""
from __future__ import annotations

import functools

import numba
import numpy as np

from . import cells, fused, microkernel
from ..util import cdiv
from .cells import accumulate
from .fused import copy_values, load_lanes
from .workspace import scratch

EPS = 1e-5

# Set per compiled loop (`cells.cached_step` rebinds them in a copy of this module's globals): the cell's
# `forward` (pointwise) and `output` (out_fn), the micro-kernel and the stack scratch of the loop's sizes.
pointwise = out_fn = tile = group = moments = None
rows_x = rows_h = rows_b = rows_t = rows_s = lanes_w = lanes_r = lanes_V = lanes_S = None
lanes_h = lanes_c = lanes_m = lanes_n = lanes_p = None
row_step = products = None


def _key(cell, compute: str) -> str:
    """The fingerprint of the loop's variant: the cell's code (`output` too) and the library's
    (cells.variant_key), the tiles."""
    return cells.variant_key(cell, compute, False, False) + \
        f" ln fused {microkernel.lanes_for(compute)} {microkernel.tile_shape(cell.G)}"


@numba.njit(inline="always")
def _squares(dst, src, mean, n):
    """dst[:n] += (src[:n] - mean)²."""
    for u in range(n):
        dst[u] += (src[u] - mean) * (src[u] - mean)


@numba.njit(inline="always")
def _normalise(dst, raw, gain, bias, mean, rstd, n):
    """dst[:n] = (raw[:n] - mean) * rstd * gain[:n] + bias[:n] (a loop indexed only by its counter)."""
    for u in range(n):
        dst[u] = (raw[u] - mean) * rstd * gain[u] + bias[u]


@functools.cache
def forward_group(cell, compute: str):
    """One row group's whole forward of one layer and direction for a layer-normalised `cell` (see the module
    docstring): ``group(grp, lo, hi, <forward_loop's arguments>)`` runs row tiles grp, grp + groups, ... through
    steps lo .. hi-1."""
    acc = np.dtype(compute).type
    zero = acc(0.0)
    one = acc(1.0)
    eps = acc(EPS)
    i64 = np.int64
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    LANES = microkernel.lanes_for(compute)
    NR = microkernel.rows_for(G)
    L = NR * LANES                              # lanes of the pointwise loop: NR rows x LANES units
    ITEM = np.dtype(compute).itemsize
    STATE = cell.cell_state
    NWX, NRH, NC = "wx" in cell.layer_norm, "rh" in cell.layer_norm, "c" in cell.layer_norm
    names = [n for n in ("wx", "rh", "c") if n in cell.layer_norm]
    KWX, KRH, KC = (2 * names.index(n) if n in names else -1 for n in ("wx", "rh", "c"))
    KEY = _key(cell, compute)

    @numba.njit(inline="always")
    def row_moments(a, r, count, part):
        """(mean, rstd) of row r's values in a [NT, K, NR*LANES] (product_tile's layout by unit tile: row r at
        lanes r*LANES ..; `count` units per k, zeros past them), ε = EPS: sums over lanes first, `part` [LANES]
        (stack scratch), so the loops vectorize; each padded zero adds mean² to the squared deviations, taken
        off again."""
        NT, K = a.shape[0], a.shape[1]
        q = r * LANES
        part[:] = zero
        for jt in range(NT):
            for k in range(K):
                accumulate(part, a[jt, k, q:q + LANES], LANES)
        total = zero
        for u in range(LANES):
            total += part[u]
        mean = total / acc(K * count)
        part[:] = zero
        for jt in range(NT):
            for k in range(K):
                _squares(part, a[jt, k, q:q + LANES], mean, LANES)
        var = zero
        for u in range(LANES):
            var += part[u]
        var = max(var - acc(K * (NT * LANES - count)) * mean * mean, zero)
        return mean, one / np.sqrt(var / acc(K * count) + eps)

    def group(
        grp,      # int     the row group this call runs (of `groups`)
        lo,       # int     the steps this call runs: lo .. hi-1
        hi,       # int
        d,        # int     direction (0 forward, 1 reverse)
        lens,     # [B]     int32 sequence lengths
        order,    # [B]     int64 rows by length, longest first
        n_active, # [steps] int64 rows active at step s (a prefix of order)
        x,        # [T, B, I]      layer input, C-contiguous
        Wp,       # [NT, G//V, I, V, LANES]  W packed (`microkernel.pack`)
        Rp,       # [NT, G//V, H, V, LANES]  R packed
        norm,     # [6, G, HP]     by gate, zeros past H: γ_x, bW, γ_r, bR, then [0, 0] γ_c, [1, 0] β_c ([0, :H]
                  #                of rows 4 and 5; gains 1 where a product is not normalised)
        vec,      # [VL, HP]       cell vectors, zeros past H
        hb,       # [B, HP]        the state h, updated in place (zeros past H)
        cb,       # [B, HP]        the state c, updated in place (unused without a state)
        y,        # [T, B, D*H]    layer output
        acts,     # [T, B, S*H]    reserve: saved values (not written without `save`)
        cs,       # [T, B, H]      reserve: c' (not written without `save`)
        lnstat,   # [T, B, 2K]     reserve: mean, rstd of each normalised row (not written without `save`)
        wx_raw,   # [T, B, G*H]    reserve ("wx"): W x (not written without `save`)
        rh_raw,   # [T, B, G*H]    reserve ("rh"): R h (not written without `save`)
        raw_w,    # [groups, NT, G, L]  scratch: W x of the tile's rows, by unit tile (product_tile's layout)
        raw_r,    # [groups, NT, G, L]  scratch: R h
        c_t,      # [groups, NT, 1, L]  scratch ("c"): c', zeros past H
        saved_t,  # [groups, NT, S, L]  scratch ("c"): the saved values
        groups,   # int     row groups run in parallel
        save,     # bool    write the reserve: False in an inference call
    ):
        KEY  # noqa: B018  (the variant's fingerprint, a closure value: it keys numba's cache, see cells.cached_step)
        B = lens.shape[0]
        I = x.shape[2]
        NT = Rp.shape[0]
        H = Rp.shape[2]
        HP = hb.shape[1]
        x_addr = i64(x.ctypes.data)
        h_addr = i64(hb.ctypes.data)
        w_addr = i64(Wp.ctypes.data)
        r_addr = i64(Rp.ctypes.data)
        rw = raw_w[grp]                              # [NT, G, L]
        rr = raw_r[grp]                              # [NT, G, L]
        ct = c_t[grp]                                # [NT, 1, L]
        st = saved_t[grp]                            # [NT, S, L]
        rw_addr = i64(rw.ctypes.data)
        rr_addr = i64(rr.ctypes.data)
        GL = G * L * ITEM                            # bytes of a unit tile's products
        # scratch of one tile (stack memory, see cells.stack_buffer): lane r*LANES + u = row r, unit j0+u
        xrows_p = rows_x(i64)
        xrows = numba.carray(xrows_p, NR)            # [NR] addresses of the rows' x_t
        hrows_p = rows_h(i64)
        hrows = numba.carray(hrows_p, NR)            # [NR] addresses of the rows' h
        rb = numba.carray(rows_b(i64), NR)           # [NR] batch row of each lane group
        rt = numba.carray(rows_t(i64), NR)           # [NR] its time index
        stat = numba.carray(rows_s(acc), (3, 2, NR)) # [3, 2, NR] per row: mean, rstd of W x, R h, c'
        part = numba.carray(lanes_p(acc), LANES)     # [LANES] partial sums of `moments`
        wx = numba.carray(lanes_w(acc), (G, L))      # [G, L] wx_g
        rh = numba.carray(lanes_r(acc), (G, L))      # [G, L] rh_g
        v = numba.carray(lanes_V(acc), (VL, L))      # [V, L] cell vectors
        saved = numba.carray(lanes_S(acc), (S, L))   # [S, L] out: saved values
        h_prev = numba.carray(lanes_h(acc), L)       # [L] h
        c_prev = numba.carray(lanes_c(acc), L)       # [L] c (0 without a state)
        m_out = numba.carray(lanes_m(acc), L)        # [L] out: m (with "c": unused until the output pass)
        c_out = numba.carray(lanes_n(acc), L)        # [L] out: c' ; with "c" then n = LN(c') γ_c + β_c
        for s in range(lo, hi):
            n = n_active[s]
            for i0 in range(grp * NR, n, groups * NR):
                nr = min(NR, n - i0)                 # the tile's active rows; spare lanes: its first row
                for r in range(NR):
                    b = order[i0 + r] if r < nr else order[i0]
                    t = s if d == 0 else lens[b] - 1 - s
                    rb[r] = b
                    rt[r] = t
                    xrows[r] = x_addr + ((t * B + b) * I) * ITEM
                    hrows[r] = h_addr + (b * HP) * ITEM
                # the products of every unit tile, straight into the group's scratch (zeros past H)
                for jt in range(NT):
                    tile(w_addr + jt * (I * G * LANES * ITEM), xrows_p, I, rw_addr + jt * GL)
                    tile(r_addr + jt * (H * G * LANES * ITEM), hrows_p, H, rr_addr + jt * GL)
                # each row's statistics over its G*H values
                for r in range(NR):
                    stat[0, 0, r], stat[0, 1, r] = moments(rw, r, H, part) if NWX else (zero, one)
                    stat[1, 0, r], stat[1, 1, r] = moments(rr, r, H, part) if NRH else (zero, one)
                if save:
                    for r in range(nr):
                        b = rb[r]
                        t = rt[r]
                        if NWX:
                            lnstat[t, b, KWX] = stat[0, 0, r]
                            lnstat[t, b, KWX + 1] = stat[0, 1, r]
                        if NRH:
                            lnstat[t, b, KRH] = stat[1, 0, r]
                            lnstat[t, b, KRH + 1] = stat[1, 1, r]
                        q = r * LANES
                        for jt in range(NT):             # the raw products, for the backward
                            j0 = jt * LANES
                            nu = min(LANES, H - j0)
                            for g in range(G):
                                if NWX:
                                    load_lanes(wx_raw[t, b, g * H + j0:g * H + j0 + nu], rw[jt, g, q:q + nu], nu,
                                               LANES)
                                if NRH:
                                    load_lanes(rh_raw[t, b, g * H + j0:g * H + j0 + nu], rr[jt, g, q:q + nu], nu,
                                               LANES)
                # the cell, unit tile by unit tile
                for jt in range(NT):
                    j0 = jt * LANES
                    nu = min(LANES, H - j0)          # units of this tile that exist
                    for r in range(NR):
                        q = r * LANES
                        for g in range(G):
                            _normalise(wx[g, q:q + LANES], rw[jt, g, q:q + LANES], norm[0, g, j0:j0 + LANES],
                                       norm[1, g, j0:j0 + LANES], stat[0, 0, r], stat[0, 1, r], LANES)
                            _normalise(rh[g, q:q + LANES], rr[jt, g, q:q + LANES], norm[2, g, j0:j0 + LANES],
                                       norm[3, g, j0:j0 + LANES], stat[1, 0, r], stat[1, 1, r], LANES)
                    fused.gather_lanes(v, h_prev, c_prev, vec, hb, cb, rb, j0, V, LANES, True, STATE)
                    for q in range(L):
                        m_out[q], c_out[q] = pointwise(wx[:, q], rh[:, q], v[:, q], h_prev[q], c_prev[q],
                                                       saved[:, q])
                    for r in range(nr):
                        b = rb[r]
                        t = rt[r]
                        q = r * LANES
                        fused.store_lanes(acts, cs, cb, saved, c_out, t, b, q, j0, nu, H, S, STATE, save, LANES)
                        if not NC:
                            load_lanes(hb[b, j0:j0 + nu], m_out[q:q + nu], nu, LANES)
                            load_lanes(y[t, b, d * H + j0:d * H + j0 + nu], m_out[q:q + nu], nu, LANES)
                    if NC:                           # kept for the output pass (c' zeros past H: `moments`)
                        for r in range(NR):
                            for u in range(nu, LANES):
                                c_out[r * LANES + u] = zero
                        copy_values(ct[jt, 0], c_out, L)
                        for k in range(S):
                            copy_values(st[jt, k], saved[k], L)
                if NC:                               # n = LN(c') γ_c + β_c, m = output(n) of the active rows
                    for r in range(NR):
                        stat[2, 0, r], stat[2, 1, r] = moments(ct, r, H, part)
                    if save:
                        for r in range(nr):
                            lnstat[rt[r], rb[r], KC] = stat[2, 0, r]
                            lnstat[rt[r], rb[r], KC + 1] = stat[2, 1, r]
                    for jt in range(NT):
                        j0 = jt * LANES
                        nu = min(LANES, H - j0)
                        for r in range(NR):
                            q = r * LANES
                            _normalise(c_out[q:q + LANES], ct[jt, 0, q:q + LANES], norm[4, 0, j0:j0 + LANES],
                                       norm[5, 0, j0:j0 + LANES], stat[2, 0, r], stat[2, 1, r], LANES)
                            for k in range(V):
                                copy_values(v[k, q:q + LANES], vec[k, j0:j0 + LANES], LANES)
                        for k in range(S):
                            copy_values(saved[k], st[jt, k], L)
                        for q in range(L):
                            m_out[q] = out_fn(c_out[q], saved[:, q], v[:, q])
                        for r in range(nr):
                            b = rb[r]
                            q = r * LANES
                            load_lanes(hb[b, j0:j0 + nu], m_out[q:q + nu], nu, LANES)
                            load_lanes(y[rt[r], b, d * H + j0:d * H + j0 + nu], m_out[q:q + nu], nu, LANES)

    extra = {"tile": microkernel.product_tile(compute, G, NR, LANES),
             "out_fn": cells.njit_function(cell.output, compute) if NC else None,
             "lanes_w": cells.stack_buffer(G * L), "lanes_r": cells.stack_buffer(G * L)}
    for name in ("rows_x", "rows_h", "rows_b", "rows_t"):
        extra[name] = cells.stack_buffer(NR)
    extra["rows_s"] = cells.stack_buffer(6 * NR)
    extra["lanes_p"] = cells.stack_buffer(LANES)
    extra["moments"] = row_moments               # a global of the compiled copy, not a closure value (cached_step)
    for name in ("lanes_h", "lanes_c", "lanes_m", "lanes_n"):
        extra[name] = cells.stack_buffer(L)
    return cells.cached_step(group, False, cells.njit_function(cell.forward, compute), G, S, VL, L,
                             fastmath={"contract"}, **extra)        # as fused.forward_group


@functools.cache
def forward_loop(cell, compute: str, parallel: bool):
    """The fused forward of one layer and direction: ``loop(d, lens, ..., groups)`` (`forward_group`'s arguments
    after grp, lo, hi) runs every row group over every step: serially group 0 of 1, in parallel each group's step
    ranges relayed between the call's threads (`fused.relay_loop`)."""
    return fused.relay_loop(forward_group(cell, compute), parallel, "n_active", False)


def supported(call, lp) -> bool:
    """Whether `forward_direction` runs this layer (zoneout and skip input take layer_norm's BLAS loop)."""
    return lp.W is not None and not call.zoneout_active and not call.zoneout_expected


def _norm_tiles(cell, lp, H: int, HP: int, ct) -> np.ndarray:
    """[6, G, HP] the normalisation vectors and biases by gate, zeros past H (see forward_group's `norm`)."""
    G = cell.G
    out = np.zeros((6, G, HP), dtype=ct)
    for row, name in ((0, "ln_wx_gain"), (2, "ln_rh_gain")):
        vec = lp.norm(cell, name)
        out[row, :, :H] = 1.0 if vec is None else vec.reshape(G, H)
    out[1, :, :H] = lp.bW.reshape(G, H)
    out[3, :, :H] = lp.bR.reshape(G, H)
    if "c" in cell.layer_norm:
        out[4, 0, :H] = lp.norm(cell, "ln_c_gain")
        out[5, 0, :H] = lp.norm(cell, "ln_c_bias")
    return out


def forward_direction(call, lp, d, x_l, h, c, y, acts, cs, lnstat, wx_raw, rh_raw, rows, ct):
    """One layer and direction (layer_norm.forward_direction's contract, `supported` calls): h [B, H] and c [B, H]
    (or an empty [0, H]) are updated in place to the state after each row's last step; y, acts, cs, lnstat,
    wx_raw, rh_raw are written at the active [t, b].  rows: fused_plan.call_rows(call)."""
    cfg, B = call.config, call.B
    cell, H, G = cfg.cell, cfg.H, cfg.G
    lens, _, order, n_active = rows[:4]
    LANES, NR = microkernel.lanes_for(ct), microkernel.rows_for(G)
    NT = cdiv(H, LANES)
    HP = NT * LANES
    I_l = x_l.shape[2]
    Wp = scratch("fused_Wp", microkernel.panel_shape(NT, I_l, G, ct), ct)   # [NT, G//V, I, V, LANES] W by unit tiles
    Rp = scratch("fused_Rp", microkernel.panel_shape(NT, H, G, ct), ct)     # [NT, G//V, H, V, LANES] R by unit tiles
    microkernel.pack(lp.W, Wp)
    microkernel.pack(lp.R, Rp)
    norm = _norm_tiles(cell, lp, H, HP, ct)                           # [6, G, HP]
    vec = np.zeros((max(cfg.V, 1), HP), dtype=ct)                     # [VL, HP]
    if lp.V is not None:
        vec[:, :H] = lp.V
    hb = np.zeros((B, HP), dtype=ct)                                  # [B, HP] h, zeros past H
    hb[:, :H] = h
    cb = np.zeros((B, HP), dtype=ct)                                  # [B, HP] c
    if c.shape[0]:
        cb[:, :H] = c
    macs = int(n_active.sum()) * G * H * (I_l + H)
    groups = fused.row_groups(B, NR, macs)
    L = NR * LANES
    raw_w = scratch("ln_raw_w", (groups, NT, G, L), ct)               # [groups, NT, G, L] W x of a tile's rows
    raw_r = scratch("ln_raw_r", (groups, NT, G, L), ct)               # [groups, NT, G, L] R h
    NC = "c" in cell.layer_norm
    c_t = scratch("ln_c", (groups, NT if NC else 0, 1, L), ct)                  # [groups, NT, 1, L] c'
    saved_t = scratch("ln_saved", (groups, NT if NC else 0, cell.S, L), ct)     # [groups, NT, S, L]
    loop = forward_loop(cell, str(ct), groups > 1)
    loop(d, lens, order, n_active, np.ascontiguousarray(x_l), Wp, Rp, norm, vec, hb, cb, y, acts, cs, lnstat, wx_raw,
         rh_raw, raw_w, raw_r, c_t, saved_t, groups, call.is_training)
    h[...] = hb[:, :H]
    if c.shape[0]:
        c[...] = cb[:, :H]


# ---------------------------------------------------------------------------------------------------------------
# the backward: per step the row loop of layer_norm.backward_loop over the group's rows, then dh += dgh_s R by the
# micro-kernel over R's packed columns (as fused.backward_group), in one njit call per layer and direction
# ---------------------------------------------------------------------------------------------------------------

def _backward_key(cell, compute: str) -> str:
    """The fingerprint of backward_group's variant (as fused._backward_key)."""
    MV = fused.COLUMN_VECTORS
    return _key(cell, compute) + f" ln fused backward {microkernel.tile_shape(MV)} {microkernel.wide_rows(MV)} {MV}"


@functools.cache
def backward_group(cell, compute: str, row_step_fn):
    """One row group's backward of one layer and direction: ``group(grp, lo, hi, <backward_loop's arguments>)`` runs
    the rows of line grp of `groups` (`fused.group_rows`), per step s = hi-1 .. lo:

        row_step(s, ..., rows_g, ...)       layer_norm.backward_loop over the group's rows: "c", the cell's
                                            backward, "rh" (dgx[t], dgh[s], hp[s], dh bypassing R, dc, the
                                            accumulated gradients of the group's rows)
        dh[b, :] += dgh[s, b] @ R           the group's active rows (a prefix), NRW or NR rows per product_tile call

    Each row's gradients are its own (the accumulators are by row): any grouping gives the same bits."""
    acc = np.dtype(compute).type
    i64 = np.int64
    LANES = microkernel.lanes_for(compute)
    MV = fused.COLUMN_VECTORS
    NR = microkernel.rows_for(MV)
    NRW = microkernel.wide_rows(MV)             # the products' wide row tiles (`fused.row_products`)
    ITEM = np.dtype(compute).itemsize
    KEY = _backward_key(cell, compute)

    def group(
        grp,      # int     the row group this call runs (a line of `groups`)
        lo,       # int     the steps this call runs: hi-1 down to lo
        hi,       # int
        d,        # int     direction
        lens,     # [B]     int32
        groups,   # [NG, n] int64 each row group's rows, longest first (-1 pads), `fused.group_rows`
        steps,    # int     the longest length
        dy, y, h0, c0, acts, cs, lnstat, rh_raw, gain_r, gain_c, bias_c, vec, dh, dc, dgx,   # (row_step's)
        dgh,      # [T, B, G*H]   out (s layout): dL/d(R h) after LN_rh's backward
        hp,       # [T, B, H]     out (s layout): h entering step s
        dbR, dgain_r, dgain_c, dbias_c, dv_acc,   # [B, ...] the accumulated gradients by row (row_step's)
        RTp,      # [NC, MV//V, G*H, V, LANES] R's columns packed (`microkernel.pack_columns`)
    ):
        KEY  # noqa: B018  (the variant's fingerprint, see forward_group)
        B, H = dh.shape
        K = RTp.shape[2]
        NC = RTp.shape[0]
        dgh_addr = i64(dgh.ctypes.data)
        r_addr = i64(RTp.ctypes.data)
        rows_g = fused.group_line(groups, grp)
        rows_p = rows_x(i64)
        rows = numba.carray(rows_p, NRW)              # [NRW] addresses of the rows' dgh_s
        out_p = lanes_w(acc)
        out = numba.carray(out_p, (MV, NRW * LANES))  # [MV, NRW*LANES] dgh_s R for a column tile
        for s in range(hi - 1, lo - 1, -1):
            row_step(s, d, lens, rows_g, dy, y, h0, c0, acts, cs, lnstat, rh_raw, gain_r, gain_c, bias_c, vec, dh,
                     dc, dgx, dgh[s], hp[s], dbR, dgain_r, dgain_c, dbias_c, dv_acc)
            n = fused.active_prefix(rows_g, lens, s)     # the group's rows active at s
            products(dh, rows_g, n, dgh_addr + (s * B * K) * ITEM, K, r_addr, NC, H, True, rows_p, rows, out_p, out)

    extra = {"products": fused.row_products(compute, MV, LANES, NR, NRW), "row_step": row_step_fn,   # a global of
             "rows_x": cells.stack_buffer(NRW), "lanes_w": cells.stack_buffer(MV * NRW * LANES)}   # the copy
    return cells.cached_step(group, False, None, 1, 1, 1, 1, **extra)


@functools.cache
def backward_loop(cell, compute: str, parallel: bool, row_step):
    """The fused backward of one layer and direction: ``loop(d, lens, groups, ..., RTp)`` (`backward_group`'s
    arguments after grp, lo, hi) runs every row group over every step, serially or its step ranges relayed between
    the call's threads (`fused.relay_loop`)."""
    return fused.relay_loop(backward_group(cell, compute, row_step), parallel, "steps", True)


def backward_direction(call, lp, d, rows, row_step, args, dgh, hp, sums, ct):
    """The time loop of one layer and direction of layer_norm.backward (its `args` of the row loop from dy to dgx,
    its dgh, hp and accumulators `sums`), in row groups on the call's threads (`fused.row_groups`); rows:
    fused_plan.call_rows(call)."""
    B, H, G = call.B, call.config.H, call.config.G
    lens, steps, by_length = rows[:3]
    MV, LANES = fused.COLUMN_VECTORS, microkernel.lanes_for(ct)
    NR = microkernel.rows_for(MV)
    RTp = scratch("fused_RTp", microkernel.panel_shape(cdiv(H, MV * LANES), G * H, MV, ct), ct)   # R by columns
    microkernel.pack_columns(lp.R, RTp)
    groups = fused.row_groups(B, NR, int(lens.sum()) * G * H * H)
    loop = backward_loop(call.config.cell, str(ct), groups > 1, row_step)
    loop(d, lens, fused.group_rows(by_length, groups, NR), steps, *args, dgh, hp, *sums, RTp)

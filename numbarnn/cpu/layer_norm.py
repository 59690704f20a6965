"""Layer-normalised cells (CellSpec.layer_norm, SPEC 13) on the CPU: a BLAS product per step and njit loops per row.

The network driver of `network.py` with the row reductions added, as the reference computes it
(numbarnn/reference/network.py): per layer and direction

    forward    gx = x W^T (BLAS, all steps) ; "wx": the raw W x to the reserve (wx_l), gx = LN(gx) γ_x + bW over
               every row at once (`input_rows`)
               per step: gh = h R^T (BLAS) ; the cell's loop over the active rows (`forward_loop`): "rh": LN of
               the row's gh (raw and stats saved), the cell per unit, "c": LN of the row's c', `output` per unit
    backward   per step (reversed): the loop (`backward_loop`): "c": `output_backward`, LN_c's backward into dc',
               the cell's backward; "rh": LN_rh's backward of the row's dgh ; then dh += dgh_raw R (BLAS)
               after the loop: "wx": LN_wx's backward of every row of dgx (`input_rows_backward`, W x from wx_l),
               then dW, dx, dR as big products

Every loop works on one row at a time (its G*H or H values), so a row's reduction is a plain loop over it, and
the backward accumulates its bias, gain and vector gradients by row (summed after the time loop): rows may run in
any grouping with the same results.  The loops above (BLAS per step) run with zoneout, skip input (the forward),
or the setting cpu_fused False; otherwise each layer and direction is one fused time loop of `layer_norm_fused.py` (the
forward's own; the backward's calls `backward_loop` on a row group's rows, then dh += dgh_s R by the
micro-kernel), the same results and reserve.

Why one file (over 500 lines): the forward and backward row loops of SPEC 13 and their row reductions are read
side by side (each backward step undoes its forward step); the fused time loops are layer_norm_fused.py.
"""
from __future__ import annotations

import contextlib
import functools

import numba
import numpy as np

from .. import settings
from ..params import unpack
from ..reserve import reserve_views
from . import cells, layer_norm_fused, threads, zoneout
from .cells import njit_function
from .layer_input import backward_input, dropped_input, input_projection
from .workspace import scratch

EPS = 1e-5
REASSOC = {"reassoc"}       # fastmath for the row loops: their sums vectorize (a few ulps from the reference's order)

# Set per compiled loop (`cells.cached_step` rebinds them in a copy of this module's globals): the cell's forward
# or backward (pointwise), its output / output_backward, the stack scratch of the loop's sizes.
pointwise = out_fn = out_bwd = lanes_G = lanes_S = lanes_V = None


def _columns(cell, name: str) -> int:
    """The first column (mean; rstd follows) of `name` in a row of the reserve's lnstat_l, or -1 when not
    normalised."""
    names = [n for n in ("wx", "rh", "c") if n in cell.layer_norm]
    return 2 * names.index(name) if name in names else -1


@functools.cache
def row_kernels(compute: str):
    """The row-wise LN loops of the input side, in `compute`."""
    acc = np.dtype(compute).type
    eps = acc(EPS)

    def input_rows(
        gx,       # [N, GH]  in: W x ; out: LN(W x) γ + bW
        gain,     # [GH]
        bias,     # [GH]
        stats,    # [N, 2]   out: mean, rstd of each row
    ):
        N, GH = gx.shape
        for r in range(N):
            mean = acc(0.0)
            for k in range(GH):
                mean += gx[r, k]
            mean /= GH
            var = acc(0.0)
            for k in range(GH):
                var += (gx[r, k] - mean) * (gx[r, k] - mean)
            rstd = acc(1.0) / np.sqrt(var / GH + eps)
            stats[r, 0] = mean
            stats[r, 1] = rstd
            for k in range(GH):
                gx[r, k] = (gx[r, k] - mean) * rstd * gain[k] + bias[k]

    def input_rows_backward(
        dgx,      # [N, GH]  in: dL/d(LN(W x) γ + bW) ; out: dL/d(W x)
        raw,      # [N, GH]  W x (the reserve's wx_l: 0 where no step ran)
        stats,    # [N, 2]   mean, rstd (rstd 0 where no step ran: dL/d(W x) 0 there)
        gain,     # [GH]
        dgain,    # [GH]     out: accumulated Σ dgx * â
    ):
        N, GH = dgx.shape
        for r in range(N):
            mean, rstd = stats[r, 0], stats[r, 1]
            mg = acc(0.0)
            mga = acc(0.0)
            for k in range(GH):
                a_hat = (raw[r, k] - mean) * rstd
                g = dgx[r, k] * gain[k]
                dgain[k] += dgx[r, k] * a_hat
                mg += g
                mga += g * a_hat
            mg /= GH
            mga /= GH
            for k in range(GH):
                a_hat = (raw[r, k] - mean) * rstd
                dgx[r, k] = rstd * (dgx[r, k] * gain[k] - mg - a_hat * mga)

    return tuple(cells.cached_step(fn, False, None, 1, 1, 1, 1, fastmath=REASSOC)
                 for fn in (input_rows, input_rows_backward))


@functools.cache
def forward_loop(cell, compute: str):
    """One step of a layer-normalised cell over the active rows (see the module docstring)."""
    acc = np.dtype(compute).type
    eps = acc(EPS)
    G, S, V = cell.G, cell.S, cell.V
    NRH, NC = "rh" in cell.layer_norm, "c" in cell.layer_norm
    KWX, KRH, KC = _columns(cell, "wx"), _columns(cell, "rh"), _columns(cell, "c")
    VL = max(V, 1)
    KEY = cells.variant_key(cell, compute, False, False) + " ln rows forward"

    def loop(
        s,        # int           step index
        d,        # int           direction
        lens,     # [B] int32
        gx,       # [T, B, G*H]   wx: W x + bW, normalised ("wx") and biased
        wx_stats, # [T, B, 2]     "wx": mean, rstd of each row of W x
        gh,       # [B, G*H]      R h of this step (no bias)
        bR,       # [G*H]
        gain_r,   # [G*H]         "rh": γ_r (else not read)
        gain_c,   # [H]           "c": γ_c
        bias_c,   # [H]           "c": β_c
        vec,      # [V, H]
        h,        # [B, H]        in: the state h ; out: h' of the active rows
        c,        # [B, H]        in: the state c ; out: c' of the active rows (no cell state: not read)
        y,        # [T, B, D*H]   out: h' at [t, b]
        acts,     # [T, B, S*H]   out (reserve): the cell's saved values
        cs,       # [T, B, H]     out (reserve): c'
        lnstat,   # [T, B, 2K]    out (reserve): mean, rstd of each normalised row
        rh_raw,   # [T, B, G*H]   out (reserve, "rh"): R h
    ):
        KEY  # noqa: B018  (the variant's fingerprint, a closure value: it keys numba's cache, see cells.cached_step)
        B, H = h.shape
        wx = numba.carray(lanes_G(acc), G)        # [G] one unit's wx_g
        rh = numba.carray(lanes_G(acc), G)        # [G] one unit's rh_g
        saved = numba.carray(lanes_S(acc), S)     # [S]
        v = numba.carray(lanes_V(acc), VL)        # [V]
        m_row = np.zeros(H, acc)                  # [H] the row's outputs
        c_row = np.zeros(H, acc)                  # [H] the row's c'
        for b in range(B):
            if s >= lens[b]:
                continue
            t = s if d == 0 else lens[b] - 1 - s
            if KWX >= 0:
                lnstat[t, b, KWX] = wx_stats[t, b, 0]
                lnstat[t, b, KWX + 1] = wx_stats[t, b, 1]
            mean_r = acc(0.0)
            rstd_r = acc(1.0)
            if NRH:                               # the row's R h: its mean and rstd
                for k in range(G * H):
                    mean_r += gh[b, k]
                    rh_raw[t, b, k] = gh[b, k]
                mean_r /= G * H
                var = acc(0.0)
                for k in range(G * H):
                    var += (gh[b, k] - mean_r) * (gh[b, k] - mean_r)
                rstd_r = acc(1.0) / np.sqrt(var / (G * H) + eps)
                lnstat[t, b, KRH] = mean_r
                lnstat[t, b, KRH + 1] = rstd_r
            for j in range(H):
                for g in range(G):
                    k = g * H + j
                    wx[g] = gx[t, b, k]
                    rh[g] = ((gh[b, k] - mean_r) * rstd_r * gain_r[k] if NRH else gh[b, k]) + bR[k]
                for q in range(V):
                    v[q] = vec[q, j]
                m_row[j], c_row[j] = pointwise(wx, rh, v, h[b, j], c[b, j] if c.shape[0] else acc(0.0), saved)
                for q in range(S):
                    acts[t, b, q * H + j] = saved[q]
            if NC:                                # the row's c': n = LN(c') γ_c + β_c, m = output(n)
                mean_c = acc(0.0)
                for j in range(H):
                    mean_c += c_row[j]
                mean_c /= H
                var = acc(0.0)
                for j in range(H):
                    var += (c_row[j] - mean_c) * (c_row[j] - mean_c)
                rstd_c = acc(1.0) / np.sqrt(var / H + eps)
                lnstat[t, b, KC] = mean_c
                lnstat[t, b, KC + 1] = rstd_c
                for j in range(H):
                    for q in range(S):
                        saved[q] = acts[t, b, q * H + j]
                    for q in range(V):
                        v[q] = vec[q, j]
                    m_row[j] = out_fn((c_row[j] - mean_c) * rstd_c * gain_c[j] + bias_c[j], saved, v)
            for j in range(H):
                h[b, j] = m_row[j]
                y[t, b, d * H + j] = m_row[j]
                if c.shape[0]:
                    c[b, j] = c_row[j]
                    cs[t, b, j] = c_row[j]

    # the cell's functions and the stack scratch (not heap: kept in registers) are globals of the compiled copy
    return cells.cached_step(loop, False, njit_function(cell.forward, compute), G, S, VL, 1, fastmath=REASSOC,
                             out_fn=njit_function(cell.output, compute) if NC else None)


@functools.cache
def backward_loop(cell, compute: str):
    """One reversed step of a layer-normalised cell over the rows (see the module docstring)."""
    acc = np.dtype(compute).type
    G, S, V = cell.G, cell.S, cell.V
    NRH, NC = "rh" in cell.layer_norm, "c" in cell.layer_norm
    KRH, KC = _columns(cell, "rh"), _columns(cell, "c")
    SPLIT = np.array(cell.split_mask)
    VL = max(V, 1)
    KEY = cells.variant_key(cell, compute, False, False) + " ln rows backward"

    def loop(
        s,        # int           step index
        d,        # int           direction
        lens,     # [B] int32
        rows,     # [n] int64     the rows to run (a -1 ends them: a row group's line, fused.group_rows)
        dy,       # [T, B, D*H]   dL/dy of the layer (0 where padded)
        y,        # [T, B, D*H]   reserve: the layer's output
        h0,       # [B, H]        the initial h
        c0,       # [B, H]        the initial c (no cell state: [0, H])
        acts,     # [T, B, S*H]   reserve
        cs,       # [T, B, H]     reserve: c'
        lnstat,   # [T, B, 2K]    reserve: mean, rstd
        rh_raw,   # [T, B, G*H]   reserve ("rh"): R h
        gain_r,   # [G*H]
        gain_c,   # [H]
        bias_c,   # [H]
        vec,      # [V, H]
        dh,       # [B, H]        in: dL/dh' from the step after ; out: the part bypassing R (the caller adds R's)
        dc,       # [B, H]        in/out: dL/dc (no cell state: [0, H])
        dgx,      # [T, B, G*H]   out: dL/d(wx) at [t, b] (before LN_wx's backward)
        dgh_s,    # [B, G*H]      out: dL/d(R h) of this step (after LN_rh's backward; 0 for inactive rows)
        hp_s,     # [B, H]        out: h entering this step (0 for inactive rows)
        dbR,      # [B, G*H]      out: accumulated dL/d(bR) by row (the caller sums the rows: they run in groups)
        dgain_r,  # [B, G*H]      out: accumulated dL/dγ_r by row ([B, 0] when "rh" is not normalised)
        dgain_c,  # [B, H]        out: accumulated dL/dγ_c by row ([B, 0] without "c")
        dbias_c,  # [B, H]        out: accumulated dL/dβ_c by row
        dv_acc,   # [B, V, H]     out: accumulated dL/dv by row
    ):
        KEY  # noqa: B018  (the variant's fingerprint: see forward_loop)
        H = dh.shape[1]
        step = 1 if d == 0 else -1
        dwx = numba.carray(lanes_G(acc), G)       # [G]
        drh = numba.carray(lanes_G(acc), G)       # [G]
        dwx_o = numba.carray(lanes_G(acc), G)     # [G] through `output`
        drh_o = numba.carray(lanes_G(acc), G)     # [G]
        dvv = numba.carray(lanes_V(acc), VL)      # [V]
        saved = numba.carray(lanes_S(acc), S)     # [S]
        v = numba.carray(lanes_V(acc), VL)        # [V]
        dm_row = np.zeros(H, acc)                 # [H]
        dc_row = np.zeros(H, acc)                 # [H] dL/dc' of the row
        c_hat = np.zeros(H, acc)                  # [H]
        pre = np.zeros(G * H, acc)                # [G*H] dL/d(rh) of the row (before LN_rh's backward)
        out_gx = np.zeros(G * H, acc)             # [G*H] `output`'s dwx of the row
        out_gh = np.zeros(G * H, acc)             # [G*H] `output`'s drh of the row
        has_c = c0.shape[0] > 0
        for i in range(rows.shape[0]):
            b = rows[i]
            if b < 0:
                break
            if s >= lens[b]:
                for k in range(G * H):
                    dgh_s[b, k] = 0.0
                for j in range(H):
                    hp_s[b, j] = 0.0
                continue
            t = s if d == 0 else lens[b] - 1 - s
            for j in range(H):
                hp_s[b, j] = h0[b, j] if s == 0 else y[t - step, b, d * H + j]
                dm_row[j] = dy[t, b, d * H + j] + dh[b, j]
                dc_row[j] = dc[b, j] if has_c else acc(0.0)
            if NC:                                # m = output(n), n = LN(c') γ_c + β_c: dn, then dc' += LN_c'(dn)
                mean_c, rstd_c = lnstat[t, b, KC], lnstat[t, b, KC + 1]
                mg = acc(0.0)
                mgc = acc(0.0)
                for j in range(H):
                    c_hat[j] = (cs[t, b, j] - mean_c) * rstd_c
                    for q in range(S):
                        saved[q] = acts[t, b, q * H + j]
                    for q in range(V):
                        v[q] = vec[q, j]
                    for g in range(G):
                        dwx_o[g] = 0.0
                        drh_o[g] = 0.0
                    dn = out_bwd(dm_row[j], c_hat[j] * gain_c[j] + bias_c[j], saved, v, dwx_o, drh_o)
                    for g in range(G):
                        out_gx[g * H + j] = dwx_o[g]
                        out_gh[g * H + j] = drh_o[g] if SPLIT[g] else dwx_o[g]
                    dgain_c[b, j] += dn * c_hat[j]
                    dbias_c[b, j] += dn
                    dm_row[j] = dn * gain_c[j]    # (g = dn γ_c, kept here until the row's means are known)
                    mg += dm_row[j]
                    mgc += dm_row[j] * c_hat[j]
                mg /= H
                mgc /= H
                for j in range(H):
                    dc_row[j] += rstd_c * (dm_row[j] - mg - c_hat[j] * mgc)
                    dm_row[j] = 0.0               # the cell's backward runs with dm = 0
            for j in range(H):
                for q in range(S):
                    saved[q] = acts[t, b, q * H + j]
                for q in range(V):
                    v[q] = vec[q, j]
                    dvv[q] = 0.0
                for g in range(G):
                    dwx[g] = 0.0
                    drh[g] = 0.0
                c_prev = acc(0.0)
                if has_c:
                    c_prev = c0[b, j] if s == 0 else cs[t - step, b, j]
                dh_direct, dc_prev = pointwise(dm_row[j], dc_row[j], saved, v, hp_s[b, j], c_prev,
                                               cs[t, b, j] if has_c else acc(0.0), dwx, drh, dvv)
                for g in range(G):
                    k = g * H + j
                    gw = dwx[g] + (out_gx[k] if NC else acc(0.0))
                    gr = (drh[g] if SPLIT[g] else dwx[g]) + (out_gh[k] if NC else acc(0.0))
                    dgx[t, b, k] = gw
                    pre[k] = gr
                for q in range(V):
                    dv_acc[b, q, j] += dvv[q]
                dh[b, j] = dh_direct
                if has_c:
                    dc[b, j] = dc_prev
            if NRH:                               # rh = LN(R h) γ_r + bR: back to R h
                mean_r, rstd_r = lnstat[t, b, KRH], lnstat[t, b, KRH + 1]
                mg = acc(0.0)
                mga = acc(0.0)
                for k in range(G * H):
                    a_hat = (rh_raw[t, b, k] - mean_r) * rstd_r
                    dbR[b, k] += pre[k]
                    dgain_r[b, k] += pre[k] * a_hat
                    mg += pre[k] * gain_r[k]
                    mga += pre[k] * gain_r[k] * a_hat
                mg /= G * H
                mga /= G * H
                for k in range(G * H):
                    a_hat = (rh_raw[t, b, k] - mean_r) * rstd_r
                    dgh_s[b, k] = rstd_r * (pre[k] * gain_r[k] - mg - a_hat * mga)
            else:
                for k in range(G * H):
                    dbR[b, k] += pre[k]
                    dgh_s[b, k] = pre[k]

    # a cached fused loop calls it too (layer_norm_fused.py): its own symbol name per variant (cells.variant_name)
    return cells.cached_step(loop, False, njit_function(cell.backward, compute), G, S, VL, 1, fastmath=REASSOC,
                             out_bwd=njit_function(cell.output_backward, compute) if NC else None)


def _norm(cell, lp, name: str, H: int, ct):
    """A normalisation vector group of the pseudo-layer (flat), or an empty array when not normalised."""
    vec = lp.norm(cell, name)
    return np.zeros(0, dtype=ct) if vec is None else vec


def forward_direction(call, lp, d, x_l, h, c, y, acts, cs, lnstat, wx_raw, rh_raw, lens, steps, ct, zone=None):
    """One layer and direction: h [B, H] and c [B, H] (or an empty [0, H]) are updated in place to the state after
    each row's last step; y, acts, cs, lnstat, wx_raw, rh_raw are written at the active [t, b] (wx_raw by a
    training call only).  zone: zoneout's (mask, zmask) as network.blas_forward takes them, or None."""
    cfg, T, B = call.config, call.T, call.B
    cell, H, G = cfg.cell, cfg.H, cfg.G
    name = str(ct)
    gx = scratch("gx", (T, B, G * H), ct)                    # [T, B, G*H] wx of every step
    wx_stats = scratch("ln_wx_stats", (T, B, 2), ct)         # [T, B, 2]   mean, rstd of each row of W x
    # R h as R @ h^T -> [G*H, B] on one BLAS thread (as network.blas_forward: the state lives transposed during
    # the time loop; the loops read both through transposed views)
    ghT = scratch("ghT", (G * H, B), ct)                     # [G*H, B]    R h of a step, transposed
    hT_buf = scratch("hT", (H, B), ct)                       # [H, B]      the state h, transposed
    gh = scratch("gh", (B, G * H), ct)                       # [B, G*H]    the same, by rows (the loop's row reads)
    input_projection(lp, x_l, G, gx)
    if "wx" in cell.layer_norm:
        if call.is_training:                                 # the raw W x of the active [t, b] (0 elsewhere)
            wx_raw[...] = gx
            for b in np.flatnonzero(lens < T):
                wx_raw[lens[b]:, b] = 0
        row_kernels(name)[0](gx.reshape(T * B, G * H), lp.norm(cell, "ln_wx_gain"), lp.bW, wx_stats.reshape(T * B, 2))
    else:
        gx += lp.bW
    loop = forward_loop(cell, name)
    gain_r, gain_c, bias_c = (_norm(cell, lp, n, H, ct) for n in ("ln_rh_gain", "ln_c_gain", "ln_c_bias"))
    vec = lp.V if lp.V is not None else np.zeros((0, H), dtype=ct)
    h_view = hT_buf.T                                        # [B, H] view of the transposed state
    h_view[...] = h
    if zone is not None:
        h_prev = scratch("zoneout_h_prev", (B, H), ct)       # [B, H] h entering the step
    with threads.serial_blas():
        for s in range(steps):
            if zone is not None:
                h_prev[...] = h_view
            np.matmul(lp.R, hT_buf, out=ghT)
            gh[...] = ghT.T
            loop(s, d, lens, gx, wx_stats, gh, lp.bR, gain_r, gain_c, bias_c, vec, h_view, c, y, acts, cs, lnstat,
                 rh_raw)
            if zone is not None:                             # h' = h_new or h_prev (zoneout.py)
                zoneout.commit(s, d, lens, call.zoneout_active, cfg.zoneout, zone[0], zone[1], h_prev, h_view, y)
    h[...] = h_view


def forward(call, x, h0, c0, params, ct, rows, saved, flat):
    """`network.forward` of a layer-normalised cell (its arguments; rows: `fused_plan.call_rows(call)`, saved/flat:
    the reserve's views and buffer) -> (y, hT, cT or None, reserve)."""
    cfg, T, B = call.config, call.T, call.B
    H, D = cfg.H, cfg.D
    lens, steps = rows[0], rows[1]
    layers = unpack(cfg, params)
    hT = np.array(h0, dtype=ct)                              # [L*D, B, H] state, updated in place
    cT = np.array(c0, dtype=ct) if cfg.has_cell_state else None
    none3 = np.zeros((0, 0, 0), dtype=ct)
    no_c = np.zeros((0, H), dtype=ct)
    fused_loops = settings.get("cpu_fused")                  # False: the BLAS loops everywhere (to compare)
    x_l = x
    with threads.budget():
        for layer in range(cfg.L):
            if layer > 0 and call.dropout_active:
                x_l = dropped_input(call, saved, layer, x_l, ct)
            y = saved[f"y{layer}"]                           # [T, B, D*H], zero at padded positions
            for d in range(D):
                p = layer * D + d
                zone = None
                if call.zoneout_active:
                    zone = (zoneout.update_mask(cfg.seed, cfg.seed2, p, T, B, H, cfg.zoneout),
                            saved[f"zmask{layer}"][d])
                elif call.zoneout_expected:
                    zone = (np.zeros((0, 0, 0), np.uint8), none3)
                args = (call, layers[p], d, np.ascontiguousarray(x_l), hT[p], cT[p] if cT is not None else no_c, y,
                        saved[f"acts{layer}"][d], saved[f"c{layer}"][d] if cT is not None else none3,
                        saved[f"lnstat{layer}"][d], *(saved[f"{n}{layer}"][d] if n in cfg.cell.layer_norm else none3
                                                      for n in ("wx", "rh")))
                if fused_loops and steps > 0 and layer_norm_fused.supported(call, layers[p]):
                    layer_norm_fused.forward_direction(*args, rows, ct)
                else:
                    forward_direction(*args, lens, steps, ct, zone)
            x_l = y
    return x_l, hT, cT, flat


def backward(call, x, h0, c0, params, dy, dhT, dcT, reserve, ct, rows):
    """`network.backward` of a layer-normalised cell -> (dx [T, B, I], dh0, dc0 or None, dparams)."""
    cfg, T, B = call.config, call.T, call.B
    H, D, G, V = cfg.H, cfg.D, cfg.G, cfg.V
    cell = cfg.cell
    lens, steps, padded = rows[0], rows[1], rows[4]
    name = str(ct)
    layers = unpack(cfg, params)
    dparams = np.zeros(params.shape[0], dtype=ct)
    dlayers = unpack(cfg, dparams)
    saved = reserve_views(call, reserve)
    dh0 = np.array(dhT, dtype=ct)                            # [L*D, B, H] becomes input_h_backprop
    dc0 = np.array(dcT, dtype=ct) if cfg.has_cell_state else None
    no_c = np.zeros((0, H), dtype=ct)
    none3 = np.zeros((0, 0, 0), dtype=ct)
    loop = backward_loop(cell, name)
    _, input_rows_backward = row_kernels(name)
    tmp = scratch("tmp", (B, H), ct)                         # [B, H] dgh_s R
    use_fused = settings.get("cpu_fused") and steps > 0 and not call.zoneout_active
    all_rows = np.arange(B, dtype=np.int64)                  # [B] the BLAS loop runs every row
    if call.zoneout_active:                                  # zoneout.py: the step gets mask*(dy + dh) in dh
        carry, no_dy = zoneout.backward_buffers(T, B, D, H, ct)   # [B, H], [T, B, D*H]
    # the fused time loops: BLAS on one thread, the call's threads are numbarnn's (threads.team); the BLAS loops
    # keep BLAS's own threads (within the call's budget)
    with threads.serial_blas() if use_fused else contextlib.nullcontext():
        dy_l = dy
        for layer in reversed(range(cfg.L)):
            x_l, keep_scaled = backward_input(call, saved, x, layer, ct)   # [T, B, I_l], dropout's factor or None
            x_l = np.ascontiguousarray(x_l)
            y = saved[f"y{layer}"]
            I_l = x_l.shape[2]
            dx_l = np.zeros((T, B, I_l), dtype=ct)
            for d in range(D):
                p = layer * D + d
                lp, dlp = layers[p], dlayers[p]
                stats = saved[f"lnstat{layer}"][d]
                rh_raw = saved[f"rh{layer}"][d] if "rh" in cell.layer_norm else none3
                dgx = scratch(f"dgx{d}", (T, B, G * H), ct)       # [T, B, G*H] (t layout)
                dgh = scratch(f"dgh{d}", (T, B, G * H), ct)       # [T, B, G*H] (s layout) after LN_rh's backward
                hp = scratch(f"hp{d}", (T, B, H), ct)             # [T, B, H]   h entering step s
                gains = [_norm(cell, g, n, H, ct) for g in (lp, dlp) for n in ("ln_rh_gain", "ln_c_gain", "ln_c_bias")]
                # the accumulated gradients by row, summed after the time loop
                dbR = np.zeros((B, G * H), dtype=ct)                                 # [B, G*H]
                dgain_r, dgain_c, dbias_c = (np.zeros((B, g.shape[0]), dtype=ct) for g in gains[3:])  # [B, G*H or 0] ..
                dv_acc = np.zeros((B, V, H), dtype=ct)                               # [B, V, H]
                if padded:
                    dgx.fill(0)
                dgh[steps:] = 0
                hp[steps:] = 0
                dh = dh0[p]
                dc = dc0[p] if dc0 is not None else no_c
                vec = lp.V if lp.V is not None else np.zeros((0, H), dtype=ct)
                dy_step = no_dy if call.zoneout_active else dy_l
                args = (dy_step, y, h0[p], c0[p] if c0 is not None else no_c, saved[f"acts{layer}"][d],
                        saved[f"c{layer}"][d] if dc0 is not None else none3, stats, rh_raw, *gains[:3], vec, dh, dc,
                        dgx)
                sums = (dbR, dgain_r, dgain_c, dbias_c, dv_acc)
                if use_fused:                                    # layer_norm_fused.py: one time loop, no BLAS per step
                    layer_norm_fused.backward_direction(call, lp, d, rows, loop, args, dgh, hp, sums, ct)
                else:
                    # per step dgh_s R (B x G*H x H: G forward steps' product) with BLAS's own rule for its threads
                    # (within the call's budget): one thread was 10% slower on an idle 2-core machine, the same under
                    # load (bench/results/cpu.md)
                    for s in reversed(range(steps)):
                        if call.zoneout_active:
                            zoneout.split(s, d, lens, saved[f"zmask{layer}"][d], dy_l, dh, carry)
                        loop(s, d, lens, all_rows, *args, dgh[s], hp[s], *sums)
                        np.matmul(dgh[s], lp.R, out=tmp)
                        np.add(dh, tmp, out=dh)
                        if call.zoneout_active:
                            zoneout.add_carry(dh, carry)
                gx2 = dgx.reshape(T * B, G * H)
                np.sum(gx2, axis=0, out=dlp.bW)
                if "wx" in cell.layer_norm:                      # back through LN_wx from the raw W x of the reserve
                    raw = saved[f"wx{layer}"][d]                 # [T, B, G*H]
                    st = np.ascontiguousarray(stats[:, :, _columns(cell, "wx"):_columns(cell, "wx") + 2])
                    input_rows_backward(gx2, raw.reshape(T * B, G * H), st.reshape(T * B, 2),
                                        lp.norm(cell, "ln_wx_gain"), dlp.norm(cell, "ln_wx_gain"))
                # the products in slices on the call's threads (threads.matmul; fused: one BLAS thread each)
                if lp.W is not None:
                    threads.matmul(gx2.T, x_l.reshape(T * B, I_l), dlp.W)
                    dx_l += threads.matmul(gx2, lp.W, scratch("dx_part", (T * B, I_l), ct)).reshape(T, B, I_l)
                else:
                    dx_l += dgx.reshape(T, B, G, H).sum(axis=2)
                threads.matmul(dgh.reshape(T * B, G * H).T, hp.reshape(T * B, H), dlp.R)
                np.sum(dbR, axis=0, out=dlp.bR)
                for total, by_row in zip(gains[3:], (dgain_r, dgain_c, dbias_c)):
                    np.sum(by_row, axis=0, out=total)
                if lp.V is not None:
                    np.sum(dv_acc, axis=0, out=dlp.V)
            if layer == 0:
                dx = dx_l
            else:
                dy_l = dx_l if keep_scaled is None else dx_l * keep_scaled
    return dx, dh0, dc0, dparams

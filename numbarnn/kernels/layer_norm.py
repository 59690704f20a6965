"""The v1 kernels of a layer-normalised cell (haste's LayerNormLSTM / LayerNormGRU: `CellSpec.layer_norm`, SPEC 13).

A row (one batch row b at one step, one direction d) is normalised across its G*H values of W x or R h, or its H
values of c', so every kernel here runs one block of NT threads per row, each thread striding over the row's
values, and reduces the row's sums in shared memory (`block_sum`).  Rows with s >= len[b] carry their state.

forward
    layer_norm_rows            after the input GEMM, grid (T*B, D): gx = LN(W x) γ_x in place (the step adds bW),
                               the row's mean and rstd -> lnstat, the raw W x -> wx (reserve)
    <cell>_layer_norm_step     per step, grid (B, D): rh_raw = R h (a matvec per value, saved), "rh": its mean and
                               rstd, rh = LN(rh_raw) γ_r + bR ; the cell per unit ; "c": the row's c' normalised,
                               n = LN(c') γ_c + β_c, m = output(n) ; h', y, c', the saved values
backward (per step, then `recurrent.make_recurrent_backward`'s dh_out += dgh R)
    <cell>_layer_norm_backward_step   grid (B, D): "c": dn = output_backward(dm, n), dL/dc' += LN_c'(dn); the
                               cell's backward (dm = 0 with "c"); "rh": dgh = LN_rh'(dL/d rh) ; per-row parts of
                               the gains' gradients (dnc: dn ĉ and dn; dgr: dL/d rh ⊙ r̂) for column sums
    layer_norm_rows_backward   after the time loop, grid (T*B, D): dwx = LN_wx'(dgx) (W x from the reserve),
                               dgw = dgx ⊙ x̂; then dW, dx from dwx, dbW from dgx
The step kernels v2 and v3 have no row reductions: a layer-normalised cell runs these (steps.step_plan's note).
"""
from __future__ import annotations

import functools
import math

from numba import cuda, int64

from .cell_steps import device, device_function, reported_cells
from .common import DTYPES, acc_dtype, arr, nb

EPS = 1e-5
#: threads per block: a GPU's, and the simulator's (few, so that a row takes several strides, the last partial)
BLOCK_GPU, BLOCK_SIM = 128, 4


def norm_offsets(cell) -> tuple:
    """Rows of the layer's normalisation vectors [D, NV, H] where γ_x, γ_r, γ_c start (β_c follows γ_c);
    -1: absent."""
    out, at = {}, 0
    for name, count in cell.norm_groups:
        out[name] = at
        at += count
    return out.get("ln_wx_gain", -1), out.get("ln_rh_gain", -1), out.get("ln_c_gain", -1)


def stat_columns(cell) -> tuple:
    """Columns of mean (rstd follows) of wx, rh, c in a row of lnstat [.., 2K]; -1 absent."""
    names = [n for n in ("wx", "rh", "c") if n in cell.layer_norm]
    return tuple(2 * names.index(n) if n in names else -1 for n in ("wx", "rh", "c"))


@functools.lru_cache(maxsize=None)
def make_block_sum(dtype, NT: int):
    """block_sum(buf, value) -> the sum of `value` over the block's NT threads (a tree in shared memory `buf`
    [NT]); every thread of the block must call it."""
    @device
    def block_sum(buf, value):
        tid = cuda.threadIdx.x
        buf[tid] = value
        cuda.syncthreads()
        half = NT // 2
        while half > 0:
            if tid < half:
                buf[tid] += buf[tid + half]
            cuda.syncthreads()
            half //= 2
        total = buf[0]
        cuda.syncthreads()                      # (buf is reused by the next call)
        return total
    return block_sum


@functools.lru_cache(maxsize=None)
def make_row_backward(dtype, NT: int):
    """row_backward(buf, raw, grad, norm, O, K, lnstat, d, t, b, H, GH, dgain, out): back through a row's layer
    normalisation, the row [d, t, b, :GH] (GH = G*H values, gains at norm rows O.., mean and rstd at lnstat's
    column K): â = (raw - mean) rstd, g = grad γ; dgain = grad ⊙ â (the row's part of dγ), out = rstd (g -
    mean(g) - â mean(g â)).  Every thread of the block calls it (`block_sum`)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    block_sum = make_block_sum(dtype, NT)

    @device
    def row_backward(buf, raw, grad, norm, O, K, lnstat, d, t, b, H, GH, dgain, out):
        tid = cuda.threadIdx.x
        mean = acc(lnstat[d, t, b, K])
        rstd = acc(lnstat[d, t, b, K + 1])
        part_g = zero
        part_ga = zero
        for k in range(tid, GH, NT):
            a_hat = (acc(raw[d, t, b, k]) - mean) * rstd
            g = acc(grad[d, t, b, k]) * acc(norm[d, O + k // H, k % H])
            dgain[d, t, b, k] = acc(grad[d, t, b, k]) * a_hat
            part_g += g
            part_ga += g * a_hat
        mg = block_sum(buf, part_g) / GH
        mga = block_sum(buf, part_ga) / GH
        for k in range(tid, GH, NT):
            a_hat = (acc(raw[d, t, b, k]) - mean) * rstd
            g = acc(grad[d, t, b, k]) * acc(norm[d, O + k // H, k % H])
            out[d, t, b, k] = rstd * (g - mg - a_hat * mga)
    return row_backward


@functools.lru_cache(maxsize=None)
def make_layer_norm_rows(cell, dtype, NT: int):
    """gx = LN(W x) γ_x in place, one block per row (see the module docstring)."""
    acc = acc_dtype(dtype).type
    eps, zero = acc(EPS), acc(0.0)
    G = cell.G
    OWX = norm_offsets(cell)[0]
    KWX = stat_columns(cell)[0]
    block_sum = make_block_sum(dtype, NT)

    def layer_norm_rows(
        lens,         # [B] int32
        gx,           # [D, T, B, G*H]  in: W x ; out: LN(W x) γ_x
        norm,         # [D, NV, H]      the normalisation vectors (γ_x at rows OWX..OWX+G-1)
        lnstat,       # [D, T, B, 2K]   out (reserve): mean, rstd at the active [t, b]
        wx,           # [D, T, B, G*H]  out (reserve): W x at the active [t, b]
    ):
        buf = cuda.shared.array(NT, acc)
        B = gx.shape[2]
        GH = gx.shape[3]
        H = GH // G
        t = cuda.blockIdx.x // B
        b = cuda.blockIdx.x % B
        d = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        part = zero
        for k in range(tid, GH, NT):
            part += acc(gx[d, t, b, k])
        mean = block_sum(buf, part) / GH
        part = zero
        for k in range(tid, GH, NT):
            diff = acc(gx[d, t, b, k]) - mean
            part += diff * diff
        rstd = acc(1.0) / math.sqrt(block_sum(buf, part) / GH + eps)
        active = t < lens[b]
        for k in range(tid, GH, NT):
            raw = gx[d, t, b, k]
            if active:
                wx[d, t, b, k] = raw
            gx[d, t, b, k] = (acc(raw) - mean) * rstd * acc(norm[d, OWX + k // H, k % H])
        if tid == 0 and active:
            lnstat[d, t, b, KWX] = mean
            lnstat[d, t, b, KWX + 1] = rstd

    return layer_norm_rows


@functools.lru_cache(maxsize=None)
def make_layer_norm_rows_backward(cell, dtype, NT: int):
    """dwx = LN_wx'(dgx), dgw = dgx ⊙ x̂, one block per row (see the module docstring)."""
    acc = acc_dtype(dtype).type
    G = cell.G
    OWX = norm_offsets(cell)[0]
    KWX = stat_columns(cell)[0]
    row_backward = make_row_backward(dtype, NT)

    def layer_norm_rows_backward(
        dgx,          # [D, T, B, G*H]  dL/d(LN(W x) γ_x + bW) (0 where padded)
        wx,           # [D, T, B, G*H]  W x, the reserve's wx_l (0 where padded)
        norm,         # [D, NV, H]
        lnstat,       # [D, T, B, 2K]   mean, rstd (0 where padded: dwx is 0 there)
        dwx,          # [D, T, B, G*H]  out: dL/d(W x)
        dgw,          # [D, T, B, G*H]  out: dgx ⊙ x̂ (summed over rows into dγ_x)
    ):
        buf = cuda.shared.array(NT, acc)
        B = wx.shape[2]
        GH = wx.shape[3]
        H = GH // G
        t = cuda.blockIdx.x // B
        b = cuda.blockIdx.x % B
        d = cuda.blockIdx.y
        row_backward(buf, wx, dgx, norm, OWX, KWX, lnstat, d, t, b, H, GH, dgw, dwx)

    return layer_norm_rows_backward


@functools.lru_cache(maxsize=None)
def make_layer_norm_step(cell, dtype, NT: int):
    """One forward step of a layer-normalised cell, one block per row (see the module docstring)."""
    acc = acc_dtype(dtype).type
    eps, zero = acc(EPS), acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    NRH, NC = "rh" in cell.layer_norm, "c" in cell.layer_norm
    CS = cell.cell_state                        # else c, c0, cs and dc are empty (steps.absent)
    _, ORH, OC = norm_offsets(cell)
    _, KRH, KC = stat_columns(cell)
    pointwise = device_function(cell.forward, dtype)
    output = device_function(cell.output, dtype) if NC else None
    block_sum = make_block_sum(dtype, NT)

    def layer_norm_step(
        s,            # int64           step index
        lens,         # [B] int32
        gx,           # [D, T, B, G*H]  W x_t, normalised ("wx"), no bias
        unit_params,  # [D, 2G+V, H]    bW, bR and the cell vectors
        norm,         # [D, NV, H]      the normalisation vectors
        R_fwd,        # [G*H, H]        recurrent matrices, forward direction
        R_rev,        # [G*H, H]        ... reverse direction
        h_in,         # [D, B, H] acc   h entering the step
        h_out,        # [D, B, H] acc   h leaving it
        c,            # [D, B, H] acc   the cell state, updated in place (empty without one)
        y,            # [T, B, D*H]     layer output
        acts,         # [D, T, B, S*H]  out (reserve): the cell's saved values
        cs,           # [D, T, B, H]    out (reserve): c' (empty without a cell state)
        lnstat,       # [D, T, B, 2K]   out (reserve): mean, rstd of each normalised row
        rh_raw,       # [D, T, B, G*H]  out (reserve): R h
    ):
        buf = cuda.shared.array(NT, acc)
        b = cuda.blockIdx.x
        d = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        H = unit_params.shape[2]
        GH = G * H
        if s >= lens[b]:                        # past the length: carry the state (the whole block returns)
            for j in range(tid, H, NT):
                h_out[d, b, j] = h_in[d, b, j]
            return
        t = s if d == 0 else lens[b] - 1 - s
        R = R_fwd if d == 0 else R_rev
        part = zero
        for k in range(tid, GH, NT):           # R h, one matvec row per value of the row
            total = zero
            for q in range(H):
                total += acc(R[k, q]) * h_in[d, b, q]
            rh_raw[d, t, b, k] = total
            part += total
        mean_r = zero
        rstd_r = acc(1.0)
        if NRH:                                 # the row's mean and rstd (rh_raw as this thread wrote it)
            mean_r = block_sum(buf, part) / GH
            part = zero
            for k in range(tid, GH, NT):
                diff = acc(rh_raw[d, t, b, k]) - mean_r
                part += diff * diff
            rstd_r = acc(1.0) / math.sqrt(block_sum(buf, part) / GH + eps)
            if tid == 0:
                lnstat[d, t, b, KRH] = mean_r
                lnstat[d, t, b, KRH + 1] = rstd_r
        wx = cuda.local.array(G, acc)          # W_g x + bW_g
        rh = cuda.local.array(G, acc)          # rh_g: LN(R h)_g γ_r + bR_g
        v = cuda.local.array(VL, acc)          # cell vectors at unit j
        saved = cuda.local.array(S, acc)
        part = zero
        for j in range(tid, H, NT):
            for g in range(G):
                k = g * H + j
                wx[g] = acc(gx[d, t, b, k]) + acc(unit_params[d, g, j])
                raw = acc(rh_raw[d, t, b, k])
                rh[g] = ((raw - mean_r) * rstd_r * acc(norm[d, ORH + g, j]) if NRH else raw) + \
                    acc(unit_params[d, G + g, j])
            for k in range(V):
                v[k] = acc(unit_params[d, 2 * G + k, j])
            c_prev = c[d, b, j] if CS else zero
            m, c_new = pointwise(wx, rh, v, h_in[d, b, j], c_prev, saved)
            for k in range(S):
                acts[d, t, b, k * H + j] = saved[k]
            if CS:
                c[d, b, j] = c_new
                cs[d, t, b, j] = c_new
                part += c_new
            if not NC:
                h_out[d, b, j] = m
                y[t, b, d * H + j] = m
        if NC:                                  # n = LN(c') γ_c + β_c, m = output(n)
            mean_c = block_sum(buf, part) / H
            part = zero
            for j in range(tid, H, NT):
                diff = c[d, b, j] - mean_c
                part += diff * diff
            rstd_c = acc(1.0) / math.sqrt(block_sum(buf, part) / H + eps)
            if tid == 0:
                lnstat[d, t, b, KC] = mean_c
                lnstat[d, t, b, KC + 1] = rstd_c
            for j in range(tid, H, NT):
                for k in range(S):
                    saved[k] = acc(acts[d, t, b, k * H + j])
                for k in range(V):
                    v[k] = acc(unit_params[d, 2 * G + k, j])
                n = (c[d, b, j] - mean_c) * rstd_c * acc(norm[d, OC, j]) + acc(norm[d, OC + 1, j])
                m = output(n, saved, v)
                h_out[d, b, j] = m
                y[t, b, d * H + j] = m

    return layer_norm_step


@functools.lru_cache(maxsize=None)
def make_layer_norm_backward_step(cell, dtype, NT: int):
    """One backward step of a layer-normalised cell, one block per row (see the module docstring)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    SPLIT = cell.split_mask
    NRH, NC = "rh" in cell.layer_norm, "c" in cell.layer_norm
    CS = cell.cell_state                        # else c, c0, cs and dc are empty (steps.absent)
    _, ORH, OC = norm_offsets(cell)
    _, KRH, KC = stat_columns(cell)
    pointwise = device_function(cell.backward, dtype)
    output_backward = device_function(cell.output_backward, dtype) if NC else None
    block_sum = make_block_sum(dtype, NT)
    row_backward = make_row_backward(dtype, NT)

    def layer_norm_backward_step(
        s,            # int64           step index
        lens,         # [B] int32
        dy,           # [T, B, D*H]     dL/dy of the layer
        y,            # [T, B, D*H]     reserve: the layer's output
        h0,           # [D, B, H]       the initial h
        c0,           # [D, B, H]       the initial c (empty without a cell state)
        acts,         # [D, T, B, S*H]  reserve: the cell's saved values
        cs,           # [D, T, B, H]    reserve: c' (empty without a cell state)
        lnstat,       # [D, T, B, 2K]   reserve: mean, rstd
        rh_raw,       # [D, T, B, G*H]  reserve: R h
        unit_params,  # [D, 2G+V, H]
        norm,         # [D, NV, H]
        dh_in,        # [D, B, H] acc   dh arriving at this step
        dh_out,       # [D, B, H] acc   out: the part bypassing R (recurrent_backward adds dgh R)
        dc,           # [D, B, H] acc   dL/dc, in place (empty without a cell state)
        dgx,          # [D, T, B, G*H]  out: dL/d(wx) (before LN_wx's backward)
        dgh,          # [D, T, B, G*H]  out: dL/d(R h)
        dgh_pre,      # [D, T, B, G*H]  out: dL/d(rh) (before LN_rh's backward: dbR's rows)
        dgr,          # [D, T, B, G*H]  out: dL/d(rh) ⊙ r̂ (dγ_r's rows)
        dnc,          # [D, T, B, 2H]   out: dn ĉ, dn (dγ_c's, dβ_c's rows)
        dvec,         # [D, T, B, V*H]  out: the cell vectors' rows (empty without vectors)
        h_prev,       # [D, T, B, H]    out: h entering the step
    ):
        buf = cuda.shared.array(NT, acc)
        b = cuda.blockIdx.x
        d = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        H = unit_params.shape[2]
        GH = G * H
        if s >= lens[b]:                        # (recurrent_backward carries dh; the gradients stay 0)
            return
        step = int64(1) if d == 0 else int64(-1)
        t = s if d == 0 else lens[b] - 1 - s
        first = s == 0
        saved = cuda.local.array(S, acc)
        v = cuda.local.array(VL, acc)
        dwx = cuda.local.array(G, acc)
        drh = cuda.local.array(G, acc)
        dv = cuda.local.array(VL, acc)
        for j in range(tid, H, NT):
            h_prev[d, t, b, j] = acc(h0[d, b, j]) if first else acc(y[t - step, b, d * H + j])
        mean_c = zero
        rstd_c = zero
        mg = zero
        mgc = zero
        if NC:                                  # m = output(n): dn, its part of dwx / drh, then the row's means
            mean_c = acc(lnstat[d, t, b, KC])
            rstd_c = acc(lnstat[d, t, b, KC + 1])
            part_g = zero
            part_gc = zero
            for j in range(tid, H, NT):
                for k in range(S):
                    saved[k] = acc(acts[d, t, b, k * H + j])
                for k in range(V):
                    v[k] = acc(unit_params[d, 2 * G + k, j])
                for g in range(G):
                    dwx[g] = zero
                    drh[g] = zero
                c_hat = (acc(cs[d, t, b, j]) - mean_c) * rstd_c
                dm = acc(dy[t, b, d * H + j]) + dh_in[d, b, j]
                dn = output_backward(dm, c_hat * acc(norm[d, OC, j]) + acc(norm[d, OC + 1, j]), saved, v, dwx, drh)
                for g in range(G):
                    dgx[d, t, b, g * H + j] = dwx[g]
                    dgh_pre[d, t, b, g * H + j] = drh[g] if SPLIT[g] else dwx[g]
                dnc[d, t, b, j] = dn * c_hat
                dnc[d, t, b, H + j] = dn
                g_j = dn * acc(norm[d, OC, j])
                dh_out[d, b, j] = g_j           # (held here until the cell's backward below)
                part_g += g_j
                part_gc += g_j * c_hat
            mg = block_sum(buf, part_g) / H
            mgc = block_sum(buf, part_gc) / H
        for j in range(tid, H, NT):             # the cell's backward (dm = 0 with a normalised state)
            for k in range(S):
                saved[k] = acc(acts[d, t, b, k * H + j])
            for k in range(V):
                v[k] = acc(unit_params[d, 2 * G + k, j])
            c_prev = zero
            c_new = zero
            dcell = zero
            if CS:
                c_prev = acc(c0[d, b, j]) if first else acc(cs[d, t - step, b, j])
                c_new = acc(cs[d, t, b, j])
                dcell = dc[d, b, j]
            for g in range(G):                  # (a cell may leave the gates `output` reads unwritten)
                dwx[g] = zero
                drh[g] = zero
            dm = zero
            if NC:
                c_hat = (c_new - mean_c) * rstd_c
                dcell += rstd_c * (dh_out[d, b, j] - mg - c_hat * mgc)
            else:
                dm = acc(dy[t, b, d * H + j]) + dh_in[d, b, j]
            dh_direct, dc_prev = pointwise(dm, dcell, saved, v, acc(h_prev[d, t, b, j]), c_prev, c_new, dwx, drh, dv)
            for g in range(G):
                k = g * H + j
                gw = dwx[g]
                gr = drh[g] if SPLIT[g] else dwx[g]
                if NC:
                    gw += acc(dgx[d, t, b, k])
                    gr += acc(dgh_pre[d, t, b, k])
                dgx[d, t, b, k] = gw
                if NRH:
                    dgh_pre[d, t, b, k] = gr
                else:
                    dgh[d, t, b, k] = gr
            for k in range(V):
                dvec[d, t, b, k * H + j] = dv[k]
            if CS:
                dc[d, b, j] = dc_prev
            dh_out[d, b, j] = dh_direct
        if NRH:                                 # rh = LN(R h) γ_r + bR: back to R h
            cuda.syncthreads()                  # (dgh_pre of every unit of the row is written)
            row_backward(buf, rh_raw, dgh_pre, norm, ORH, KRH, lnstat, d, t, b, H, GH, dgr, dgh)

    return layer_norm_backward_step


def kernel_specs():
    """The kernels of every reported layer-normalised cell (numbarnn.contrib: layer_norm_lstm, layer_norm_gru)."""
    specs = []
    for dt in DTYPES:
        a, i64, i32 = str(acc_dtype(dt)), nb("int64"), arr("int32", 1)
        for cell in reported_cells():
            if not cell.layer_norm:
                continue
            c_acc, c_dt, cs = arr(a, 3), arr(dt, 3), arr(dt, 4)     # (empty where the cell has none: steps.absent)
            R = (arr(dt, 2), arr(dt, 2))
            NT = BLOCK_GPU
            if "wx" in cell.layer_norm:
                specs.append((f"{cell.name}_layer_norm_rows", dt, make_layer_norm_rows(cell, dt, NT),
                              (i32, arr(dt, 4), arr(dt, 3), arr(dt, 4), arr(dt, 4)), NT))
                specs.append((f"{cell.name}_layer_norm_rows_backward", dt, make_layer_norm_rows_backward(cell, dt, NT),
                              (arr(dt, 4), arr(dt, 4), arr(dt, 3), arr(dt, 4), arr(dt, 4), arr(dt, 4)), NT))
            specs.append((f"{cell.name}_layer_norm_step", dt, make_layer_norm_step(cell, dt, NT),
                          (i64, i32, arr(dt, 4), arr(dt, 3), arr(dt, 3)) + R + (arr(a, 3), arr(a, 3), c_acc,
                                                                                 arr(dt, 3), arr(dt, 4), cs,
                                                                                 arr(dt, 4), arr(dt, 4)), NT))
            specs.append((f"{cell.name}_layer_norm_backward_step", dt, make_layer_norm_backward_step(cell, dt, NT),
                          (i64, i32, arr(dt, 3), arr(dt, 3), arr(dt, 3), c_dt, arr(dt, 4), cs, arr(dt, 4),
                           arr(dt, 4), arr(dt, 3), arr(dt, 3), arr(a, 3), arr(a, 3), c_acc) + (arr(dt, 4),) * 5 +
                          (arr(dt, 4), arr(dt, 4)), NT))
    return specs

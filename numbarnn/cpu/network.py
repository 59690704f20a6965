"""The CPU network driver: layers, directions, ragged lengths, dropout, projection (SPEC 3, 5, 6, 7).

The same structure as `numbarnn/reference/network.py` (see the package docstring), in the compute dtype: the
fused loops (`fused.py`, their per-call plans in `fused_plan.py`) where a cell allows them, else BLAS for every
product and the njit step loops of `cells.py` for the pointwise math.  All arrays here are
NumPy arrays in the compute dtype `ct`; `backend.py` converts at the boundary.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from .. import settings
from ..config import RNNCall
from ..params import unpack
from ..reserve import reserve_entries, reserve_views
from . import (cells, diagonal, fused, fused_plan, layer_norm, microkernel, modulated, modulated_fused, panels,
               threads, zoneout)
from .jitcache import njit_cached
from .layer_input import backward_input, dropped_input, input_projection
from .workspace import scratch


@njit_cached
def commit_projection(
    s,        # int     step index
    d,        # int     direction
    lens,     # [B]     int32
    h_new,    # [B, P]  W_proj m of this step (BLAS), every row
    h,        # [B, P]  state h: active rows take h_new
    y,        # [T, B, D*P] layer output
):
    B, P = h.shape
    for b in range(B):
        if s < lens[b]:
            t = s if d == 0 else lens[b] - 1 - s
            for k in range(P):
                h[b, k] = h_new[b, k]
                y[t, b, d * P + k] = h_new[b, k]


@njit_cached
def total_dh(
    s,        # int     step index
    d,        # int     direction
    lens,     # [B]     int32
    dy,       # [T, B, D*P]
    dh,       # [B, P]  dh' from the next step
    dht_s,    # [B, P]  out: dy + dh of this step (0 for inactive rows), the input of W_proj^T
    dh_all,   # [T, B, P] out: the same at [t, b] (for dW_proj)
):
    B, P = dh.shape
    for b in range(B):
        if s < lens[b]:
            t = s if d == 0 else lens[b] - 1 - s
            for k in range(P):
                v = dy[t, b, d * P + k] + dh[b, k]
                dht_s[b, k] = v
                dh_all[t, b, k] = v
        else:
            for k in range(P):
                dht_s[b, k] = 0.0


def buffers(call: RNNCall, ct, zero_y: bool = True) -> tuple[np.ndarray, dict]:
    """A buffer laid out like the reserve (SPEC 7) in the compute dtype, and its named views: a new zeroed array
    for training (it is returned), workspace scratch for inference (the step loops write the same arrays;
    only the output leaves the call, copied; only the y entries are zeroed, and only with `zero_y`: a call
    whose every row runs every step writes all of them)."""
    if call.is_training:
        flat = np.zeros(_layout_size(call), dtype=ct)
        return flat, reserve_views(call, flat)
    flat = scratch("reserve", (_layout_size(call),), ct)
    views = _inference_views.get(call)
    if views is None or views[0] is not flat:              # the scratch grew, or another thread's
        if len(_inference_views) > 64:
            _inference_views.clear()
        named = reserve_views(call, flat)
        views = _inference_views[call] = (flat, named, [v for name, v in named.items() if name.startswith("y")])
    if zero_y:
        for view in views[2]:                               # only the outputs are read: y is 0 where no
            view.fill(0)                                    # step runs; the saved values are not kept
    return views[0], views[1]


@functools.lru_cache(maxsize=256)
def _layout_size(call: RNNCall) -> int:
    """Elements of the reserve's layout (inference calls too: their reserve_size is 0)."""
    return sum(e.size for e in reserve_entries(call))


#: call -> (the inference scratch, its views): the same scratch comes back while it does not grow
_inference_views: dict = {}


def fused_forward(call: RNNCall, plan: fused_plan.FusedPlan, p: int, params, d, x_l, h, c, y, acts, cs, ms, rows, ct,
                  kept=None, zone=None):
    """Pseudo-layer p (direction d) by `fused.forward_loop`, its weights read from the opaque `params`: h [B, P]
    and c [B, H] (or None) are updated in place to the state after each row's last step; y, acts, cs (and ms
    with a projection) are written for the active [t, b].  plan: `fused_plan.forward_plan`, rows:
    `fused_plan.call_rows(call)`.
    kept: (the layer's kept panels Wp, Rp, Wq, bW, bR, vec, whether they hold params already) or None: the
    panels are packed into scratch.  zone: zoneout's (mask [T, B, P] uint8, zmask [T, B, P] reserve) in training,
    (empty, empty) at inference (the expectation), or None: no zoneout."""
    cfg, B = call.config, call.B
    H, P = cfg.H, cfg.P
    lens, steps, _, _, _, ran, t_last = rows
    lay = plan.layers[p]
    z = lay.z
    HP = z.HP
    # bW, bR [NT, G, LANES], vec [VL, HP], hbuf [2, B, HB] (h, double-buffered), cbuf [B, HP]: one scratch
    bW, bR, vec, hbuf, cbuf = fused_plan.small_buffers(lay.small, ct)
    if kept is None:
        Rp = scratch("fused_Rp", z.R_panels, ct)             # [NT, G//V, P, V, LANES] R by unit tiles
        Wp = Rp if lay.skip else scratch("fused_Wp", z.W_panels, ct)   # [NT, G//V, I, V, LANES] (skip: not read)
        # W_proj^T by column tiles, the forward's NR rows
        Wq = scratch("fused_Wq", z.Wq_panels, ct) if cfg.has_proj else lay.no_Wq
        packed = False
    else:                                                    # the same arrays, kept between calls (panels.py)
        (Wp, Rp, Wq, bW, bR, vec), packed = kept
        Wp = Rp if lay.skip else Wp
    mbuf = scratch("fused_m", (B, HP), ct) if cfg.has_proj else lay.no_m   # [B, HP] m of a step
    fused_plan.fused_prepare(params, lay.spans, x_l.shape[2], H, cfg.V, h, plan.no_c if c is None else c, Wp, Rp,
                             Wq, bW, bR, vec, hbuf, cbuf, not packed)
    zin, zmask = zone if zone is not None else (zoneout.NO_MASK, plan.none3)
    lay.loop(d, H, lens, steps, np.ascontiguousarray(x_l), Wp, Rp, bW, bR, vec, hbuf, cbuf, y, acts,
             cs, lay.rows, Wq, mbuf, ms, lay.skip, call.is_training, zoneout.fused_mode(call), cfg.zoneout, zin,
             zmask)
    if plan.full:                            # every row's last step: t = T-1 (reverse: 0)
        h[...] = y[call.T - 1 if d == 0 else 0, :, d * P:(d + 1) * P]
    else:                                    # rows that ran: h is their last output
        h[ran] = y[t_last[d][ran], ran, d * P:(d + 1) * P]
    if c is not None:
        c[...] = cbuf[:, :H]


def blas_forward(call: RNNCall, lp, d, x_l, h_state, c_state, y, acts, cs, ms, lens, steps, ct, acts_mod=None,
                 zone=None):
    """One layer and direction by BLAS products and the njit step loop (the setting cpu_fused False; always for a
    diagonal or a modulated cell): h_state [B, P] and c_state [B, H] (or None) are updated in place; acts_mod
    [T, B, H]: the reserve's m of a modulated cell; zone: zoneout's (mask [T, B, P] uint8, zmask [T, B, P] reserve)
    (zoneout.py; empty arrays at inference)."""
    cfg, T, B = call.config, call.T, call.B
    H, P, G = cfg.H, cfg.P, cfg.G
    step = cells.pick(cells.forward_step, cfg.cell, ct, cfg.has_proj, B, H)
    # R h is computed as R @ h^T -> [G*H, B] (M = G*H, N = B): on OpenBLAS 40% faster than h @ R^T for
    # B=32, G*H=2048 (44 vs 73 ms per 100 steps, bench/results/cpu.md); the step loops read both through
    # transposed views, so the state h lives as hT_buf [P, B] during a direction's time loop.
    ghT = scratch("ghT", (G * H, B), ct)                     # [G*H, B] R h of one step, transposed
    hT_buf = scratch("hT", (P, B), ct)                       # [P, B]   the state h, transposed
    gx = scratch("gx", (T, B, G * H), ct)                    # [T, B, G*H] W x_t
    m_step = scratch("m_step", (B, H), ct)                   # [B, H]   projection input of one step
    h_new = scratch("h_new", (B, P), ct)                     # [B, P]   W_proj m of one step
    input_projection(lp, x_l, G, gx)
    h = hT_buf.T                                             # [B, P] view of the transposed state
    h[...] = h_state
    c = c_state if c_state is not None else m_step
    vec = lp.V if lp.V is not None else np.zeros((0, H), dtype=ct)
    if cfg.cell.modulated:                                   # two products, m ⊙ h between them (modulated.py)
        rows1, rows2 = modulated.gate_rows(cfg.cell, H, False), modulated.gate_rows(cfg.cell, H, True)
        R1, R2 = lp.R[rows1], lp.R[rows2]                    # [G1*H, P], [G2*H, P] the two products' rows
        modulate = modulated.modulate(cfg.cell, fused_plan.dtype_name(ct))
        qT_buf = scratch("qT", (H, B), ct)                   # [H, B] m ⊙ h, transposed like h
        gh1T = scratch("gh1T", (rows1.size, B), ct)          # [G1*H, B] R_1 h
        gh2T = scratch("gh2T", (rows2.size, B), ct)          # [G2*H, B] R_2 (m ⊙ h)
    # a modulated cell's small per-step products: BLAS on one thread (threads.serial_blas)
    if zone is not None:
        h_prev = scratch("zoneout_h_prev", (B, P), ct)       # [B, P] h entering the step
    with threads.serial_blas() if cfg.cell.modulated else contextlib.nullcontext():
        for s in range(steps):
            if zone is not None:
                h_prev[...] = h
            if cfg.cell.modulated:                           # (modulate reads only the unmodulated rows)
                modulated.product(R1, hT_buf, ghT, rows1, gh1T)
                modulate(s, d, lens, gx, ghT.T, lp.bW, lp.bR, vec, h, qT_buf.T, acts_mod)
                modulated.product(R2, qT_buf, ghT, rows2, gh2T)
            elif cfg.cell.diagonal:                          # u_g ⊙ h per gate (diagonal.py)
                diagonal.recurrent(lp.R, hT_buf, ghT)
            else:
                np.matmul(lp.R, hT_buf, out=ghT)
            step(s, d, lens, gx, ghT.T, lp.bW, lp.bR, vec, h, c, m_step, y, acts, cs, ms)
            if cfg.has_proj:
                np.matmul(m_step, lp.W_proj.T, out=h_new)
                commit_projection(s, d, lens, h_new, h, y)
            if zone is not None:                             # h' = h_new or h_prev (zoneout.py)
                zoneout.commit(s, d, lens, call.zoneout_active, cfg.zoneout, zone[0], zone[1], h_prev, h, y)
    h_state[...] = h


def forward(call: RNNCall, x, h0, c0, params, ct):
    """x [T, B, I], h0 [L*D, B, P], c0 [L*D, B, H] or None, params [N] (all ct)
    -> (y [T, B, D*P], hT [L*D, B, P], cT [L*D, B, H] or None, reserve [R] (ct, nonce slot zero))."""
    cfg, T, B = call.config, call.T, call.B
    P, D = cfg.P, cfg.D
    rows = fused_plan.call_rows(call)
    lens, steps = rows[0], rows[1]                            # [B], no step past the longest
    cell = cfg.cell
    if cell.layer_norm:                                       # the row reductions of SPEC 13 (layer_norm.py)
        flat, saved = buffers(call, ct)
        return layer_norm.forward(call, x, h0, c0, params, ct, rows, saved, flat)
    # the fused loops make one product by a matrix R per step: not a diagonal cell's, nor a modulated cell's two
    fused_loops = settings.get("cpu_fused")                  # False: the BLAS loops everywhere (to compare)
    use_fused = fused_loops and steps > 0 and not cell.diagonal and not cell.modulated
    if use_fused:                                             # (reads the weights from params: no views)
        plan = fused_plan.forward_plan(call, ct, microkernel.geometry(cell.G), threads.num_threads(), cell,
                                       settings.get("cpu_side_by_side"))
        layers, none3 = None, plan.none3
    else:
        layers, none3 = unpack(cfg, params), np.zeros((0, 0, 0), dtype=ct)
    kept = None
    if use_fused and T * B <= panels.KEEP_ROWS and params.shape[0] >= panels.KEEP_WEIGHTS:
        kept = panels.KEPT.lookup(plan, params, plan.kept)   # few rows: the packed weights are kept (panels.py)
    flat, saved = buffers(call, ct, zero_y=rows[4] or not use_fused)   # (rows[4]: some [t, b] never runs)
    hT = np.array(h0, dtype=ct)                              # [L*D, B, P] state, updated in place
    cT = np.array(c0, dtype=ct) if cell.cell_state else None

    x_l = x
    for layer in range(cfg.L):
        if layer > 0 and call.dropout_active:
            x_l = dropped_input(call, saved, layer, x_l, ct)
        y = saved[f"y{layer}"]                               # [T, B, D*P], zero at padded positions

        def direction(d, layer=layer, x_l=x_l, y=y):
            p = layer * D + d
            acts = saved[f"acts{layer}"][d]
            cs = saved[f"c{layer}"][d] if cfg.has_cell_state else none3
            c_state = cT[p] if cT is not None else None
            ms = saved[f"m{layer}"][d] if cfg.has_proj else none3
            zone = None                                      # zoneout's (mask, zmask) (zoneout.py)
            if call.zoneout_active:
                zone = (zoneout.update_mask(cfg.seed, cfg.seed2, p, T, B, P, cfg.zoneout), saved[f"zmask{layer}"][d])
            elif call.zoneout_expected:
                zone = (zoneout.NO_MASK, none3)
            if use_fused:
                fused_forward(call, plan, p, params, d, x_l, hT[p], c_state, y, acts, cs, ms, rows, ct,
                              None if kept is None else (kept[0].layers[p], kept[1]), zone)
            elif cell.modulated and fused_loops and steps > 0 and modulated_fused.supported(call, layers[p]):
                with threads.budget():                       # two products a step, fused (modulated_fused.py)
                    modulated_fused.forward_direction(call, layers[p], d, x_l, hT[p], c_state, y, acts, cs,
                                                      saved[f"mod{layer}"][d], rows, ct)
            else:
                with threads.budget():
                    blas_forward(call, layers[p], d, x_l, hT[p], c_state, y, acts, cs, ms, lens, steps, ct,
                                 saved[f"mod{layer}"][d] if cfg.cell.modulated else None, zone)

        if use_fused and plan.sides[layer]:                 # one thread each (fused.side_by_side)
            threads.side_by_side(functools.partial(direction, 0), functools.partial(direction, 1))
        else:
            for d in range(D):
                direction(d)
        x_l = y
    if kept is not None and not kept[1]:
        panels.KEPT.commit(kept[0], params)                  # every pseudo-layer's panels hold params now
    return x_l, hT, cT, flat


@njit_cached
def bias_sums(
    gx,       # [N, C]  W-side pre-activation gradients (C > 1)
    gh,       # [N, C]  R-side
    dbW,      # out: [C] column sums of gx (columns c0 .. c1 written)
    dbR,      # out: [C] column sums of gh
    c0,       # int     the first column summed
    c1,       # int     past the last
):
    """The bias gradients of columns c0 .. c1 in one compiled call, bit for bit NumPy's `np.sum(g, axis=0)` of a
    C-contiguous [N, C], C > 1 (NumPy adds row after row onto zeros there; a single column it sums pairwise): two
    NumPy reductions cost ~10 us a tiny call.  The sums and the rows as slices: LLVM vectorises the column loop
    (indexing dbW[c] and gx[r, c] directly it did not, 9x slower).  gh the same memory as gx (network.backward
    shares them where the R side has no gradient of its own): summed once."""
    n = c1 - c0
    sW = dbW[c0:c1]                                          # [n] views of the outputs' columns
    sR = dbR[c0:c1]
    sW[:] = 0.0
    for r in range(gx.shape[0]):
        row = gx[r, c0:c1]                                   # [n]
        for c in range(n):
            sW[c] += row[c]
    if gh.ctypes.data == gx.ctypes.data and gh.shape == gx.shape and gh.strides == gx.strides:
        sR[:] = sW
        return
    sR[:] = 0.0
    for r in range(gh.shape[0]):
        row = gh[r, c0:c1]
        for c in range(n):
            sR[c] += row[c]


def _no_dv(B: int, H: int, ct) -> np.ndarray:
    """dv_acc [B, 0, H] of a cell without vectors (empty: never read or written)."""
    return np.zeros((B, 0, H), ct)


def sum_of_outer(a, b, out):
    """out [M, N] = a^T b for a [K, M], b [K, N]: a weight gradient, the sum over the call's K = T*B rows of
    their outer products.  K == 1 (a call of one step and one row) as the outer product itself: NumPy's matmul
    of an inner size 1 does not call BLAS (1.6 ms for [2048, 1] x [1, 512] on one thread, 0.21 ms at K = 2,
    np.multiply 0.38 ms: bench/results/cpu.md); the same bits (one multiply per value)."""
    if a.shape[0] == 1:
        return np.multiply(a.T, b, out=out)
    return np.matmul(a.T, b, out=out)


def backward(call: RNNCall, x, h0, c0, params, dy, dhT, dcT, reserve, ct):
    """Backprop through the whole network from the reserve (all ct)
    -> (dx [T, B, I], dh0 [L*D, B, P], dc0 [L*D, B, H] or None, dparams [N])."""
    cfg, T, B = call.config, call.T, call.B
    H, P, D, G, V = cfg.H, cfg.P, cfg.D, cfg.G, cfg.V
    lens, steps, by_length, _, padded, _, _ = fused_plan.call_rows(call)   # [B], the longest length, [B]
    #                                                                          longest first
    if cfg.cell.layer_norm:                                  # the row reductions of SPEC 13 (layer_norm.py)
        return layer_norm.backward(call, x, h0, c0, params, dy, dhT, dcT, reserve, ct, fused_plan.call_rows(call))
    layers = unpack(cfg, params)
    dparams = np.zeros(params.shape[0], dtype=ct)
    dlayers = unpack(cfg, dparams)
    saved = reserve_views(call, reserve)
    dh0 = np.array(dhT, dtype=ct)                            # [L*D, B, P] state, becomes input_h_backprop
    dc0 = np.array(dcT, dtype=ct) if cfg.has_cell_state else None
    cell = cfg.cell
    # the fused loops make one product by a matrix R per step: not a diagonal cell's, nor a modulated cell's two
    use_fused = settings.get("cpu_fused") and steps > 0 and not cell.diagonal and not cell.modulated
    if cell.modulated:                                       # modulated.py: two products per step
        rows1, rows2 = modulated.gate_rows(cell, H, False), modulated.gate_rows(cell, H, True)
        modulate_backward = modulated.modulate_backward(cell, fused_plan.dtype_name(ct))
        dq = scratch("dq", (B, H), ct)                       # [B, H] dgh_2 R_2 of a step
    if use_fused:
        MV = fused.COLUMN_VECTORS
        plan = fused_plan.backward_plan(call, ct, microkernel.geometry(MV), threads.num_threads(), cell)
        no_vec, none3 = plan.no_vec, plan.none3
    else:
        step = cells.pick(cells.backward_step, cell, ct, cfg.has_proj, B, H)
        all_rows = np.arange(B, dtype=np.int64)
        no_vec, none3 = np.zeros((0, H), dtype=ct), np.zeros((0, 0, 0), dtype=ct)
    split = plan.split if use_fused else any(cell.split_mask)
    if call.zoneout_active:                                  # zoneout.py: the cell step gets mask*(dy + dh) in dh
        _, no_dy = zoneout.backward_buffers(T, B, D, P, ct)   # [T, B, D*P] zeros: the step's dy
    # per layer: its two directions side by side, each its time loop and its products on one thread
    sides = fused_plan.layer_sides(call, threads.num_threads(), bool(use_fused and settings.get("cpu_side_by_side")))

    def time_loop(layer, d, x_l, y, dy_l, grouped):
        """Pass 1 of direction d: its time loop from the reserve -> the gradients its products read.  Scratch
        (workspace.py, the running thread's): every element read is written first (steps < T are zeroed,
        inactive rows are zeroed by the step, dgx/dh_all/dv_acc are filled here)."""
        p = layer * D + d
        lp = layers[p]
        acts = saved[f"acts{layer}"][d]
        cs = saved[f"c{layer}"][d] if cfg.has_cell_state else none3
        vec = lp.V if lp.V is not None else no_vec
        tmp = scratch("tmp", (B, P), ct)                     # [B, P]      dgh_s @ R
        dht = scratch("dht", (B, P), ct)                     # [B, P]      projection: dy + dh of a step
        dm = scratch("dm", (B, H), ct)                       # [B, H]      projection: W_proj^T (dy + dh)
        carry = zoneout.carry_buffer(B, P, ct)               # [B, P]      zoneout: what bypasses the cell
        dh = dh0[p]
        dc = dc0[p] if dc0 is not None else dm
        c0p = c0[p] if c0 is not None else dm
        dgx = scratch(f"dgx{d}", (T, B, G * H), ct)           # [T, B, G*H] W-side grads (t layout)
        # [T, B, G*H] R-side grads (s layout).  The forward direction's s is t, and without a gate whose R
        # side has its own gradient (GRU's candidate has) they equal dgx: the same memory (T*B*G*H fewer)
        # (not for a modulated cell: its second pass adds to both)
        share = d == 0 and not split and not cell.modulated
        dgh = dgx if share else scratch(f"dgh{d}", (T, B, G * H), ct)
        hp = scratch(f"hp{d}", (T, B, P), ct)                 # [T, B, P]   h entering step s (s layout)
        dv_acc = scratch(f"dv_acc{d}", (B, V, H), ct) if V else _no_dv(B, H, ct)   # [B, V, H]
        dh_all = scratch(f"dh_all{d}", (T, B, P), ct) if cfg.has_proj else None   # [T, B, P] for dW_proj
        qs = scratch(f"qs{d}", (T, B, H), ct) if cfg.cell.modulated else None   # [T, B, H] m ⊙ h_prev (s layout)
        if padded:
            dgx.fill(0)
        if steps < T:                                        # steps never run stay 0 in the s layout
            dgh[steps:] = 0
            hp[steps:] = 0
            if qs is not None:
                qs[steps:] = 0
        if dh_all is not None:
            dh_all.fill(0)
        dv_acc.fill(0)
        grad = (dgx, dgh, hp, dv_acc, dh_all, qs)
        if use_fused:
            RTp = scratch("fused_RTp", plan.RTp_shape, ct)  # R by columns
            microkernel.pack_columns(lp.R, RTp)
            rows, loop = plan.grouped if grouped else plan.serial
            if cfg.has_proj:                                 # W_proj's columns, by column tiles
                Wc = scratch("fused_Wc", plan.Wc_shape, ct)
                microkernel.pack_columns(lp.W_proj, Wc)
                proj = (Wc, dht, dm, dh_all)
            else:
                proj = plan.no_proj
            if call.zoneout_active:                          # the loop splits dy_l + dh by the mask
                zone = (no_dy, True, saved[f"zmask{layer}"][d], dy_l, carry)
            else:                                            # (empty [0, P]: carry never read)
                zone = (dy_l, False, none3, dy_l, plan.no_proj[1])
            loop(d, lens, rows, zone[0], y, h0[p], c0p, acts, cs, vec, dh, dc, dgx, dgh, hp, dv_acc, RTp, steps,
                 *proj, *zone[1:])
            return grad
        if cfg.cell.modulated:
            R1, R2 = lp.R[rows1], lp.R[rows2]                # [G1*H, P], [G2*H, P] the two products' rows
        # a modulated cell's small per-step products: BLAS on one thread (threads.serial_blas)
        with threads.serial_blas() if cfg.cell.modulated else contextlib.nullcontext():
            dy_step = dy_l
            if call.zoneout_active:
                zmask, dy_step = saved[f"zmask{layer}"][d], no_dy
            for s in reversed(range(steps)):
                if call.zoneout_active:
                    zoneout.split(s, d, lens, zmask, dy_l, dh, carry)
                if cfg.has_proj:
                    total_dh(s, d, lens, dy_step, dh, dht, dh_all)
                    np.matmul(dht, lp.W_proj, out=dm)
                step(s, d, lens, all_rows, dy_step, y, h0[p], c0p, acts, cs, vec, dm, dh, dc, dgx, dgh[s],
                     hp[s], dv_acc)
                if cfg.cell.modulated:                       # through R_2 (m ⊙ h), then R_1 h (modulated.py)
                    np.matmul(modulated.columns(dgh[s], rows2), R2, out=dq)
                    modulate_backward(s, d, lens, dq, saved[f"mod{layer}"][d], acts, vec, hp[s], dh, dgx, dgh[s],
                                      qs[s])
                    np.matmul(modulated.columns(dgh[s], rows1), R1, out=tmp)
                    np.add(dh, tmp, out=dh)
                elif cfg.cell.diagonal:                      # dh += sum_g dgh_g ⊙ u_g (diagonal.py)
                    diagonal.recurrent_backward(dgh[s], lp.R, dh)
                else:
                    np.matmul(dgh[s], lp.R, out=tmp)
                    np.add(dh, tmp, out=dh)
                if call.zoneout_active:
                    zoneout.add_carry(dh, carry)
        return grad

    def gradients(layer, d, x_l, grad, dx_part, i=0, pieces=1):
        """Pass 2 of direction d: its weight gradients, single big products over all steps and rows, and its
        part of dx (dx_part [T*B, I_l]); with `pieces`, only slice i of each product's rows (gate units, rows of
        dx, projected units), so that each thread of a call makes one slice (one BLAS thread each)."""
        dgx, dgh, hp, dv_acc, dh_all, qs = grad
        p = layer * D + d
        lp, dlp = layers[p], dlayers[p]
        I_l = x_l.shape[2]
        gx2, gh2 = dgx.reshape(T * B, G * H), dgh.reshape(T * B, G * H)
        g, r = threads.part(G * H, i, pieces), threads.part(T * B, i, pieces)   # its gate units, dx rows
        if lp.W is not None:
            sum_of_outer(gx2[:, g], x_l.reshape(T * B, I_l), dlp.W[g])
            np.matmul(gx2[r], lp.W, out=dx_part[r])
        else:                                                # skip_input: x reached every gate as it is
            np.sum(dgx.reshape(T * B, G, H)[r], axis=1, out=dx_part[r])
        if cfg.cell.modulated:                               # dR_1 = dgh_1^T h_prev, dR_2 = dgh_2^T (m ⊙ h_prev)
            dlp.R[rows1] = modulated.columns(gh2, rows1).T @ hp.reshape(T * B, P)   # (never in slices: the BLAS
            dlp.R[rows2] = modulated.columns(gh2, rows2).T @ qs.reshape(T * B, H)   # loops make one piece)
        elif cfg.cell.diagonal:                              # du_g = sum over t, b of dgh_g ⊙ h_prev (likewise)
            diagonal.gradient(gh2, hp.reshape(T * B, P), dlp.R)
        else:
            sum_of_outer(gh2[:, g], hp.reshape(T * B, P), dlp.R[g])
        if gx2.shape[1] > 1:                                # (one column: NumPy sums pairwise, not row by row)
            bias_sums(gx2, gh2, dlp.bW, dlp.bR, g.start, g.stop)
        elif i == 0:
            np.sum(gx2, axis=0, out=dlp.bW)
            np.sum(gh2, axis=0, out=dlp.bR)
        if cfg.has_proj:
            q = threads.part(P, i, pieces)
            sum_of_outer(dh_all.reshape(T * B, P)[:, q], saved[f"m{layer}"][d].reshape(T * B, H), dlp.W_proj[q])
        if lp.V is not None and i == 0:
            np.sum(dv_acc, axis=0, out=dlp.V)

    # the fused path: BLAS on one thread, the call's threads are numbarnn's (threads.team); the BLAS loops keep
    # BLAS's own threads (within the call's budget)
    with threads.serial_blas() if use_fused else contextlib.nullcontext():
        dy_l = dy
        for layer in reversed(range(cfg.L)):
            x_l, keep_scaled = backward_input(call, saved, x, layer, ct)   # [T, B, I_l], dropout's factor or None
            y = saved[f"y{layer}"]
            I_l = x_l.shape[2]
            # [T, B, I_l] the sum over directions of dgx @ W: returned for layer 0, else the next layer's dy
            # (scratch named by parity: layer l reads dy_l, layer l+1's dx, while it writes its own)
            dx_l = np.empty((T, B, I_l), dtype=ct) if layer == 0 else scratch(f"dx{layer % 2}", (T, B, I_l), ct)
            dx_d = scratch("dx_d", (T * B, I_l), ct) if D > 1 else None   # [T*B, I_l] the reverse direction's
            parts = [dx_l.reshape(T * B, I_l), dx_d]             # the first direction writes dx_l
            if sides[layer]:
                def direction(d, layer=layer, x_l=x_l, y=y, dy_l=dy_l):
                    gradients(layer, d, x_l, time_loop(layer, d, x_l, y, dy_l, False), parts[d])
                threads.side_by_side(functools.partial(direction, 0), functools.partial(direction, 1))
            else:
                # pass 1, the time loops of every direction (row groups on the call's threads); pass 2, their weight
                # gradients and dx, each product in slices on the call's threads, one BLAS thread each
                grads = [time_loop(layer, d, x_l, y, dy_l, True) for d in range(D)]
                pieces = threads.pieces_for(T * B * G * H * (2 * I_l + P)) if use_fused else 1
                for d, grad in enumerate(grads):
                    threads.team([functools.partial(gradients, layer, d, x_l, grad, parts[d], i, pieces)
                                  for i in range(pieces)])
            if D > 1:
                dx_l += dx_d.reshape(T, B, I_l)
            if layer == 0:
                dx = dx_l
            else:
                dy_l = dx_l if keep_scaled is None else dx_l * keep_scaled
    return dx, dh0, dc0, dparams

"""The forward of a modulated cell (classic GRU, MGU: `CellSpec.modulated`) as one fused time loop.

Why: `network.blas_forward` made two BLAS products a step on one thread with a serial loop between them
(`modulated.py`), where the built-in cells run `fused.py`'s loops, both cores at the micro-kernel's speed.  The
modulated gates' product R_2 (m ⊙ h) needs m of every unit of the row first, and a row depends on no other row,
so the loop works row tile by row tile (NR rows, `microkernel.rows_for(G)`), per step, in two passes over the unit
tiles (`microkernel.product_tile` over weights packed by unit tiles, `microkernel.pack`):

    pass 1     wx = W x + bW (every gate), rh_1 = R_1 h + bR_1 (the unmodulated gates), kept by unit tile in the
               group's scratch ; m = cell.modulation(wx, rh_1, v, h) ; q = m ⊙ h (the rows' q buffer, mods)
    pass 2     rh_2 = R_2 q + bR_2 (the modulated gates) ; the cell's `forward` on NR*LANES lanes ; h', y, acts

A row's products read only its own h and q, and its h' is written in pass 2, after pass 1 read all of h: h
needs no double buffer.  Threads split the row tiles into groups, each its own time loop (as
`fused.row_groups`).  The backward stays network.py's BLAS loop (it reads the same reserve); an inference call
writes no reserve (acts, cs, mods), as `fused.forward_group`.  Not here (`network.blas_forward` runs them):
zoneout, skip input.
"""
from __future__ import annotations

import functools

import numba
import numpy as np

from . import cells, fused, microkernel
from .fused import copy_values, load_lanes
from .modulated import gate_rows
from .workspace import scratch

# Set per compiled loop (`cells.cached_step` rebinds them in a copy of this module's globals): the cell's
# `forward` (pointwise) and `modulation` (mod_fn), the micro-kernels and the stack scratch of the loop's sizes.
pointwise = mod_fn = tile_w = tile_1 = tile_2 = group = None
rows_x = rows_h = rows_q = rows_b = rows_t = None
lanes_w = lanes_r = lanes_2 = lanes_V = lanes_S = lanes_h = lanes_c = lanes_m = lanes_n = None


def _key(cell, compute: str) -> str:
    """The fingerprint of the loop's variant: the cell's code (`modulation` too) and the library's
    (cells.variant_key), the tiles."""
    return cells.variant_key(cell, compute, False, False) + \
        f" modulated fused {microkernel.lanes_for(compute)} {microkernel.tile_shape(cell.G)}"


@functools.cache
def forward_group(cell, compute: str):
    """One row group's whole forward of one layer and direction for a modulated `cell` (see the module
    docstring): ``group(grp, lo, hi, <forward_loop's arguments>)`` runs row tiles grp, grp + groups, ... through
    steps lo .. hi-1."""
    acc = np.dtype(compute).type
    zero = acc(0.0)
    i64 = np.int64
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    FREE = tuple(not m for m in cell.modulated_mask)             # per gate: unmodulated (R_1's)
    SLOT = tuple(sum(FREE[:g]) if FREE[g] else sum(not f for f in FREE[:g]) for g in range(G))   # row in R_1 / R_2
    G1, G2 = sum(FREE), G - sum(FREE)
    LANES = microkernel.lanes_for(compute)
    NR = microkernel.rows_for(G)
    L = NR * LANES                              # lanes of the pointwise loop: NR rows x LANES units
    ITEM = np.dtype(compute).itemsize
    STATE = cell.cell_state
    KEY = _key(cell, compute)

    def group(
        grp,      # int     the row group this call runs (of `groups`)
        lo,       # int     the steps this call runs: lo .. hi-1
        hi,       # int
        d,        # int     direction (0 forward, 1 reverse)
        lens,     # [B]     int32 sequence lengths
        order,    # [B]     int64 rows by length, longest first
        n_active, # [steps] int64 rows active at step s (a prefix of order)
        x,        # [T, B, I]      layer input, C-contiguous
        Wp,       # [NT, G//V, I, V, LANES]    W packed (`microkernel.pack`)
        R1p,      # [NT, G1//V1, H, V1, LANES] the unmodulated gates' rows of R, packed
        R2p,      # [NT, G2//V2, H, V2, LANES] the modulated gates' rows
        bW,       # [NT, G, LANES]  bW by unit tiles, zeros past H (`microkernel.bias_tiles`)
        bR1,      # [NT, G1, LANES] bR of the unmodulated gates
        bR2,      # [NT, G2, LANES] bR of the modulated gates
        vec,      # [VL, HP]       cell vectors, zeros past H
        hb,       # [B, HP]        the state h, updated in place (zeros past H)
        cb,       # [B, HP]        the state c, updated in place (unused without a state)
        qb,       # [B, HP]        m ⊙ h of the step (zeros past H)
        y,        # [T, B, D*H]    layer output
        acts,     # [T, B, S*H]    reserve: saved values (not written without `save`)
        cs,       # [T, B, H]      reserve: c' (not written without `save`)
        mods,     # [T, B, H]      reserve: m (not written without `save`)
        wx_t,     # [groups, NT, G, NR*LANES]  scratch: wx of the tile's rows, by unit tile (product_tile's layout)
        rh_t,     # [groups, NT, G1, NR*LANES] scratch: rh_1
        groups,   # int     row groups run in parallel
        save,     # bool    write the reserve: False in an inference call
    ):
        KEY  # noqa: B018  (the variant's fingerprint, a closure value: it keys numba's cache, see cells.cached_step)
        B = lens.shape[0]
        I = x.shape[2]
        NT = Wp.shape[0]
        H = R1p.shape[2]
        HP = hb.shape[1]
        x_addr = i64(x.ctypes.data)
        h_addr = i64(hb.ctypes.data)
        q_addr = i64(qb.ctypes.data)
        w_addr = i64(Wp.ctypes.data)
        r1_addr = i64(R1p.ctypes.data)
        r2_addr = i64(R2p.ctypes.data)
        bw_addr = i64(bW.ctypes.data)
        b1_addr = i64(bR1.ctypes.data)
        b2_addr = i64(bR2.ctypes.data)
        wxs = wx_t[grp]                              # [NT, G, L]
        rhs = rh_t[grp]                              # [NT, G1, L]
        wxs_addr = i64(wxs.ctypes.data)
        rhs_addr = i64(rhs.ctypes.data)
        # scratch of one tile (stack memory, see cells.stack_buffer): lane r*LANES + u = row r, unit j0+u
        xrows_p = rows_x(i64)
        xrows = numba.carray(xrows_p, NR)            # [NR] addresses of the rows' x_t
        hrows_p = rows_h(i64)
        hrows = numba.carray(hrows_p, NR)            # [NR] addresses of the rows' h
        qrows_p = rows_q(i64)
        qrows = numba.carray(qrows_p, NR)            # [NR] addresses of the rows' q
        rb = numba.carray(rows_b(i64), NR)           # [NR] batch row of each lane group
        rt = numba.carray(rows_t(i64), NR)           # [NR] its time index
        wx = numba.carray(lanes_w(acc), (G, L))      # [G, L] wx_g
        rh = numba.carray(lanes_r(acc), (G, L))      # [G, L] rh_g (0 for the modulated gates in pass 1)
        rh2_p = lanes_2(acc)
        rh2 = numba.carray(rh2_p, (G2, L))           # [G2, L] R_2 q + bR_2
        v = numba.carray(lanes_V(acc), (VL, L))      # [V, L] cell vectors
        saved = numba.carray(lanes_S(acc), (S, L))   # [S, L] out: saved values
        h_prev = numba.carray(lanes_h(acc), L)       # [L] h
        c_prev = numba.carray(lanes_c(acc), L)       # [L] c (0 without a state)
        m_out = numba.carray(lanes_m(acc), L)        # [L] out: m (pass 1), h' (pass 2)
        c_out = numba.carray(lanes_n(acc), L)        # [L] out: c'
        GL = G * L * ITEM                            # bytes of a unit tile's wx scratch
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
                    qrows[r] = q_addr + (b * HP) * ITEM
                # pass 1: wx, rh_1 and m of every unit tile
                for jt in range(NT):
                    j0 = jt * LANES
                    nu = min(LANES, H - j0)          # units of this tile that exist
                    tile_w(w_addr + jt * (I * G * LANES * ITEM), xrows_p, I, wxs_addr + jt * GL,
                           bw_addr + jt * (G * LANES * ITEM))
                    tile_1(r1_addr + jt * (H * G1 * LANES * ITEM), hrows_p, H, rhs_addr + jt * (G1 * L * ITEM),
                           b1_addr + jt * (G1 * LANES * ITEM))
                    for g in range(G):
                        copy_values(wx[g], wxs[jt, g], L)
                        if FREE[g]:
                            copy_values(rh[g], rhs[jt, SLOT[g]], L)
                        else:
                            rh[g, :] = zero
                    for r in range(NR):
                        q = r * LANES
                        for k in range(V):
                            copy_values(v[k, q:q + LANES], vec[k, j0:j0 + LANES], LANES)
                        copy_values(h_prev[q:q + LANES], hb[rb[r], j0:j0 + LANES], LANES)
                    for q in range(L):
                        m_out[q] = mod_fn(wx[:, q], rh[:, q], v[:, q], h_prev[q])
                    for r in range(nr):
                        q = r * LANES
                        if save:
                            load_lanes(mods[rt[r], rb[r], j0:j0 + nu], m_out[q:q + nu], nu, LANES)
                        for u in range(nu):
                            qb[rb[r], j0 + u] = m_out[q + u] * h_prev[q + u]
                # pass 2: rh_2 and the cell of every unit tile
                for jt in range(NT):
                    j0 = jt * LANES
                    nu = min(LANES, H - j0)
                    tile_2(r2_addr + jt * (H * G2 * LANES * ITEM), qrows_p, H, rh2_p,
                           b2_addr + jt * (G2 * LANES * ITEM))
                    for g in range(G):
                        copy_values(wx[g], wxs[jt, g], L)
                        if FREE[g]:
                            copy_values(rh[g], rhs[jt, SLOT[g]], L)
                        else:
                            copy_values(rh[g], rh2[SLOT[g]], L)
                    fused.gather_lanes(v, h_prev, c_prev, vec, hb, cb, rb, j0, V, LANES, True, STATE)
                    for q in range(L):
                        m_out[q], c_out[q] = pointwise(wx[:, q], rh[:, q], v[:, q], h_prev[q], c_prev[q],
                                                       saved[:, q])
                    for r in range(nr):
                        b = rb[r]
                        t = rt[r]
                        q = r * LANES
                        fused.store_lanes(acts, cs, cb, saved, c_out, t, b, q, j0, nu, H, S, STATE, save, LANES)
                        load_lanes(hb[b, j0:j0 + nu], m_out[q:q + nu], nu, LANES)
                        load_lanes(y[t, b, d * H + j0:d * H + j0 + nu], m_out[q:q + nu], nu, LANES)

    extra = {"tile_w": microkernel.product_tile(compute, G, NR, LANES, bias=True),
             "tile_1": microkernel.product_tile(compute, G1, NR, LANES, bias=True),
             "tile_2": microkernel.product_tile(compute, G2, NR, LANES, bias=True),
             "mod_fn": cells.njit_function(cell.modulation, compute),
             "lanes_w": cells.stack_buffer(G * L), "lanes_r": cells.stack_buffer(G * L),
             "lanes_2": cells.stack_buffer(G2 * L)}
    for name in ("rows_x", "rows_h", "rows_q", "rows_b", "rows_t"):
        extra[name] = cells.stack_buffer(NR)
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
    """Whether `forward_direction` runs this layer (zoneout and skip input take network.blas_forward)."""
    return lp.W is not None and not call.zoneout_active and not call.zoneout_expected


def forward_direction(call, lp, d, x_l, h, c, y, acts, cs, mods, rows, ct):
    """One layer and direction (network.blas_forward's contract for a modulated cell, `supported` calls): h [B, H]
    and c [B, H] (or None) are updated in place to the state after each row's last step; y, acts, cs, mods are
    written at the active [t, b].  rows: fused_plan.call_rows(call)."""
    cfg, B = call.config, call.B
    cell, H, G = cfg.cell, cfg.H, cfg.G
    lens, _, order, n_active = rows[:4]
    LANES, NR = microkernel.lanes_for(ct), microkernel.rows_for(G)
    NT = -(-H // LANES)
    HP = NT * LANES
    I_l = x_l.shape[2]
    rows1, rows2 = gate_rows(cell, H, False), gate_rows(cell, H, True)
    G1, G2 = rows1.size // H, rows2.size // H
    Wp = scratch("fused_Wp", microkernel.panel_shape(NT, I_l, G, ct), ct)         # [NT, G//V, I, V, LANES] W
    R1p = scratch("fused_Rp", microkernel.panel_shape(NT, H, G1, ct, NR), ct)     # [NT, G1//V1, H, V1, LANES] R_1
    R2p = scratch("fused_R2p", microkernel.panel_shape(NT, H, G2, ct, NR), ct)    # [NT, G2//V2, H, V2, LANES] R_2
    microkernel.pack(lp.W, Wp)
    microkernel.pack(np.ascontiguousarray(lp.R[rows1]), R1p)
    microkernel.pack(np.ascontiguousarray(lp.R[rows2]), R2p)
    bW = microkernel.bias_tiles(lp.bW, H, NT, LANES, np.empty((NT, G, LANES), ct))          # [NT, G, LANES]
    bR1 = microkernel.bias_tiles(lp.bR[rows1], H, NT, LANES, np.empty((NT, G1, LANES), ct))  # [NT, G1, LANES]
    bR2 = microkernel.bias_tiles(lp.bR[rows2], H, NT, LANES, np.empty((NT, G2, LANES), ct))  # [NT, G2, LANES]
    vec = np.zeros((max(cfg.V, 1), HP), dtype=ct)                           # [VL, HP]
    if lp.V is not None:
        vec[:, :H] = lp.V
    hb = np.zeros((B, HP), dtype=ct)                                        # [B, HP] h, zeros past H
    hb[:, :H] = h
    cb = np.zeros((B, HP), dtype=ct)                                        # [B, HP] c
    if c is not None:
        cb[:, :H] = c
    qb = np.zeros((B, HP), dtype=ct)                                        # [B, HP] m ⊙ h
    groups = fused.row_groups(B, NR, int(n_active.sum()) * G * H * (I_l + H))
    wx_t = scratch("mod_wx", (groups, NT, G, NR * LANES), ct)               # [groups, NT, G, L]
    rh_t = scratch("mod_rh", (groups, NT, G1, NR * LANES), ct)              # [groups, NT, G1, L]
    none3 = np.zeros((0, 0, 0), dtype=ct)
    loop = forward_loop(cell, str(ct), groups > 1)
    loop(d, lens, order, n_active, np.ascontiguousarray(x_l), Wp, R1p, R2p, bW, bR1, bR2, vec, hb, cb, qb, y, acts,
         cs if c is not None else none3, mods, wx_t, rh_t, groups, call.is_training)
    h[...] = hb[:, :H]
    if c is not None:
        c[...] = cb[:, :H]

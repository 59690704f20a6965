"""Fused time loops: one njit call per layer and direction, no BLAS and no Python per step.

Why: the BLAS loop (`network.py`: x W^T for all steps by OpenBLAS, then per step R h^T by OpenBLAS and the
njit pointwise loop) loses time in three places: OpenBLAS packs R again at every per-step call, W x_t for all
steps goes through DRAM between the GEMM and the pointwise loop, and the pointwise loop runs on one core while
OpenBLAS's other thread spins (measured: bench/results/cpu.md).

Forward (`forward_loop`).  W and R are packed once per call into unit tiles (`pack`: the G gates of LANES
units side by side for every k, zeros past H; a one-gate cell's tiles hold two unit tiles, `units_per_pass`, so
that a pass of the micro-kernel has two vectors).  Per step, per unit tile j0 and tile of nr batch rows (NRW or
NR, below):

    acc_w[g, r, u] = sum_k W[g*H + j0+u, k] x[t_r, b_r, k]     `product_tile` (the micro-kernel below)
    acc_r[g, r, u] = sum_k R[g*H + j0+u, k] h[b_r, k]          the same over h (double-buffered)
    the cell's own pointwise forward on the nr*LANES lanes (acc + biases); results to y, c, the reserve

Backward (`backward_loop`).  Per step (s = steps-1 .. 0; with a projection first dm = W_proj^T (dy + dh) by
the micro-kernel): the cell's pointwise backward of the rows
(`cells.backward_step`, the BLAS loop's own), then dh[b] += dgh_s[b] R by the same micro-kernel over R's
columns (`pack_columns`).  The weight gradients and dx stay single big BLAS products after the loops.

The micro-kernel, its tile shapes and the weight packing are in microkernel.py.

Rows are independent through a layer and direction, so threads split the rows, not the steps: `row_groups` (each
group its own time loop over its rows; why not a hand-off per step: see row_groups). A group's time loop is one
function over a range of steps (`forward_group`, `backward_group`): the serial loop runs it for the one group over
every step, the parallel loop (`relay_loop`) runs each group's steps in a few ranges, relayed between the call's
threads, so that a thread that starts late or runs slowed (another pool's spinning worker on its core) does not hold
the call up. Rows are sorted by length once per call (longest first), so the rows active at step s are a prefix
(`n_active[s]`) and a step runs only the active rows; the groups take tiles of NR of them in turn (`group_rows`), so
each group's active rows are a prefix of its own too. A group's active rows run in wide tiles of NRW rows, then
tiles of NR (`microkernel.wide_rows`, `wide_tiles`: 16 rows as 6 + 6 + 4 on AVX2; NRW = NR where there is no wider
tile), the backward's products likewise (`row_products`); a partial tile's spare lanes recompute the group's longest
row and are not written. Units: a partial last tile computes on zeros (packed weights, biases and the padded columns
of the h and c buffers are 0) and writes only its first H - j0 lanes.

Used for every call (network.py); the setting cpu_fused False selects the BLAS loops.

Why one file (over 500 lines): the forward's and the backward's time loops and the inline helpers compiled into
both (row groups, the products, the scatters) are read together.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..util import cdiv
from . import cells
from .cells import accumulate
from . import threads
from .microkernel import lanes_for, product_tile, rows_for, tile_shape, units_per_pass, vectors_per_pass, wide_rows
from .zoneout import NONE as ZONE_NONE
from .zoneout import split_row, zone_lanes

# Set per compiled loop (`cells.cached_step` rebinds them in a copy of this module's globals): the cell's
# pointwise function, the micro-kernels, the backward's step loop and the stack scratch of each loop's sizes.
pointwise = tile_w = tile_n = tile_q = step_fn = products = None
rows_x = rows_h = rows_b = rows_t = rows_d = None
lanes_w = lanes_r = lanes_q = lanes_h = lanes_c = lanes_m = lanes_o = lanes_V = lanes_S = None


def _forward_key(cell, compute: str, has_proj: bool) -> str:
    """The fingerprint of forward_group's variant: the cell's and library's code (cells.variant_key), the vector
    width and the tiles."""
    GU = cell.G * units_per_pass(cell.G)
    return (cells.variant_key(cell, compute, has_proj, False)
            + f"fused {lanes_for(compute)} {GU} {tile_shape(GU)} {wide_rows(GU)} {COLUMN_VECTORS}")


@functools.cache
def forward_group(cell, compute: str, has_proj: bool = False):
    """One row group's whole fused forward of one layer and direction for `cell` (see the module docstring):
    ``group(grp, lo, hi, <forward_loop's arguments>)`` runs the rows of line grp of `groups` (`group_rows`)
    through steps lo .. hi-1.  With a projection the cell's m goes to `mbuf`, and after a step's unit tiles each
    tile of NR rows' h' = W_proj m by the micro-kernel over W_proj's rows (`pack_columns` of W_proj^T), written to
    y and h.

    Three run-time flags: `save` False (an inference call) writes no reserve (acts, cs: the largest writes of the
    loop); `skip`: skip input, x reaches the gates as it is; `zone`: haste's zoneout of h (SPEC 6.1, zoneout.py),
    h' = h_new where the mask is 1, else h_prev (training, the mask recorded in zmask), or p*h_prev + (1-p)*h_new
    (inference), applied to the lanes of a row before they reach y and the next step's h (with a projection to
    the projected h).  Each is a branch per row of a tile, never per lane, so one compiled loop serves training
    and inference, with or without skip input or zoneout (a cold compile takes seconds a variant).  The
    projection stays a compile-time choice: it brings a second micro-kernel (`tile_q`), whose machine code would
    lengthen every loop's first compile."""
    acc = np.dtype(compute).type
    zero = acc(0.0)
    i64 = np.int64
    G, S, V = cell.G, cell.S, cell.V
    VL = max(V, 1)
    LANES = lanes_for(compute)
    U = units_per_pass(G)                       # unit tiles per pass of the products (2 for a one-gate cell)
    GU = G * U                                  # vectors of a pass: gate w % G of unit tile jp*U + w // G
    NR = rows_for(GU)                           # rows of a tile (the projection's, a row group's last tiles)
    NRW = wide_rows(GU)                         # rows of a wide tile (NR where there is none)
    L = NRW * LANES                             # lanes of the pointwise loop: up to NRW rows x LANES units
    ITEM = np.dtype(compute).itemsize
    STATE = cell.cell_state
    PROJ = has_proj
    MQ = COLUMN_VECTORS                         # vectors of projected outputs per product_tile call
    KEY = _forward_key(cell, compute, has_proj)

    def group(
        grp,      # int     the row group this call runs (of `groups`)
        lo,       # int     the steps this call runs: lo .. hi-1
        hi,       # int
        d,        # int     direction (0 forward, 1 reverse)
        H,        # int     hidden units
        lens,     # [B]     int32 sequence lengths
        steps,    # int     the longest length
        x,        # [T, B, I]      layer input, C-contiguous
        Wp,       # [NT/U, GU//V, I, V, LANES] W packed by U unit tiles (`pack`; unused with skip input)
        Rp,       # [NT/U, GU//V, P, V, LANES] R packed (P = H without a projection)
        bW,       # [NT, G, LANES] W-side bias by unit tiles, zeros past H (`bias_tiles`)
        bR,       # [NT, G, LANES] R-side bias
        vec,      # [VL, HP]       cell vectors, zeros past H
        hbuf,     # [2, B, HB]     h double-buffered: [0] holds h0 (zeros past P); step s reads [s%2]
        cbuf,     # [B, HP]        c, updated in place (zeros past H; unused without a state)
        y,        # [T, B, D*P]    layer output
        acts,     # [T, B, S*H]    reserve: saved values (not written without `save`)
        cs,       # [T, B, H]      reserve: c' (not written without `save`)
        groups,   # [NG, n] int64 each row group's rows, longest first (-1 pads), `group_rows`
        Wq,       # [NQ, MQ//V, H, V, LANES] projection: W_proj^T packed by columns (`pack_columns`)
        mbuf,     # [B, HP]        projection: m of the step
        ms,       # [T, B, H]      projection: reserve m (not written without `save`)
        skip,     # bool    skip input: x_t reaches the gates as it is (I == H), Wp not read
        save,     # bool    write the reserve (acts, cs, ms): False in an inference call
        zone,     # int     zoneout: zoneout.NONE, MASK (training) or EXPECTATION (inference)
        zp,       # float   zoneout: the probability p
        zin,      # [T, B, P]      zoneout: the update mask, uint8 (MASK; else empty)
        zmask,    # [T, B, P]      zoneout: reserve, the mask at active [t, b] (MASK; else empty)
    ):
        KEY  # noqa: B018  (the variant's fingerprint, a closure value: it keys numba's cache, see cells.cached_step)
        B = lens.shape[0]
        I = x.shape[2]
        NTU = Rp.shape[0]                           # tiles of U unit tiles
        x_addr = i64(x.ctypes.data)
        h_addr = i64(hbuf.ctypes.data)
        w_addr = i64(Wp.ctypes.data)
        r_addr = i64(Rp.ctypes.data)
        bw_addr = i64(bW.ctypes.data)
        br_addr = i64(bR.ctypes.data)
        GL = GU * LANES * ITEM                      # bytes of a tile's biases (U unit tiles')
        q_addr = i64(Wq.ctypes.data)
        m_addr = i64(mbuf.ctypes.data)
        HB = hbuf.shape[2]
        HP = mbuf.shape[1]
        P = Rp.shape[2]
        NQ = Wq.shape[0]
        # row group grp: the rows of line grp of `groups` (longest first: those active at a step are a prefix);
        # per step in wide tiles of NRW rows, then tiles of NR (`wide_tiles`)
        rows_g = group_line(groups, grp)
        # scratch of one tile (stack memory, see cells.stack_buffer): lane r*LANES + u = row r, unit j0+u
        xrows_p = rows_x(i64)
        xrows = numba.carray(xrows_p, NRW)  # [NRW] addresses of the rows' x_t
        hrows_p = rows_h(i64)
        hrows = numba.carray(hrows_p, NRW)  # [NRW] addresses of the rows' h
        rb = numba.carray(rows_b(i64), NRW)  # [NRW] batch row of each lane group
        rt = numba.carray(rows_t(i64), NRW)  # [NRW] its time index
        wx_p = lanes_w(acc)
        wx = numba.carray(wx_p, (GU, L))    # [GU, L] W_g x + bW_g of unit tile jp*U + w // G at w (g = w % G)
        rh_p = lanes_r(acc)
        rh = numba.carray(rh_p, (GU, L))    # [GU, L] R_g h + bR_g
        v = numba.carray(lanes_V(acc), (VL, L))      # [V, L] cell vectors
        saved = numba.carray(lanes_S(acc), (S, L))   # [S, L] out: saved values
        h_prev = numba.carray(lanes_h(acc), L)       # [L] h
        c_prev = numba.carray(lanes_c(acc), L)       # [L] c (0 without a state)
        m_out = numba.carray(lanes_m(acc), L)        # [L] out: m = h'
        c_out = numba.carray(lanes_o(acc), L)        # [L] out: c'
        q_p = lanes_q(acc)
        q_out = numba.carray(q_p, (MQ, NR * LANES))  # [MQ, NR*LANES] projection: W_proj m of a column tile
        for s in range(lo, hi):
            cur = s % 2
            nxt = 1 - cur
            ng = active_prefix(rows_g, lens, s)     # the group's rows active at s: rows_g[:ng]
            nw = wide_tiles(ng, NRW, NR)            # the first nw tiles wide
            for jp in range(NTU):
                i0 = 0
                k = 0
                while i0 < ng:
                    nr = NRW if k < nw else NR
                    for r in range(nr):
                        # spare lanes: the group's longest row
                        b = rows_g[i0 + r] if i0 + r < ng else rows_g[0]
                        t = s if d == 0 else lens[b] - 1 - s
                        rb[r] = b
                        rt[r] = t
                        xrows[r] = x_addr + ((t * B + b) * I) * ITEM
                        hrows[r] = h_addr + ((cur * B + b) * HB) * ITEM
                    # the products with their biases: GU x nr results, V*nr accumulators per pass over k
                    if skip:                                 # x reaches every gate as it is (I == H)
                        for w in range(GU):
                            jt = jp * U + w // G
                            j0 = jt * LANES
                            nu = min(LANES, H - j0)
                            for r in range(nr):
                                q = r * LANES
                                wx[w, q:q + LANES] = zero
                                if nu > 0:
                                    load_lanes(wx[w, q:q + nu], x[rt[r], rb[r], j0:j0 + nu], nu, LANES)
                                accumulate(wx[w, q:q + LANES], bW[jt, w % G], LANES)
                    elif nr == NRW:
                        tile_w(w_addr + jp * (I * GU * LANES * ITEM), xrows_p, I, wx_p, bw_addr + jp * GL)
                    else:
                        tile_n(w_addr + jp * (I * GU * LANES * ITEM), xrows_p, I, wx_p, bw_addr + jp * GL)
                    if nr == NRW:
                        tile_w(r_addr + jp * (P * GU * LANES * ITEM), hrows_p, P, rh_p, br_addr + jp * GL)
                    else:
                        tile_n(r_addr + jp * (P * GU * LANES * ITEM), hrows_p, P, rh_p, br_addr + jp * GL)
                    for su in range(U):                  # the cell, unit tile by unit tile of the pass
                        j0 = (jp * U + su) * LANES
                        nu = min(LANES, H - j0)         # units of this tile that exist
                        if nu <= 0:
                            break
                        # the lanes' other inputs (a cell allowing a projection reads no h)
                        gather_lanes(v, h_prev, c_prev, vec, hbuf[cur], cbuf, rb[:nr], j0, V, LANES, not PROJ,
                                     STATE)
                        # the cell, one lane per (row, unit): reads and writes only the scratch
                        g0 = su * G
                        for q in range(nr * LANES):
                            m_out[q], c_out[q] = pointwise(wx[g0:g0 + G, q], rh[g0:g0 + G, q], v[:, q], h_prev[q],
                                                           c_prev[q], saved[:, q])
                        # scatter the active rows' results
                        for r in range(min(nr, ng - i0)):
                            b = rb[r]
                            t = rt[r]
                            q = r * LANES
                            store_lanes(acts, cs, cbuf, saved, c_out, t, b, q, j0, nu, H, S, STATE, save, LANES)
                            if PROJ:
                                load_lanes(mbuf[b, j0:j0 + nu], m_out[q:q + nu], nu, LANES)
                                if save:
                                    load_lanes(ms[t, b, j0:j0 + nu], m_out[q:q + nu], nu, LANES)
                            else:
                                if zone != ZONE_NONE:            # h' of zoneout, in place of h_new
                                    zone_lanes(zone, zp, zin, zmask, t, b, j0, nu, h_prev[q:q + nu], m_out[q:q + nu])
                                load_lanes(hbuf[nxt, b, j0:j0 + nu], m_out[q:q + nu], nu, LANES)
                                load_lanes(y[t, b, d * H + j0:d * H + j0 + nu], m_out[q:q + nu], nu, LANES)
                    i0 += nr
                    k += 1
            if PROJ:                                 # h' = W_proj m, once every unit's m is in mbuf
                for i0 in range(0, ng, NR):
                    for r in range(NR):
                        b = rows_g[i0 + r] if i0 + r < ng else rows_g[0]
                        rb[r] = b
                        rt[r] = s if d == 0 else lens[b] - 1 - s
                        hrows[r] = m_addr + (b * HP) * ITEM
                    for cq in range(NQ):
                        tile_q(q_addr + cq * (H * MQ * LANES * ITEM), hrows_p, H, q_p)
                        for r in range(min(NR, ng - i0)):
                            b = rb[r]
                            t = rt[r]
                            for mq in range(MQ):
                                c0 = (cq * MQ + mq) * LANES
                                nc = min(LANES, P - c0)
                                if nc > 0:
                                    if zone != ZONE_NONE:    # h' of zoneout: of the projected h
                                        zone_lanes(zone, zp, zin, zmask, t, b, c0, nc, hbuf[cur, b, c0:c0 + nc],
                                                   q_out[mq, r * LANES:r * LANES + nc])
                                    qv = q_out[mq, r * LANES:r * LANES + nc]
                                    load_lanes(hbuf[nxt, b, c0:c0 + nc], qv, nc, LANES)
                                    load_lanes(y[t, b, d * P + c0:d * P + c0 + nc], qv, nc, LANES)

    V_G = vectors_per_pass(GU, NR)              # the panels' vectors per pass: both tiles read the same panels
    extra = {"tile_w": product_tile(compute, GU, NRW, LANES, V_G, bias=True),
             "tile_n": product_tile(compute, GU, NR, LANES, V_G, bias=True, out_rows=NRW),
             "lanes_w": cells.stack_buffer(GU * L),
             "lanes_r": cells.stack_buffer(GU * L), "tile_q": product_tile(compute, MQ, NR, LANES),
             "lanes_q": cells.stack_buffer(MQ * NR * LANES)}
    for name in ("rows_x", "rows_h", "rows_b", "rows_t"):
        extra[name] = cells.stack_buffer(NRW)
    for name in ("lanes_h", "lanes_c", "lanes_m", "lanes_o"):
        extra[name] = cells.stack_buffer(L)
    # fastmath contract: the pointwise code's multiplies and adds fused (the float32 tanh's polynomials: 64
    # multiplies and 48 adds per 8 lanes of an LSTM became 44 fused multiply-adds, bench/results/cpu.md)
    return cells.cached_step(group, False, cells.njit_function(cell.forward, compute), G, S, VL, L,
                             fastmath={"contract"}, **extra)


@functools.cache
def forward_loop(cell, compute: str, parallel: bool, has_proj: bool = False):
    """The fused forward of one layer and direction for `cell`: ``loop(d, H, lens, ..., save, zone, .., zmask)`` (the
    arguments of `forward_group` after grp, lo, hi) runs every row group of `forward_group` over every step.
    Serial: group 0 of 1.  Parallel: each group's step ranges relayed between the call's threads (`relay_loop`)."""
    return relay_loop(forward_group(cell, compute, has_proj), parallel, "steps", False)


def relay_loop(group, parallel: bool, steps: str, reverse: bool):
    """The loop over the row groups of a group function that runs a range of steps, ``group(g, lo, hi, *args)``
    (steps lo .. hi-1; `reverse`: from hi-1 down), the steps' count the argument named `steps` (an int, or an
    array of that length), the group count the one named ``groups``.  Serial: group 0 over every step.  Parallel:
    each group's steps in RELAY_LINKS ranges, in order (backward from the last with `reverse`), relayed between
    the call's threads (`threads.relay`: a thread that is late or slowed does not hold the call up).  Every fused
    loop family's (this module's, layer_norm_fused's, modulated_fused's).

    Why not an njit prange over the groups: its workers (libgomp's) spin after the region for ~3-17 ms on the
    core the next BLAS product or loop wants, and the pool numba's loops and BLAS would take turns on slowed
    both (a backward's weight gradients after a parallel loop, its lower layers' loops after the products:
    bench/results/cpu.md); the prange loop was also a second compile of every cell's loop."""
    code = group.py_func.__code__
    names = code.co_varnames[3:code.co_argcount]                # after grp, lo, hi
    at_groups, at_steps = names.index("groups"), names.index(steps)

    def count(value) -> int:
        return int(value) if np.ndim(value) == 0 else value.shape[0]

    if not parallel:
        def loop(*args):
            return group(np.int64(0), np.int64(0), np.int64(count(args[at_steps])), *args)
    else:
        def loop(*args):
            T = count(args[at_steps])
            size = cdiv(T, RELAY_LINKS) if T else 1
            bounds = [(np.int64(lo), np.int64(min(lo + size, T))) for lo in range(0, T, size)]
            if reverse:
                bounds.reverse()
            threads.relay(lambda g, k: group(np.int64(g), *bounds[k], *args), count(args[at_groups]), len(bounds))
    loop.group = group
    return loop


#: step ranges per row group in the parallel loops (`relay_loop`): a group moves between threads only at a range's
#: end, and each range is a call of the compiled loop and a hand-off (a few us: 64 ranges instead of 1 added ~0.3 ms
#: to an LSTM forward of T=64 B=32 I=H=256, bench/results/cpu.md)
RELAY_LINKS = 8


#: a call (one layer and direction) of fewer multiply-adds than this runs serially (one row group)
PARALLEL_MIN_MACS = 1 << 24


def row_groups(B: int, NR: int, macs: int) -> int:
    """Row groups for a call of B rows and `macs` multiply-adds: one per thread, at most one per tile of NR rows;
    1 (the serial loop) below PARALLEL_MIN_MACS.

    Rows are independent through a layer and direction: each group runs its own time loop, on the call's threads
    (`relay_loop`: a hand-off per range of steps).  Not a hand-off per step: a step of a few tens of microseconds
    would wait on the other thread every time.  The threshold: below it a group's share of the call is too short to
    pay for the hand-off and each thread's reading every weight panel (bench/results/cpu.md)."""
    if macs < PARALLEL_MIN_MACS:
        return 1
    return max(1, min(threads.num_threads(), cdiv(B, NR)))


#: the two directions of a layer run side by side when each direction's multiply-adds reach this: handing one to
#: the helper thread costs ~0.1 ms (threads.side_by_side)
SIDE_MIN_MACS = 1 << 25


def side_by_side(D: int, threads: int, macs: int) -> bool:
    """Whether a bidirectional layer of `macs` multiply-adds per direction runs its two directions side by side on
    a call's two threads, one each (each direction's loop serial, its backward products on one BLAS thread),
    rather than one after the other, each in row groups on both.  Why: the directions are independent until their
    dx meet; a thread then reads only its own direction's weights and hands nothing off between the time loops
    and the products (bench/results/cpu.md)."""
    return D == 2 and threads == 2 and macs >= SIDE_MIN_MACS


# ---------------------------------------------------------------------------------------------------------------
# the backward: per step the cell's pointwise backward (cells.backward_step, the BLAS loop's own step), then
# dh += dgh_s R by the micro-kernel, in one njit call per layer and direction
# ---------------------------------------------------------------------------------------------------------------


#: MV, vectors of LANES columns per column tile of the backward's product dgh_s R (4: the forward's LSTM
#: tile, in the passes `tile_shape` gives it: one on AVX-512, two on AVX2).  One value for every P: each value
#: is another compiled loop per cell and dtype; a P below 4*LANES computes padded columns, which costs little
#: at sizes that small.
COLUMN_VECTORS = 4


def rows_by_length(lens) -> np.ndarray:
    """[B] int64: the batch rows, longest first (stable): the rows active at any step are a prefix."""
    return np.argsort(-np.asarray(lens), kind="stable").astype(np.int64)


def group_rows(order, groups: int, NR: int) -> np.ndarray:
    """[groups, n] int64: row group g's rows, the row tiles g, g + groups, ... of `order` (rows by length,
    longest first; tile i = order[i*NR : i*NR + NR]) one after another, so a group's rows are longest first
    too and those active at a step are a prefix; -1 pads the shorter groups."""
    B = len(order)
    tiles = cdiv(B, NR)
    per_group = [np.concatenate([order[i * NR:(i + 1) * NR] for i in range(g, tiles, groups)] or [order[:0]])
                 for g in range(groups)]
    out = np.full((groups, max(len(r) for r in per_group)), -1, dtype=np.int64)
    for g, r in enumerate(per_group):
        out[g, :len(r)] = r
    return out


@njit(inline="always")
def wide_tiles(n: int, NRW: int, NR: int) -> int:
    """How many of n rows' tiles are wide (NRW rows), the rest tiles of NR: the cover computing the fewest rows
    (spare rows of a partial tile are computed too), then the most wide tiles.  16 rows in 6 + 6 + 4, 8 in
    4 + 4, 5 in one 6."""
    best, best_rows = 0, -1
    for a in range(n // NRW + 2):
        rows = a * NRW + max(0, -(-(n - a * NRW) // NR)) * NR
        if best_rows < 0 or rows <= best_rows:
            best, best_rows = a, rows
    return best


@intrinsic
def copy_values(typingctx, dst, src, n):
    """dst[:n] = src[:n] as LLVM's memcpy, for contiguous 1-d arrays of one dtype: with n a compile-time constant,
    a few vector moves.  Why not a loop: LLVM unrolls a loop of constant count into scalar moves, one value at a
    time, where it cannot prove the two arrays apart (the fused loops' stack scratch, whose address the
    micro-kernel takes): 8 loads and 8 stores per LANES values, ~6-9% of an LSTM forward (bench/results/cpu.md);
    memcpy's operands never overlap."""
    for name, arg in (("dst", dst), ("src", src)):
        if not isinstance(arg, types.Array) or arg.ndim != 1 or arg.layout not in "CF":
            raise TypeError(f"copy_values: {name} must be a contiguous 1-d array, got {arg}")
    if dst.dtype != src.dtype or not isinstance(n, types.Integer):
        raise TypeError(f"copy_values: arrays of one dtype and an integer count, got {dst}, {src}, {n}")

    def codegen(context, builder, signature, args):
        d = context.make_array(signature.args[0])(context, builder, args[0])
        s = context.make_array(signature.args[1])(context, builder, args[1])
        count = context.cast(builder, args[2], signature.args[2], types.intp)
        cgutils.raw_memcpy(builder, d.data, s.data, count, context.get_abi_sizeof(d.data.type.pointee))
        return context.get_dummy_value()
    return types.void(dst, src, n), codegen


@njit(inline="always")
def load_lanes(dst, src, n, LANES):
    """dst[:n] = src[:n] for n <= LANES, a compile-time constant: the fused loops' copies of a unit tile's lanes.
    n == LANES, every tile but a partial last one, is a copy of constant size (`copy_values`: a vector move or
    two); a copy of n, unknown at compile time, a loop (LLVM would make it a call of memcpy: 8 calls of 32 bytes
    per row, tile and step in the LSTM's forward, ~5% of a training call's time)."""
    if n == LANES:
        copy_values(dst, src, LANES)
    else:
        for u in range(n):
            dst[u] = src[u]


@njit(inline="always")
def accumulate_lanes(dst, src, n, LANES):
    """dst[:n] += src[:n] for n <= LANES, a compile-time constant (as `load_lanes`: constant size when whole)."""
    if n == LANES:
        for u in range(LANES):
            dst[u] += src[u]
    else:
        for u in range(n):
            dst[u] += src[u]


@njit(inline="always")
def gather_lanes(v, h_prev, c_prev, vec, h, c, rb, j0, V, LANES, READ_H, STATE):
    """The pointwise loop's inputs besides the products, for unit tile j0 (lane r*LANES + u: row rb[r], unit
    j0 + u): the cell vectors from vec [VL, HP]; h from h [B, HP] (zeros unless READ_H); c from c [B, HP] (zeros
    without a state).  Every forward loop of the fused family gathers its lanes here (loops over slices indexed by
    their counters: vectorized; indexing the big arrays directly would keep them scalar, see cells.py)."""
    for r in range(rb.shape[0]):
        q = r * LANES
        b = rb[r]
        for k in range(V):
            copy_values(v[k, q:q + LANES], vec[k, j0:j0 + LANES], LANES)
        if READ_H:
            copy_values(h_prev[q:q + LANES], h[b, j0:j0 + LANES], LANES)
        else:
            h_prev[q:q + LANES] = 0
        if STATE:
            copy_values(c_prev[q:q + LANES], c[b, j0:j0 + LANES], LANES)
        else:
            c_prev[q:q + LANES] = 0


@njit(inline="always")
def store_lanes(acts, cs, c, saved, c_out, t, b, q, j0, nu, H, S, STATE, save, LANES):
    """Row b's results of unit tile j0 from its lanes (q ..): the saved values to the reserve's acts [T, B, S*H] at
    [t, b] and c' to the state c [B, HP] and the reserve's cs [T, B, H] (reserve writes only with `save`).  h' and
    y are each loop's own (projection, zoneout, the normalised state)."""
    if save:
        for k in range(S):
            load_lanes(acts[t, b, k * H + j0:k * H + j0 + nu], saved[k, q:q + nu], nu, LANES)
    if STATE:
        load_lanes(c[b, j0:j0 + nu], c_out[q:q + nu], nu, LANES)
        if save:
            load_lanes(cs[t, b, j0:j0 + nu], c_out[q:q + nu], nu, LANES)


@njit(inline="always")
def group_line(groups, grp):
    """Row group grp's rows, longest first: line grp of `groups` (`group_rows`) up to its first -1."""
    size = 0
    while size < groups.shape[1] and groups[grp, size] >= 0:
        size += 1
    return groups[grp, :size]


@njit(inline="always")
def active_prefix(rows_g, lens, s):
    """How many of a group's rows (longest first) run step s: they are a prefix of rows_g."""
    n = 0
    while n < rows_g.shape[0] and lens[rows_g[n]] > s:
        n += 1
    return n


@njit(inline="always")
def scatter_columns(dst, rows, i0, nr, out, ct, MV, LANES, width, add):
    """dst[b, the columns of column tile ct] = out (add: +=) for the nr rows b = rows[i0 + r] of a product_tile
    call: out [MV, NR*LANES] holds row r's MV vectors of LANES columns at lanes r*LANES ..; columns past `width`
    (a partial last tile) are not written."""
    for r in range(nr):
        b = rows[i0 + r]
        for m in range(MV):
            c0 = (ct * MV + m) * LANES
            nc = min(LANES, width - c0)
            if nc > 0:
                if add:
                    accumulate_lanes(dst[b, c0:c0 + nc], out[m, r * LANES:r * LANES + nc], nc, LANES)
                else:
                    load_lanes(dst[b, c0:c0 + nc], out[m, r * LANES:r * LANES + nc], nc, LANES)


@functools.cache
def row_products(compute: str, MV: int, LANES: int, NR: int, NRW: int):
    """The backward's per-step products, inline: ``products(dst, rows_g, n, src, K, panels, NC, width, add, rows_p,
    rows, out_p, out)``: dst[b, :width] = (add: +=) src_b @ M for the rows b = rows_g[:n], src_b the K values at
    address src + b*K*itemsize, M's NC column tiles packed at `panels` (`microkernel.pack_columns`), in wide tiles
    of NRW rows, then tiles of NR (`wide_tiles`; NRW = NR: all of NR); rows_p/rows [NRW], out_p/out [MV,
    NRW*LANES]: the caller's stack scratch (taken in a loop, the stack would grow every iteration)."""
    ITEM = np.dtype(compute).itemsize
    V = vectors_per_pass(MV, NR)                # both tiles read the panels of NR's pass
    wide = product_tile(compute, MV, NRW, LANES, V)
    tile = product_tile(compute, MV, NR, LANES, V, out_rows=NRW)

    @njit(inline="always")
    def products(dst, rows_g, n, src, K, panels, NC, width, add, rows_p, rows, out_p, out):
        nw = wide_tiles(n, NRW, NR)             # the first nw row tiles wide
        for ct in range(NC):                    # column tiles outer: a tile's panel, K*MV*LANES values (256 KB at
            i0 = 0                              # K = 2048 float32), is read from memory once per step, then from
            k = 0                               # the cache by every row tile
            while i0 < n:
                nr = NRW if k < nw else NR
                for r in range(nr):
                    b = rows_g[i0 + r] if i0 + r < n else rows_g[0]
                    rows[r] = src + (b * K) * ITEM
                if nr == NRW:
                    wide(panels + ct * (K * MV * LANES * ITEM), rows_p, K, out_p)
                else:
                    tile(panels + ct * (K * MV * LANES * ITEM), rows_p, K, out_p)
                scatter_columns(dst, rows_g, i0, min(nr, n - i0), out, ct, MV, LANES, width, add)
                i0 += nr
                k += 1

    return products


def _backward_key(cell, compute: str, MV: int, has_proj: bool) -> str:
    """The fingerprint of backward_group's variant (see _forward_key)."""
    return (cells.variant_key(cell, compute, has_proj, False)
            + f"fused backward {lanes_for(compute)} {tile_shape(MV)} {wide_rows(MV)} {MV}")


@functools.cache
def backward_group(cell, compute: str, MV: int, has_proj: bool = False):
    """One row group's backward of one layer and direction: ``group(grp, lo, hi, <backward_loop's arguments>)``
    runs the rows of line grp of `groups` (`group_rows`), per step s = hi-1 .. lo:

        (projection: dht = dy + dh -> dh_all[t];  dm = dht @ W_proj by the micro-kernel over W_proj's columns)
        cells.backward_step(...)            the pointwise backward of the group's rows: dgx[t], dgh[s], hp[s],
                                            dh (the part that bypasses R), dc, dv_acc (the BLAS loop's step)
        dh[b, :] += dgh[s, b] @ R           the group's active rows (a prefix), NRW or NR rows per product_tile call,
                                            column tiles of MV*LANES columns

    With zoneout (`zon`, training: zoneout.py's split and carry, row by row) the step first splits dy + dh by
    the forward's mask: the cell gets mask*(dy + dh) (in dh, dy then zeros), and (1-mask)*(dy + dh) is added
    to dh after R's product, the part of dh' that h_prev took.
    """
    acc = np.dtype(compute).type
    i64 = np.int64
    LANES = lanes_for(compute)
    NR = rows_for(MV)
    NRW = wide_rows(MV)
    ITEM = np.dtype(compute).itemsize
    PROJ = has_proj
    step = cells.backward_step(cell, compute, has_proj, False)
    KEY = _backward_key(cell, compute, MV, has_proj)

    def group(
        grp,      # int     the row group this call runs (a line of `groups`)
        lo,       # int     the steps this call runs: hi-1 down to lo
        hi,       # int
        d,        # int     direction
        lens,     # [B]     int32
        groups,   # [NG, n] int64 each row group's rows, longest first (-1 pads), `group_rows`
        dy,       # [T, B, D*P]   gradient reaching the layer output
        y,        # [T, B, D*P]   layer output (reserve)
        h0,       # [B, P]
        c0,       # [B, H]
        acts,     # [T, B, S*H]   reserve: saved values
        cs,       # [T, B, H]     reserve: c'
        vec,      # [V, H]
        dh,       # [B, P]        in: dhT; out: dh0
        dc,       # [B, H]        in: dcT; out: dc0
        dgx,      # [T, B, G*H]   out (t layout)
        dgh,      # [T, B, G*H]   out (s layout)
        hp,       # [T, B, P]     out: h entering step s (s layout)
        dv_acc,   # [B, V, H]     cell-vector gradients, accumulated
        RTp,      # [NC, MV//V, G*H, V, LANES] R's columns packed (`pack_columns`)
        steps,    # int     the longest length
        Wc,       # [NCH, MV//V, P, V, LANES] projection: W_proj's columns packed (`pack_columns`)
        dht,      # [B, P]        projection: dy + dh of the step
        dm,       # [B, H]        projection: W_proj^T (dy + dh), the step's dm_proj ([0, P] without)
        dh_all,   # [T, B, P]     projection: dy + dh at [t, b] (for dW_proj)
        zon,      # bool    zoneout (training): dy above is zeros, dyo the output's gradient, split by zmask
        zmask,    # [T, B, P]     zoneout: reserve, the forward's mask (else empty)
        dyo,      # [T, B, D*P]   zoneout: the gradient reaching the layer output (else dy)
        carry,    # [B, P]        zoneout: (1-mask)*(dy + dh) of the step, bypassing the cell (else empty)
    ):
        KEY  # noqa: B018  (the variant's fingerprint, see forward_group)
        B = dh.shape[0]
        P = dh.shape[1]
        K = RTp.shape[2]
        NC = RTp.shape[0]
        H = cs.shape[2]                         # units (projection only: a projection needs a cell state)
        dgh_addr = i64(dgh.ctypes.data)
        wc_addr = i64(Wc.ctypes.data)
        dht_addr = i64(dht.ctypes.data)
        NCH = Wc.shape[0]
        r_addr = i64(RTp.ctypes.data)
        rows_g = group_line(groups, grp)
        rows_p = rows_d(i64)
        rows = numba.carray(rows_p, NRW)              # [NRW] addresses of the rows' dgh_s
        out_p = lanes_w(acc)
        out = numba.carray(out_p, (MV, NRW * LANES))  # [MV, NRW*LANES] dgh_s R for a column tile
        for s in range(hi - 1, lo - 1, -1):     # every step: the step zeroes dgh[s], hp[s] of inactive rows
            n = active_prefix(rows_g, lens, s)      # the group's rows active at s
            if zon:                                  # zoneout: dh = mask*(dy + dh), carry = the rest (dy: zeros)
                for i in range(n):
                    b = rows_g[i]
                    split_row(s if d == 0 else lens[b] - 1 - s, b, d, zmask, dyo, dh, carry)
            if PROJ:                                 # dm = W_proj^T (dy + dh) for the active rows
                for i in range(n):
                    b = rows_g[i]
                    t = s if d == 0 else lens[b] - 1 - s
                    for k in range(P):
                        dht[b, k] = dy[t, b, d * P + k] + dh[b, k]
                        dh_all[t, b, k] = dht[b, k]
                products(dm, rows_g, n, dht_addr, P, wc_addr, NCH, H, False, rows_p, rows, out_p, out)
            step_fn(s, d, lens, rows_g, dy, y, h0, c0, acts, cs, vec, dm, dh, dc, dgx, dgh[s], hp[s], dv_acc)
            products(dh, rows_g, n, dgh_addr + (s * B * K) * ITEM, K, r_addr, NC, P, True, rows_p, rows, out_p, out)
            if zon:                                  # zoneout: dh_prev += what bypassed the cell
                for i in range(n):
                    b = rows_g[i]
                    accumulate(dh[b], carry[b], P)

    extra = {"step_fn": step, "products": row_products(compute, MV, LANES, NR, NRW),
             "rows_d": cells.stack_buffer(NRW), "lanes_w": cells.stack_buffer(MV * NRW * LANES)}
    return cells.cached_step(group, False, None, 1, 1, 1, 1, **extra)


@functools.cache
def backward_loop(cell, compute: str, parallel: bool, MV: int, has_proj: bool = False):
    """The backward of one layer and direction: ``loop(d, lens, groups, ..., dh_all)`` (the arguments of
    `backward_group` after grp, lo, hi) runs every row group (line of `groups`) of `backward_group`: serially its
    function for the one group, in parallel each group's step ranges relayed between the call's threads
    (`relay_loop`)."""
    return relay_loop(backward_group(cell, compute, MV, has_proj), parallel, "steps", True)

"""The fused loops' per-call plans: what a call signature alone decides (its rows by length, each layer's panel
shapes, loops and row groups, the backward's column tiles), worked out once per signature and shared (never
written), and `fused_prepare`, which packs a layer's weights and states for `fused.forward_loop`.

network.py runs the loops with these; the caches key everything the compiled code and the panels depend on
(the call, the compute dtype, `microkernel.geometry`, the thread count, the cell).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..config import RNNCall
from ..params import _layer_spans
from ..util import cdiv
from . import fused, microkernel
from .jitcache import njit_cached
from .microkernel import pack as _pack
from .microkernel import pack_columns as _pack_columns
from .workspace import scratch


dtype_name = functools.cache(str)     # a dtype's name, the loops' cache key (numpy's str(dtype) costs ~5 us)


@functools.lru_cache(maxsize=256)
def call_rows(call: RNNCall) -> tuple:
    """What a call's lengths decide, worked out once per call signature (shared: never written):
    (lens [B] int32, steps: the longest length, order [B] int64: rows longest first, n_active [steps] int64:
    rows active at each step, padded: some [t, b] never runs, ran [<=B]: the rows with a step, t_last: per
    direction [B] the t of each row's last step)."""
    lens = call.lengths_array().astype(np.int32)
    B = call.B
    steps = int(lens.max()) if B else 0
    order = fused.rows_by_length(lens)
    n_active = (lens[None, :] > np.arange(steps)[:, None]).sum(axis=1).astype(np.int64)
    ran = np.nonzero(lens > 0)[0]                             # rows with at least one step
    t_last = (lens - 1, np.zeros_like(lens))                  # per direction: the t of a row's last step
    return lens, steps, order, n_active, B > 0 and int(lens.min()) < call.T, ran, t_last


@dataclass(frozen=True)
class FusedSizes:
    """What `fused_forward` derives from a layer's sizes alone (worked out once per configuration, tile shape
    and dtype: a small call spent most of its time recomputing it)."""
    LANES: int              # units per vector
    NT: int                 # unit tiles
    HP: int                 # H padded to whole tiles
    R_panels: tuple         # shape of R packed by unit tiles
    W_panels: tuple         # shape of W packed by unit tiles (no W: skip input)
    Wq_panels: tuple        # shape of W_proj^T by column tiles (empty without a projection)
    macs: int               # multiply-adds per row and step
    NR: int                 # rows of the forward's tile (of G * `microkernel.units_per_pass(G)` vectors)


@functools.lru_cache(maxsize=256)
def fused_sizes(cfg, I_l: int, ct, geometry: tuple) -> FusedSizes:
    """(geometry: `microkernel.geometry(G)`, the vector width and tile shape, in the key: the tuner changes the tile,
    tests the width)"""
    H, P, G = cfg.H, cfg.P, cfg.G
    LANES, MQ = microkernel.lanes_for(ct), fused.COLUMN_VECTORS
    U = microkernel.units_per_pass(G)
    NT = cdiv(cdiv(H, LANES), U) * U            # unit tiles, whole tiles of U of them
    NR = microkernel.rows_for(G * U)
    Wq = microkernel.panel_shape(cdiv(P, MQ * LANES), H, MQ, ct, NR) if cfg.has_proj else \
        microkernel.panel_shape(0, 0, MQ, ct, NR)
    return FusedSizes(LANES, NT, NT * LANES, microkernel.panel_shape(NT // U, P, G * U, ct),
                      microkernel.panel_shape(NT // U, I_l, G * U, ct), Wq, step_macs(cfg, I_l), NR)


def step_macs(cfg, I_l: int) -> int:
    """Multiply-adds per row and step of a layer and direction of input size I_l: W x, R h (and W_proj m)."""
    return cfg.G * cfg.H * (I_l + cfg.P) + (cfg.H * cfg.P if cfg.has_proj else 0)


@functools.lru_cache(maxsize=256)
def layer_sides(call: RNNCall, threads: int, allowed: bool) -> tuple:
    """Per layer, whether its two directions run side by side (`fused.side_by_side` of a direction's multiply-adds
    over the call's rows and steps; never unless `allowed`, the setting cpu_side_by_side): one answer per call
    signature for the forward and the backward."""
    cfg = call.config
    rows_steps = int(call_rows(call)[3].sum())               # sum over steps of the rows active (= sum of lengths)
    return tuple(allowed and fused.side_by_side(cfg.D, threads, rows_steps * step_macs(cfg, cfg.layer_input_size(l)))
                 for l in range(cfg.L))


@njit_cached
def fused_prepare(
    params,   # [N]  the opaque buffer (compute dtype)
    spans,    # [6]  int64 offsets in params of this pseudo-layer's W, R, W_proj, bW, bR, V (-1: absent)
    I_l,      # int  the layer's input size
    H,        # int  hidden units
    V,        # int  cell vectors
    h,        # [B, P]  the state h entering the layer
    c,        # [B, H]  the state c (no cell state: empty)
    Wp,       # out: [NT/U, G*U//V, I_l, V, LANES] W by tiles of U unit tiles (`microkernel.pack`; not written with
              #      skip input; U = `microkernel.units_per_pass(G)`)
    Rp,       # out: [NT/U, G*U//V, P, V, LANES]  R likewise
    Wq,       # out: W_proj^T by column tiles (`microkernel.pack_columns`; not written without a projection)
    bWt,      # out: [NT, G, LANES] bW by unit tiles, zeros past H (`microkernel.bias_tiles`)
    bRt,      # out: [NT, G, LANES] bR
    vec,      # out: [VL, HP] the cell vectors, zeros past H (all zeros without vectors)
    hbuf,     # out: [2, B, HB] hbuf[0] = h (zeros past P), hbuf[1] zeros
    cbuf,     # out: [B, HP] c, zeros past H (all zeros without a cell state)
    weights,  # bool   pack the weights (Wp .. vec); False: they already hold these (`panels.KEPT`)
):
    """Everything `fused.forward_loop` reads besides x, read straight from the opaque buffer (`params.unpack`'s
    layout) in one compiled call: a tiny call spent ~50 us in the NumPy operations, views and look-ups that
    did this one by one."""
    NT, G, LANES = bWt.shape
    P = h.shape[1]
    U = Rp.shape[1] * Rp.shape[3] // G             # unit tiles per packed tile
    oW, oR, oQ, obW, obR, oV = spans[0], spans[1], spans[2], spans[3], spans[4], spans[5]
    GH = G * H
    if weights:
        if oW >= 0:
            _pack(params[oW:oW + GH * I_l].reshape((GH, I_l)), Wp, U)
        _pack(params[oR:oR + GH * P].reshape((GH, P)), Rp, U)
        if oQ >= 0:
            _pack_columns(params[oQ:oQ + P * H].reshape((P, H)).T, Wq)
        for jt in range(NT):
            for g in range(G):
                for u in range(LANES):
                    j = jt * LANES + u
                    if j < H:
                        bWt[jt, g, u] = params[obW + g * H + j]
                        bRt[jt, g, u] = params[obR + g * H + j]
                    else:
                        bWt[jt, g, u] = 0.0
                        bRt[jt, g, u] = 0.0
        vec[...] = 0.0
        if oV >= 0:
            for v in range(V):
                for j in range(H):
                    vec[v, j] = params[oV + v * H + j]
    hbuf[...] = 0.0
    for b in range(h.shape[0]):
        for k in range(P):
            hbuf[0, b, k] = h[b, k]
    cbuf[...] = 0.0
    for b in range(c.shape[0]):
        for j in range(c.shape[1]):
            cbuf[b, j] = c[b, j]


@dataclass(frozen=True)
class FusedLayer:
    """What `fused_forward` needs of one pseudo-layer besides its arrays (shared: never written)."""
    z: FusedSizes
    loop: object            # fused.forward_loop's loop
    rows: np.ndarray        # [groups, n] int64 each row group's rows, longest first (-1 pads): `fused.group_rows`
    spans: np.ndarray       # [6] int64 offsets of W, R, W_proj, bW, bR, V in the opaque buffer (-1: absent)
    skip: bool              # skip input: no W
    small: tuple            # (the shapes of bW, bR, vec, hbuf, cbuf, their total size): `small_buffers`
    no_Wq: np.ndarray       # the empty Wq panels without a projection (never written)
    no_m: np.ndarray        # [0, HP]: mbuf without a projection (never written)

    @property
    def groups(self) -> int:
        """Row groups: the lines of `rows`."""
        return self.rows.shape[0]


@dataclass(frozen=True)
class FusedPlan:
    """`forward`'s fused path of one call signature: per pseudo-layer a `FusedLayer`, and what the rows decide."""
    layers: tuple
    full: bool              # every row runs all T steps: a row's last output is y[T-1] (reverse: y[0])
    no_c: np.ndarray        # [0, 0]: c of `fused_prepare` without a cell state (never written)
    none3: np.ndarray       # [0, 0, 0]: the absent reserve entries (never written)
    kept: tuple             # per pseudo-layer the shapes `panels.KEPT` keeps: Wp, Rp, Wq panels, bW, bR, vec
    sides: tuple            # per layer: its two directions side by side, one thread each (`layer_sides`)


@functools.lru_cache(maxsize=256)
def forward_plan(call: RNNCall, ct, geometry: tuple, threads: int, cell, side: bool = True) -> FusedPlan:
    """The fused forward's plan of a call, worked out once per call signature, compute dtype, vector width and
    tile shape (`microkernel.geometry`), thread count, cell and whether directions may run side by side (the setting
    cpu_side_by_side) (all in the key: the tuner changes the tile, tests the width, row groups follow the threads,
    a cell may be registered again under its name)."""
    cfg, B = call.config, call.B
    _, _, order, n_active, padded, ran, _ = call_rows(call)
    layers = []
    sides = layer_sides(call, threads, side)
    for (p, layer, _), spans in zip(cfg.pseudo_layers(), _layer_spans(cfg, cell)):
        z = fused_sizes(cfg, cfg.layer_input_size(layer), ct, geometry)
        groups = 1 if sides[layer] else fused.row_groups(B, z.NR, int(n_active.sum()) * z.macs)
        loop = fused.forward_loop(cell, dtype_name(ct), groups > 1, cfg.has_proj)
        offsets = np.array([-1 if sp is None else sp[0] for sp in spans], dtype=np.int64)
        small = ((z.NT, cfg.G, z.LANES), (z.NT, cfg.G, z.LANES), (max(cfg.V, 1), z.HP),
                 (2, B, max(z.HP, cfg.P)), (B, z.HP))
        small = (small, sum(math.prod(shape) for shape in small))
        layers.append(FusedLayer(z, loop, fused.group_rows(order, groups, z.NR), offsets, spans[0] is None, small,
                                 np.zeros(z.Wq_panels, ct), np.zeros((0, z.HP), ct)))
    kept = tuple(((0,) * 5 if lay.skip else lay.z.W_panels, lay.z.R_panels, lay.z.Wq_panels) + lay.small[0][:3]
                 for lay in layers)
    return FusedPlan(tuple(layers), not padded and len(ran) == B and call.T > 0, np.zeros((0, 0), ct),
                     np.zeros((0, 0, 0), ct), kept, sides)


def small_buffers(small: tuple, ct) -> list:
    """Views of the shapes small[0] carved from one scratch buffer ("fused_small", small[1] elements), carved once
    while that buffer stays the same (five look-ups of the pool cost ~5 us a tiny call)."""
    flat = scratch("fused_small", (small[1],), ct)
    hit = _small_views.get((small, ct))
    if hit is None or hit[0] is not flat:                 # the scratch grew, or another thread's
        if len(_small_views) > 64:
            _small_views.clear()
        views, at = [], 0
        for shape in small[0]:
            size = math.prod(shape)
            views.append(flat[at:at + size].reshape(shape))
            at += size
        hit = _small_views[(small, ct)] = (flat, views)
    return hit[1]


#: (shapes, dtype) -> (the "fused_small" scratch, the views `small_buffers` carved of it)
_small_views: dict = {}


@dataclass(frozen=True)
class BackwardPlan:
    """What `backward`'s fused path works out of a call signature alone (shared: never written)."""
    grouped: tuple          # (rows [groups, n] int64, loop): the row groups on the call's threads
    serial: tuple           # (rows [1, B] int64, loop): one group (a direction on a thread of its own)
    RTp_shape: tuple        # R by column tiles
    Wc_shape: tuple         # W_proj by column tiles (projection)
    no_proj: tuple          # the loop's projection arguments without a projection (empty, never written)
    split: bool             # some gate's R side has its own gradient (GRU's candidate)
    no_vec: np.ndarray      # [0, H]
    none3: np.ndarray       # [0, 0, 0]


@functools.lru_cache(maxsize=256)
def backward_plan(call: RNNCall, ct, geometry: tuple, threads: int, cell) -> BackwardPlan:
    """The fused backward's row groups, loops and panel shapes of a call, once per call signature, compute dtype,
    vector width and column tile (`microkernel.geometry(MV)`), thread count and cell (all in the key, as
    `forward_plan`)."""
    cfg, B = call.config, call.B
    H, P, G = cfg.H, cfg.P, cfg.G
    lens, _, by_length, _, _, _, _ = call_rows(call)
    MV = fused.COLUMN_VECTORS
    NR = microkernel.rows_for(MV)
    LANES = microkernel.lanes_for(ct)
    macs = int(lens.sum()) * G * H * P                         # the per-step products dgh_s R
    name = dtype_name(ct)
    grouped = fused.group_rows(by_length, fused.row_groups(B, NR, macs), NR)
    serial = fused.group_rows(by_length, 1, NR)
    serial_loop = fused.backward_loop(cell, name, False, MV, cfg.has_proj)
    grouped_loop = fused.backward_loop(cell, name, True, MV, cfg.has_proj) if grouped.shape[0] > 1 else \
        serial_loop
    no_rows = np.zeros((0, P), ct)
    return BackwardPlan((grouped, grouped_loop), (serial, serial_loop),
                        microkernel.panel_shape(cdiv(P, MV * LANES), G * H, MV, ct),
                        microkernel.panel_shape(cdiv(H, MV * LANES), P, MV, ct),
                        (np.zeros(microkernel.panel_shape(0, 0, MV, ct), ct), no_rows, no_rows,
                         np.zeros((0, 0, 0), ct)),
                        any(cell.split_mask), np.zeros((0, H), ct), np.zeros((0, 0, 0), ct))

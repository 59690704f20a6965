"""Step kernels v2: R read once per step, coalesced, all batch rows together.

What changed from v1 and why: v1 gives every (row b, unit j) its own thread that walks R[g*H+j, :] alone, so
neighbouring threads read addresses a whole row apart (uncoalesced) and every batch row re-reads all of R
(B x |R| per step).  v2 computes the recurrent product of a step as a small tiled GEMM: a block owns
TJ units x all G gates x TB batch rows, stages R and h through shared memory in K-chunks of KC columns with
coalesced loads (consecutive threads read consecutive k), register-blocks RB rows per thread, and then runs
the cell's pointwise math in its epilogue.  A block reads its G*TJ rows of R once for all its TB rows, so a
step reads ceil(B / TB) x |R| per direction (B <= TB: exactly |R|).  R is used as stored ([G*H, P], k
contiguous): a row segment of KC consecutive k is one coalesced load, so no transposed copy is needed.

Kernels (templates over a `numbarnn.cells.CellSpec`, like `cell_steps.py`, whose argument tables, wrapper and
`device_function` rebinding they reuse):

    <cell>_forward_step_v2       grid (ceil(H/TJ), ceil(B/TB), D), TJ*RG threads; arguments = FORWARD_ARGS
        rh[g, b] = bR[g, j] + sum_k R[g*H+j, k] h[d, b, k]     tiled product, R_tile/h_tile in shared memory
        m, c' = cell.forward(wx, rh, v, h, c, saved)           epilogue, one (unit, row) pair at a time
    <cell>_backward_step_v2      (cells without a projection) one launch per step, s = T-1 .. 0, then s = -1:
        dh[b, j] += sum_gj dgh_{s+1}[b, gj] R[gj, j]           prologue: finishes dh arriving at step s
        dh_direct, dc_prev = cell.backward(dy + dh, ...)       epilogue at step s (s >= 0): dgx, dgh_s, dh
        dh lives in one buffer: it holds the direct term (GRU's z*dm, else 0) of a row that was active at
        step s+1, or the carried dh of a row that was not; the thread of (b, j) alone reads and writes it.
    recurrent_backward_v2        (with a projection, after v1's backward step, whose fused W_proj^T needs
        all of dh): dh_out[b, k] += sum_gj dgh_s[b, gj] R[gj, k], carry for inactive rows (v1 semantics)

Staging (`staging.py`, shared with v3): each thread owns one column of a staged chunk and a fixed set of its
rows, in loops with constant trip counts that numba unrolls, and issues LOADS_IN_FLIGHT global loads before
their shared-memory stores (storing each load before the next waits a memory latency per element).  R is read
through `R.flat` from a per-thread offset (one add a load); h's and dgh's rows, time indexes and flat offsets
are computed once per launch; every index is unsigned (`common.U`: no wrap-around code).

k loops: the tiles are zero past the product's width, so every chunk runs all KC columns, KU ks unrolled per
trip (`staging.unroll`): a constant trip count, which NVVM unrolls.  The H100 measured v2 latency bound, so the
instructions a thread issues are its time (`python -m numbarnn.analysis.sass --only _v2 --loops` counts them).

Tiles (`Tiles`): on a GPU TJ = 32 units (a warp: coalesced gx/y/acts rows in the epilogue and a 128-byte R row
segment per warp load), RG = 2 row groups x RB = 4 rows = TB = 8 rows (B = 8 reads R exactly once; 4 x RB
accumulators per thread), KC = 32 columns per chunk (one 128-byte float32 line per R row).  The tiles are
16-byte aligned and the R tile's rows KC + 4 words apart (`staging.pitch`): each thread reads 4 consecutive k
of a row at once, which NVVM fuses into one LDS.128 (the h and dgh tiles are a broadcast per warp and need no
padding), and the 32 rows a warp reads at one k spread over all 32 banks, 4 wavefronts for its 512 bytes.

Narrow tiles (`narrow`): where the GPU tiles' grid has fewer blocks than the GPU has SMs (768x16: 48 blocks of
2 warps on an H100's 132 SMs, latency bound), `tiles` gives TJ = 16, RG = 4, RB = 2: the same 8 rows and 64
threads, twice the blocks, half the rows and FMAs a thread; R is read as often (per row tile), h by twice the
blocks (B x P words each).

In the simulator the tiles are tiny and divide nothing (TJ = 3, RG = 2, RB = 2, KC = 2) so that partial tiles
in units, rows and K are always exercised.  float64 uses KC = 16 (the R tile of 32 KC = 32 would be 34 KiB: 4
blocks per SM on sm_80).

Each revision's instruction counts and timings: bench/results/gpu_h100.md.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from numba import cuda, types

from .. import settings
from ..cells import get_cell
from ..util import cdiv
from .cell_steps import FORWARD_ARGS, _wrap, reported_cells, signature, used_args
from . import target
from .common import DTYPES, U, acc_dtype, arr, device, nb
from .epilogues import BACKWARD_V2_ARGS, make_backward_epilogue, make_forward_epilogue
from .staging import (LOADS_IN_FLIGHT, VECTOR_BYTES, make_fetch, make_put_rows, make_row_offsets,
                      make_stage_matrix, make_step_offsets, make_tile_rows, pitch, rows_per_thread, unroll,
                      vector_ks)


class Tiles(NamedTuple):
    """A v2 block: TJ units (x all G gates) x RG*RB batch rows, K staged KC columns at a time."""

    TJ: int    # units per block (threads along x)
    RG: int    # row groups per block (threads along y): TJ * RG threads
    RB: int    # batch rows per thread (register blocking)
    KC: int    # K columns staged per shared-memory chunk

    @property
    def TB(self) -> int:
        return self.RG * self.RB

    @property
    def threads(self) -> int:
        return self.TJ * self.RG


def narrow(t: Tiles) -> Tiles:
    """`t` with half the units a block, twice the row groups and half the rows a thread: the same TB rows and
    threads, twice the blocks (the module docstring's "Narrow tiles")."""
    return t._replace(TJ=t.TJ // 2, RG=2 * t.RG, RB=t.RB // 2)


GPU_TILES = Tiles(TJ=32, RG=2, RB=4, KC=32)
GPU_TILES_F64 = Tiles(TJ=32, RG=2, RB=4, KC=16)   # float64: half the K chunk, half the R tile's 34 KiB
NARROW_TILES = narrow(GPU_TILES)                  # 16 units x 4 row groups x 2 rows
NARROW_TILES_F64 = narrow(GPU_TILES_F64)
SIM_TILES = Tiles(TJ=3, RG=2, RB=2, KC=2)


def tiles(dtype="float32", simulator: bool | None = None, H: int | None = None, B: int | None = None, D: int = 1,
          sms: int | None = None) -> Tiles:
    """The tiles this process launches for `dtype` (small ones in the simulator, see the module docstring).

    Given the layer (H units, B rows, D directions) on a GPU: the narrow tiles (`narrow`) where the GPU tiles'
    grid has fewer blocks than the GPU has SMs (`sms`, default this process's GPU's; without one, the GPU tiles).
    NUMBARNN_V2_NARROW=0 keeps the GPU tiles (`bash bench/gpu_run.sh narrow` times both)."""
    if target.simulator(simulator):
        return SIM_TILES
    t = GPU_TILES_F64 if str(dtype) == "float64" else GPU_TILES
    if H is None or B is None or not settings.get("v2_narrow"):
        return t
    if sms is None:
        geometry = target.device_geometry_or_none()
        if geometry is None:                              # no GPU: the GPU tiles
            return t
        sms = geometry[1]
    gx, gy, gz = grid(H, B, D, t)
    return narrow(t) if gx * gy * gz < sms else t


def grid(n_units: int, B: int, D: int, t: Tiles) -> tuple:
    """(blocks over units, blocks over rows, directions)."""
    return (max(1, cdiv(n_units, t.TJ)), max(1, cdiv(B, t.TB)), D)


def r_bytes_per_step(G: int, H: int, P: int, B: int, D: int, itemsize: int, t: Tiles = GPU_TILES) -> int:
    """Bytes of R loaded per step by the forward (and backward) product, counted per tile: every block loads
    its G*TJ rows (the units < H) of every K column once, and there are ceil(B / TB) row tiles per direction."""
    return D * cdiv(B, t.TB) * G * H * P * itemsize


# ---------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_forward_step_v2(cell, dtype, has_proj: bool, t: Tiles = GPU_TILES):
    """Tiled recurrent product for TJ units x G gates x TB rows, then the cell's pointwise forward."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    G = cell.G
    TJ, RB, KC, TB, NT = t.TJ, t.RB, t.KC, t.TB, t.threads
    GJ = G * TJ                                 # rows of R a block owns: unit jj of gate g is row g*TJ + jj
    RS = NT // KC                               # staging: rows apart of one thread's R elements
    RH = rows_per_thread(TB, RS)                # a thread's rows of the h tile
    KU = unroll(KC, G * RB)                     # ks per trip of the k loop: G*RB FMAs each
    V = vector_ks(dtype, KU)                    # ks of one shared load (4 fp32 words: an LDS.128)
    assert NT % KC == 0, "staging needs whole rows of KC columns per pass"
    KC1 = pitch(KC, dtype)                      # R tile row pitch: KC + 4 fp32 words, rows 16-byte aligned
    epilogue = make_forward_epilogue(cell, dtype, RB)
    stage_R = make_stage_matrix(dtype, G, TJ, RS)
    tile_rows = make_tile_rows(TB, RS)
    row_offsets = make_row_offsets(TB, RS)
    fetch_h = make_fetch(dtype, TB, RS)
    put_h = make_put_rows(TB, RS)

    @device
    def forward_body(s, lens, gx, unit_params, R_fwd, R_rev, h_in, h_out, c, y, acts, cs, ms):
        tid = cuda.threadIdx.x
        jj = tid % TJ                           # this thread's unit within the tile
        rg = tid // TJ                          # its row group: rows rg*RB .. rg*RB + RB-1 of the tile
        j0 = cuda.blockIdx.x * TJ
        b0 = cuda.blockIdx.y * TB
        d = cuda.blockIdx.z
        H = unit_params.shape[2]
        P = h_in.shape[2]
        B = lens.shape[0]
        R = R_fwd if d == 0 else R_rev
        R_tile = cuda.shared.array((GJ, KC1), acc, alignment=VECTOR_BYTES)    # R[g*H + j0+jj', k0+kk]
        h_tile = cuda.shared.array((TB, KC), acc, alignment=VECTOR_BYTES)     # h[d, b0+bb, k0+kk]
        rh = cuda.local.array((G, RB), acc)             # the product, G gates x RB rows, in registers
        r_k = cuda.local.array((G, V), acc)             # R_tile[g*TJ + jj, kk .. kk+V-1], every gate
        h_k = cuda.local.array((RB, V), acc)            # h_tile[rg*RB + r, kk .. kk+V-1], every row
        buf = cuda.local.array(LOADS_IN_FLIGHT, acc)    # R's loads in flight (registers)
        h_buf = cuda.local.array(RH, acc)               # h's
        rb = cuda.local.array(RH, types.int32)          # the batch row of each staged h row, -1: none
        off = cuda.local.array(RH, types.int64)         # the flat index of h[d, that row, 0], -1: none
        for g in range(G):
            for r in range(RB):
                rh[g, r] = zero

        kc = tid % KC                           # this thread's column of every staged chunk
        r0 = tid // KC                          # and its rows: R's r0, r0 + RS, ...; h's r0*RH .. r0*RH + RH-1
        tile_rows(rb, b0, B, TB, 1, r0)         # once: h's rows of this block (no splits of K in v2)
        row_offsets(h_in, rb, off, d)
        for k0 in range(0, P, KC):
            k = k0 + kc
            fetch_h(h_in, off, h_buf, k, k < P)     # h's loads first: in flight while R's are issued
            stage_R(R, R_tile, buf, j0, H, H, k, k < P, kc, r0)   # G*TJ rows x KC columns, coalesced along k
            put_h(h_tile, h_buf, kc, r0)
            cuda.syncthreads()
            for k8 in range(0, KC, KU):         # whole chunks (the tiles are zero past P), KU ks unrolled
                for kv in range(0, KU, V):      # V consecutive k of a row: one vector load (LDS.128)
                    for g in range(G):
                        for v in range(V):
                            r_k[g, v] = R_tile[U(g * TJ + jj), U(k8 + kv + v)]
                    for r in range(RB):
                        for v in range(V):      # the same for the whole warp: a broadcast
                            h_k[r, v] = h_tile[U(rg * RB + r), U(k8 + kv + v)]
                    for v in range(V):
                        for r in range(RB):
                            for g in range(G):
                                rh[g, r] += r_k[g, v] * h_k[r, v]
            cuda.syncthreads()

        j = j0 + jj
        if j < H:                               # epilogue: the cell at (unit j, row b), this thread's RB rows
            epilogue(s, lens, gx, unit_params, h_in, h_out, c, y, acts, cs, ms, rh, d, j, b0 + rg * RB)

    name = f"{cell.name}_forward_step_v2" + ("_proj" if has_proj else "")
    return _wrap(name, forward_body, FORWARD_ARGS, cell, has_proj)


# ---------------------------------------------------------------------------------------------------
# backward: dh = dgh R, tiled (shared by the fused cell kernel and recurrent_backward_v2)
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_dgh_R(dtype, t: Tiles):
    """Device function: acc[r] = sum_gj dgh[d, t_b, b, gj] R[gj, k0+kx] for the thread's RB rows, where the
    rows are those of step `s_src` (t_b its time index; rows with s_src >= len[b], or s_src < 0, give 0)."""
    acc = acc_dtype(dtype).type
    zero = acc(0.0)
    TJ, RB, KC, TB, NT, RG = t.TJ, t.RB, t.KC, t.TB, t.threads, t.RG
    GS = NT // KC                                       # staging dgh: rows apart of one thread's elements
    RH = rows_per_thread(TB, GS)                        # a thread's rows of the dgh tile
    assert NT % KC == 0, "staging needs whole rows of KC columns per pass"
    stage_R = make_stage_matrix(dtype, 1, KC, RG)
    tile_rows = make_tile_rows(TB, GS)
    step_offsets = make_step_offsets(TB, GS)
    fetch_dgh = make_fetch(dtype, TB, GS)
    put_dgh = make_put_rows(TB, GS)
    KU = unroll(KC, RB)                                 # ks per trip of the k loop: RB FMAs each
    V = vector_ks(dtype, KU)                            # ks of one dgh tile load (4 fp32 words: an LDS.128)

    @device
    def dgh_R(s_src, lens, dgh, R, R_tile, g_tile, out):
        tid = cuda.threadIdx.x
        kx = tid % TJ
        rg = tid // TJ
        k0 = cuda.blockIdx.x * TJ
        b0 = cuda.blockIdx.y * TB
        d = cuda.blockIdx.z
        GH = R.shape[0]
        P = R.shape[1]
        buf = cuda.local.array(LOADS_IN_FLIGHT, acc)    # R's loads in flight (see staging.LOADS_IN_FLIGHT)
        g_buf = cuda.local.array(RH, acc)               # dgh's
        rb = cuda.local.array(RH, types.int32)          # the batch row of each staged dgh row, -1: none
        off = cuda.local.array(RH, types.int64)         # the flat index of dgh[d, its time at s_src, row, 0], -1
        r_k = cuda.local.array(V, acc)                  # R_tile[kk .. kk+V-1, kx]
        g_k = cuda.local.array((RB, V), acc)            # g_tile[rg*RB + r, kk .. kk+V-1], every row
        for r in range(RB):
            out[r] = zero
        cg = tid % KC                                   # this thread's gj column of the dgh tile
        rb0 = tid // KC                                 # and its rows there, rb0*RH .. rb0*RH + RH-1
        tile_rows(rb, b0, lens.shape[0], TB, 1, rb0)    # once: rows and their time indexes at s_src
        step_offsets(s_src, lens, dgh, rb, off, d)
        k = k0 + kx
        for gj0 in range(0, GH, KC):
            fetch_dgh(dgh, off, g_buf, gj0 + cg, gj0 + cg < GH)     # coalesced along gj, in flight ...
            stage_R(R, R_tile, buf, gj0, 0, GH, k, k < P, kx, rg)     # ... while KC rows gj x TJ columns k of R
            put_dgh(g_tile, g_buf, cg, rb0)
            cuda.syncthreads()
            for k8 in range(0, KC, KU):             # whole chunks (the tiles are zero past GH), KU ks unrolled
                for kv in range(0, KU, V):
                    for v in range(V):
                        r_k[v] = R_tile[U(k8 + kv + v), U(kx)]      # consecutive threads, consecutive banks
                    for r in range(RB):
                        for v in range(V):              # a broadcast; V consecutive k: one vector load
                            g_k[r, v] = g_tile[U(rg * RB + r), U(k8 + kv + v)]
                    for v in range(V):
                        for r in range(RB):
                            out[r] += g_k[r, v] * r_k[v]
            cuda.syncthreads()

    return dgh_R


@functools.lru_cache(maxsize=None)
def make_recurrent_backward_v2(dtype, t: Tiles = GPU_TILES):
    """v1's recurrent_backward, tiled: dh_out += dgh_s R for active rows, carry dh_in for the others."""
    acc = acc_dtype(dtype).type
    TJ, RB, KC, TB = t.TJ, t.RB, t.KC, t.TB
    dgh_R = make_dgh_R(dtype, t)

    def recurrent_backward_v2(
        s,        # int64           step index
        lens,     # [B] int32
        dgh,      # [D, T, B, G*H]  R-side pre-activation gradients of this step
        R_fwd,    # [G*H, P]
        R_rev,    # [G*H, P]
        dh_in,    # [D, B, P] acc   dh arriving at this step
        dh_out,   # [D, B, P] acc   in: the cell's direct term; out: dh leaving towards step s-1
    ):
        R_tile = cuda.shared.array((KC, TJ), acc)
        g_tile = cuda.shared.array((TB, KC), acc, alignment=VECTOR_BYTES)
        total = cuda.local.array(RB, acc)
        d = cuda.blockIdx.z
        dgh_R(s, lens, dgh, R_fwd if d == 0 else R_rev, R_tile, g_tile, total)
        k = cuda.blockIdx.x * TJ + cuda.threadIdx.x % TJ
        P = dh_in.shape[2]
        B = lens.shape[0]
        if k >= P:
            return
        for r in range(RB):
            b = cuda.blockIdx.y * TB + cuda.threadIdx.x // TJ * RB + r
            if b >= B:
                break
            if s >= lens[b]:
                dh_out[d, b, k] = dh_in[d, b, k]
            else:
                dh_out[d, b, k] += total[r]

    return recurrent_backward_v2


@functools.lru_cache(maxsize=None)
def make_backward_step_v2(cell, dtype, t: Tiles = GPU_TILES):
    """Cells without a projection: one launch per step, dh = direct + dgh_{s+1} R, then the cell backward."""
    acc = acc_dtype(dtype).type
    G, TJ, RB, KC, TB = cell.G, t.TJ, t.RB, t.KC, t.TB
    dgh_R = make_dgh_R(dtype, t)
    epilogue = make_backward_epilogue(cell, dtype, RB)

    @device
    def backward_body(s, lens, dy, y, h0, c0, acts, cs, unit_params, R_fwd, R_rev, dh, dc, dgx, dgh, dvec,
                      h_prev):
        R_tile = cuda.shared.array((KC, TJ), acc)
        g_tile = cuda.shared.array((TB, KC), acc, alignment=VECTOR_BYTES)
        from_R = cuda.local.array(RB, acc)
        d = cuda.blockIdx.z
        dgh_R(s + 1, lens, dgh, R_fwd if d == 0 else R_rev, R_tile, g_tile, from_R)   # 0 where s+1 >= len
        j = cuda.blockIdx.x * TJ + cuda.threadIdx.x % TJ
        if j < dgx.shape[3] // G:
            epilogue(s, lens, dy, y, h0, c0, acts, cs, unit_params, dh, dc, dgx, dgh, dvec, h_prev, from_R, d,
                     j, cuda.blockIdx.y * TB + cuda.threadIdx.x // TJ * RB)

    return _wrap(f"{cell.name}_backward_step_v2", backward_body, BACKWARD_V2_ARGS, cell, False)


def backward_v2_args(cell) -> list[str]:
    return used_args(BACKWARD_V2_ARGS, cell, False)


# ---------------------------------------------------------------------------------------------------
# kernel report
# ---------------------------------------------------------------------------------------------------

def recurrent_signature(dt) -> tuple:
    """recurrent_backward_v2's argument types: s, lens, dgh [D, T, B, G*H], R_fwd, R_rev [G*H, P], dh_in, dh_out."""
    a = str(acc_dtype(dt))
    return (nb("int64"), arr("int32", 1), arr(dt, 4), arr(dt, 2), arr(dt, 2), arr(a, 3), arr(a, 3))


def kernel_specs():
    """The v2 kernels of REPORTED_CELLS at the GPU tiles (block = TJ * RG threads), and LSTM's at the narrow ones."""
    specs = []
    for dt in DTYPES:
        t = tiles(dt, simulator=False)
        for cell in reported_cells("matrix"):
            for proj in ((False, True) if cell.projection else (False,)):
                tag = "_proj" if proj else ""
                specs.append((f"{cell.name}_forward_step_v2{tag}", dt, make_forward_step_v2(cell, dt, proj, t),
                              signature(FORWARD_ARGS, cell, dt, proj), t.threads))
            specs.append((f"{cell.name}_backward_step_v2", dt, make_backward_step_v2(cell, dt, t),
                          signature(BACKWARD_V2_ARGS, cell, dt, False), t.threads))
        specs.append(("recurrent_backward_v2", dt, make_recurrent_backward_v2(dt, t), recurrent_signature(dt),
                      t.threads))
    # the narrow tiles (`tiles` on a grid smaller than the GPU), LSTM: float32 (float16's tiles too) and float64
    lstm = get_cell("lstm")
    for dt in ("float32", "float64"):
        t = narrow(tiles(dt, simulator=False))
        specs.append(("lstm_forward_step_v2_narrow", dt, make_forward_step_v2(lstm, dt, False, t),
                      signature(FORWARD_ARGS, lstm, dt, False), t.threads))
        specs.append(("lstm_backward_step_v2_narrow", dt, make_backward_step_v2(lstm, dt, t),
                      signature(BACKWARD_V2_ARGS, lstm, dt, False), t.threads))
        specs.append(("recurrent_backward_v2_narrow", dt, make_recurrent_backward_v2(dt, t), recurrent_signature(dt),
                      t.threads))
    return specs


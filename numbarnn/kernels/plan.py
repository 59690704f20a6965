"""The launch plan of one call: every kernel launch the driver will make, built as data before anything runs.

A plan is a list of `Launch` entries for one phase of one call on one target (the simulator's launch sizes or a
GPU's).  Per layer it reads as reference/network.py's loops do:

    forward    [dropout_forward], gx = x_l W^T (a GEMM per direction; tile_gates for skip_input), h0 (c0) cast in,
               the step launches (the step version's row of `steps.STEP_KERNELS`), hT (cT) cast out
    backward   [apply_mask for x_l], zero the scratch gradients, dhT (dcT) cast in, the step launches (T-1 .. 0),
               dh0 (dc0) cast out, dW / dx / dR (/ dW_proj) GEMMs, column sums for the biases, [sum_gates],
               [apply_mask: dropout backward]

An entry names its kernel by factory and key (nothing is compiled), its grid and block, its arguments by role
(buffer names and views of them, resolved by the executor), the steps it covers (a per-step kernel is one entry
for all of its steps), why this step version runs, and its FLOP and byte estimates.  Once the step kernels are
chosen (`steps.step_plan`: v3 asks the device, or the model of one, whether its blocks fit), building a plan
compiles nothing and touches no device, so a GPU's plan can be made in the simulator.  driver.py executes plans;
`launch_plan` groups one into the rows `numbarnn explain`, the profiler and the roofline model read.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

import numpy as np

from ..dropout import dropout_key, dropout_scale, dropout_threshold
from ..params import param_regions
from ..reserve import NONCE_SIZE, reserve_size
from . import target
from .common import acc_dtype, blocks, make_cast_copy, make_fill, make_put4, threads
from .gemm import DEFAULT_VERSION, VERSIONS, auto_split_k
from .layer_ops import (column_sums_launches, make_apply_mask, make_dropout_forward, make_sum_gates,
                        make_tile_gates)
from .layer_norm import BLOCK_GPU, BLOCK_SIM, make_layer_norm_rows, make_layer_norm_rows_backward, norm_offsets
from .recurrent import make_diagonal_gradient
from .steps import STEP_KERNELS, step_plan
from . import zoneout

NONCE_KERNEL = "put4 (the reserve's nonce)"


class Run(str, enum.Enum):
    """How the executor (driver.run_entry) runs a plan entry."""
    KERNEL = "kernel"                 # one launch of `kernel` (per step of `steps` with each_step)
    GEMM = "gemm"                     # a gemm.gemm call (its split_k_sum: the WITH_PREVIOUS entry after it)
    COLUMN_SUMS = "column_sums"       # a layer_ops.column_sums call (its column_totals after it)
    WITH_PREVIOUS = "with_previous"   # launched by the call of the entry before it
    BY_OPS = "by_ops"                 # the reserve's nonce, written by ops after the forward


@dataclass(frozen=True)
class Launch:
    """One entry of a plan: a kernel launch, or one per step of `steps` (each_step), or one call of a launcher
    that makes its own launches (`Run`)."""

    phase: str                   # "forward" or "backward"
    layer: int | None            # None: a launch for the whole call (the reserve's fill, dparams' fill, the nonce)
    label: str                   # its row in `launch_plan` (and `numbarnn explain`)
    name: str                    # as the LaunchLog counts it
    grid: tuple
    block: int
    kernel: tuple = ()           # (factory, *key): the executor launches jit(*kernel)
    args: tuple = ()             # roles (buffer names, `view`s of them, "s", "h_in", ...) or literal scalars
    steps: range | None = None   # the time steps it covers (backward: descending); None: not a step launch
    each_step: bool = False      # one launch per step of `steps` (else one launch covers them all)
    swaps: bool = False          # the state ping-pongs (h_in <-> h_out) once per step covered
    why: str = ""                # the step plan's note (step launches)
    run: Run = Run.KERNEL        # how the executor runs it
    options: tuple = ()          # (name, value) pairs of the gemm() call: trans_a, trans_b, beta, split_k
    flops: int = 0               # per launch: FLOPs
    nbytes: int = 0              # per launch: compulsory global-memory bytes (no cache effects)

    @property
    def launches(self) -> int:
        return len(self.steps) if self.each_step else 1


def view(op: str, role, *params) -> tuple:
    """A view of a buffer by role: ("part", role, index), ("rows", role, *shape) or ("flat", role)."""
    return (op, role, *params)


def part(role, index):
    return view("part", role, index)


def rows(role, *shape):
    return view("rows", role, *shape)


def flat(role):
    return view("flat", role)


class Builder:
    """Appends one phase's entries, with the call's sizes at hand (per launch estimates: FLOPs, bytes)."""

    def __init__(self, call, phase: str, simulator: bool, step=None):
        cfg = self.cfg = call.config
        self.call, self.phase, self.sim = call, phase, simulator
        self.T, self.B, self.dt = call.T, call.B, np.dtype(call.dtype)
        self.dts, self.acc = str(self.dt), str(acc_dtype(self.dt))    # kernel keys: the dtypes' names
        self.H, self.P, self.D, self.G = cfg.H, cfg.P, cfg.D, cfg.G
        self.TB, self.GH, self.sz = call.T * call.B, cfg.G * cfg.H, self.dt.itemsize
        self.steps = max(call.lengths, default=0)
        self.step = step_plan(call, phase, simulator) if step is None else step
        self.layer = None
        self.entries: list[Launch] = []

    # -- sizes as the kernels launch them on this target -------------------------------------------------
    def flat_grid(self, n: int) -> tuple:
        """(grid, block) of an elementwise kernel over n items."""
        t = threads(n, 256, simulator=self.sim)
        return (blocks(n, t),), t

    def unit_grid(self, n: int) -> tuple:
        """(grid, block) of a v1 step kernel: a thread per (unit of n, row, direction)."""
        t = threads(n, simulator=self.sim)
        return (blocks(n, t), self.B, self.D), t

    # -- entries --------------------------------------------------------------------------------------------
    def add(self, label, name, grid, block, kernel=(), args=(), **more) -> None:
        self.entries.append(Launch(self.phase, self.layer, label, name, tuple(grid), int(block), tuple(kernel),
                                   tuple(args), **more))

    def step_range(self) -> range:
        """The steps a layer runs (up to max(len)), in the phase's order."""
        return range(self.steps) if self.phase == "forward" else range(self.steps)[::-1]

    def fill(self, what: str, role, n: int) -> None:
        """role = 0 (n elements; nothing when n == 0)."""
        if n:
            self.add(f"fill ({what} = 0)", "fill", *self.flat_grid(n), (make_fill, self.dts), (flat(role), 0.0),
                     nbytes=n * self.sz)

    def cast(self, what: str, src, dst, n: int, src_dt: str, dst_dt: str) -> None:
        """dst = src converted (n elements, both contiguous; nothing when n == 0)."""
        if n:
            self.add(f"cast_copy ({what})", "cast_copy", *self.flat_grid(n), (make_cast_copy, src_dt, dst_dt),
                     (flat(src), flat(dst)),
                     nbytes=2 * n * self.sz)

    def gemm(self, what: str, a, b, c, M: int, N: int, K: int, **options) -> None:
        """One gemm(a, b, c) call (M x N x K; nothing when M * N == 0, as gemm launches nothing then), with its
        split-K chosen here as gemm would choose it, and the split_k_sum launch that then follows."""
        if M * N == 0:
            return
        v = VERSIONS[DEFAULT_VERSION]
        config = v.sim_config if self.sim else v.gpu_config
        split = auto_split_k(DEFAULT_VERSION, self.dts, False, M, N, K, config, simulator=self.sim)
        grid, block = v.launch(M, N, split, config)
        label = f"gemm v{DEFAULT_VERSION} ({what})" + (f", split-K {split}" if split > 1 else "")
        self.add(label, "gemm", grid, math.prod(block), (), (a, b, c), run=Run.GEMM,
                 options=tuple(options.items()) + (("split_k", split),), flops=2 * M * N * K,
                 nbytes=(M * K + K * N + split * M * N) * self.sz)
        if split > 1:                  # stage 2: read the partials, read C (beta) and write it
            self.add(f"split_k_sum ({what})", "split_k_sum", *self.flat_grid(M * N), run=Run.WITH_PREVIOUS,
                     flops=split * M * N, nbytes=(split + 2) * M * N * self.sz)

    def column_sums(self, what: str, a, b, out, N: int, C: int) -> None:
        """out = the column sums of a (and b), deterministic: column_partials, then column_totals."""
        S = 1 if b is None else 2
        (name1, grid1, block1), (name2, grid2, block2) = column_sums_launches(N, C, S, simulator=self.sim)
        self.add(f"{name1} ({what})", name1, grid1, block1, (), (a, b, out), run=Run.COLUMN_SUMS,
                 flops=S * N * C, nbytes=S * (N + grid1[1]) * C * self.sz)
        self.add(f"{name2} ({what})", name2, grid2, block2, run=Run.WITH_PREVIOUS, flops=S * grid1[1] * C,
                 nbytes=S * (grid1[1] + 1) * C * self.sz)


def dropout_args(cfg, layer: int, T: int, B: int, dt) -> tuple:
    """The dropout kernels' (offset, key, key, threshold, scale) of layer `layer` (SPEC 6)."""
    k0, k1 = dropout_key(cfg.seed, cfg.seed2)
    base = (layer - 1) * T * B * cfg.D * cfg.P
    scale = acc_dtype(dt).type(dropout_scale(cfg.dropout))
    return np.uint64(base), np.uint32(k0), np.uint32(k1), np.uint32(dropout_threshold(cfg.dropout)), scale


# ---------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------

def forward_plan(call, simulator: bool | None = None, device_reserve: bool = False, step=None) -> list[Launch]:
    """The forward's launches for `call` on the current target (or the one `simulator` names).  Buffers by role:
    x [T, B, I], h0/hT [L*D, B, P], c0/cT [L*D, B, H], reserve [R] and its views (reserve_views' names, e.g.
    "saved.y0"), W{p}/R{p}/Wp{p} per pseudo-layer p, unit{l} [D, 2G+V, H]; scratch gx [D, T, B, G*H], h_a/h_b
    [D, B, P] (the state, double-buffered: "h_in"/"h_out" by parity), c [D, B, H], x_drop [T, B, D*P].
    device_reserve: a training reserve stays on the device, so ops writes its nonce by a launch (listed last).
    step: the phase's `step_plan` where the caller has it."""
    b = Builder(call, "forward", target.simulator(simulator), step)
    cfg, T, B, D, P, H, TB, GH, dt, a = b.cfg, b.T, b.B, b.D, b.P, b.H, b.TB, b.GH, b.dts, b.acc
    n_reserve = reserve_size(replace(call, is_training=True))   # inference: scratch of the same layout
    b.fill("reserve", "reserve", n_reserve)
    x_l = "x"                                                    # [T, B, I_l]
    for layer in range(cfg.L):
        b.layer, ps = layer, slice(layer * D, (layer + 1) * D)
        I_l = cfg.layer_input_size(layer)
        if layer > 0 and call.dropout_active:                   # x_l = y_{l-1} * keep * scale
            n = T * B * D * P
            b.add("dropout_forward", "dropout_forward", *b.flat_grid(n), (make_dropout_forward, dt),
                  (flat(x_l), *dropout_args(cfg, layer, T, B, dt), flat(f"saved.keep{layer}"), flat("x_drop")),
                  nbytes=3 * n * b.sz)
            x_l = "x_drop"
        for d in range(D if TB else 0):                         # gx[d] = x_l W_d^T for all steps at once
            if cfg.has_w(layer):
                b.gemm("gx = x W^T, all steps", rows(x_l, TB, I_l), f"W{layer * D + d}", rows(part("gx", d), TB, GH),
                       TB, GH, I_l, trans_b=True)
            else:                                               # skip_input: W = identity, x_l tiled per gate
                b.add("tile_gates", "tile_gates", *b.flat_grid(TB * GH), (make_tile_gates, dt),
                      (rows(x_l, TB, H), rows(part("gx", d), TB, GH)), nbytes=TB * (GH + H) * b.sz)
        if "wx" in cfg.cell.layer_norm and TB:                  # gx = LN(W x) γ_x, a block per row
            NT = BLOCK_SIM if b.sim else BLOCK_GPU
            b.add("layer_norm_rows (W x)", "layer_norm_rows", (TB, D), NT, (make_layer_norm_rows, cfg.cell, dt, NT),
                  ("lens", "gx", f"norm{layer}", f"saved.lnstat{layer}", f"saved.wx{layer}"), flops=D * TB * 8 * GH,
                  nbytes=D * TB * 4 * GH * b.sz)
        b.cast("h0 in", part("h0", ps), "h_in", D * B * P, dt, a)
        if cfg.has_cell_state:
            b.cast("c0 in", part("c0", ps), "c", D * B * H, dt, a)
        STEP_KERNELS[b.step.version].forward(b)
        if cfg.zoneout:                                         # h' = h_new or h_prev (v1 only: kernels/zoneout.py)
            zoneout.plan_forward(b)
        b.cast("hT out", "h_in", part("hT", ps), D * B * P, a, dt)
        if cfg.has_cell_state:
            b.cast("cT out", "c", part("cT", ps), D * B * H, a, dt)
        x_l = f"saved.y{layer}"
    b.layer = None
    if call.is_training and device_reserve:                     # ops.write_nonce, after the forward
        b.add(NONCE_KERNEL, NONCE_KERNEL, (1,), 1, (make_put4, dt), run=Run.BY_OPS, nbytes=NONCE_SIZE * b.sz)
    return b.entries


# ---------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------

def backward_plan(call, simulator: bool | None = None, step=None) -> list[Launch]:
    """The backward's launches for `call` on the current target (or the one `simulator` names).  Buffers by role,
    beside the forward's: dy [T, B, D*P], dhT/dh0 [L*D, B, P], dcT/dc0 [L*D, B, H], dparams [N] and its views
    dW{p}/dR{p}/dWp{p}, dunit{l} [D, 2G+V, H]; scratch dgx/dgh [D, T, B, G*H], dvec [D, T, B, V*H], h_prev and
    dh_total [D, T, B, P], qs [D, T, B, H], dgm [D, GM, T, B, H], dh_a/dh_b [D, B, P] ("dh_in"/"dh_out"),
    dc [D, B, H], x_masked/dy_masked, dx (layer 0, returned) and dx0/dx1 [T, B, I_l] (the layers above)."""
    b = Builder(call, "backward", target.simulator(simulator), step)
    cfg, T, B, D, P, H, TB, GH, dt, a = b.cfg, b.T, b.B, b.D, b.P, b.H, b.TB, b.GH, b.dts, b.acc
    V, GM = cfg.V, len(cfg.cell.modulated)
    norm = cfg.cell.layer_norm                                  # SPEC 13 (kernels/layer_norm.py)
    OWX, ORH, OC = norm_offsets(cfg.cell)
    n_params = sum(r.size for r in param_regions(cfg))
    b.fill("dparams", "dparams", n_params)
    n = T * B * D * P
    masked = (make_apply_mask, dt)
    dy_l = "dy"                                                 # [T, B, D*P]
    for layer in reversed(range(cfg.L)):
        b.layer, ps = layer, slice(layer * D, (layer + 1) * D)
        I_l = cfg.layer_input_size(layer)
        drop = layer > 0 and call.dropout_active
        x_l = "x" if layer == 0 else f"saved.y{layer - 1}"            # [T, B, I_l]
        if drop:                                                # the layer's input as the forward saw it
            b.add("apply_mask (x_l for dW)", "apply_mask", *b.flat_grid(n), masked,
                  (flat(x_l), flat(f"saved.keep{layer}"), dropout_args(cfg, layer, T, B, dt)[-1], flat("x_masked")),
                  flops=n, nbytes=3 * n * b.sz)
            x_l = "x_masked"
        for what, size in (("dgx", D * TB * GH), ("dgh", D * TB * GH), ("dvec", D * TB * V * H),
                           ("h_prev", D * TB * P), ("dh_total", D * TB * P * cfg.has_proj),
                           ("qs", D * TB * H * bool(GM)), ("dgm", D * GM * TB * H),
                           ("dgh_pre", D * TB * GH * bool(norm)), ("dgr", D * TB * GH * bool(norm)),
                           ("dnc", D * TB * 2 * H * bool(norm))):
            b.fill(what, what, size)                            # zeros at padded steps
        b.cast("dhT in", part("dhT", ps), "dh_in", D * B * P, dt, a)
        if cfg.has_cell_state:
            b.cast("dcT in", part("dcT", ps), "dc", D * B * H, dt, a)
        if call.zoneout_active:                                 # the cell gets mask*dh', the step a zero dy
            b.fill("zoneout_no_dy", "zoneout_no_dy", n)
            zoneout.plan_backward_before(b, dy_l)
            STEP_KERNELS[b.step.version].backward(b, "zoneout_no_dy")
            zoneout.plan_backward_after(b)
        else:
            STEP_KERNELS[b.step.version].backward(b, dy_l)
        b.cast("dh0 out", "dh_in", part("dh0", ps), D * B * P, a, dt)
        if cfg.has_cell_state:
            b.cast("dc0 out", "dc", part("dc0", ps), D * B * H, a, dt)

        # weight gradients and dx as big GEMMs after the time loop; dx_l [T, B, I_l]: returned for layer 0,
        # else the next layer's dy (scratch by parity: layer l reads layer l+1's dx while it writes its own)
        dx_l = "dx" if layer == 0 else f"dx{layer % 2}"
        if "wx" in norm and TB:                                 # back through LN_wx (the raw W x kept), a block per row
            NT = BLOCK_SIM if b.sim else BLOCK_GPU
            b.add("layer_norm_rows_backward (W x)", "layer_norm_rows_backward", (TB, D), NT,
                  (make_layer_norm_rows_backward, cfg.cell, dt, NT),
                  ("dgx", f"saved.wx{layer}", f"norm{layer}", f"saved.lnstat{layer}", "dwx", "dgw"),
                  flops=D * TB * 12 * GH, nbytes=D * TB * 4 * GH * b.sz)
        dwx = "dwx" if "wx" in norm else "dgx"                  # dL/d(W x): dW's and dx's
        for d in range(D):
            p = layer * D + d
            gx2, gh2 = rows(part(dwx, d), TB, GH), rows(part("dgh", d), TB, GH)
            if cfg.has_w(layer):
                b.gemm("dW = dgx^T x", gx2, rows(x_l, TB, I_l), f"dW{p}", GH, I_l, TB, trans_a=True)
                b.gemm("dx += dgx W", gx2, f"W{p}", rows(dx_l, TB, I_l), TB, I_l, GH, beta=0.0 if d == 0 else 1.0)
            if cfg.cell.diagonal:                               # du_g = sum over t, b of dgh_g ⊙ h_prev
                b.add("diagonal_gradient", "diagonal_gradient", (blocks(GH, threads(GH, simulator=b.sim)),),
                      threads(GH, simulator=b.sim), (make_diagonal_gradient, dt),
                      (gh2, rows(part("h_prev", d), TB, P), f"dR{p}"), flops=2 * TB * GH,
                      nbytes=(2 * TB * GH + GH) * b.sz)
            else:
                b.gemm("dR = dgh^T h_prev", gh2, rows(part("h_prev", d), TB, P), f"dR{p}", GH, P, TB, trans_a=True)
            for i, g in enumerate(cfg.cell.gate(name) for name in cfg.cell.modulated):   # their rows again:
                b.gemm("dR_g = dgh_g^T (m ⊙ h_prev), modulated gates", rows(part(part("dgm", d), i), TB, H),
                       rows(part("qs", d), TB, H), part(f"dR{p}", slice(g * H, (g + 1) * H)), H, H, TB,
                       trans_a=True)
            if cfg.has_proj:
                b.gemm("dW_proj = dh^T m", rows(part("dh_total", d), TB, P), rows(part(f"saved.m{layer}", d), TB, H),
                       f"dWp{p}", P, H, TB, trans_a=True)
            dbias = flat(part(f"dunit{layer}", d))              # [(2G+V)*H]: bW, bR, vectors
            if norm:                                            # the biases after the LN: dL/d(wx), dL/d(rh)
                b.column_sums("dbW, dbR", rows(part("dgx", d), TB, GH),
                              rows(part("dgh_pre" if "rh" in norm else "dgh", d), TB, GH),
                              rows(part(dbias, slice(0, 2 * GH)), 2, GH), TB, GH)
                dnorm = flat(part(f"dnorm{layer}", d))          # [NV*H]: the gains (and β_c)
                for what, src, at, width in (("dγ_x", "dgw", OWX, GH), ("dγ_r", "dgr", ORH, GH),
                                             ("dγ_c, dβ_c", "dnc", OC, 2 * H)):
                    if at >= 0 and TB:
                        b.column_sums(what, rows(part(src, d), TB, width), None,
                                      rows(part(dnorm, slice(at * H, at * H + width)), 1, width), TB, width)
            else:
                b.column_sums("dbW, dbR", gx2, gh2, rows(part(dbias, slice(0, 2 * GH)), 2, GH), TB, GH)
            if V and TB:
                b.column_sums("cell vectors", rows(part("dvec", d), TB, V * H), None,
                              rows(part(dbias, slice(2 * GH, None)), 1, V * H), TB, V * H)
        if not cfg.has_w(layer) and TB:                         # skip_input: dx = the sum of the gates' dgx
            b.add("sum_gates (skip_input dx)", "sum_gates", *b.flat_grid(TB * H), (make_sum_gates, dt),
                  (rows(dwx, D, TB, GH), rows(dx_l, TB, H)), flops=D * TB * GH, nbytes=D * TB * GH * b.sz)
        dy_l = dx_l
        if drop:                                                # dropout backward: dy_{l-1} = dx_l * keep * scale
            b.add("apply_mask (dropout backward)", "apply_mask", *b.flat_grid(n), masked,
                  (flat(dx_l), flat(f"saved.keep{layer}"), dropout_args(cfg, layer, T, B, dt)[-1], flat("dy_masked")),
                  flops=n, nbytes=3 * n * b.sz)
            dy_l = "dy_masked"
    return b.entries


# ---------------------------------------------------------------------------------------------------
# the rows of `numbarnn explain`
# ---------------------------------------------------------------------------------------------------

def plan_rows(entries) -> list[dict]:
    """A plan grouped by (phase, layer, label), in order of first launch: phase, layer, kernel, grid, block,
    launches (summed: the directions' GEMMs are one row), flops and bytes (per launch)."""
    out: dict = {}
    for e in entries:
        key = (e.phase, e.layer, e.label)
        row = out.get(key)
        if row is None:
            out[key] = {"phase": e.phase, "layer": e.layer, "kernel": e.label, "grid": e.grid, "block": e.block,
                        "launches": e.launches, "flops": int(e.flops), "bytes": int(e.nbytes)}
        else:
            row["launches"] += e.launches
    return [r for r in out.values() if r["launches"] > 0]


def launch_plan(call, gpu: bool = True, device_reserve: bool = True) -> list[dict]:
    """Every launch forward() and backward() make for `call`, as rows: phase, layer, kernel, grid, block,
    launches, and per-launch estimates of FLOPs and global-memory bytes (compulsory traffic, no cache effects).

    gpu: launch sizes, step kernels and GEMM tiles of a real GPU (True) or of the target this process launches
    for (False: the simulator's here).  device_reserve: a training call's reserve stays on the device (device
    arrays in), so its nonce is written by a launch; False: NumPy in, the nonce is written on the host."""
    simulator = False if gpu else None
    return plan_rows(forward_plan(call, simulator, device_reserve) + backward_plan(call, simulator))

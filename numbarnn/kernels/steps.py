"""Which step kernels a call runs, and each step version's launches in a layer's plan (one table row per version).

    v1   cell_steps.py + recurrent.py: a thread per (unit, row, direction); forward 1 launch per step (+ project
         with a projection), backward 2 (the step, recurrent_backward).  Diagonal, modulated and layer-normalised
         cells run v1 only (modulated.py: the step in two launches, the backward in three; layer_norm.py: a block
         per row).
    v2   step_v2.py: a tiled product that reads R once per step for all rows, the cell in its epilogue; forward
         1 launch per step (+ project), backward 1 fused launch per step + 1 to finish dh0 (with a projection:
         v1's backward step + recurrent_backward_v2).
    v3   step_v3.py: one persistent cooperative launch per layer and phase, R's slice in shared memory for all
         steps, a grid barrier per step; where `step_v3.choose` finds it cannot run, v2 (its note says why).

`step_plan` decides once per call and phase; `STEP_KERNELS[version].forward(b)` / `.backward(b, dy)` append that
version's launches for layer `b.layer` to a plan (kernels/plan.py's Builder: its sizes, target and step plan).
Adding a step version is a module of kernels and one row here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import settings
from . import step_v2, step_v3, target
from .cell_steps import BACKWARD_ARGS, FORWARD_ARGS, make_backward_step, make_forward_step, make_project, used_args
from .common import blocks
from .layer_norm import BLOCK_GPU, BLOCK_SIM, make_layer_norm_backward_step, make_layer_norm_step
from .modulated import (make_modulate, make_modulate_backward, make_modulated_recurrent_backward,
                        make_modulated_step)
from .recurrent import make_recurrent_backward
from ..util import cdiv


@dataclass(frozen=True)
class StepPlan:
    """The step kernels one phase of a call runs: version 1, 2 or 3, v3's slice (None unless 3), v2's tiles (also
    what v2's recurrent product uses beside v1's backward step with a projection), and why (v3: its blocks, or
    why v2 runs instead)."""

    version: int
    slice: object = None
    tiles: object = None
    note: str = ""


#: why a cell with a diagonal recurrence runs the v1 step kernels (the launch log's and `numbarnn explain`'s note)
DIAGONAL_NOTE = ("v1: {cell!r} has a diagonal recurrence (u_g ⊙ h); the v2/v3 step kernels tile a product by a "
                 "matrix R, so v1 runs instead of v{version}")
#: why a layer-normalised cell runs the v1 step kernels (kernels/layer_norm.py)
LAYER_NORM_NOTE = ("v1: {cell!r} layer-normalises its rows ({what}): a reduction across the row inside the step; "
                   "the v2/v3 step kernels have none, so v1 runs instead of v{version}")
#: why a call with zoneout runs the v1 step kernels (kernels/zoneout.py)
ZONEOUT_NOTE = ("v1: zoneout={zoneout} mixes h_prev into each step's h' (kernels/zoneout.py, launched between "
                "v1's step kernels); the v2/v3 step kernels have no such hook, so v1 runs instead of v{version}")
#: why a modulated cell runs the v1 step kernels (kernels/modulated.py)
MODULATED_NOTE = ("v1: {cell!r} modulates the state before a recurrent product (R_g (m ⊙ h)); the v2/v3 step "
                  "kernels make one product per step, so v1 runs instead of v{version}")


def step_version(simulator: bool | None = None) -> int:
    """The step kernels to use: NUMBARNN_STEP_VERSION (one of STEP_VERSIONS) if set, else 3 on a GPU (which
    runs v2 where v3 cannot) and 1 in the simulator (whose tests run every version explicitly).  simulator: as
    this process runs (None) or as given."""
    version = settings.get("step_version")
    if version is None:
        return 1 if target.simulator(simulator) else 3
    return version


@contextlib.contextmanager
def pinned_step_version(version: int | None):
    """The step version `version` inside the block, in this thread (`settings.override`); None: as it is.  The
    profiler and the bench's per-version rows use it."""
    if version is None:
        yield
        return
    if version not in STEP_KERNELS:
        raise ValueError(f"step_version: expected one of {tuple(STEP_KERNELS)}, got {version!r}")
    with settings.override(step_version=version):
        yield


def step_plan(call, phase: str, simulator: bool | None = None) -> StepPlan:
    """The step kernels `phase` ("forward" or "backward") of `call` runs on the current target (or the one
    `simulator` names): `step_version()`, and for 3, v3 where `step_v3.choose` finds its slices fit and its
    blocks co-resident, else v2, saying why."""
    cfg, B, dt = call.config, call.B, np.dtype(call.dtype)
    version, slice_, note = step_version(simulator), None, ""
    if version > 1 and cfg.cell.diagonal:                  # v2 and v3 multiply by a matrix R
        version, note = 1, DIAGONAL_NOTE.format(cell=cfg.rnn_mode, version=version)
    if version > 1 and cfg.cell.modulated:                 # v2 and v3 make one product per step
        version, note = 1, MODULATED_NOTE.format(cell=cfg.rnn_mode, version=version)
    if version > 1 and cfg.cell.layer_norm:                # v2 and v3 reduce no rows
        version, note = 1, LAYER_NORM_NOTE.format(cell=cfg.rnn_mode, what=", ".join(cfg.cell.layer_norm),
                                                  version=version)
    if version > 1 and cfg.zoneout:                        # zoneout's kernels run between v1's
        version, note = 1, ZONEOUT_NOTE.format(zoneout=cfg.zoneout, version=version)
    if version == 3:
        slice_, note = step_v3.choose(cfg.cell, dt, cfg.H, cfg.P, cfg.D, cfg.has_proj, simulator=simulator,
                                      phase=phase, B=B)
        version = 3 if slice_ is not None else 2
    tiles = step_v2.tiles(dt, simulator=simulator, H=cfg.H, B=B, D=cfg.D)   # narrower where the grid is small
    return StepPlan(version, slice_, tiles, note)


# ---------------------------------------------------------------------------------------------------
# the step kernels' arguments by role
# ---------------------------------------------------------------------------------------------------

def roles(b, dy=None) -> dict:
    """Step-kernel argument name -> its role in layer b.layer's plan ("s", "h_in", ... change per step)."""
    layer, D, ps = b.layer, b.D, slice(b.layer * b.D, (b.layer + 1) * b.D)
    first, last = layer * D, layer * D + D - 1
    return dict(s="s", lens="lens", gx="gx", unit_params=f"unit{layer}", R_fwd=f"R{first}", R_rev=f"R{last}",
                Wp_fwd=f"Wp{first}", Wp_rev=f"Wp{last}", h_in="h_in", h_out="h_out", h_a="h_in", h_b="h_out",
                c="c", y=f"saved.y{layer}", acts=f"saved.acts{layer}", cs=f"saved.c{layer}", ms=f"saved.m{layer}",
                mods=f"saved.mod{layer}", gh="gh", q="q", steps=b.steps,
                dy=dy, h0=("part", "h0", ps), c0=("part", "c0", ps) if b.cfg.has_cell_state else None,   # (plan.part)
                dh="dh_in", dh_in="dh_in", dh_out="dh_out", dc="dc", dgx="dgx", dgh="dgh", dvec="dvec",
                h_prev="h_prev", dh_total="dh_total", qs="qs", dgm="dgm",
                norm=f"norm{layer}", lnstat=f"saved.lnstat{layer}", dgh_pre="dgh_pre", dgr="dgr", dnc="dnc",
                rh_raw=f"saved.rh{layer}" if "rh" in b.cfg.cell.layer_norm else
                ("rh_raw" if dy is None else None))


def absent(dtype: str, ndim: int) -> tuple:
    """The role of an argument a call does not have: an empty array of `dtype` and rank `ndim` (driver.resolve)."""
    return ("absent", dtype, ndim)


def absent_roles(b, dy=None) -> dict:
    """The arguments the layer-normalised step kernels take whether or not the cell has them (c, c0, cs, dc
    without a cell state, dvec without vectors, rh_raw where the backward reads no R h), as empty arrays of their
    dtype and rank (`absent`): a kernel on a GPU takes no None (numba-cuda cannot pass one)."""
    cfg, dt, a = b.cfg, b.dts, b.acc
    out = {} if cfg.has_cell_state else dict(c=absent(a, 3), c0=absent(dt, 3), cs=absent(dt, 4), dc=absent(a, 3))
    if not cfg.V:
        out["dvec"] = absent(dt, 4)
    if roles(b, dy)["rh_raw"] is None:
        out["rh_raw"] = absent(dt, 4)
    return out


def by_role(b, names, dy=None, **fixed) -> tuple:
    """The roles of a kernel's argument `names`, in order (`fixed`: literals, e.g. s=-1)."""
    r = dict(roles(b, dy), **fixed)
    return tuple(None if name is None else r[name] for name in names)


def per_step(b, label, name, grid, block, kernel, args, flops, nbytes, swaps=True) -> None:
    """One launch per step of the layer's steps (none without steps or rows); swaps: the state ping-pongs after
    each step (h_in <-> h_out), else it is updated in place."""
    if b.steps and b.B:
        b.add(label, name, grid, block, kernel, args, steps=b.step_range(), each_step=True, swaps=swaps,
              why=b.step.note, flops=flops, nbytes=nbytes)


# ---------------------------------------------------------------------------------------------------
# v1: cell_steps.py, recurrent.py, modulated.py
# ---------------------------------------------------------------------------------------------------

def v1_forward(b) -> None:
    """Per step: the step kernel (a modulated cell: modulate, then modulated_step), then project with a projection."""
    cfg, cell, dt, B, D, H, P, G, GH, sz = b.cfg, b.cfg.cell, b.dts, b.B, b.D, b.H, b.P, b.G, b.GH, b.sz
    grid, block = b.unit_grid(H)
    if cell.layer_norm:                                # a block per row: R h, its LN, the cell, LN of c'
        NT = BLOCK_SIM if b.sim else BLOCK_GPU
        per_step(b, f"{cfg.rnn_mode}_layer_norm_step", "layer_norm_step", (B, D), NT,
                 (make_layer_norm_step, cell, dt, NT),
                 by_role(b, ("s", "lens", "gx", "unit_params", "norm", "R_fwd", "R_rev", "h_in", "h_out", "c", "y",
                             "acts", "cs", "lnstat", "rh_raw"), **absent_roles(b)),
                 D * B * (2 * GH * P + 20 * H + 10 * GH), D * (GH * P + B * (3 * GH + 4 * P + (cell.S + 2) * H)) * sz)
    elif cell.modulated:                               # R_1 h and m ⊙ h; then R_2 (m ⊙ h) and the cell
        GM = len(cell.modulated)
        per_step(b, f"{cfg.rnn_mode}_modulate", "modulate", grid, block, (make_modulate, cell, dt),
                 by_role(b, ("s", "lens", "gx", "unit_params", "R_fwd", "R_rev", "h_in", "gh", "q", "mods")),
                 D * B * (2 * (G - GM) * H * H + 8 * H),
                 D * ((G - GM) * H * H + B * (G * H + 4 * H + (G - GM) * H)) * sz)
        per_step(b, f"{cfg.rnn_mode}_modulated_step", "modulated_step", grid, block, (make_modulated_step, cell, dt),
                 by_role(b, ("s", "lens", "gx", "unit_params", "R_fwd", "R_rev", "h_in", "h_out", "gh", "q", "y",
                             "acts")),
                 D * B * (2 * GM * H * H + 12 * H), D * (GM * H * H + B * (2 * GH + 4 * H + cell.S * H)) * sz)
    else:
        KR = 1 if cell.diagonal else P                 # a recurrent output's inputs: h's P columns, or its own unit
        per_step(b, f"{cfg.rnn_mode}_forward_step", "forward_step", grid, block,
                 (make_forward_step, cell, dt, cfg.has_proj), by_role(b, used_args(FORWARD_ARGS, cell, cfg.has_proj)),
                 D * B * (2 * GH * KR + 12 * H), D * (GH * KR + B * (GH + 2 * P + (G + 2) * H)) * sz)
    project(b)


def project(b) -> None:
    """h' = W_proj m after each step (v1 and v2 with a projection)."""
    if b.cfg.has_proj:
        B, D, H, P = b.B, b.D, b.H, b.P
        per_step(b, "project", "project", *b.unit_grid(P), (make_project, b.dts),
                 by_role(b, ("s", "lens", "ms", "Wp_fwd", "Wp_rev", "h_in", "h_out", "y")),
                 2 * D * B * P * H, D * (P * H + B * (H + 2 * P)) * b.sz)


def v1_backward(b, dy) -> None:
    """Per step, T-1 .. 0: the backward step, [modulate_backward], then dh_prev = dgh R (recurrent_backward)."""
    cfg, cell, dt, B, D, H, P, GH, sz = b.cfg, b.cfg.cell, b.dts, b.B, b.D, b.H, b.P, b.GH, b.sz
    grid, block = b.unit_grid(H)
    if cell.layer_norm:                                # a block per row: output, LN_c', the cell, LN_rh'
        NT = BLOCK_SIM if b.sim else BLOCK_GPU
        per_step(b, f"{cfg.rnn_mode}_layer_norm_backward_step", "layer_norm_backward_step", (B, D), NT,
                 (make_layer_norm_backward_step, cell, dt, NT),
                 by_role(b, ("s", "lens", "dy", "y", "h0", "c0", "acts", "cs", "lnstat", "rh_raw", "unit_params",
                             "norm", "dh_in", "dh_out", "dc", "dgx", "dgh", "dgh_pre", "dgr", "dnc", "dvec", "h_prev"),
                         dy, **absent_roles(b, dy)),
                 D * B * (30 * H + 12 * GH), D * B * (6 * GH + (cell.S + 6) * H) * sz)
    else:
        backward_step(b, dy)
    if cell.modulated:                                 # dL/d(m ⊙ h) = R_2^T dgh_2 into m's gates and h
        GM = len(cell.modulated)
        per_step(b, f"{cfg.rnn_mode}_modulate_backward", "modulate_backward", grid, block,
                 (make_modulate_backward, cell, dt),
                 by_role(b, ("s", "lens", "acts", "unit_params", "R_fwd", "R_rev", "mods", "h_prev", "dgx", "dgh",
                             "dh_out", "qs", "dgm")),
                 D * B * (2 * GM * H * H + 12 * H), D * (GM * H * H + B * (2 * GM * H + 4 * GH + 6 * H)) * sz)
        per_step(b, f"{cfg.rnn_mode}_recurrent_backward", "recurrent_backward", *b.unit_grid(P),
                 (make_modulated_recurrent_backward, cell, dt), recurrent_args(b),   # the unmodulated gates' rows
                 2 * D * B * (GH - GM * H) * P, D * ((GH - GM * H) * P + B * (GH + 2 * P)) * sz)
    else:
        KR = 1 if cell.diagonal else P
        per_step(b, "recurrent_backward", "recurrent_backward", *b.unit_grid(P),
                 (make_recurrent_backward, dt, cell.diagonal), recurrent_args(b),
                 2 * D * B * GH * KR, D * (GH * KR + B * (GH + 2 * P)) * sz)


def backward_step(b, dy) -> None:
    """v1's backward step (v1, and v2 with a projection: the projection's backward fused in)."""
    cfg, B, D, H, P, GH = b.cfg, b.B, b.D, b.H, b.P, b.GH
    per_step(b, f"{cfg.rnn_mode}_backward_step", "backward_step", *b.unit_grid(H),
             (make_backward_step, cfg.cell, b.dts, cfg.has_proj),
             by_role(b, used_args(BACKWARD_ARGS, cfg.cell, cfg.has_proj), dy),
             D * B * (20 * H + (2 * P * H if cfg.has_proj else 0)), D * B * (2 * GH + cfg.cell.S * H + 3 * P) * b.sz)


def recurrent_args(b) -> tuple:
    """dh_out = dgh_s R (+ carried dh_in for finished rows): v1's, the modulated cells' and v2's argument roles."""
    return by_role(b, ("s", "lens", "dgh", "R_fwd", "R_rev", "dh_in", "dh_out"))


# ---------------------------------------------------------------------------------------------------
# v2: step_v2.py
# ---------------------------------------------------------------------------------------------------

def v2_forward(b) -> None:
    """Per step: the tiled step (the product and the cell), then project with a projection."""
    cfg, t, B, D, H, P, G, GH = b.cfg, b.step.tiles, b.B, b.D, b.H, b.P, b.G, b.GH
    row_tiles = cdiv(B, t.TB)                          # v2 reads R once per row tile
    per_step(b, f"{cfg.rnn_mode}_forward_step_v2", "forward_step_v2", step_v2.grid(H, B, D, t), t.threads,
             (step_v2.make_forward_step_v2, cfg.cell, b.dts, cfg.has_proj, t),
             by_role(b, used_args(FORWARD_ARGS, cfg.cell, cfg.has_proj)), D * B * (2 * GH * P + 12 * H),
             D * (row_tiles * GH * P + B * (GH + 2 * P + (G + 2) * H)) * b.sz)
    project(b)


def v2_backward(b, dy) -> None:
    """Per step, T-1 .. 0: one fused launch (+1 for dh0); with a projection v1's step + the tiled dgh R."""
    cfg, t, B, D, H, P, GH, sz = b.cfg, b.step.tiles, b.B, b.D, b.H, b.P, b.GH, b.sz
    row_tiles = cdiv(B, t.TB)
    if cfg.has_proj:                                   # v1's step (the projection's backward), v2's dgh R
        backward_step(b, dy)
        per_step(b, "recurrent_backward_v2", "recurrent_backward_v2", step_v2.grid(P, B, D, t), t.threads,
                 (step_v2.make_recurrent_backward_v2, b.dts, t), recurrent_args(b),
                 2 * D * B * GH * P, D * (row_tiles * GH * P + B * (GH + 2 * P)) * sz)
        return
    # fused: dh in place (one buffer), steps + 1 launches: the last (s = -1) finishes dh0 = direct + dgh_0 R
    label, kernel = f"{cfg.rnn_mode}_backward_step_v2", (step_v2.make_backward_step_v2, cfg.cell, b.dts, t)
    grid, flops = step_v2.grid(H, B, D, t), D * B * (20 * H + 2 * GH * P)
    nbytes = D * (row_tiles * GH * P + B * (3 * GH + cfg.cell.S * H + 3 * P)) * sz
    names = step_v2.backward_v2_args(cfg.cell)
    per_step(b, label, "backward_step_v2", grid, t.threads, kernel, by_role(b, names, dy), flops, nbytes, swaps=False)
    if b.steps and B:
        b.add(label, "backward_step_v2", grid, t.threads, kernel, by_role(b, names, dy, s=-1), why=b.step.note,
              flops=flops, nbytes=nbytes)


# ---------------------------------------------------------------------------------------------------
# v3: step_v3.py (persistent: one launch per layer covers all its steps)
# ---------------------------------------------------------------------------------------------------

def v3_forward(b) -> None:
    """One persistent launch for all the layer's steps."""
    cfg, sl, B, D, H, P, G, GH = b.cfg, b.step.slice, b.B, b.D, b.H, b.P, b.G, b.GH
    proj_flops, proj_bytes = (2 * P * H, P * H) if cfg.has_proj else (0, 0)
    if b.steps and B:                                  # the state ping-pongs inside: odd step counts end in h_out
        b.add(f"{cfg.rnn_mode}_forward_persistent_v3", "forward_persistent_v3", (blocks(H, sl.TJ), 1, D),
              sl.threads, (step_v3.make_forward_persistent_v3, cfg.cell, b.dts, sl, cfg.has_proj),
              by_role(b, used_args(step_v3.PERSISTENT_ARGS, cfg.cell, cfg.has_proj)), steps=b.step_range(),
              swaps=True, why=b.step.note, flops=b.steps * D * B * (2 * GH * P + 12 * H + proj_flops),
              nbytes=D * (GH * P + proj_bytes + b.steps * B * (GH + 2 * P + (G + 2 + cfg.has_proj) * H)) * b.sz)


def v3_backward(b, dy) -> None:
    """One persistent launch for all the layer's steps, dh0 included (+ record_h_prev with a projection)."""
    cfg, sl, B, D, H, P, GH, steps = b.cfg, b.step.slice, b.B, b.D, b.H, b.P, b.GH, b.steps
    proj_flops, proj_bytes = (2 * P * H, P * H) if cfg.has_proj else (0, 0)
    if not (steps and B):
        return
    b.add(f"{cfg.rnn_mode}_backward_persistent_v3", "backward_persistent_v3", (blocks(H, sl.TJ), 1, D), sl.threads,
          (step_v3.make_backward_persistent_v3, cfg.cell, b.dts, sl, cfg.has_proj),
          by_role(b, used_args(step_v3.PERSISTENT_BACKWARD_ARGS, cfg.cell, cfg.has_proj), dy), steps=b.step_range(),
          why=b.step.note, flops=D * B * (steps * (20 * H + proj_flops) + (steps + 1) * 2 * GH * P),
          nbytes=D * (GH * P + proj_bytes + steps * B * (3 * GH + cfg.cell.S * H + (3 + 2 * cfg.has_proj) * P)) * b.sz)
    if cfg.has_proj:                                   # (the persistent projection kernel leaves h_prev out)
        b.add("record_h_prev", "record_h_prev", *b.unit_grid(P), (step_v3.make_record_h_prev, b.dts),
              by_role(b, ("lens", "y", "h0", "h_prev")), steps=b.step_range(), why=b.step.note,
              nbytes=D * steps * B * 2 * P * b.sz)


@dataclass(frozen=True)
class StepKernels:
    """One step version: its title and what it appends to a layer's forward and backward plan."""

    number: int
    title: str
    forward: Callable      # (builder) -> None
    backward: Callable     # (builder, dy role) -> None


STEP_KERNELS = {
    1: StepKernels(1, "a thread per unit and row (cell_steps.py, recurrent.py, modulated.py)", v1_forward, v1_backward),
    2: StepKernels(2, "a tiled product per step, R read once for all rows (step_v2.py)", v2_forward, v2_backward),
    3: StepKernels(3, "one persistent launch per layer, R's slice in shared memory (step_v3.py)", v3_forward,
                   v3_backward),
}

#: step kernel versions the driver can run
STEP_VERSIONS = tuple(STEP_KERNELS)

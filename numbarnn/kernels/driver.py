"""The driver: sequences the kernel launches of a whole network, forward and backward.

It mirrors `numbarnn/reference/network.py` step for step.  Per layer l (both directions in each launch):

    forward                                               launches
      [dropout_forward]  x_l = y_{l-1} * keep * scale     1 per layer (l > 0, training, p > 0)
      gemm v4            gx[d] = x_l @ W_d^T              D per layer (tile_gates for skip_input)
      per step s:        <cell>_forward_step              1 per step: recurrent matvec + cell, both directions
                         [project]                        +1 per step with num_proj
    backward
      per step s (T-1 .. 0):
                         <cell>_backward_step             1 per step (projection fused in for LSTM)
                         recurrent_backward               1 per step: dh_prev = dgh @ R (+ GRU's z*dh)
      gemm v4            dW_d = dgx_d^T x_l, dR_d = dgh_d^T h_prev, dW_proj_d = dh_d^T m_d, dx_l = sum_d dgx_d W_d
      column_sums v2     dbW, dbR ; [cell vectors] (deterministic two-stage: column_partials + column_totals)
      [apply_mask]       dy_{l-1} = dx_l * keep * scale

Step kernels: v1 (`cell_steps.py`: one thread per (row, unit), R re-read by every row) or v2 (`step_v2.py`: a
tiled product that reads R once per step for all rows, the cell in its epilogue; backward one fused launch
per step, +1 to finish dh0; with num_proj v1's backward step + recurrent_backward_v2) or v3 (`step_v3.py`:
the forward of a layer as one persistent launch, when `step_v3.choose` finds that its R slice fits in shared
memory and all its blocks are co-resident (in the widest block that helps for the batch), else v2; its backward
likewise, one persistent launch per layer that keeps the columns of R in shared memory, else v2's; with
num_proj the same single launches, each step in two phases with a grid barrier after each).  `step_version()` picks:
NUMBARNN_STEP_VERSION=1|2|3, else 3 on a GPU (v3 where it can run, v2 where not: faster than v2 at every
shape measured on an H100, bench/results/gpu_h100.md) and 1 in the simulator; the LaunchLog records the
version that ran and, for v3, why (`LaunchLog.note`).

A modulated cell (`CellSpec.modulated`: classic GRU, MGU) runs v1 only, its step in two launches (<cell>_modulate:
R_1 h and m ⊙ h; <cell>_modulated_step: R_2 (m ⊙ h) and the cell) and its backward in three (the backward step,
<cell>_modulate_backward, <cell>_recurrent_backward), plus one GEMM per modulated gate for its rows of dR
(`modulated.py`; `step_plan` gives the note).

Steps run only up to max(len): past it every row just carries its state.  State buffers (h, c, dh, dc)
live in the compute dtype (float32 for half) and are double-buffered where a step reads other units' values.
Arrays here are device arrays, time-major, in the call's dtype; `backend.py` handles NumPy and layouts.
Scratch (gx, the state buffers, the backward's dgx/dgh/h_prev/..., masked copies, an inference call's
reserve) comes from `SCRATCH`, a workspace kept across calls per thread and device (numbarnn/workspace.py),
and the lengths are copied to the device only when they change (`device_lengths`): a call of a shape seen
before allocates only what it returns.  Buffers whose zeros matter are filled per call, as before.  Every
launch goes through `launch.launch`: numba's launch with its per-launch typing and packing of the arguments
done once per argument kind (a step loop passes the same arrays at every step).

Why one file: forward and backward read as the twins of reference/network.py's two loops, and
launch_plan must list exactly the launches they make; keeping the three together keeps them in step.  Which
step kernels a phase runs is decided once, by `step_plan`, for all three.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import contextlib
import math
import threading

import numpy as np
from numba import cuda

from .. import settings
from ..params import param_regions, unpack
from ..workspace import ScratchPool
from ..dropout import dropout_key, dropout_scale, dropout_threshold
from ..reserve import NONCE_SIZE, reserve_size, reserve_views
from ..util import cdiv
from .cell_steps import BACKWARD_ARGS, FORWARD_ARGS, make_backward_step, make_forward_step, make_project, used_args
from . import target
from .common import acc_dtype, blocks, jit, make_cast_copy, make_fill, make_put4, threads
from .gemm import gemm
from .launch import launch
from .layer_ops import (column_sums, column_sums_launches, make_apply_mask, make_dropout_forward, make_sum_gates,
                        make_tile_gates)
from .recurrent import make_diagonal_gradient, make_recurrent_backward
from . import modulated, step_v2, step_v3

#: step kernel versions the driver can run (v1: cell_steps.py + recurrent.py, v2: step_v2.py, v3: step_v3.py,
#: the persistent forward and backward)
STEP_VERSIONS = (1, 2, 3)
STEP_VERSION_VAR = settings.SETTINGS["step_version"][0]


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
    if version not in STEP_VERSIONS:
        raise ValueError(f"step_version: expected one of {STEP_VERSIONS}, got {version!r}")
    with settings.override(step_version=version):
        yield


@dataclass
class LaunchLog:
    """Kernel launches of the last forward/backward call, total and per time step."""

    total: int = 0
    per_step: int = 0          # launches inside one step of the time loop (both directions together)
    steps: int = 0
    by_kernel: dict = field(default_factory=dict)
    step_version: int = 1      # which step kernels ran (1: cell_steps.py, 2: step_v2.py, 3: step_v3.py)
    note: str = ""             # why this version (v3 asked for: chosen or why v2 ran instead)

    def __call__(self, kernel, name, grid, block, *args):
        if min(grid) <= 0 or block <= 0:
            return
        launch(kernel, grid, block, *args)
        self.count(name)

    def count(self, name):
        self.total += 1
        self.by_kernel[name] = self.by_kernel.get(name, 0) + 1


_last: dict = {}


def last_launch_count() -> dict:
    """{"forward": LaunchLog, "backward": LaunchLog} of the last calls (shown by `numbarnn check`)."""
    return dict(_last)


NONCE_KERNEL = "put4 (the reserve's nonce)"


def write_nonce(reserve, nonce) -> None:
    """A training reserve's nonce (`numbarnn.reserve`), written by a launch of one thread (a copy from host
    memory would first wait for the forward's kernels), counted with the last forward's launches."""
    tail = reserve[reserve.shape[0] - NONCE_SIZE:]
    log = _last.get("forward") or LaunchLog()        # no forward in this thread yet: launched, not counted
    log(jit(make_put4, str(np.dtype(tail.dtype))), NONCE_KERNEL, (1,), 1, tail, *map(float, nonce))


def record(phase: str, log: LaunchLog) -> None:
    """Make `log` the last `phase` ("forward"/"backward") call's launches (RNN and BlockLSTM drivers alike)."""
    _last[phase] = log


# ---------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------

def fill(a, value, log: LaunchLog | None = None):
    """Every element of the contiguous device array `a` = value (one launch, recorded in `log` if given;
    nothing to do when `a` is empty)."""
    n = int(np.prod(a.shape, dtype=np.int64))
    if n:
        k, grid, block = jit(make_fill, str(np.dtype(a.dtype))), blocks(n, threads(n, 256)), threads(n, 256)
        if log is None:
            launch(k, grid, block, flat(a), value)
        else:
            log(k, "fill", (grid,), block, flat(a), value)
    return a


def device_zeros(shape, dtype, log: LaunchLog | None = None):
    return fill(cuda.device_array(shape, dtype=dtype), 0.0, log)


#: the driver's workspace (numbarnn/workspace.py): device scratch kept across calls, per thread and device.
#: What a call returns (y, hT, cT, a training reserve, the gradients, dx) is allocated per call; everything
#: else (gx, state buffers, the backward's dgx/dgh/..., an inference call's reserve) comes from here.
SCRATCH = ScratchPool(allocate=lambda n, dtype: cuda.device_array(n, dtype=dtype), fill=fill,
                      where=lambda: cuda.get_current_device().uuid)


scratch = SCRATCH.get


def scratch_zeros(name, shape, dtype, log: LaunchLog | None = None):
    return fill(scratch(name, shape, dtype), 0.0, log)


_lengths = threading.local()


def device_lengths(call):
    """[B] int32 sequence lengths on the device, copied only when they differ from this thread's last call's
    (the kernels only read them)."""
    host = call.lengths_array()
    key = (cuda.get_current_device().uuid, host.tobytes())
    last = getattr(_lengths, "last", None)
    if last is None or last[0] != key:
        last = _lengths.last = (key, cuda.to_device(host))
    return last[1]


def cast_into(src, dst, log: LaunchLog):
    """dst = src converted (same number of elements; both contiguous)."""
    n = int(np.prod(dst.shape, dtype=np.int64))
    if n:
        k = jit(make_cast_copy, str(src.dtype), str(dst.dtype))
        log(k, "cast_copy", (blocks(n, threads(n, 256)),), threads(n, 256), flat(src), flat(dst))


_VIEWS = "_numbarnn_views"      # where a device array keeps the views the driver made of it


def derived(a, key, make):
    """make(a), made once per device array and key and kept on the array: a device array's shape and memory
    never change, and each numba-cuda view costs a DeviceNDArray (~10-20 us of host time on an H100's host;
    a warm host-bound call made ~56 of them).  The arrays a caller passes again (x, the states, params), the
    workspace's (the same objects at every call) and their views are made once."""
    cache = getattr(a, "__dict__", None)
    if cache is None:
        return make(a)
    views = cache.get(_VIEWS)
    if views is None:
        views = cache[_VIEWS] = {}
    view = views.get(key)
    if view is None:
        view = views[key] = make(a)
    return view


def part(a, index):
    """a[index] of a device array (index: an int or a slice).  numba-cuda refuses any view of an array with no
    elements ("non-empty slice into empty slice", seen on an H100 with B = 0; the simulator slices like NumPy),
    so an empty part is a new empty array of the right shape."""
    def make(a):
        shape = np.lib.stride_tricks.as_strided(np.empty(1, np.int8), a.shape, (0,) * a.ndim)[index].shape
        return a[index] if math.prod(shape) else cuda.device_array(shape, dtype=a.dtype)
    key = ("part", (index.start, index.stop, index.step) if isinstance(index, slice) else index)
    return derived(a, key, make)


def flat(a):
    """A contiguous array as 1-D (a view)."""
    return derived(a, "flat", lambda a: a.reshape(int(np.prod(a.shape, dtype=np.int64))))


def rows(a, *shape):
    """a.reshape(*shape) of a contiguous device array (a view, made once per array and shape)."""
    return derived(a, ("reshape", shape), lambda a: a.reshape(*shape))


def _params_views(cfg, params) -> tuple:
    """(unpack(cfg, params), _unit_param_views(cfg, params)), made once per params array and configuration."""
    return derived(params, ("params", cfg, cfg.cell), lambda p: (unpack(cfg, p), _unit_param_views(cfg, p)))


def _unit_param_views(cfg, params):
    """Per layer, the [D, 2G+V, H] view of bW, bR and the cell vectors of both directions (contiguous)."""
    first_bias = {r.p: r.offset for r in reversed(param_regions(cfg)) if r.kind == "bW"}
    K = 2 * cfg.G + cfg.V
    n = cfg.D * K * cfg.H
    return [params[first_bias[layer * cfg.D]:first_bias[layer * cfg.D] + n].reshape(cfg.D, K, cfg.H)
            for layer in range(cfg.L)]


def _cell_kernels(cfg, dtype):
    """The cell's (forward, backward) step kernels and the argument names each takes, in order."""
    key = (cfg.cell, str(dtype), cfg.has_proj)
    return (jit(make_forward_step, *key), used_args(FORWARD_ARGS, cfg.cell, cfg.has_proj),
            jit(make_backward_step, *key), used_args(BACKWARD_ARGS, cfg.cell, cfg.has_proj))


def _dropout_args(cfg, layer, T, B):
    k0, k1 = dropout_key(cfg.seed, cfg.seed2)
    base = (layer - 1) * T * B * cfg.D * cfg.P
    return np.uint64(base), np.uint32(k0), np.uint32(k1), np.uint32(dropout_threshold(cfg.dropout))


# ---------------------------------------------------------------------------------------------------
# which step kernels: one decision for forward(), backward() and launch_plan()
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPlan:
    """The step kernels one phase of a call runs: version 1, 2 or 3, v3's slice (None unless 3), v2's tiles (also
    what v2's recurrent product uses beside v1's backward step with a projection), and why (v3: its blocks, or
    why v2 runs instead)."""

    version: int
    slice: object = None
    tiles: object = None
    note: str = ""


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
    if version == 3:
        slice_, note = step_v3.choose(cfg.cell, dt, cfg.H, cfg.P, cfg.D, cfg.has_proj, simulator=simulator,
                                      phase=phase, B=B)
        version = 3 if slice_ is not None else 2
    tiles = step_v2.tiles(dt, simulator=simulator, H=cfg.H, B=B, D=cfg.D)   # narrower where the grid is small
    return StepPlan(version, slice_, tiles, note)


#: why a cell with a diagonal recurrence runs the v1 step kernels (the launch log's and `numbarnn explain`'s note)
DIAGONAL_NOTE = ("v1: {cell!r} has a diagonal recurrence (u_g ⊙ h); the v2/v3 step kernels tile a product by a "
                 "matrix R, so v1 runs instead of v{version}")
#: why a modulated cell runs the v1 step kernels (kernels/modulated.py)
MODULATED_NOTE = ("v1: {cell!r} modulates the state before a recurrent product (R_g (m ⊙ h)); the v2/v3 step "
                  "kernels make one product per step, so v1 runs instead of v{version}")


# ---------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------

def forward(call, x, h0, c0, params):
    """x [T, B, I], h0 [L*D, B, P], c0 [L*D, B, H] or None, params [N] (device, dtype)
    -> (y [T, B, D*P], hT [L*D, B, P], cT [L*D, B, H] or None, reserve [R])."""
    cfg, T, B, dt = call.config, call.T, call.B, np.dtype(call.dtype)
    H, P, D, G = cfg.H, cfg.P, cfg.D, cfg.G
    a = acc_dtype(dt)
    log = LaunchLog()
    train_call = call if call.is_training else replace(call, is_training=True)
    if call.is_training:
        reserve = device_zeros((reserve_size(train_call),), dt, log)
    else:                                                          # inference: scratch for the kernels
        reserve = scratch_zeros("reserve", (reserve_size(train_call),), dt, log)
    saved = reserve_views(train_call, reserve)
    lens = device_lengths(call)                                    # [B] int32
    steps = max(call.lengths, default=0)
    layers, unit_params = _params_views(cfg, params)
    plan = step_plan(call, "forward")
    version, slice_, tiles, log.note, log.step_version = plan.version, plan.slice, plan.tiles, plan.note, plan.version
    persistent = (jit(step_v3.make_forward_persistent_v3, cfg.cell, str(dt), slice_, cfg.has_proj)
                  if version == 3 else None)
    cell_forward, forward_args, _, _ = _cell_kernels(cfg, dt)
    if version == 2:
        cell_forward = jit(step_v2.make_forward_step_v2, cfg.cell, str(dt), cfg.has_proj, tiles)
        step_grid, step_block, step_name = step_v2.grid(H, B, D, tiles), tiles.threads, "forward_step_v2"
    else:
        step_grid, step_block, step_name = (blocks(H, threads(H)), B, D), threads(H), "forward_step"
    project = jit(make_project, str(dt)) if cfg.has_proj and persistent is None else None
    if cfg.cell.modulated:                                         # two products per step (kernels/modulated.py)
        modulate = jit(modulated.make_modulate, cfg.cell, str(dt))
        cell_forward = jit(modulated.make_modulated_step, cfg.cell, str(dt))
        step_name = "modulated_step"
    scale = a.type(dropout_scale(cfg.dropout))
    hT = cuda.device_array((cfg.L * D, B, P), dtype=dt)            # [L*D, B, P]
    cT = cuda.device_array((cfg.L * D, B, H), dtype=dt) if cfg.has_cell_state else None

    x_l = x                                                        # [T, B, I_l]
    for layer in range(cfg.L):
        ps = slice(layer * D, (layer + 1) * D)
        if layer > 0 and call.dropout_active:
            x_drop = scratch("x_drop", (T, B, D * P), dt)
            n = T * B * D * P
            log(jit(make_dropout_forward, str(dt)), "dropout_forward", (blocks(n, threads(n, 256)),),
                threads(n, 256), flat(x_l), *_dropout_args(cfg, layer, T, B), scale,
                flat(saved[f"keep{layer}"]), flat(x_drop))
            x_l = x_drop
        I_l = cfg.layer_input_size(layer)
        gx = scratch("gx", (D, T, B, G * H), dt)                   # [D, T, B, G*H] W x for all steps
        for d in range(D):
            lp = layers[layer * D + d]
            if T * B == 0:
                break
            if lp.W is not None:
                gemm(rows(x_l, T * B, I_l), lp.W, rows(part(gx, d), T * B, G * H), trans_b=True, log=log,
                     scratch=scratch)
            else:
                n = T * B * G * H
                log(jit(make_tile_gates, str(dt)), "tile_gates", (blocks(n, threads(n, 256)),), threads(n, 256),
                    rows(x_l, T * B, H), rows(part(gx, d), T * B, G * H))
        h_in = scratch("h_a", (D, B, P), a)                        # [D, B, P] state, double-buffered
        h_out = scratch("h_b", (D, B, P), a)
        cast_into(part(h0, ps), h_in, log)
        c = scratch("c", (D, B, H), a) if cfg.has_cell_state else None   # [D, B, H] in place
        if c is not None:
            cast_into(part(c0, ps), c, log)
        y_l = saved[f"y{layer}"]                                   # [T, B, D*P] (zeros past the lengths)
        args = dict(lens=lens, gx=gx, unit_params=unit_params[layer], R_fwd=layers[layer * D].R,
                    R_rev=layers[layer * D + D - 1].R, c=c, y=y_l, acts=saved[f"acts{layer}"],
                    cs=saved.get(f"c{layer}"), ms=saved.get(f"m{layer}"))
        log.steps, before = steps, log.total
        if persistent is not None and steps:                      # v3: one launch for all steps
            v3_args = dict(args, steps=steps, h_a=h_in, h_b=h_out, Wp_fwd=layers[layer * D].W_proj,
                           Wp_rev=layers[layer * D + D - 1].W_proj)
            log(persistent, "forward_persistent_v3", (blocks(H, slice_.TJ), 1, D), slice_.threads,
                *[v3_args[name] for name in used_args(step_v3.PERSISTENT_ARGS, cfg.cell, cfg.has_proj)])
            if steps % 2:                                          # h ping-pongs: odd step counts end in h_out
                h_in, h_out = h_out, h_in
        if cfg.cell.modulated:
            args.update(gh=scratch("gh", (D, B, G * H), a), q=scratch("q", (D, B, H), a),
                        mods=saved[f"mod{layer}"])
            forward_args = ("s", "lens", "gx", "unit_params", "R_fwd", "R_rev", "h_in", "h_out", "gh", "q", "y",
                            "acts")
        for s in range(steps if persistent is None else 0):
            args.update(s=s, h_in=h_in, h_out=h_out)
            if cfg.cell.modulated:                                 # R_1 h and m ⊙ h, before the step's R_2 q
                log(modulate, "modulate", step_grid, step_block,
                    *[args[name] for name in ("s", "lens", "gx", "unit_params", "R_fwd", "R_rev", "h_in", "gh", "q",
                                              "mods")])
            log(cell_forward, step_name, step_grid, step_block, *[args[name] for name in forward_args])
            if project is not None:
                log(project, "project", (blocks(P, threads(P)), B, D), threads(P),
                    s, lens, args["ms"], layers[layer * D].W_proj, layers[layer * D + D - 1].W_proj, h_in, h_out, y_l)
            h_in, h_out = h_out, h_in
        if steps:
            log.per_step = 0 if persistent is not None else (log.total - before) // steps
        cast_into(h_in, part(hT, ps), log)
        if cfg.has_cell_state:
            cast_into(c, part(cT, ps), log)
        x_l = y_l
    y = cuda.device_array((T, B, D * P), dtype=dt)
    if y.size:
        y.copy_to_device(x_l)
    record("forward", log)
    if not call.is_training:
        reserve = cuda.device_array((0,), dtype=dt)
    return y, hT, cT, reserve


# ---------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------

def backward(call, x, h0, c0, params, dy, dhT, dcT, reserve):
    """Device arrays, time-major: -> (dx [T, B, I], dh0 [L*D, B, P], dc0 [L*D, B, H] or None, dparams [N])."""
    cfg, T, B, dt = call.config, call.T, call.B, np.dtype(call.dtype)
    H, P, D, G = cfg.H, cfg.P, cfg.D, cfg.G
    a = acc_dtype(dt)
    TB, GH = T * B, G * H
    log = LaunchLog()
    saved = reserve_views(call, reserve)
    lens = device_lengths(call)
    steps = max(call.lengths, default=0)
    (layers, unit_params), dparams = _params_views(cfg, params), device_zeros((params.shape[0],), dt, log)
    dlayers, dunit_params = unpack(cfg, dparams), _unit_param_views(cfg, dparams)
    _, _, cell_backward, backward_args = _cell_kernels(cfg, dt)
    plan = step_plan(call, "backward")
    version, slice_, tiles, log.note, log.step_version = plan.version, plan.slice, plan.tiles, plan.note, plan.version
    persistent = (jit(step_v3.make_backward_persistent_v3, cfg.cell, str(dt), slice_, cfg.has_proj)
                  if version == 3 else None)
    fused = version in (2, 3) and not cfg.has_proj     # v2: one launch per step (+1 to finish dh0); v3: one
    if version == 2:
        recurrent = jit(step_v2.make_recurrent_backward_v2, str(dt), tiles)   # v2 with a projection
    elif cfg.cell.modulated:                            # the unmodulated gates' dgh @ R (kernels/modulated.py)
        recurrent = jit(modulated.make_modulated_recurrent_backward, cfg.cell, str(dt))
        modulate_backward = jit(modulated.make_modulate_backward, cfg.cell, str(dt))
    else:
        recurrent = jit(make_recurrent_backward, str(dt), cfg.cell.diagonal)
    if fused:
        cell_backward = jit(step_v2.make_backward_step_v2, cfg.cell, str(dt), tiles)
        backward_args = step_v2.backward_v2_args(cfg.cell)
    scale = a.type(dropout_scale(cfg.dropout))
    dh0 = cuda.device_array((cfg.L * D, B, P), dtype=dt)
    dc0 = cuda.device_array((cfg.L * D, B, H), dtype=dt) if cfg.has_cell_state else None
    V = cfg.V

    def masked(src, layer, name):
        """src * keep_layer * scale into scratch `name` (dropout backward, and x_l for dW)."""
        out = scratch(name, src.shape, dt)
        n = int(np.prod(src.shape, dtype=np.int64))
        log(jit(make_apply_mask, str(dt)), "apply_mask", (blocks(n, threads(n, 256)),), threads(n, 256),
            flat(src), flat(saved[f"keep{layer}"]), scale, flat(out))
        return out

    dy_l = dy                                                      # [T, B, D*P]
    dx_l = None
    for layer in reversed(range(cfg.L)):
        ps = slice(layer * D, (layer + 1) * D)
        I_l = cfg.layer_input_size(layer)
        if layer == 0:
            x_l = x
        else:
            x_l = (masked(saved[f"y{layer - 1}"], layer, "x_masked") if call.dropout_active
                   else saved[f"y{layer - 1}"])
        dgx = scratch_zeros("dgx", (D, T, B, GH), dt, log)         # [D, T, B, G*H] zeros at padded steps
        dgh = scratch_zeros("dgh", (D, T, B, GH), dt, log)         # [D, T, B, G*H]
        dvec = scratch_zeros("dvec", (D, T, B, V * H), dt, log) if V else None   # [D, T, B, V*H]
        h_prev = scratch_zeros("h_prev", (D, T, B, P), dt, log)    # [D, T, B, P]
        dh_total = scratch_zeros("dh_total", (D, T, B, P), dt, log) if cfg.has_proj else None
        if cfg.cell.modulated:                         # m ⊙ h_prev and the modulated gates' dgh, for their dR
            GM = len(cfg.cell.modulated)
            qs = scratch_zeros("qs", (D, T, B, H), dt, log)            # [D, T, B, H]
            dgm = scratch_zeros("dgm", (D, GM, T, B, H), dt, log)      # [D, GM, T, B, H]
        dh_in = scratch("dh_a", (D, B, P), a)
        dh_out = scratch("dh_b", (D, B, P), a)
        cast_into(part(dhT, ps), dh_in, log)
        dc = scratch("dc", (D, B, H), a) if cfg.has_cell_state else None
        if dc is not None:
            cast_into(part(dcT, ps), dc, log)
        lp_f, lp_r = layers[layer * D], layers[layer * D + D - 1]
        args = dict(lens=lens, dy=dy_l, y=saved[f"y{layer}"], h0=part(h0, ps),
                    c0=part(c0, ps) if dc is not None else None,
                    acts=saved[f"acts{layer}"], cs=saved.get(f"c{layer}"), unit_params=unit_params[layer],
                    Wp_fwd=lp_f.W_proj, Wp_rev=lp_r.W_proj, dc=dc, dgx=dgx, dgh=dgh, dvec=dvec, h_prev=h_prev,
                    dh_total=dh_total)
        log.steps, before = steps, log.total
        if persistent is not None and steps:           # v3: one launch for all steps, dh0 included
            args.update(R_fwd=lp_f.R, R_rev=lp_r.R, dh=dh_in, steps=steps)
            log(persistent, "backward_persistent_v3", (blocks(H, slice_.TJ), 1, D), slice_.threads,
                *[args[name] for name in used_args(step_v3.PERSISTENT_BACKWARD_ARGS, cfg.cell, cfg.has_proj)])
            if cfg.has_proj:                           # (the persistent projection kernel leaves h_prev out)
                log(jit(step_v3.make_record_h_prev, str(dt)), "record_h_prev", (blocks(P, threads(P)), B, D),
                    threads(P), lens, args["y"], args["h0"], h_prev)
            log.per_step = 0
        elif fused:                                    # dh in place: dh_in is the one buffer
            args.update(R_fwd=lp_f.R, R_rev=lp_r.R, dh=dh_in)
            for s in reversed(range(steps)):
                args.update(s=s)
                log(cell_backward, "backward_step_v2", step_v2.grid(H, B, D, tiles), tiles.threads,
                    *[args[name] for name in backward_args])
            if steps:
                log.per_step = (log.total - before) // steps
                args.update(s=-1)                      # finish dh0 = direct + dgh_0 R (rows with len > 0)
                log(cell_backward, "backward_step_v2", step_v2.grid(H, B, D, tiles), tiles.threads,
                    *[args[name] for name in backward_args])
        for s in reversed(range(steps if not fused and persistent is None else 0)):
            args.update(s=s, dh_in=dh_in, dh_out=dh_out)
            log(cell_backward, "backward_step", (blocks(H, threads(H)), B, D), threads(H),
                *[args[name] for name in backward_args])
            if cfg.cell.modulated:                     # dL/d(m ⊙ h) into m's gates and h
                log(modulate_backward, "modulate_backward", (blocks(H, threads(H)), B, D), threads(H), s, lens,
                    args["acts"], unit_params[layer], lp_f.R, lp_r.R, saved[f"mod{layer}"], h_prev, dgx, dgh,
                    dh_out, qs, dgm)
            if version == 2:
                log(recurrent, "recurrent_backward_v2", step_v2.grid(P, B, D, tiles), tiles.threads,
                    s, lens, dgh, lp_f.R, lp_r.R, dh_in, dh_out)
            else:
                log(recurrent, "recurrent_backward", (blocks(P, threads(P)), B, D), threads(P),
                    s, lens, dgh, lp_f.R, lp_r.R, dh_in, dh_out)
            dh_in, dh_out = dh_out, dh_in
        if steps and not fused and persistent is None:
            log.per_step = (log.total - before) // steps
        cast_into(dh_in, part(dh0, ps), log)
        if cfg.has_cell_state:
            cast_into(dc, part(dc0, ps), log)

        # weight gradients and dx as big GEMMs after the time loop
        # [T, B, I_l]: returned for layer 0; else the next layer's dy (scratch named by parity: layer l reads
        # dy_l, layer l+1's dx, while it writes its own)
        dx_l = (cuda.device_array((T, B, I_l), dtype=dt) if layer == 0
                else scratch(f"dx{layer % 2}", (T, B, I_l), dt))
        for d in range(D):
            p = layer * D + d
            lp, dlp = layers[p], dlayers[p]
            gx2, gh2 = rows(part(dgx, d), TB, GH), rows(part(dgh, d), TB, GH)
            if lp.W is not None:
                gemm(gx2, rows(x_l, TB, I_l), dlp.W, trans_a=True, log=log, scratch=scratch)
                gemm(gx2, lp.W, dx_l.reshape(TB, I_l), beta=0.0 if d == 0 else 1.0, log=log, scratch=scratch)
            if cfg.cell.diagonal:                      # du_g = sum over t, b of dgh_g ⊙ h_prev (recurrent.py)
                log(jit(make_diagonal_gradient, str(dt)), "diagonal_gradient", (blocks(GH, threads(GH)),),
                    threads(GH), gh2, rows(part(h_prev, d), TB, P), dlp.R)
            else:
                gemm(gh2, rows(part(h_prev, d), TB, P), dlp.R, trans_a=True, log=log, scratch=scratch)
            for i, g in enumerate(cfg.cell.gate(name) for name in cfg.cell.modulated):   # their rows again:
                dR_g = part(dlp.R, slice(g * H, (g + 1) * H))                            # dgh_g^T (m ⊙ h_prev)
                gemm(rows(part(part(dgm, d), i), TB, H), rows(part(qs, d), TB, H), dR_g, trans_a=True, log=log,
                     scratch=scratch)
            if cfg.has_proj:
                gemm(part(dh_total, d).reshape(TB, P), part(saved[f"m{layer}"], d).reshape(TB, H), dlp.W_proj,
                     trans_a=True, log=log, scratch=scratch)
            dbias = dunit_params[layer][d].reshape(-1)              # [(2G+V)*H]: bW, bR, vectors
            column_sums(log, gx2, gh2, dbias[:2 * GH].reshape(2, GH), scratch)
            if V and TB:
                column_sums(log, part(dvec, d).reshape(TB, V * H), None, dbias[2 * GH:].reshape(1, V * H), scratch)
        if layers[layer * D].W is None and TB:
            n = TB * H
            log(jit(make_sum_gates, str(dt)), "sum_gates", (blocks(n, threads(n, 256)),), threads(n, 256),
                dgx.reshape(D, TB, GH), dx_l.reshape(TB, H))
        if layer > 0:
            dy_l = masked(dx_l, layer, "dy_masked") if call.dropout_active else dx_l
    record("backward", log)
    return dx_l, dh0, dc0, dparams


# ---------------------------------------------------------------------------------------------------
# the launch plan (the teaching view of `numbarnn explain`); tests check it against LaunchLog
# ---------------------------------------------------------------------------------------------------

def launch_plan(call, gpu: bool = True, device_reserve: bool = True) -> list[dict]:
    """Every launch forward() and backward() make for `call`, grouped: phase, layer, kernel, grid, block,
    launches, and per-launch estimates of FLOPs and global-memory bytes (compulsory traffic, no cache effects).

    gpu: launch sizes as on a real GPU (True) or as this process launches them (False: simulator sizes here).
    device_reserve: a training call's reserve stays on the device (device arrays in), so its nonce is written by
    a launch (`write_nonce`); False: NumPy arrays in, the reserve comes back and the nonce is written on the host.
    GEMM grids come from the GEMM launcher's tiles; the step kernels are step_version(simulator=not gpu)'s.
    """
    from .gemm import DEFAULT_VERSION, VERSIONS, auto_split_k
    sim = None if not gpu else False
    v_gemm = VERSIONS[DEFAULT_VERSION]
    gemm_cfg = v_gemm.gpu_config if gpu else v_gemm.default_config()
    cfg, T, B = call.config, call.T, call.B
    H, P, D, G, L = cfg.H, cfg.P, cfg.D, cfg.G, cfg.L
    sz = np.dtype(call.dtype).itemsize
    fplan, bplan = step_plan(call, "forward", not gpu), step_plan(call, "backward", not gpu)   # as they decide
    slice_, bslice, tiles = fplan.slice, bplan.slice, fplan.tiles
    version = min(fplan.version, 2)                                # v1, else v2 where v3's slices are None
    row_tiles = cdiv(B, tiles.TB)                                  # v2 reads R once per row tile
    steps = max(call.lengths, default=0)
    TB, GH = T * B, G * H
    proj_flops, proj_bytes = (2 * P * H, P * H) if cfg.has_proj else (0, 0)   # h' = W_proj m: per row, step; W_proj
    KR = 1 if cfg.cell.diagonal else P            # a recurrent output's inputs: h's P columns, or its own unit
    GM = len(cfg.cell.modulated)                  # a modulated cell's gates whose product is by m ⊙ h
    rows = []

    layer = None

    def add(phase, kernel, launches, grid=None, block=None, flops=0, nbytes=0):
        if launches > 0:
            rows.append({"phase": phase, "layer": layer, "kernel": kernel, "grid": grid, "block": block,
                         "launches": int(launches), "flops": int(flops), "bytes": int(nbytes)})

    def flat(n):
        t = threads(n, 256, simulator=sim)
        return (blocks(n, t),), t

    def gemm_row(phase, what, launches, M, N, K):
        split = auto_split_k(DEFAULT_VERSION, np.dtype(call.dtype), False, M, N, K, gemm_cfg, simulator=not gpu)
        grid, block = v_gemm.launch(M, N, split, gemm_cfg)
        add(phase, f"gemm v{DEFAULT_VERSION} ({what})" + (f", split-K {split}" if split > 1 else ""), launches,
            tuple(grid), int(np.prod(block)), 2 * M * N * K, (M * K + K * N + split * M * N) * sz)
        if split > 1:                                  # stage 2: read the partials, read C (beta) and write it
            add(phase, f"split_k_sum ({what})", launches, *flat(M * N), split * M * N, (split + 2) * M * N * sz)

    def steps_grid(n):
        t = threads(n, simulator=sim)
        return (blocks(n, t), B, D), t

    def cast_rows(phase, what_h, what_c):
        for n, what in ((D * B * P, what_h), (D * B * H if cfg.has_cell_state else 0, what_c)):
            add(phase, f"cast_copy ({what})", int(n > 0), *flat(n), 0, 2 * n * sz)

    cell = cfg.rnn_mode
    train = replace(call, is_training=True)
    add("forward", "fill (reserve = 0)", 1 if reserve_size(train) else 0, *flat(reserve_size(train)),
        0, reserve_size(train) * sz)
    for layer in range(L):
        I_l = cfg.layer_input_size(layer)
        n = T * B * D * P
        add("forward", "dropout_forward", int(layer > 0 and call.dropout_active and n > 0), *flat(n), 0, 3 * n * sz)
        if TB:
            if cfg.has_w(layer):
                gemm_row("forward", "gx = x W^T, all steps", D, TB, GH, I_l)
            else:
                add("forward", "tile_gates", D, *flat(TB * GH), 0, TB * (GH + H) * sz)
        cast_rows("forward", "h0 in", "c0 in")
        grid, block = steps_grid(H)
        if slice_ is not None:                         # persistent (a projection: phase B per step too)
            add("forward", f"{cell}_forward_persistent_v3", int(steps > 0 and B > 0),
                (blocks(H, slice_.TJ), 1, D), slice_.threads, steps * D * B * (2 * GH * P + 12 * H + proj_flops),
                D * (GH * P + proj_bytes + steps * B * (GH + 2 * P + (G + 2 + cfg.has_proj) * H)) * sz)
        elif version == 2:
            add("forward", f"{cell}_forward_step_v2", steps if B else 0, step_v2.grid(H, B, D, tiles),
                tiles.threads, D * B * (2 * GH * P + 12 * H),
                D * (row_tiles * GH * P + B * (GH + 2 * P + (G + 2) * H)) * sz)
        elif GM:                                       # the unmodulated gates' product, m; then R_2 (m ⊙ h), the cell
            add("forward", f"{cell}_modulate", steps if B else 0, grid, block, D * B * (2 * (G - GM) * H * H + 8 * H),
                D * ((G - GM) * H * H + B * (G * H + 4 * H + (G - GM) * H)) * sz)
            add("forward", f"{cell}_modulated_step", steps if B else 0, grid, block, D * B * (2 * GM * H * H + 12 * H),
                D * (GM * H * H + B * (2 * GH + 4 * H + cfg.cell.S * H)) * sz)
        else:
            add("forward", f"{cell}_forward_step", steps if B else 0, grid, block,
                D * B * (2 * GH * KR + 12 * H), D * (GH * KR + B * (GH + 2 * P + (G + 2) * H)) * sz)
        if cfg.has_proj and slice_ is None:
            grid, block = steps_grid(P)
            add("forward", "project", steps if B else 0, grid, block, 2 * D * B * P * H,
                D * (P * H + B * (H + 2 * P)) * sz)
        cast_rows("forward", "hT out", "cT out")
    layer = None
    add("forward", NONCE_KERNEL, int(call.is_training and device_reserve), (1,), 1, 0, NONCE_SIZE * sz)   # by ops
    n_params = sum(r.size for r in param_regions(cfg))
    add("backward", "fill (dparams = 0)", 1, *flat(n_params), 0, n_params * sz)
    for layer in reversed(range(L)):
        I_l = cfg.layer_input_size(layer)
        n = T * B * D * P
        drop = layer > 0 and call.dropout_active and n > 0
        add("backward", "apply_mask (x_l for dW)", int(drop), *flat(n), n, 3 * n * sz)
        for n, what in ((D * TB * GH, "dgx"), (D * TB * GH, "dgh"), (D * TB * cfg.V * H, "dvec"),
                        (D * TB * P, "h_prev"), (D * TB * P * cfg.has_proj, "dh_total"), (D * TB * H * bool(GM), "qs"),
                        (D * GM * TB * H, "dgm")):
            add("backward", f"fill ({what} = 0)", int(n > 0), *flat(n), 0, n * sz)
        cast_rows("backward", "dhT in", "dcT in")
        grid, block = steps_grid(H)
        if bslice is not None:                         # persistent: one launch, steps + 1 products (dh0)
            add("backward", f"{cell}_backward_persistent_v3", int(steps > 0 and B > 0),
                (blocks(H, bslice.TJ), 1, D), bslice.threads,
                D * B * (steps * (20 * H + proj_flops) + (steps + 1) * 2 * GH * P),
                D * (GH * P + proj_bytes + steps * B * (3 * GH + cfg.cell.S * H + (3 + 2 * cfg.has_proj) * P)) * sz)
            add("backward", "record_h_prev", int(steps > 0 and B > 0 and cfg.has_proj), *steps_grid(P), 0,
                D * steps * B * 2 * P * sz)
        elif version == 2 and not cfg.has_proj:        # fused: steps + 1 launches (the last finishes dh0)
            add("backward", f"{cell}_backward_step_v2", steps + 1 if B and steps else 0,
                step_v2.grid(H, B, D, tiles), tiles.threads, D * B * (20 * H + 2 * GH * P),
                D * (row_tiles * GH * P + B * (3 * GH + cfg.cell.S * H + 3 * P)) * sz)
        else:
            add("backward", f"{cell}_backward_step", steps if B else 0, grid, block,
                D * B * (20 * H + (2 * P * H if cfg.has_proj else 0)),
                D * B * (2 * GH + cfg.cell.S * H + 3 * P) * sz)
        if GM:                                         # dL/d(m ⊙ h) = R_2^T dgh_2 into m's gates and h
            add("backward", f"{cell}_modulate_backward", steps if B else 0, grid, block,
                D * B * (2 * GM * H * H + 12 * H), D * (GM * H * H + B * (2 * GM * H + 4 * GH + 6 * H)) * sz)
        grid, block = steps_grid(P)
        if version == 2 and cfg.has_proj and bslice is None:
            add("backward", "recurrent_backward_v2", steps if B else 0, step_v2.grid(P, B, D, tiles),
                tiles.threads, 2 * D * B * GH * P, D * (row_tiles * GH * P + B * (GH + 2 * P)) * sz)
        elif version == 1 and GM:                      # the unmodulated gates' rows only
            add("backward", f"{cell}_recurrent_backward", steps if B else 0, grid, block, 2 * D * B * (GH - GM * H) * P,
                D * ((GH - GM * H) * P + B * (GH + 2 * P)) * sz)
        elif version == 1:
            add("backward", "recurrent_backward", steps if B else 0, grid, block, 2 * D * B * GH * KR,
                D * (GH * KR + B * (GH + 2 * P)) * sz)
        cast_rows("backward", "dh0 out", "dc0 out")

        if cfg.has_w(layer):
            gemm_row("backward", "dW = dgx^T x", D, GH, I_l, TB)
            gemm_row("backward", "dx += dgx W", D, TB, I_l, GH)
        if cfg.cell.diagonal:
            add("backward", "diagonal_gradient", D, (blocks(GH, threads(GH, simulator=sim)),),
                threads(GH, simulator=sim), 2 * TB * GH, (2 * TB * GH + GH) * sz)
        else:
            gemm_row("backward", "dR = dgh^T h_prev", D, GH, P, TB)
        if GM:                                         # the modulated gates' rows again, by m ⊙ h_prev
            gemm_row("backward", "dR_g = dgh_g^T (m ⊙ h_prev), modulated gates", D * GM, H, H, TB)
        if cfg.has_proj:
            gemm_row("backward", "dW_proj = dh^T m", D, P, H, TB)
        for S, C, what, n in ((2, GH, "dbW, dbR", D), (1, cfg.V * H, "cell vectors", D if cfg.V and TB else 0)):
            (_, grid1, block1), (_, grid2, block2) = column_sums_launches(TB, C, S, simulator=sim)
            add("backward", f"column_partials ({what})", n, grid1, block1, S * TB * C, S * (TB + grid1[1]) * C * sz)
            add("backward", f"column_totals ({what})", n, grid2, block2, S * grid1[1] * C, S * (grid1[1] + 1) * C * sz)
        add("backward", "sum_gates (skip_input dx)", int(not cfg.has_w(layer) and TB > 0), *flat(TB * H),
            D * TB * GH, D * TB * GH * sz)
        add("backward", "apply_mask (dropout backward)", int(drop), *flat(n), n, 3 * n * sz)
    return rows

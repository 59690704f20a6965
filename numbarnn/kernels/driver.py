"""The driver: runs a call's launch plan (kernels/plan.py) on the device, forward and backward.

For one call the plan lists every launch, in order, for this process's target; the driver allocates the buffers
the plan names by role, then runs the list (`execute`):

    forward     [dropout_forward], gx = x_l W^T, h0 (c0) cast in, the step launches, hT (cT) cast out   per layer
    backward    [apply_mask], zeroed scratch, dhT cast in, the steps T-1 .. 0, dh0 cast out, dW / dx / dR GEMMs,
                bias column sums, [sum_gates], [apply_mask]                                           per layer

A per-step entry runs once per step of its range, interleaved with the other per-step entries of that range (a
step's kernels in order); the step state (h, or dh) is double-buffered and swapped after each step where a step
reads other units' values.  Which step kernels run is `steps.step_plan`'s decision, recorded with the launches
in the LaunchLog (version, why).  `launch_plan` lists the same plan's rows, so what `numbarnn explain` shows is
what runs.

Steps run only up to max(len): past it every row just carries its state.  State buffers (h, c, dh, dc) live in
the compute dtype (float32 for half).  Arrays here are device arrays, time-major, in the call's dtype;
`backend.py` handles NumPy and layouts.  Scratch (gx, the state buffers, the backward's dgx/dgh/h_prev/...,
masked copies, an inference call's reserve) comes from `SCRATCH`, a workspace kept across calls per thread and
device (numbarnn/workspace.py), and the lengths are copied to the device only when they change
(`device_lengths`): a call of a shape seen before allocates only what it returns.  Buffers whose zeros matter
are filled by the plan, per call.  Every launch goes through `launch.launch`: numba's launch with its
per-launch typing and packing of the arguments done once per argument kind (a step loop passes the same arrays
at every step).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import functools
import math
import threading

import numpy as np
from numba import cuda

from .. import settings
from ..params import param_regions, unpack
from ..workspace import ScratchPool
from ..reserve import NONCE_SIZE, reserve_size, reserve_views
from .common import acc_dtype, blocks, jit, make_cast_copy, make_fill, make_put4, threads
from . import gemm as gemm_module
from . import target
from .gemm import gemm
from .launch import launch
from .layer_ops import column_sums
from .plan import NONCE_KERNEL, Run, backward_plan, forward_plan, launch_plan, plan_rows  # noqa: F401 (re-exported)
from .steps import (DIAGONAL_NOTE, MODULATED_NOTE, STEP_VERSIONS, StepPlan, pinned_step_version,  # noqa: F401
                    step_plan, step_version)

STEP_VERSION_VAR = settings.SETTINGS["step_version"][0]


@dataclass
class LaunchLog:
    """Kernel launches of the last forward/backward call, total and per time step, and the plan they ran."""

    total: int = 0
    per_step: int = 0          # launches inside one step of the time loop (both directions together)
    steps: int = 0
    by_kernel: dict = field(default_factory=dict)
    step_version: int = 1      # which step kernels ran (1: cell_steps.py, 2: step_v2.py, 3: step_v3.py)
    note: str = ""             # why this version (v3 asked for: chosen or why v2 ran instead)
    plan: tuple = ()           # the plan's entries that were executed (kernels/plan.py), RNN calls only

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


def write_nonce(reserve, nonce) -> None:
    """A training reserve's nonce (`numbarnn.reserve`), written by a launch of one thread (a copy from host
    memory would first wait for the forward's kernels), counted with the last forward's launches (the plan's
    last forward entry when the reserve stays on the device)."""
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
    """dst = src converted (same number of elements; both contiguous; the BlockLSTM driver's)."""
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


def _param_roles(cfg, params, prefix: str = "") -> dict:
    """Role -> view of `params` [N]: W{p}, R{p}, Wp{p} per pseudo-layer p (None where absent), unit{l}
    [D, 2G+V, H] per layer; prefix "d" for the gradients.  Made once per params array and configuration."""
    def make(p):
        roles = {}
        for i, lp in enumerate(unpack(cfg, p)):
            roles.update({f"{prefix}W{i}": lp.W, f"{prefix}R{i}": lp.R, f"{prefix}Wp{i}": lp.W_proj})
        for layer, unit in enumerate(_unit_param_views(cfg, p)):
            roles[f"{prefix}unit{layer}"] = unit
        for layer, norm in enumerate(_norm_views(cfg, p)):
            roles[f"{prefix}norm{layer}"] = norm
        return roles
    return derived(params, ("roles", cfg, cfg.cell, prefix), make)


def _unit_param_views(cfg, params):
    """Per layer, the [D, 2G+V, H] view of bW, bR and the cell vectors of both directions (contiguous)."""
    first_bias = {r.p: r.offset for r in reversed(param_regions(cfg)) if r.kind == "bW"}
    K = 2 * cfg.G + cfg.V
    n = cfg.D * K * cfg.H
    return [params[first_bias[layer * cfg.D]:first_bias[layer * cfg.D] + n].reshape(cfg.D, K, cfg.H)
            for layer in range(cfg.L)]


def _norm_views(cfg, params):
    """Per layer, the [D, NV, H] view of both directions' normalisation vectors (SPEC 13; none without)."""
    if not cfg.cell.NV:
        return []
    first = {r.p: r.offset for r in reversed(param_regions(cfg)) if r.kind == "N"}
    n = cfg.D * cfg.cell.NV * cfg.H
    return [params[first[layer * cfg.D]:first[layer * cfg.D] + n].reshape(cfg.D, cfg.cell.NV, cfg.H)
            for layer in range(cfg.L)]


# ---------------------------------------------------------------------------------------------------
# the executor: a plan's entries, run in order
# ---------------------------------------------------------------------------------------------------

VIEWS = {"part": part, "rows": rows, "flat": flat}
#: roles whose buffer changes as the steps go: the step index and the double-buffered state
DYNAMIC = frozenset(("s", "h_in", "h_out", "dh_in", "dh_out"))
#: (in, out, first, second): the state pairs a layer starts with in (first, second) and swaps after each step
STATES = (("h_in", "h_out", "h_a", "h_b"), ("dh_in", "dh_out", "dh_a", "dh_b"))


@functools.lru_cache(maxsize=None)
def absent_array(dtype: str, ndim: int):
    """An empty device array of `dtype` and rank `ndim`: what a kernel gets for an argument the call does not have
    (it holds no memory, so one serves every call and device)."""
    return cuda.device_array((0,) * ndim, dtype=dtype)


def resolve(role, env: dict):
    """A role's value: a buffer's name, a view of one (plan.view), or a literal (scalars, None)."""
    if isinstance(role, str):
        return env[role]
    if isinstance(role, tuple):
        if role[0] == "absent":                        # (steps.absent)
            return absent_array(*role[1:])
        return VIEWS[role[0]](resolve(role[1], env), *role[2:])
    return role


def _swap(env: dict) -> None:
    for r_in, r_out, _, _ in STATES:
        if r_in in env:
            env[r_in], env[r_out] = env[r_out], env[r_in]


def _bind(e, env: dict) -> tuple:
    """(kernel, args with the per-step roles left to fill, [(index, role)] of those) of a per-step entry."""
    args = [None if isinstance(r, str) and r in DYNAMIC else resolve(r, env) for r in e.args]
    slots = [(i, r) for i, r in enumerate(e.args) if isinstance(r, str) and r in DYNAMIC]
    return jit(*e.kernel), args, slots


def run_entry(e, env: dict, log: LaunchLog) -> None:
    """One entry that is not per-step: a kernel, a gemm() or column_sums() call; the launches a call makes
    itself (Run.WITH_PREVIOUS) and the nonce ops writes (Run.BY_OPS) are not run here."""
    if e.run is Run.KERNEL:
        log(jit(*e.kernel), e.name, e.grid, e.block, *[resolve(r, env) for r in e.args])
    elif e.run is Run.GEMM:
        gemm(*[resolve(r, env) for r in e.args], **dict(e.options), log=log, scratch=scratch)
    elif e.run is Run.COLUMN_SUMS:
        column_sums(log, *[resolve(r, env) for r in e.args], scratch)
    elif e.run not in (Run.WITH_PREVIOUS, Run.BY_OPS):
        raise ValueError(f"unknown plan entry kind {e.run!r}")


def execute(entries, env: dict, log: LaunchLog, steps: int) -> None:
    """Run `entries` in order.  Consecutive per-step entries of one step range run as one time loop (each step:
    their launches in order, then the state swapped where they ping-pong it); a layer starts with its state in
    (h_a, h_b) / (dh_a, dh_b).  log.per_step: the launches of one step of that loop."""
    log.steps, log.plan, layer, i = steps, tuple(entries), object(), 0
    while i < len(entries):
        e = entries[i]
        if e.layer != layer:                           # a new layer: the state starts in its first buffer
            layer = e.layer
            for r_in, r_out, first, second in STATES:
                if first in env:
                    env[r_in], env[r_out] = env[first], env[second]
            if steps and layer is not None:
                log.per_step = 0
        if not e.each_step:
            run_entry(e, env, log)
            if e.swaps and len(e.steps) % 2:           # a persistent launch ping-pongs its state inside
                _swap(env)
            i += 1
            continue
        j = i
        while j < len(entries) and entries[j].each_step and entries[j].steps == e.steps:
            j += 1
        group, before = entries[i:j], log.total
        bound = [(_bind(g, env), g) for g in group]
        swaps = any(g.swaps for g in group)
        for s in e.steps:
            env["s"] = s
            for (kernel, args, slots), g in bound:
                for k, r in slots:
                    args[k] = env[r]
                log(kernel, g.name, g.grid, g.block, *args)
            if swaps:
                _swap(env)
        log.per_step = (log.total - before) // len(e.steps)
        i = j


# ---------------------------------------------------------------------------------------------------
# plans, built once per call signature
# ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _planned(phase: str, call, step, where, split_knobs) -> tuple:
    """`forward_plan` / `backward_plan` of `call`, remembered: a plan is a function of the call, its step plan,
    the target and split-K's knobs (`_split_knobs`), all in the key; building one costs ~0.2-1 ms of Python, the
    host time of a whole small GPU call."""
    with target.planning_for(where):
        return tuple(forward_plan(call, step=step) if phase == "forward" else backward_plan(call, step=step))


def _split_knobs() -> tuple:
    """What split-K's choice reads besides the shapes: its threshold and the multiprocessors it plans for."""
    return gemm_module.SPLIT_MIN_K_TILES, gemm_module.sm_count()


# ---------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------

def forward(call, x, h0, c0, params):
    """x [T, B, I], h0 [L*D, B, P], c0 [L*D, B, H] or None, params [N] (device, dtype)
    -> (y [T, B, D*P], hT [L*D, B, P], cT [L*D, B, H] or None, reserve [R])."""
    cfg, T, B, dt = call.config, call.T, call.B, np.dtype(call.dtype)
    H, P, D, G = cfg.H, cfg.P, cfg.D, cfg.G
    a = acc_dtype(dt)
    step = step_plan(call, "forward")
    log = LaunchLog(step_version=step.version, note=step.note)
    n_reserve = reserve_size(replace(call, is_training=True))
    reserve = (cuda.device_array((n_reserve,), dtype=dt) if call.is_training   # [R], zeroed by the plan
               else scratch("reserve", (n_reserve,), dt))                     # inference: scratch for the kernels
    env = dict(x=x, h0=h0, c0=c0, reserve=reserve, lens=device_lengths(call),
               hT=cuda.device_array((cfg.L * D, B, P), dtype=dt),                          # [L*D, B, P]
               cT=cuda.device_array((cfg.L * D, B, H), dtype=dt) if cfg.has_cell_state else None,
               gx=scratch("gx", (D, T, B, G * H), dt),                  # [D, T, B, G*H] W x for all steps
               h_a=scratch("h_a", (D, B, P), a), h_b=scratch("h_b", (D, B, P), a),   # [D, B, P] the state
               c=scratch("c", (D, B, H), a) if cfg.has_cell_state else None)        # [D, B, H] in place
    if call.dropout_active:
        env["x_drop"] = scratch("x_drop", (T, B, D * P), dt)             # [T, B, D*P] a layer's dropped input
    if cfg.cell.modulated:                                               # kernels/modulated.py
        env.update(gh=scratch("gh", (D, B, G * H), a), q=scratch("q", (D, B, H), a))   # R_1 h, m ⊙ h
    if cfg.cell.layer_norm and "rh" not in cfg.cell.layer_norm:        # R h kept per step all the same
        env["rh_raw"] = scratch("rh_raw", (D, T, B, G * H), dt)          # [D, T, B, G*H]
    env.update((f"saved.{name}", v) for name, v in reserve_views(replace(call, is_training=True), reserve).items())
    env.update(_param_roles(cfg, params))
    execute(_planned("forward", call, step, target.current(), _split_knobs()), env, log,
            max(call.lengths, default=0))
    y = cuda.device_array((T, B, D * P), dtype=dt)
    if y.size:
        y.copy_to_device(env[f"saved.y{cfg.L - 1}"])
    record("forward", log)
    if not call.is_training:
        reserve = cuda.device_array((0,), dtype=dt)
    return y, env["hT"], env["cT"], reserve


# ---------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------

def backward(call, x, h0, c0, params, dy, dhT, dcT, reserve):
    """Device arrays, time-major: -> (dx [T, B, I], dh0 [L*D, B, P], dc0 [L*D, B, H] or None, dparams [N])."""
    cfg, T, B, dt = call.config, call.T, call.B, np.dtype(call.dtype)
    H, P, D, G, V = cfg.H, cfg.P, cfg.D, cfg.G, cfg.V
    a = acc_dtype(dt)
    GH = G * H
    step = step_plan(call, "backward")
    log = LaunchLog(step_version=step.version, note=step.note)
    dparams = cuda.device_array((params.shape[0],), dtype=dt)           # [N], zeroed by the plan
    env = dict(x=x, h0=h0, c0=c0, dy=dy, dhT=dhT, dcT=dcT, lens=device_lengths(call), dparams=dparams,
               dx=cuda.device_array((T, B, cfg.I), dtype=dt),                              # [T, B, I]
               dh0=cuda.device_array((cfg.L * D, B, P), dtype=dt),                         # [L*D, B, P]
               dc0=cuda.device_array((cfg.L * D, B, H), dtype=dt) if cfg.has_cell_state else None,
               dgx=scratch("dgx", (D, T, B, GH), dt),                   # [D, T, B, G*H] zeros at padded steps
               dgh=scratch("dgh", (D, T, B, GH), dt),                   # [D, T, B, G*H]
               dvec=scratch("dvec", (D, T, B, V * H), dt) if V else None,          # [D, T, B, V*H]
               h_prev=scratch("h_prev", (D, T, B, P), dt),              # [D, T, B, P]
               dh_total=scratch("dh_total", (D, T, B, P), dt) if cfg.has_proj else None,
               dh_a=scratch("dh_a", (D, B, P), a), dh_b=scratch("dh_b", (D, B, P), a),   # [D, B, P] the state
               dc=scratch("dc", (D, B, H), a) if cfg.has_cell_state else None)   # [D, B, H] in place
    if cfg.cell.modulated:                         # m ⊙ h_prev and the modulated gates' dgh, for their dR
        GM = len(cfg.cell.modulated)
        env.update(qs=scratch("qs", (D, T, B, H), dt),                  # [D, T, B, H]
                   dgm=scratch("dgm", (D, GM, T, B, H), dt))            # [D, GM, T, B, H]
    if cfg.cell.layer_norm:                        # kernels/layer_norm.py: the rows of dbR, dγ_r, dγ_c, dβ_c
        env.update(dgh_pre=scratch("dgh_pre", (D, T, B, GH), dt), dgr=scratch("dgr", (D, T, B, GH), dt),
                   dnc=scratch("dnc", (D, T, B, 2 * H), dt))             # [D, T, B, G*H] x 2, [D, T, B, 2H]
        if "wx" in cfg.cell.layer_norm:            # dL/d(W x), the rows of dγ_x
            env.update(dwx=scratch("dwx", (D, T, B, GH), dt), dgw=scratch("dgw", (D, T, B, GH), dt))
    for layer in range(1, cfg.L):                  # [T, B, D*P]: layer l writes dx{l % 2}, reads dx{(l + 1) % 2}
        env[f"dx{layer % 2}"] = scratch(f"dx{layer % 2}", (T, B, D * P), dt)
    if call.zoneout_active:                        # kernels/zoneout.py: the bypass of dh', a zero dy for the step
        env.update(zoneout_carry=scratch("zoneout_carry", (D, B, P), a),                  # [D, B, P]
                   zoneout_no_dy=scratch("zoneout_no_dy", (T, B, D * P), dt))              # [T, B, D*P]
    if call.dropout_active:                        # [T, B, D*P] masked copies
        env.update(x_masked=scratch("x_masked", (T, B, D * P), dt), dy_masked=scratch("dy_masked", (T, B, D * P), dt))
    env.update((f"saved.{name}", v) for name, v in reserve_views(call, reserve).items())
    env.update(_param_roles(cfg, params))
    env.update(_param_roles(cfg, dparams, "d"))
    execute(_planned("backward", call, step, target.current(), _split_knobs()), env, log,
            max(call.lengths, default=0))
    record("backward", log)
    return env["dx"], env["dh0"], env["dc0"], dparams

"""A memory profiler for numba.cuda kernels that runs in numba's CUDA simulator: whole op calls, per kernel.

`numbarnn.analysis.recorder` records what a GPU's memory system would see of each launch (every address each
CUDA thread of the simulator touches, grouped into warp-level requests and 32-byte sectors); this module runs
whole op calls through it and reports.

Whole op calls: `profile_rnn(...)` runs ``ops.cudnn_rnn_v3`` (training) and ``ops.cudnn_rnn_backprop_v3`` on the
cuda backend with device arrays and reports per phase: launches (total and per step), per kernel the recorder's
figures, R bytes per step, and `numbarnn.analysis.roofline`'s predicted times (a model, not a measurement).
By default launches use the GPU's block sizes (``geometry="gpu"``: 128-thread step kernels, GEMM v3's 64x64
tiles), because warp-level figures need full warps; ``geometry="simulator"`` keeps the tests' tiny blocks.

    run_profile(mode="lstm", units=32, input_size=32, batch=8, time=3)   -> a plain dict (JSON-able)
    format_profile(result)                                                -> the text report
    profile_launch(kernel, grid, block, *args) / with recording() as rec: -> one launch's / many launches' stats
                              (the recorder's, re-exported here)
    measure_v1_figures()      the per-request figures of the v1 step kernels the model extrapolates from
    measure_v2_figures()      the same for v2 (GPU tiles), with the totals roofline.v2_step_traffic predicts
    measure_v3_figures()      one step of v3's body with a GPU-shaped slice (roofline.v3_traffic's totals)
    model_report(gpu)         the model's v1/v2/v3 table at the DeepBench shapes (what `numbarnn bench` prints
                              without a GPU), from figures measured now
    python -m numbarnn.analysis.profiler --kwargs '{"units": 32}' [--json]   (run_profile in this process)

This module imports numba only inside functions, and with it the kernel modules (all but gpus and simulator
import numba): `run_profile` re-runs itself in a subprocess with NUMBA_ENABLE_CUDASIM=1 when the calling process
has numba loaded without the simulator.

Why one file (over 500 lines): one tool: whole op calls through the recorder, per-kernel figures and their
report.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import numpy as np

from .. import ops, settings  # imports no numba
from ..cells import get_cell, load_cell_modules
from ..config import RNNCall, rnn_config
from ..kernels.gpus import SECTOR
from ..params import param_regions
from . import roofline
from .recorder import (SIM_VAR, Recorder, fuse_vector_loads, launch_stats, profile_launch,  # noqa: F401
                       recording, simulator_active)


# ---------------------------------------------------------------------------------------------------
# whole op calls
# ---------------------------------------------------------------------------------------------------

#: kernels launched once per time step (per layer); anything else runs once per layer or per call.  A new
#: kernel family marks itself by a name ending in "_step" or "_persistent" (optionally "_v<N>", then "_proj"; a
#: persistent kernel runs the whole time loop in one launch), or is listed here.
STEP_KERNELS = ("project", "recurrent_backward", "recurrent_backward_v2")
#: step kernel versions the simulator can profile (v3: its persistent kernels run with the GPU's slices as one
#: cooperative grid of every block, numbarnn's fix to the simulator; v2 where that is more than
#: simulator.COOPERATIVE_BLOCKS blocks, as on a GPU where they cannot all be co-resident)
PROFILED_STEP_VERSIONS = (1, 2, 3)
_STEP_NAME = re.compile(r"_(step|persistent|modulate|modulate_backward|recurrent_backward)(_v\d+)?(_proj)?$")


def is_step_kernel(name: str) -> bool:
    return name in STEP_KERNELS or _STEP_NAME.search(name) is not None


def kernel_family(name: str) -> str:
    """Launches of one family share a row in the per-kernel table (the GEMM's variants are one family)."""
    return "gemm" if name.startswith("gemm") else name


def _sum_stats(launches) -> dict:
    """Totals over launches of one family."""
    out = dict(launches=len(launches), requests=0, sectors=0, bytes_used=0, l1_bytes=0, l2_bytes=0,
               dram_bytes=0, load_requests=0, store_requests=0, shared_bytes_per_block=0, shared_load_bytes=0,
               shared_store_bytes=0, shared_wavefronts=0, shared_requests=0, tags={}, lines={})
    for st in launches:
        for kind, row in st["global_"].items():
            out["requests"] += row["requests"]
            out["sectors"] += row["sectors"]
            out["bytes_used"] += row["bytes_used"]
        out["load_requests"] += st["global_"]["load"]["requests"]
        out["store_requests"] += st["global_"]["store"]["requests"]
        for k in ("l1_bytes", "l2_bytes", "dram_bytes"):
            out[k] += st[k]
        sh = st["shared"]
        out["shared_bytes_per_block"] = max(out["shared_bytes_per_block"], sh["bytes_per_block"])
        out["shared_load_bytes"] += sh["load_bytes"]
        out["shared_store_bytes"] += sh["store_bytes"]
        out["shared_wavefronts"] += sh["wavefronts"]
        out["shared_requests"] += sh["requests"]
        for tag, t in st["tags"].items():
            acc = out["tags"].setdefault(tag, dict(requests=0, sectors=0, bytes_used=0, l1_bytes=0, l2_bytes=0,
                                                   dram_bytes=0))
            for k in acc:
                acc[k] += t[k]
        for row in st["lines"]:
            acc = out["lines"].setdefault((row["where"], row["instr"], row["kind"], row["tag"]),
                                          dict(requests=0, sectors=0, bytes_used=0))
            for k in acc:
                acc[k] += row[k]
    out["sectors_per_request"] = out["sectors"] / out["requests"] if out["requests"] else None
    out["coalescing"] = out["bytes_used"] / (out["sectors"] * SECTOR) if out["sectors"] else None
    for t in out["tags"].values():
        t["sectors_per_request"] = t["sectors"] / t["requests"] if t["requests"] else None
        t["coalescing"] = t["bytes_used"] / (t["sectors"] * SECTOR) if t["sectors"] else None
    rows = []
    for (where, instr, kind, tag), r in out["lines"].items():
        rows.append(dict(where=where, instr=instr, kind=kind, tag=tag, requests=r["requests"], sectors=r["sectors"],
                         sectors_per_request=r["sectors"] / r["requests"],
                         coalescing=r["bytes_used"] / (r["sectors"] * SECTOR)))
    rows.sort(key=lambda r: -r["sectors"])
    out["lines"] = rows
    return out


def summarize_phase(launches, steps: int, layers: int, matrix_bytes: dict) -> dict:
    """Per-phase summary of an op call's launches: counts, per-kernel totals, per-step figures."""
    families: dict = {}
    for st in launches:
        families.setdefault(kernel_family(st["kernel"]), []).append(st)
    kernels = {}
    for fam, group in families.items():
        row = _sum_stats(group)
        row["step_kernel"] = is_step_kernel(group[0]["kernel"])
        row["names"] = sorted({st["kernel"] for st in group})
        kernels[fam] = row
    loop = [st for st in launches if is_step_kernel(st["kernel"])]
    per = max(1, steps * layers)
    out = dict(launches=len(launches), step_launches=len(loop), steps=steps, layers=layers,
               launches_per_step=len(loop) / per if steps else 0.0, kernels=kernels)
    step = _sum_stats(loop) if loop else None
    tags_all = _sum_stats(launches)["tags"] if launches else {}
    per_step = {}
    for tag, size in matrix_bytes.items():
        t = tags_all.get(tag)
        if t is None:
            continue
        per_step[tag] = dict(
            bytes=size, l2_bytes_per_step=t["l2_bytes"] / per if steps else None,
            times_matrix=(t["l2_bytes"] / per / size) if steps and size else None,
            l1_bytes_per_step=t["l1_bytes"] / per if steps else None,
            sectors_per_request=t["sectors_per_request"], coalescing=t["coalescing"], requests=t["requests"])
    out["matrices"] = per_step
    if step is not None:
        out["per_step"] = dict(l1_bytes=step["l1_bytes"] / per, l2_bytes=step["l2_bytes"] / per,
                               dram_bytes=step["dram_bytes"] / per, requests=step["requests"] / per)
    return out


#: run_profile's keyword arguments and defaults (the configuration flags of `numbarnn check`)
CONFIG_DEFAULTS = dict(mode="lstm", layers=1, units=32, input_size=None, direction="unidirectional",
                       input_mode="linear_input", proj=0, batch=8, time=3, lengths=None, dtype="float32",
                       dropout=0.0, seed=0, seed2=0, data_seed=0, batch_major=False)


def run_profile(gpu: str = "H100 SXM", geometry: str = "gpu", phases=("forward", "backward"), cells=(),
                lines: int = 3, step_version: int | None = None, **config) -> dict:
    """Profile one cudnn_rnn_v3 (training) + cudnn_rnn_backprop_v3 call on the cuda backend, in the simulator.

    config: CONFIG_DEFAULTS' keys (the flags of `numbarnn check`; input_size None = H for skip_input, else H).
    gpu: the roofline model's GPU (numbarnn.kernels.gpus.GPUS).  lines: source lines kept per kernel.
    step_version: the step kernels, 1, 2 or 3 (PROFILED_STEP_VERSIONS); None = NUMBARNN_STEP_VERSION if set,
    else 2 (the version whose per-step figures the README quotes; 3 profiles the persistent kernels: R once
    per layer, one launch per layer and phase, so its "per step" figures are the layer's divided by T).
    Returns a JSON-able dict: the configuration, per phase the launches, per-kernel memory figures, per step
    figures and bytes of R per step, and the model's predicted times.  Runs in a subprocess with the
    simulator when this process has numba loaded without it.
    """
    unknown = set(config) - set(CONFIG_DEFAULTS)
    if unknown:
        raise TypeError(f"run_profile: unknown configuration {sorted(unknown)}; expected {sorted(CONFIG_DEFAULTS)}")
    if gpu not in roofline.GPUS:
        raise ValueError(f"gpu: expected one of {sorted(roofline.GPUS)}, got {gpu!r}")
    bad = [p for p in phases if p not in ("forward", "backward")]
    if bad or not phases:
        raise ValueError(f"phases: expected 'forward' and/or 'backward', got {list(phases)}")
    if step_version is not None and step_version not in PROFILED_STEP_VERSIONS:
        raise ValueError(f"step_version: expected one of {PROFILED_STEP_VERSIONS} (or None), got {step_version!r}")
    kwargs = dict(gpu=gpu, geometry=geometry, phases=list(phases), cells=list(cells), lines=lines,
                  step_version=step_version, **config)
    if "numba" in sys.modules and not simulator_active():
        return _run_in_subprocess(kwargs)
    if "numba" not in sys.modules:
        settings.request_simulator()        # numba reads it when first imported (by _profile_here)
    return _profile_here(**kwargs)


def _run_in_subprocess(kwargs: dict) -> dict:
    env = settings.environment(simulator=True)
    proc = subprocess.run([sys.executable, "-m", "numbarnn.analysis.profiler", "--kwargs", json.dumps(kwargs),
                           "--json"], env=env, capture_output=True, text=True, check=False)
    try:
        return json.loads(proc.stdout)
    except ValueError as exc:
        raise RuntimeError(f"profiler subprocess failed (exit {proc.returncode}):\n{proc.stdout}\n"
                           f"{proc.stderr}") from exc


def _profile_here(gpu, geometry, phases, cells, lines, step_version=None, **config) -> dict:
    from numba import cuda  # lazy: numba.cuda after the simulator switch

    from ..kernels import driver  # lazy: the kernels import numba.cuda
    from ..testing import make_rnn_case  # lazy: testing imports hypothesis

    load_cell_modules(cells, "cells")
    c = dict(CONFIG_DEFAULTS, **config)
    H = c["units"]
    I = c["input_size"] if c["input_size"] is not None else H
    cfg = rnn_config(c["layers"], H, I, c["mode"], c["input_mode"], c["direction"], c["proj"], c["dropout"],
                     c["seed"], c["seed2"])
    T, B = c["time"], c["batch"]
    lengths = c["lengths"]
    if lengths is not None:
        lengths = [int(v) for v in lengths]
        if len(lengths) != B:
            raise ValueError(f"lengths: expected batch = {B} lengths, got {len(lengths)}")
    time_major = not c["batch_major"]
    dtype = np.dtype(c["dtype"])
    case = make_rnn_case(cfg, T, B, lengths, seed=c["data_seed"], dtype=dtype, time_major=time_major)
    lens = tuple(lengths) if lengths is not None else (T,) * B
    call = RNNCall(cfg, T, B, dtype, time_major, True, lens)
    steps = max(lens, default=0)

    dev = {k: (None if v is None else cuda.to_device(v)) for k, v in
           dict(x=case.x, h0=case.h0, c0=case.c0, params=case.params, dy=case.dy, dhT=case.dhT,
                dcT=case.dcT).items()}
    rec = Recorder()
    rec.keep_lines = lines > 0
    # tag the matrices inside the opaque params buffer (contiguous gates of one pseudo-layer merge)
    item = dtype.itemsize
    matrix_bytes: dict = {}
    for r in param_regions(cfg):
        if r.kind in ("R", "W", "W_proj"):
            rec.tag(r.kind, dev["params"], r.offset * item, (r.offset + r.size) * item)
            matrix_bytes[r.kind] = matrix_bytes.get(r.kind, 0) + r.size * item
    per_layer = {k: v / cfg.L for k, v in matrix_bytes.items()}   # both directions of one layer

    attrs = case.attrs
    result = dict(config=dict(c, input_size=I, cells=list(cells), dtype=str(dtype)), geometry=geometry,
                  gpu=gpu, phases={})
    if step_version is None and settings.get("step_version") is None:
        step_version = 2                            # see run_profile
    with recording(rec, geometry=geometry), driver.pinned_step_version(step_version):
        version = driver.step_version()
        if version not in PROFILED_STEP_VERSIONS:
            raise ValueError(f"{driver.STEP_VERSION_VAR}={version}: the profiler runs step versions "
                             f"{PROFILED_STEP_VERSIONS}")
        result["step_version"] = version
        rec.label = "forward"
        fwd = ops.cudnn_rnn_v3(dev["x"], dev["h0"], dev["c0"], dev["params"], case.lengths, is_training=True,
                               backend="cuda", **attrs)
        if "backward" in phases:
            rec.label = "backward"
            y, hT, cT, reserve, host_reserved = fwd
            ops.cudnn_rnn_backprop_v3(dev["x"], dev["h0"], dev["c0"], dev["params"], case.lengths, y, hT, cT,
                                      dev["dy"], dev["dhT"], dev["dcT"], reserve, host_reserved, backend="cuda",
                                      **attrs)
        plan = driver.launch_plan(call, gpu=True)       # (inside: the same v3 choice as the run)
    logs = driver.last_launch_count()
    for phase in phases:
        launches = [st for st in rec.launches if st["label"] == phase]
        summary = summarize_phase(launches, steps, cfg.L, per_layer)
        log = logs.get(phase)
        summary["driver_launches"] = None if log is None else log.total
        for row in summary["kernels"].values():
            row["lines"] = row["lines"][:lines]
        summary["model"] = roofline.predict_phase(summary, [r for r in plan if r["phase"] == phase], gpu)
        result["phases"][phase] = summary
    return result


# ---------------------------------------------------------------------------------------------------
# the per-request figures of the v1 step kernels (what roofline's extrapolation to big shapes uses)
# ---------------------------------------------------------------------------------------------------

def measure_v1_figures(H: int = 32, B: int = 2) -> dict:
    """Measure, now, the per-request figures of roofline.V1_MEASURED on the v1 LSTM step kernels (float32,
    GPU block sizes): sectors per R request of the forward step and of recurrent_backward, and sectors per
    request of the broadcast reads (h in the forward step, dgh in recurrent_backward).  Also returns the
    R bytes per step of both, in units of B x |R|.  Runs in a subprocess when the simulator is off here."""
    if not simulator_active():
        return _measure_in_subprocess("--measure-v1")
    from numba import cuda  # lazy: numba.cuda after the simulator switch

    from ..kernels.cell_steps import FORWARD_ARGS, make_forward_step, used_args  # lazy: the kernels import numba.cuda
    from ..kernels.recurrent import make_recurrent_backward  # lazy: the kernels import numba.cuda

    cell = get_cell("lstm")
    G, S, P = cell.G, cell.S, H
    rng = np.random.default_rng(0)

    def dev(*shape):
        return cuda.to_device(rng.standard_normal(shape).astype(np.float32))

    R, lens = dev(G * H, P), cuda.to_device(np.ones(B, np.int32))
    h, dgh = dev(1, B, P), dev(1, 1, B, G * H)
    args = dict(s=0, lens=lens, gx=dev(1, 1, B, G * H), unit_params=dev(1, 2 * G + cell.V, H), R_fwd=R, R_rev=R,
                h_in=h, h_out=cuda.device_array((1, B, P), np.float32), c=dev(1, B, H), y=dev(1, B, P),
                acts=dev(1, 1, B, S * H), cs=dev(1, 1, B, H))
    forward = cuda.jit(make_forward_step(cell, "float32", False))
    backward = cuda.jit(make_recurrent_backward("float32"))
    block = min(128, -(-H // 32) * 32)
    with recording() as rec:
        rec.tag("R", R)
        rec.tag("broadcast", h)
        forward[(-(-H // block), B, 1), block](*[args[n] for n in used_args(FORWARD_ARGS, cell, False)])
        rec.tag("broadcast", dgh)
        backward[(-(-P // block), B, 1), block](0, lens, dgh, R, R, dev(1, B, P), dev(1, B, P))
    fwd, bwd = (st["tags"] for st in rec.launches)

    def inner_loop(st, tag):   # the tagged instruction with the most requests: the k loop's broadcast read
        return max((r for r in st["lines"] if r["tag"] == tag), key=lambda r: r["requests"])

    return dict(forward_R_sectors_per_request=fwd["R"]["sectors_per_request"],
                backward_R_sectors_per_request=bwd["R"]["sectors_per_request"],
                broadcast_sectors_per_request=max(inner_loop(st, "broadcast")["sectors_per_request"]
                                                  for st in rec.launches),
                forward_R_per_step_in_B_R=fwd["R"]["l2_bytes"] / (B * R.nbytes),
                backward_R_per_step_in_B_R=bwd["R"]["l2_bytes"] / (B * R.nbytes))


def _measure_in_subprocess(flag: str) -> dict:
    env = settings.environment(simulator=True)
    proc = subprocess.run([sys.executable, "-m", "numbarnn.analysis.profiler", flag], env=env,
                          capture_output=True, text=True, check=False)
    try:
        return json.loads(proc.stdout)
    except ValueError as exc:
        raise RuntimeError(f"profiler subprocess failed (exit {proc.returncode}):\n{proc.stderr}") from exc


def _lstm_step_arrays(H: int, P: int, B: int, T: int = 1, lens: int = 1, seed: int = 0) -> dict:
    """Device arrays of every forward and backward step argument of an LSTM layer (float32, D = 1)."""
    from numba import cuda  # lazy: numba.cuda after the simulator switch

    cell = get_cell("lstm")
    G, S = cell.G, cell.S
    rng = np.random.default_rng(seed)

    def dev(*shape):
        return cuda.to_device(rng.standard_normal(shape).astype(np.float32))

    R = dev(G * H, P)
    return dict(cell=cell, s=0, lens=cuda.to_device(np.full(B, lens, np.int32)), gx=dev(1, T, B, G * H),
                unit_params=dev(1, 2 * G + cell.V, H), R_fwd=R, R_rev=R, h_in=dev(1, B, P),
                h_out=cuda.device_array((1, B, P), np.float32), c=dev(1, B, H), y=dev(T, B, P),
                acts=dev(1, T, B, S * H), cs=dev(1, T, B, H), dy=dev(T, B, P), h0=dev(1, B, P), c0=dev(1, B, H),
                dh=dev(1, B, P), dc=dev(1, B, H), dgx=dev(1, T, B, G * H), dgh=dev(1, T, B, G * H),
                h_prev=dev(1, T, B, P))


def measure_v2_figures(H: int = 32, B: int = 10) -> dict:
    """Measure, now, the v2 step kernels (LSTM, float32, the GPU tiles step_v2.GPU_TILES: 32 units x 8 rows,
    64 threads) at a small shape: the per-request figures of roofline.V2_MEASURED (sectors per request of the
    R and h/dgh staging loads, shared wavefronts per request) and the totals roofline.v2_step_traffic predicts
    (R and h/dgh bytes per block-distinct sectors, shared wavefronts) of one forward step and one fused
    backward step.  B = 10: two row tiles, the second partial.  Runs in a subprocess when the simulator is
    off here."""
    if not simulator_active():
        return _measure_in_subprocess("--measure-v2")
    from ..kernels import step_v2  # lazy: the kernels import numba.cuda
    from ..kernels.cell_steps import FORWARD_ARGS, used_args  # lazy: the kernels import numba.cuda

    t = step_v2.GPU_TILES
    a = _lstm_step_arrays(H, H, B, T=2, lens=2)
    cell, GH, item = a["cell"], a["cell"].G * H, 4
    forward = step_v2.make_forward_step_v2(cell, "float32", False, t)
    backward = step_v2.make_backward_step_v2(cell, "float32", t)
    from numba import cuda  # lazy: numba.cuda after the simulator switch
    with recording() as rec:
        rec.tag("R", a["R_fwd"])
        rec.tag("h", a["h_in"])
        cuda.jit(forward)[step_v2.grid(H, B, 1, t), t.threads](*[a[n] for n in used_args(FORWARD_ARGS, cell, False)])
        rec.tag("dgh_next", a["dgh"], B * GH * item, 2 * B * GH * item)      # dgh of step s+1 = 1, staged
        cuda.jit(backward)[step_v2.grid(H, B, 1, t), t.threads](
            *[a[n] for n in step_v2.backward_v2_args(cell)])
    fwd, bwd = rec.launches
    R_bytes = a["R_fwd"].nbytes

    def staged(st, tag):       # the staging instruction: the tagged load with the most requests
        return max((r for r in st["lines"] if r["tag"] == tag and r["kind"] == "load"), key=lambda r: r["requests"])

    shared = [st["shared"] for st in rec.launches]
    return dict(R_sectors_per_request=max(st["tags"]["R"]["sectors_per_request"] for st in rec.launches),
                h_sectors_per_request=max(staged(fwd, "h")["sectors_per_request"],
                                          staged(bwd, "dgh_next")["sectors_per_request"]),
                shared_wavefronts_per_request=max(sh["wavefronts"] / sh["requests"] for sh in shared),
                R_coalescing=min(st["tags"]["R"]["coalescing"] for st in rec.launches),
                forward_R_per_step_in_R=fwd["tags"]["R"]["l2_bytes"] / R_bytes,
                backward_R_per_step_in_R=bwd["tags"]["R"]["l2_bytes"] / R_bytes,
                forward_R_l2=fwd["tags"]["R"]["l2_bytes"], backward_R_l2=bwd["tags"]["R"]["l2_bytes"],
                forward_h_l2=fwd["tags"]["h"]["l2_bytes"], backward_dgh_l2=bwd["tags"]["dgh_next"]["l2_bytes"],
                forward_shared_wavefronts=shared[0]["wavefronts"], backward_shared_wavefronts=shared[1]["wavefronts"],
                H=H, B=B)


def measure_v3_figures(H: int = 4, P: int = 32, B: int = 2, TJ: int = 2, backward_H: int = 32) -> dict:
    """Measure, now, one step of the v3 step bodies (step_v3's per-step variants: one step, not a whole
    persistent loop) with a GPU-shaped slice of TJ units (64 threads, KC = 32, KMAX = P) at a tiny
    shape: the R slice load and the h staging (bytes, sectors per request) and the shared wavefronts, which
    roofline.v3_traffic predicts (slice + one step), bank conflicts of the h tile included; and the same of
    the backward at H = P = backward_H (its columns of R, the dgh staging: roofline.v3_backward_traffic)."""
    if not simulator_active():
        return _measure_in_subprocess("--measure-v3")
    from numba import cuda  # lazy: numba.cuda after the simulator switch

    from ..kernels import step_v2, step_v3, v3_slices  # lazy: the kernels import numba.cuda
    from ..kernels.cell_steps import FORWARD_ARGS, used_args  # lazy: the kernels import numba.cuda
    sl = v3_slices.Slice(TJ=TJ, RG=v3_slices.THREADS // TJ, RB=1, KC=32, KMAX=P)
    a = _lstm_step_arrays(H, P, B)
    cell = a["cell"]
    with recording() as rec:
        rec.tag("R", a["R_fwd"])
        rec.tag("h", a["h_in"])
        cuda.jit(step_v3.make_forward_step_v3(cell, "float32", sl))[(-(-H // TJ), 1, 1), sl.threads](
            *[a[n] for n in used_args(FORWARD_ARGS, cell, False)])
    st = rec.launches[0]
    staged = max((r for r in st["lines"] if r["tag"] == "h" and r["kind"] == "load"), key=lambda r: r["requests"])
    Hb = backward_H
    sl_b = sl._replace(KMAX=Hb)
    b = _lstm_step_arrays(Hb, Hb, B, T=2, lens=2)
    GH = cell.G * Hb
    with recording() as rec_b:
        rec_b.tag("R", b["R_fwd"])
        rec_b.tag("dgh_next", b["dgh"], B * GH * 4, 2 * B * GH * 4)         # dgh of step s+1 = 1, staged
        cuda.jit(step_v3.make_backward_step_v3(cell, "float32", sl_b))[(-(-Hb // TJ), 1, 1), sl.threads](
            *[b[n] for n in step_v2.backward_v2_args(cell)])
    bt = rec_b.launches[0]
    staged_b = max((r for r in bt["lines"] if r["tag"] == "dgh_next" and r["kind"] == "load"),
                   key=lambda r: r["requests"])
    return dict(R_l2=st["tags"]["R"]["l2_bytes"], R_sectors_per_request=st["tags"]["R"]["sectors_per_request"],
                h_l2=st["tags"]["h"]["l2_bytes"], h_sectors_per_request=staged["sectors_per_request"],
                shared_wavefronts=st["shared"]["wavefronts"], shared_requests=st["shared"]["requests"],
                backward_R_l2=bt["tags"]["R"]["l2_bytes"], backward_R_l1=bt["tags"]["R"]["l1_bytes"],
                backward_R_sectors_per_request=bt["tags"]["R"]["sectors_per_request"],
                backward_dgh_l2=bt["tags"]["dgh_next"]["l2_bytes"],
                backward_dgh_sectors_per_request=staged_b["sectors_per_request"],
                backward_shared_wavefronts=bt["shared"]["wavefronts"], H=H, P=P, B=B, TJ=TJ, backward_H=Hb)


def model_report(gpu: str = "H100 SXM", shapes=None, measure: bool = True) -> str:
    """The text `numbarnn bench` prints without a GPU: the roofline MODEL of the v1, v2 and v3 step kernels at
    the DeepBench shapes (or `shapes`: (H, B, T) tuples), from per-request figures measured now in the
    simulator (measure=True; a few seconds) or the stored ones (roofline.V1_MEASURED, V2_MEASURED), with
    the GPU targets' comparison points (cuDNN's and haste's published times) said to be met or not."""
    if measure:
        figures, figures_v2 = measure_v1_figures(), measure_v2_figures()
    else:
        figures, figures_v2 = dict(roofline.V1_MEASURED), dict(roofline.V2_MEASURED)
    used = {k: figures[k] for k in roofline.V1_MEASURED}
    used_v2 = {k: figures_v2[k] for k in roofline.V2_MEASURED}
    text = roofline.format_deepbench_model(gpu, shapes or roofline.DEEPBENCH, measured=used, measured_v2=used_v2)
    where = "measured now in the CUDA simulator" if measure else "stored in roofline.V1_MEASURED / V2_MEASURED"
    return (text + "\nper-request figures " + where + ": v1 " + ", ".join(f"{k} = {v:g}" for k, v in used.items())
            + "; v2 " + ", ".join(f"{k} = {v:g}" for k, v in used_v2.items()))


# ---------------------------------------------------------------------------------------------------
# the text report
# ---------------------------------------------------------------------------------------------------

def _b(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _f(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _table(headers, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def format_profile(result: dict) -> str:
    """The text report of `run_profile`'s dict."""
    c = result["config"]
    head = (f"{c['mode']} L={c['layers']} H={c['units']} I={c['input_size']} T={c['time']} B={c['batch']} "
            f"{c['direction']} {c['dtype']}" + (f" proj={c['proj']}" if c["proj"] else "")
            + (f" lengths={','.join(map(str, c['lengths']))}" if c["lengths"] else "")
            + (f", step kernels v{result['step_version']}" if result.get("step_version") else ""))
    how = (f"measured in numba's CUDA simulator with {result['geometry']} launch sizes: every global/shared "
           f"access, grouped into warp requests by (block, warp, instruction, occurrence); 32-byte sectors")
    out = [f"numbarnn profile: {head}", how]
    for phase, s in result["phases"].items():
        out.append("")
        out.append(f"== {phase}: {s['launches']} launches ({s['step_launches']} in the time loop: "
                   f"{_f(s['launches_per_step'], 2)} per step x {s['steps']} steps x {s['layers']} layer(s))")
        rows = []
        for fam, k in s["kernels"].items():
            rows.append([fam + (" *" if k["step_kernel"] else ""), k["launches"], k["requests"],
                         _f(k["sectors_per_request"]), _pct(k["coalescing"]), _b(k["l1_bytes"]),
                         _b(k["l2_bytes"]), _b(k["dram_bytes"]), _b(k["shared_bytes_per_block"]),
                         _b(k["shared_load_bytes"] + k["shared_store_bytes"])])
        out.append(_table(["kernel (* = per step)", "launches", "requests", "sect/req", "coalesced", "L1 bytes",
                           "L2 bytes", "DRAM bytes", "smem/block", "smem moved"], rows))
        if s["matrices"]:
            out.append("")
            out.append("weight matrices (tagged address ranges inside params; per step = per layer and step, "
                       "L2 bytes = each block's distinct sectors):")
            rows = []
            for tag, m in s["matrices"].items():
                rows.append([tag, _b(m["bytes"]), m["requests"], _f(m["sectors_per_request"]),
                             _pct(m["coalescing"]), _b(m["l2_bytes_per_step"]), _f(m["times_matrix"], 2),
                             _b(m["l1_bytes_per_step"])])
            out.append(_table(["matrix", "|M| per layer", "requests", "sect/req", "coalesced", "L2 bytes/step",
                               "x |M|", "L1 bytes/step"], rows))
        hot = []
        for fam, k in s["kernels"].items():
            for line in k["lines"]:
                hot.append([fam, f"{line['where']} @{line['instr']}", line["kind"] + (f" {line['tag']}" if line["tag"]
                                                                               else ""),
                            line["requests"], _f(line["sectors_per_request"]),
                            _pct(line["coalescing"])])
        if hot:
            out.append("")
            out.append("busiest instructions (most sectors) per kernel: source line @ bytecode offset; kind and "
                       "tagged array:")
            out.append(_table(["kernel", "instruction", "kind", "requests", "sect/req", "coalesced"], hot))
        out.append("")
        out.append(roofline.format_phase_model(s["model"]))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# CLI (`numbarnn profile` calls cli_main; `python -m numbarnn.analysis.profiler --kwargs JSON`)
# ---------------------------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    """The profile-only flags (the configuration flags come from numbarnn.cli)."""
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--gpu", default="H100 SXM", choices=sorted(roofline.GPUS),
                        help="the GPU of the roofline model (default: H100 SXM)")
    parser.add_argument("--geometry", default="gpu", choices=("gpu", "simulator"),
                        help="launch sizes: the GPU's (default: full warps) or the simulator tests' tiny blocks")
    parser.add_argument("--forward-only", dest="forward_only", action="store_true",
                        help="profile the forward call only")
    parser.add_argument("--step-version", dest="step_version", type=int, choices=PROFILED_STEP_VERSIONS,
                        help="step kernels to profile (default: NUMBARNN_STEP_VERSION, else 2; 3: the persistent "
                             "kernels, R once per layer)")


def cli_main(args, spec_from_args) -> int:
    """`numbarnn profile`: args from numbarnn.cli's parser, spec_from_args its Spec builder."""
    if "numba" not in sys.modules:
        settings.request_simulator()        # before a --cells module imports numba
    try:
        if simulator_active():
            load_cell_modules(args.cells)
        spec = spec_from_args(args)
        if spec.blocklstm:
            raise ValueError("--blocklstm: the profiler covers the cuDNN RNN ops (cudnn_rnn_v3 / backprop)")
        config = {k: getattr(spec, k) for k in CONFIG_DEFAULTS}
        if getattr(args, "units", None) is None:
            config["units"] = CONFIG_DEFAULTS["units"]
        if getattr(args, "batch", None) is None and spec.lengths is None:
            config["batch"] = CONFIG_DEFAULTS["batch"]
        if getattr(args, "input_size", None) is None:
            config["input_size"] = None
        if config["lengths"] is not None:
            config["lengths"] = list(config["lengths"])
        result = run_profile(gpu=args.gpu, geometry=args.geometry, cells=args.cells or (),
                             step_version=args.step_version,
                             phases=("forward",) if args.forward_only else ("forward", "backward"), **config)
    except (ValueError, TypeError) as exc:
        print(f"numbarnn profile: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_profile(result))
    return 0


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m numbarnn.analysis.profiler",
                                description="run_profile(**KWARGS) in this process (the simulator must be on)")
    p.add_argument("--kwargs", default="{}", help="run_profile's keyword arguments as JSON")
    p.add_argument("--json", action="store_true")
    p.add_argument("--measure-v1", dest="measure_v1", action="store_true",
                   help="print measure_v1_figures() as JSON instead")
    p.add_argument("--measure-v2", dest="measure_v2", action="store_true",
                   help="print measure_v2_figures() as JSON instead")
    p.add_argument("--measure-v3", dest="measure_v3", action="store_true",
                   help="print measure_v3_figures() as JSON instead")
    args = p.parse_args(argv)
    kwargs = json.loads(args.kwargs)
    if not simulator_active():
        print(f"python -m numbarnn.analysis.profiler: needs {SIM_VAR}=1", file=sys.stderr)
        return 2
    if args.measure_v1:
        print(json.dumps(measure_v1_figures()))
        return 0
    if args.measure_v2:
        print(json.dumps(measure_v2_figures()))
        return 0
    if args.measure_v3:
        print(json.dumps(measure_v3_figures()))
        return 0
    result = _profile_here(**dict(dict(gpu="H100 SXM", geometry="gpu", phases=["forward", "backward"], cells=[],
                                       lines=3), **kwargs))
    print(json.dumps(result) if args.json else format_profile(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())

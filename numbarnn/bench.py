"""`numbarnn bench`: validated timings of the cuDNN-style RNN ops, one row per (mode, shape, backend).

    numbarnn bench                                   # every available backend, the default shapes
    numbarnn bench --quick                           # two shapes, 3 repetitions
    numbarnn bench --modes lstm --dtype float16 --shapes 1024x32x25 512x1x100 --csv out.csv --plot out.png
    numbarnn bench --backends cuda --simulator --shapes 3x2x2 --reps 1   # no GPU: does the path run at all?
    python -m numbarnn.bench ...                     # the same

A shape is HxBxT: H hidden units (= input size I, as in DeepBench), B batch, T time steps; one layer,
unidirectional, linear input, full-length sequences (DeepBench's RNN training set-up).

Backends (default: every available one):
    reference   numbarnn's NumPy reference (always available); NumPy arrays in and out
    cuda        numbarnn's numba.cuda kernels on a real GPU; device arrays in and out (nothing goes through the
                host).  Without a GPU only with --simulator, in numba's CUDA simulator: it validates, but the
                simulator runs one Python thread per CUDA thread, so its timings mean nothing
    cudnn       cuDNN through torch.nn.LSTM / GRU / RNN on cuda (torch tensors), when torch with CUDA is
                importable; the same weights (numbarnn.params.to_torch_state_dict)

For every (mode, shape):
1. validation before any timing: each backend runs forward (training mode) and backward on the same H, B, I at
   T=2 in the benchmark dtype, and every named output it has (output, output_h, output_c, reserve_space,
   input_backprop, input_h_backprop, input_c_backprop, params_backprop; cuDNN has no reserve_space) is compared
   with the float64 reference on the same (dtype-rounded) inputs as ‖out − ref‖/‖ref‖ against the SPEC 10
   tolerances (numbarnn.testing.TOLERANCES).  A backend that fails is printed and not timed; the exit code is 1.
2. timing: `fwd` = one training-mode cudnn_rnn_v3 call (it writes the reserve space), `fwd+bwd` = that call
   plus cudnn_rnn_backprop_v3 (cuDNN: module(x) plus torch.autograd.grad of the same upstream gradients).
   --warmup untimed calls first (numba compiles each kernel on its first launch: compilation is not timed),
   then the median of --reps calls, each synchronised before and after (numba.cuda.synchronize,
   torch.cuda.synchronize; nothing for NumPy).  The times include numbarnn's Python-side work (argument
   checks, launch overhead): a user pays for it too.

Output: a table (milliseconds; ratio = time / time of the baseline backend, the first of cudnn, reference in
the run; above 1: slower; `err vs f64` = the backend's worst relative error over the outputs and gradients
against the float64 reference, the reserve_space only when it fails; the reference row shows the rounding of
the float64 reference to the dtype), --csv PATH
 (one row per mode/shape/backend), --plot PATH (bar chart PNG; needs
matplotlib, which numbarnn does not depend on).  Exit status: 0 all validated and timed, 1 a validation (or a
timed call) failed, 2 bad arguments, an unavailable backend asked for by name, or --plot without matplotlib.

No numba import at module level: `main` first calls numbarnn.device.use_simulator_unless_gpu() (numba reads
NUMBA_ENABLE_CUDASIM once, when it is imported).  torch is imported only when the cudnn backend is asked for,
or when the default backends are being found on a machine with a GPU.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .cells import cell_names

from . import device as _device
from .device import SIM_VAR
from .reserve import reserve_contents

#: DeepBench-like training shapes (H, B, T) for a GPU: hidden sizes 256-1024, batch 1-64, 25-100 steps
GPU_SHAPES = ("256x16x25", "512x32x25", "512x1x100", "1024x64x25", "1024x16x50", "256x64x100")
GPU_QUICK_SHAPES = ("256x16x25", "512x4x25")
#: NumPy only (no GPU): small shapes that finish in seconds
CPU_SHAPES = ("64x1x10", "64x16x25", "128x4x25", "256x16x25")
CPU_QUICK_SHAPES = ("64x4x10", "128x8x25")
#: the cuda backend in numba's CUDA simulator (one Python thread per CUDA thread): tiny
SIMULATOR_SHAPES = ("3x2x2", "4x3x3")
SIMULATOR_QUICK_SHAPES = ("3x2x2",)

DTYPES = ("float16", "float32", "float64")
BACKENDS = ("reference", "cuda", "cudnn")          # the order of the rows
BASELINES = ("cudnn", "reference")                 # ratios are against the first of these in the run
CHECK_T = 2                                        # time steps of the validation slice
FORWARD_NAMES = ("output", "output_h", "output_c", "reserve_space")
BACKWARD_NAMES = ("input_backprop", "input_h_backprop", "input_c_backprop", "params_backprop")
CSV_FIELDS = ("mode", "dtype", "H", "B", "T", "I", "backend", "fwd_ms", "fwdbwd_ms", "baseline", "fwd_ratio",
              "fwdbwd_ratio", "check_rel_error", "check_output", "check_tolerance", "check_ok", "timed",
              "launches_fwd", "launches_bwd", "reps", "warmup", "device", "note")
TORCH_DEVICE = "cuda"   # where the cudnn backend runs ("cpu" only to test this module without a GPU)
PROG = "numbarnn bench"


def parse_shape(text: str) -> tuple[int, int, int]:
    """'HxBxT' -> (H, B, T)."""
    try:
        H, B, T = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxBxT like 512x32x25, got {text!r}") from None
    if min(H, B, T) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes in HxBxT, got {text!r}")
    return H, B, T


def shape_label(shape) -> str:
    return "x".join(str(v) for v in shape)


def make_case(mode: str, H: int, B: int, T: int, I: int, dtype, seed: int = 0):  # noqa: E741
    """A one-layer, unidirectional, linear-input case (full lengths), scaled like torch's default init."""
    from .config import rnn_config
    from .testing import make_rnn_case

    cfg = rnn_config(1, H, I, mode, input_mode="linear_input")
    return make_rnn_case(cfg, T, B, None, seed=seed, dtype=dtype, scale=1.0 / math.sqrt(max(H, I)))


def _host(a):
    """NumPy copy of a NumPy / numba device / torch array (None stays None)."""
    if a is None:
        return None
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


# --------------------------------------------------------------------------------------------------
# backends: calls(case) -> (forward, backward, named)
#   forward() -> forward outputs; backward(forward outputs) -> gradients;
#   named(forward outputs, gradients) -> {output name: NumPy array} (validation only)
# --------------------------------------------------------------------------------------------------

class ReferenceBackend:
    """numbarnn's ops with backend="reference" on NumPy arrays."""

    name = "reference"
    op_backend = "reference"

    def sync(self) -> None:
        pass

    def put(self, a):
        return None if a is None else np.ascontiguousarray(a)

    def calls(self, case):
        from . import ops

        x, h0, c0, params, dy, dhT, dcT = (self.put(a) for a in (case.x, case.h0, case.c0, case.params, case.dy,
                                                                  case.dhT, case.dcT))
        attrs, be = case.attrs, self.op_backend

        def forward():
            return ops.cudnn_rnn_v3(x, h0, c0, params, None, is_training=True, backend=be, **attrs)

        def backward(fwd):
            y, hT, cT, reserve, host_reserved = fwd
            return ops.cudnn_rnn_backprop_v3(x, h0, c0, params, None, y, hT, cT, dy, dhT, dcT, reserve,
                                             host_reserved, backend=be, **attrs)

        def named(fwd, grads):
            lstm = case.cfg.has_cell_state
            out = {n: _host(a) for n, a in zip(FORWARD_NAMES, fwd[:3] + (reserve_contents(fwd[3]),))
                   if lstm or n != "output_c"}
            out.update({n: _host(a) for n, a in zip(BACKWARD_NAMES, grads) if lstm or n != "input_c_backprop"})
            return out

        return forward, backward, named

    def start(self) -> None:
        """Called once before this backend's first call of the run (stop: after its last)."""

    def stop(self) -> None:
        pass

    def extra(self) -> dict:
        return {}


class CudaBackend(ReferenceBackend):
    """numbarnn's numba.cuda kernels (backend="cuda") on device arrays."""

    name = "cuda"
    op_backend = "cuda"

    def sync(self) -> None:
        from numba import cuda
        cuda.synchronize()

    def put(self, a):
        from numba import cuda
        return None if a is None else cuda.to_device(np.ascontiguousarray(a))

    def extra(self) -> dict:
        """Kernel launches of the last forward / backward call."""
        try:
            from .kernels import driver
            last = driver.last_launch_count()
            return {"launches_fwd": last["forward"].total, "launches_bwd": last["backward"].total}
        except Exception:   # pragma: no cover - informative only
            return {}


class CudnnBackend:
    """cuDNN through torch.nn.LSTM / GRU / RNN (training mode) on TORCH_DEVICE, torch tensors.

    TF32 is switched off for cuDNN's RNNs during the run (torch allows it by default on Ampere and later): float32
    means float32, as in numbarnn, so that the SPEC 10 tolerances apply and the timings compare like with like.
    """

    name = "cudnn"
    _restore = None

    def start(self) -> None:
        import torch
        if TORCH_DEVICE != "cuda":
            return
        rnn = getattr(torch.backends.cudnn, "rnn", None)
        if rnn is not None and hasattr(rnn, "fp32_precision"):     # torch >= 2.9: the new API only (no mixing)
            old = rnn.fp32_precision
            rnn.fp32_precision = "ieee"
            self._restore = lambda: setattr(rnn, "fp32_precision", old)
        else:
            old = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            self._restore = lambda: setattr(torch.backends.cudnn, "allow_tf32", old)

    def stop(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def sync(self) -> None:
        import torch
        if TORCH_DEVICE == "cuda":
            torch.cuda.synchronize()

    def calls(self, case):
        import torch

        from .params import from_torch_state_dict, to_torch_state_dict

        cfg = case.cfg
        tdt = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}[str(case.dtype)]
        kw = dict(input_size=cfg.I, hidden_size=cfg.H, num_layers=cfg.L, bidirectional=cfg.D == 2)
        make = {"lstm": lambda: torch.nn.LSTM(**kw), "gru": lambda: torch.nn.GRU(**kw),
                "rnn_tanh": lambda: torch.nn.RNN(nonlinearity="tanh", **kw),
                "rnn_relu": lambda: torch.nn.RNN(nonlinearity="relu", **kw)}[cfg.rnn_mode]
        module = make().to(dtype=tdt)
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in to_torch_state_dict(cfg, case.params).items()}
        module.load_state_dict(state, strict=True)
        module = module.to(device=TORCH_DEVICE).train()

        def tensor(a, grad=False):
            return None if a is None else torch.tensor(np.asarray(a), device=TORCH_DEVICE, dtype=tdt,
                                                       requires_grad=grad)

        x, h0, c0 = tensor(case.x, True), tensor(case.h0, True), tensor(case.c0, True)    # [T,B,I] [1,B,H] [1,B,H]
        dy, dhT, dcT = tensor(case.dy), tensor(case.dhT), tensor(case.dcT)
        lstm = cfg.has_cell_state
        names = [n for n, _ in module.named_parameters()]
        inputs = [x, h0] + ([c0] if lstm else []) + [p for _, p in module.named_parameters()]

        def forward():
            return module(x, (h0, c0) if lstm else h0)

        def backward(fwd):
            y, state_T = fwd
            outs, grads = ([y, state_T[0], state_T[1]], [dy, dhT, dcT]) if lstm else ([y, state_T], [dy, dhT])
            return torch.autograd.grad(outs, inputs, grads)

        def named(fwd, grads):
            y, state_T = fwd
            out = {"output": _host(y)}
            if lstm:
                out["output_h"], out["output_c"] = _host(state_T[0]), _host(state_T[1])
            else:
                out["output_h"] = _host(state_T)
            k = 3 if lstm else 2
            out["input_backprop"], out["input_h_backprop"] = _host(grads[0]), _host(grads[1])
            if lstm:
                out["input_c_backprop"] = _host(grads[2])
            out["params_backprop"] = from_torch_state_dict(
                cfg, {n: _host(g).astype(np.float64) for n, g in zip(names, grads[k:])}, dtype=np.float64)
            return out

        return forward, backward, named

    def extra(self) -> dict:
        return {}


BACKEND_CLASSES = {"reference": ReferenceBackend, "cuda": CudaBackend, "cudnn": CudnnBackend}


# --------------------------------------------------------------------------------------------------
# what is available (numba and torch imported only here, after use_simulator_unless_gpu)
# --------------------------------------------------------------------------------------------------

def cuda_status(allow_simulator: bool) -> tuple[bool, bool, str]:
    """-> (usable, in the simulator, description) of the cuda backend."""
    if os.environ.get(SIM_VAR) == "1":
        if allow_simulator:
            return True, True, "numba's CUDA simulator (--simulator)"
        return False, True, (f"needs a real GPU (numba's CUDA simulator is active: no GPU found, or {SIM_VAR}=1), "
                             "or --simulator to run it in the simulator (validates; its timings mean nothing)")
    try:
        from numba import cuda
        if not cuda.is_available():
            return False, False, "needs a real GPU (numba finds no CUDA driver/device), or --simulator"
        name = cuda.get_current_device().name
        return True, False, name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:
        return False, False, f"numba.cuda is not usable ({type(exc).__name__}: {exc})"


def cudnn_status() -> tuple[bool, str]:
    """-> (usable, description) of cuDNN through torch; torch is not imported when there is no GPU."""
    if TORCH_DEVICE == "cuda" and not _device.real_gpu_present():
        return False, "needs torch with CUDA on a GPU (no GPU found)"
    try:
        import torch
    except Exception as exc:
        return False, f"torch does not import ({type(exc).__name__}: {exc})"
    if TORCH_DEVICE != "cuda":
        return True, f"torch {torch.__version__} on {TORCH_DEVICE} (a stand-in, not cuDNN)"
    try:
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} has no usable CUDA"
        if not (torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled):
            return False, f"torch {torch.__version__} has no usable cuDNN"
        return True, (f"cuDNN {torch.backends.cudnn.version()} via torch {torch.__version__}, TF32 off, on "
                      f"{torch.cuda.get_device_name()}")
    except Exception as exc:   # pragma: no cover - broken installs
        return False, f"torch's CUDA is not usable ({type(exc).__name__}: {exc})"


# --------------------------------------------------------------------------------------------------
# validation and timing
# --------------------------------------------------------------------------------------------------

@dataclass
class Check:
    error: float            # ‖out − ref‖/‖ref‖ of the output worst relative to its tolerance
    output: str             # the output it belongs to
    tolerance: float
    ok: bool
    message: str = ""


@dataclass
class Row:
    mode: str
    dtype: str
    H: int
    B: int
    T: int
    I: int  # noqa: E741
    backend: str
    check: Check | None = None
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    baseline: str = ""
    fwd_ratio: float | None = None
    fwdbwd_ratio: float | None = None
    extra: dict = field(default_factory=dict)
    note: str = ""

    @property
    def shape(self) -> str:
        return shape_label((self.H, self.B, self.T))

    @property
    def timed(self) -> bool:
        return self.fwd_ms is not None and self.fwdbwd_ms is not None


def reference_outputs(case) -> dict:
    """The float64 reference of `case` (whatever backends the run patches or times)."""
    from .testing import run_backward, run_forward

    case64 = case.astype(np.float64)
    fwd = run_forward(case64, "reference")
    grads = run_backward(case64, fwd, "reference")
    out = dict(zip(FORWARD_NAMES, fwd[:3] + (reserve_contents(fwd[3]),)))

    out.update(zip(BACKWARD_NAMES, grads))
    if not case.cfg.has_cell_state:
        del out["output_c"], out["input_c_backprop"]
    return {k: _host(v) for k, v in out.items()}


def named_outputs(backend, case) -> dict:
    """One forward + backward of `backend` on `case`: {name: NumPy array}."""
    forward, backward, named = backend.calls(case)
    fwd = forward()
    grads = backward(fwd)
    backend.sync()
    return named(fwd, grads)


def validate(backend, case, ref: dict) -> Check:
    """Every named output `backend` has vs the float64 reference `ref`, SPEC 10 tolerances of case.dtype."""
    from .testing import TOLERANCES, relative_error

    tol_out, tol_grad = TOLERANCES[np.dtype(case.dtype)]
    try:
        got = named_outputs(backend, case)
    except Exception as exc:
        return Check(math.inf, "-", tol_out, False, f"{type(exc).__name__}: {exc}")
    missing = [n for n in ("output", "output_h", "input_backprop", "params_backprop") if n not in got]
    if missing:
        return Check(math.inf, missing[0], tol_out, False, f"no {', '.join(missing)} returned")
    checks = []
    for name in FORWARD_NAMES + BACKWARD_NAMES:
        if name not in got or name not in ref:
            continue
        tol = tol_out if name in FORWARD_NAMES else tol_grad
        value, want = np.asarray(got[name]), ref[name]
        if value.shape != want.shape:
            return Check(math.inf, name, tol, False, f"{name}: shape {value.shape}, expected {want.shape}")
        err = relative_error(value, want)
        checks.append(Check(err, name, tol, bool(err <= tol)))      # NaN is not <= anything: a failure
    ratio = lambda c: math.inf if math.isnan(c.error) else c.error / c.tolerance   # noqa: E731
    # shown: the worst of what a user reads (outputs and gradients); the opaque reserve_space is validated too,
    # but only shown when it fails (its error is the dtype's rounding of bounded activations, the same every row)
    worst = max([c for c in checks if c.output != "reserve_space"] or checks, key=ratio)
    bad = [c for c in checks if not c.ok]
    if bad:
        worst = max(checks, key=ratio)
        worst.ok = False
        worst.message = "; ".join(f"{c.output} rel. error {c.error:.2e} > {c.tolerance:.0e}" for c in bad)
    return worst


def median_ms(fn, sync, reps: int, warmup: int) -> float:
    """Median wall time in ms of fn() over `reps` calls after `warmup` untimed ones, synchronised around each."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median ms of fn() over `reps` calls, synchronised with the GPU when numba.cuda runs on one.

    `warmup` untimed calls first keep kernel compilation out of the numbers; in the CUDA simulator there is
    nothing to synchronise and no warm-up (its timings only say that it is slow).
    """
    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        return median_ms(fn, lambda: None, reps, 0)
    return median_ms(fn, cuda.synchronize, reps, warmup)


def time_backend(backend, case, reps: int, warmup: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of `backend` on `case`."""
    forward, backward, _ = backend.calls(case)
    fwd_ms = median_ms(forward, backend.sync, reps, warmup)
    fwdbwd_ms = median_ms(lambda: backward(forward()), backend.sync, reps, warmup)
    return fwd_ms, fwdbwd_ms


def add_ratios(rows: list[Row]) -> None:
    """ratio = time / time of the baseline (first of BASELINES timed for the same mode and shape)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.mode, r.H, r.B, r.T), []).append(r)
    for group in groups.values():
        timed = {r.backend: r for r in group if r.timed}
        base = next((timed[b] for b in BASELINES if b in timed), None)
        if base is None:
            continue
        for r in group:
            r.baseline = base.backend
            if r.timed:
                r.fwd_ratio = r.fwd_ms / base.fwd_ms if base.fwd_ms > 0 else None
                r.fwdbwd_ratio = r.fwdbwd_ms / base.fwdbwd_ms if base.fwdbwd_ms > 0 else None


# --------------------------------------------------------------------------------------------------
# output: table, CSV, plot
# --------------------------------------------------------------------------------------------------

def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _check_text(r: Row) -> str:
    if r.check is None:
        return "-"
    return f"{r.check.error:.1e}" if r.check.ok else f"FAIL {r.check.error:.1e}"


def format_table(rows: list[Row]) -> str:
    headers = ("mode", "shape HxBxT", "backend", "fwd ms", "fwd+bwd ms", "fwd ratio", "fwd+bwd ratio",
               "err vs f64")
    body = [(r.mode, r.shape, r.backend, _fmt(r.fwd_ms), _fmt(r.fwdbwd_ms), _fmt(r.fwd_ratio, ".2f"),
             _fmt(r.fwdbwd_ratio, ".2f"), _check_text(r)) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(headers, *body)]
    left = 3                                   # mode, shape, backend left-aligned; numbers right-aligned

    def line(cells):
        return "  ".join(c.ljust(w) if k < left else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(b) for b in body])


def write_csv(path: str, rows: list[Row], reps: int, warmup: int, device: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            c = r.check
            w.writerow(dict(mode=r.mode, dtype=r.dtype, H=r.H, B=r.B, T=r.T, I=r.I, backend=r.backend,
                            fwd_ms=_csv(r.fwd_ms), fwdbwd_ms=_csv(r.fwdbwd_ms), baseline=r.baseline,
                            fwd_ratio=_csv(r.fwd_ratio), fwdbwd_ratio=_csv(r.fwdbwd_ratio),
                            check_rel_error="" if c is None else repr(c.error), check_output="" if c is None
                            else c.output, check_tolerance="" if c is None else repr(c.tolerance),
                            check_ok="" if c is None else c.ok, timed=r.timed,
                            launches_fwd=r.extra.get("launches_fwd", ""), launches_bwd=r.extra.get("launches_bwd", ""),
                            reps=reps, warmup=warmup, device=device, note=r.note))
    print(f"wrote {path}")


def _csv(v) -> str:
    return "" if v is None else repr(float(v))


def load_pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plot(path: str, rows: list[Row], plt, title: str) -> None:
    """Grouped bars (one group per mode and shape, one bar per backend), forward and forward+backward, log y."""
    timed = [r for r in rows if r.timed]
    groups = list(dict.fromkeys((r.mode, r.shape) for r in timed))
    backends = [b for b in BACKENDS if any(r.backend == b for r in timed)]
    by_key = {(r.mode, r.shape, r.backend): r for r in timed}
    width = 0.8 / max(1, len(backends))
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(groups) + 2), 7), sharex=True)
    for ax, attr, label in zip(axes, ("fwd_ms", "fwdbwd_ms"), ("forward (ms)", "forward + backward (ms)")):
        for k, b in enumerate(backends):
            xs = [g + (k - (len(backends) - 1) / 2) * width for g in range(len(groups))
                  if (*groups[g], b) in by_key]
            ys = [getattr(by_key[(*groups[g], b)], attr) for g in range(len(groups)) if (*groups[g], b) in by_key]
            ax.bar(xs, ys, width=width, label=b)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    axes[0].set_title(title)
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels([f"{m}\n{s}" for m, s in groups], fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Validated timings of numbarnn's RNN ops (CudnnRNNV3 forward + CudnnRNNBackpropV3) per "
                    "backend, DeepBench-style\nshapes HxBxT (H hidden = input size, B batch, T steps; one layer, "
                    "unidirectional).",
        epilog="backends: reference (NumPy, always), cuda (numba.cuda kernels: a real GPU, or --simulator), "
               "cudnn (torch.nn on cuda).\nEach backend is validated against the float64 reference at T=2 "
               "(SPEC 10 tolerances) before it is timed.\n"
               f"default shapes: GPU {' '.join(GPU_SHAPES)}\n"
               f"                (--quick {' '.join(GPU_QUICK_SHAPES)});\n"
               f"                NumPy only {' '.join(CPU_SHAPES)} (--quick {' '.join(CPU_QUICK_SHAPES)});\n"
               f"                cuda in the simulator {' '.join(SIMULATOR_SHAPES)}.\n"
               "exit status: 0 ok, 1 a validation or timed call failed, 2 usage (bad flag, unavailable backend, "
               "--plot without matplotlib).")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                   help="backends to validate and time (default: every available one)")
    p.add_argument("--modes", nargs="+", choices=cell_names(), default=["lstm", "gru"],
                   help="rnn_modes (registered cells; default: lstm gru)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="default: float32")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=None, metavar="HxBxT",
                   help="default: see below (depends on the backends)")
    p.add_argument("--quick", action="store_true", help="two shapes, 3 repetitions")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement, the median is shown "
                                                          "(default 10, --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first, at least 1: the first call "
                                                         "compiles the kernels (default 2)")
    p.add_argument("--csv", metavar="PATH", help="also write one row per mode/shape/backend as CSV")
    p.add_argument("--plot", metavar="PATH", help="also draw a bar chart PNG (needs matplotlib)")
    p.add_argument("--simulator", action="store_true",
                   help="without a GPU, run the cuda backend in numba's CUDA simulator (slow; the timings mean "
                        "nothing)")
    p.add_argument("--no-cudnn", action="store_true", help=argparse.SUPPRESS)   # bench_rnn.py's old flag
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 3 if args.quick else 10
    if args.reps < 1:
        p.error(f"--reps: expected >= 1, got {args.reps}")
    if args.warmup < 1:
        p.error(f"--warmup: expected >= 1 (the first call compiles), got {args.warmup}")
    return args


def _error(text: str) -> int:
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return 2


def choose_backends(args) -> tuple[list[str], dict, list[str], int | None]:
    """-> (backends to run, {backend: description}, notes to print, exit code when a named one is unavailable)."""
    requested = list(dict.fromkeys(args.backends)) if args.backends else None
    wanted = requested or [b for b in BACKENDS if not (b == "cudnn" and args.no_cudnn)]
    info = {"reference": "numbarnn.reference (NumPy)"}
    chosen = ["reference"] if "reference" in wanted else []
    notes = []
    if "cuda" in wanted:
        ok, simulated, why = cuda_status(args.simulator)
        info["cuda"] = why
        if ok:
            chosen.append("cuda")
            if simulated:
                notes.append("WARNING: the cuda backend runs in numba's CUDA simulator (--simulator): one Python "
                             "thread per CUDA thread, so its timings mean nothing about a GPU; they only show that "
                             "the path runs.")
        elif requested:
            return chosen, info, notes, _error(f"--backends cuda: {why}")
        else:
            notes.append(f"note: cuda backend skipped: {why}")
    if "cudnn" in wanted:
        ok, why = cudnn_status()
        info["cudnn"] = why
        if ok:
            chosen.append("cudnn")
        elif requested:
            return chosen, info, notes, _error(f"--backends cudnn: {why}")
        else:
            notes.append(f"note: cudnn backend skipped: {why}")
    return [b for b in BACKENDS if b in chosen], info, notes, None


def default_shapes(args, backends: list[str], cuda_simulated: bool) -> list[tuple]:
    if "cudnn" in backends or ("cuda" in backends and not cuda_simulated):
        names = GPU_QUICK_SHAPES if args.quick else GPU_SHAPES
    elif "cuda" in backends:
        names = SIMULATOR_QUICK_SHAPES if args.quick else SIMULATOR_SHAPES
    else:
        names = CPU_QUICK_SHAPES if args.quick else CPU_SHAPES
    return [parse_shape(s) for s in names]


def measure(args, backends: list[str], instances: dict, shapes) -> tuple[list[Row], bool]:
    """Validate, then time, every backend for every (mode, shape). -> (rows, anything failed)."""
    rows: list[Row] = []
    failed = False
    for mode in args.modes:
        for H, B, T in shapes:
            I = H  # noqa: E741 - DeepBench: input size = hidden size
            label = f"{mode} {shape_label((H, B, T))}"
            small = make_case(mode, H, B, CHECK_T, I, np.float64, seed=H + B).astype(args.dtype)
            ref = reference_outputs(small)
            case = None
            for b in backends:
                row = Row(mode, args.dtype, H, B, T, I, b)
                rows.append(row)
                row.check = validate(instances[b], small, ref)
                if not row.check.ok:
                    failed = True
                    row.note = row.check.message
                    print(f"  {label:<18} {b:<9} validation FAILED: {row.check.message}; not timed", flush=True)
                    continue
                case = case if case is not None else make_case(mode, H, B, T, I, args.dtype, seed=1)
                try:
                    row.fwd_ms, row.fwdbwd_ms = time_backend(instances[b], case, args.reps, args.warmup)
                except Exception as exc:
                    failed = True
                    row.fwd_ms = row.fwdbwd_ms = None
                    row.note = f"timing failed: {type(exc).__name__}: {exc}"
                    print(f"  {label:<18} {b:<9} {row.note}", flush=True)
                    continue
                row.extra = instances[b].extra()
                print(f"  {label:<18} {b:<9} error vs float64 reference {row.check.error:.1e} "
                      f"({row.check.output}) ok; "
                      f"fwd {row.fwd_ms:.3f} ms, fwd+bwd {row.fwdbwd_ms:.3f} ms", flush=True)
    return rows, failed


def run(args) -> int:
    env = _device.use_simulator_unless_gpu()     # before numba is imported (cuda_status imports it)
    plt = None
    if args.plot:
        plt = load_pyplot()
        if plt is None:
            return _error("--plot needs matplotlib, which is not installed (numbarnn does not depend on it): "
                          "`pip install matplotlib`, or leave out --plot")
    backends, info, notes, code = choose_backends(args)
    if code is not None:
        return code
    if not backends:
        return _error("no backend to run")
    cuda_simulated = "cuda" in backends and os.environ.get(SIM_VAR) == "1"
    shapes = args.shapes or default_shapes(args, backends, cuda_simulated)
    if "cuda" in backends and not cuda_simulated:
        device = info["cuda"]
    elif "cudnn" in backends and TORCH_DEVICE == "cuda":
        device = info["cudnn"].rsplit(" on ", 1)[-1]
    else:
        device = f"CPU ({os.cpu_count()} cores)" + (", cuda backend in numba's CUDA simulator" if cuda_simulated
                                                     else "")
    print(f"device: {device}   [numba: {env}]")
    for b in backends:
        print(f"  {b:<9} {info[b]}")
    for note in notes:
        print(note)
    print(f"dtype {args.dtype}; one layer, unidirectional, I = H, full-length sequences; median of {args.reps} "
          f"call{'s' * (args.reps != 1)} after {args.warmup} warm-up call{'s' * (args.warmup != 1)}")
    print(f"validation: every named output vs the float64 reference at T={CHECK_T} (SPEC 10 tolerances), before "
          f"timing\n", flush=True)

    instances = {b: BACKEND_CLASSES[b]() for b in backends}
    started = []
    try:
        for b in backends:
            instances[b].start()
            started.append(instances[b])
        rows, failed = measure(args, backends, instances, shapes)
    finally:
        for inst in started:
            inst.stop()
    add_ratios(rows)

    print()
    print(format_table(rows))
    print(f"\nratio = time / time of the baseline for the same mode and shape, the first of "
          f"{' > '.join(BASELINES)} timed (above 1: slower)\nerr vs f64 = this backend's worst relative error "
          f"‖out − ref‖/‖ref‖ over the outputs and gradients, against the float64 reference on the same inputs "
          f"(T={CHECK_T}; a failed check: not timed). The reference row is the float64 reference rounded to the "
          f"dtype: its value is that rounding, the floor for every backend.")

    if cuda_simulated:
        print("(cuda: numba's CUDA simulator, timings meaningless)")
    if args.csv:
        write_csv(args.csv, rows, args.reps, args.warmup, device)
    if plt is not None:
        if any(r.timed for r in rows):
            write_plot(args.plot, rows, plt, f"numbarnn bench, {args.dtype}, {device}")
        else:
            print(f"no timings: {args.plot} not written")
    if failed:
        print("FAILED: at least one backend failed its validation (or a timed call failed): not timed")
        return 1
    return 0


def main(argv=None) -> int:
    """`numbarnn bench [ARGS]` (also `python -m numbarnn.bench`); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except SystemExit as exc:   # --help (0) or a bad flag (2, message already printed by argparse)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""`numbarnn bench`: validated timings of the cuDNN-style RNN ops, one row per (mode, shape, backend).

    numbarnn bench                                   # every available backend, the default shapes
    numbarnn bench --quick                           # two shapes, 3 repetitions
    numbarnn bench --modes lstm --dtype float16 --shapes 1024x32x25 512x1x100 --csv out.csv --plot out.png
    numbarnn bench --backends cuda --simulator --shapes 3x2x2 --reps 1   # no GPU: does the path run at all?
    numbarnn bench --backends cuda cudnn --modes lstm --deepbench --step-versions 1 2 3   # v1-v3 vs cuDNN
    python -m numbarnn.bench ...                     # the same

--step-versions 1 2 3 runs the cuda backend once per step-kernel version (rows "cuda v1", "cuda v2", "cuda v3";
the note column says why v3 ran or why v2 ran instead); --deepbench takes DeepBench's LSTM shapes (those of the
roofline model and of bench/results/gpu_h100.md).

A shape is HxBxT: H hidden units (= input size I, as in DeepBench), B batch, T time steps; one layer,
unidirectional, linear input, full-length sequences (DeepBench's RNN training set-up).

Backends (default: every available one; the adapters live in numbarnn/measure.py):
    reference   numbarnn's NumPy reference (always available); NumPy arrays in and out
    cpu         numbarnn's numba CPU backend; NumPy arrays in and out
    torch       torch.nn on the CPU, same thread count as numba: what a user without a GPU would pick instead
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
   tolerances (numbarnn.verify.TOLERANCES).  A backend that fails is printed and not timed; the exit code is 1.
2. timing: `fwd` = one training-mode cudnn_rnn_v3 call (it writes the reserve space), `fwd+bwd` = that call
   plus cudnn_rnn_backprop_v3 (cuDNN: module(x) plus torch.autograd.grad of the same upstream gradients).
   --warmup untimed calls first (numba compiles each kernel on its first launch: compilation is not timed),
   then the median of --reps calls, each synchronised before and after (numba.cuda.synchronize,
   torch.cuda.synchronize; nothing for NumPy).  The times include numbarnn's Python-side work (argument
   checks, launch overhead): a user pays for it too.

The validation call is the first call of each backend and cell in the process: its time is the `cold` column
(JIT compilation included); the timed calls come after it and after the warm-up.

Output: a table (milliseconds; ratio = time / time of the baseline backend, the first of cudnn, torch, reference
in the run; above 1: slower; `err vs f64` = the backend's worst relative error over the outputs and gradients
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
import sys

from . import device as _device
from . import measure
from .cells import cell_names, get_cell
from .analysis.profiler import model_report  # imports no numba
from .analysis.roofline import DEEPBENCH   # no numba (numba is imported after use_simulator_unless_gpu)
from . import settings
from .measure import timed_ms  # noqa: F401 (numbarnn.bench.timed_ms: older tutorials)
from .measure import (BACKENDS, BASELINES, CHECK_T, Row, cpu_status, cuda_status, make_adapter, measure_all,
                      torch_status)

#: DeepBench-like training shapes (H, B, T) for a GPU: hidden sizes 256-1024, batch 1-64, 25-100 steps
GPU_SHAPES = ("256x16x25", "512x32x25", "512x1x100", "1024x64x25", "1024x16x50", "256x64x100")
GPU_QUICK_SHAPES = ("256x16x25", "512x4x25")
#: no GPU (reference, cpu, torch on the CPU): shapes that finish in seconds on the reference
CPU_SHAPES = ("64x1x10", "64x16x25", "128x4x25", "256x16x25")
CPU_QUICK_SHAPES = ("64x4x10", "128x8x25")
#: the cuda backend in numba's CUDA simulator (one Python thread per CUDA thread): tiny
SIMULATOR_SHAPES = ("3x2x2", "4x3x3")
SIMULATOR_QUICK_SHAPES = ("3x2x2",)
#: DeepBench's LSTM training shapes (H, B, T), those the roofline model and bench/results/gpu_h100.md use
DEEPBENCH_SHAPES = tuple(f"{H}x{B}x{T}" for H, B, T in DEEPBENCH)

DTYPES = ("float16", "float32", "float64")
CSV_FIELDS = ("mode", "dtype", "H", "B", "T", "I", "P", "backend", "cold_ms", "fwd_ms", "fwdbwd_ms", "baseline", "fwd_ratio",
              "fwdbwd_ratio", "check_rel_error", "check_output", "check_tolerance", "check_ok", "timed",
              "launches_fwd", "launches_bwd", "reps", "warmup", "device", "note")
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
    headers = ("mode", "shape HxBxT", "backend", "cold ms", "fwd ms", "fwd+bwd ms", "fwd ratio", "fwd+bwd ratio",
               "err vs f64")
    body = [(r.mode, r.shape, r.backend, _fmt(r.cold_ms, ".0f"), _fmt(r.fwd_ms), _fmt(r.fwdbwd_ms),
             _fmt(r.fwd_ratio, ".2f"), _fmt(r.fwdbwd_ratio, ".2f"), _check_text(r)) for r in rows]
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
            w.writerow(dict(mode=r.mode, dtype=r.dtype, H=r.H, B=r.B, T=r.T, I=r.I, P=r.P, backend=r.backend,
                            cold_ms=_csv(r.cold_ms), fwd_ms=_csv(r.fwd_ms), fwdbwd_ms=_csv(r.fwdbwd_ms), baseline=r.baseline,
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
        import matplotlib  # lazy: matplotlib is optional
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib is optional
    except ImportError:
        return None
    return plt


def write_plot(path: str, rows: list[Row], plt, title: str) -> None:
    """Grouped bars (one group per mode and shape, one bar per backend), forward and forward+backward, log y."""
    timed = [r for r in rows if r.timed]
    groups = list(dict.fromkeys((r.mode, r.shape) for r in timed))
    backends = list(dict.fromkeys(r.backend for r in timed))   # in the order of the rows ("cuda v1", ...)
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
        epilog="backends: reference (NumPy, always), cpu (numba CPU kernels), torch (torch.nn on the CPU), cuda "
               "(numba.cuda kernels: a real GPU, or --simulator),\ncudnn (torch.nn on cuda).\nEach backend is validated against the float64 reference at T=2 "
               "(SPEC 10 tolerances) before it is timed.\n"
               f"default shapes: GPU {' '.join(GPU_SHAPES)}\n"
               f"                (--quick {' '.join(GPU_QUICK_SHAPES)});\n"
               f"                NumPy only {' '.join(CPU_SHAPES)} (--quick {' '.join(CPU_QUICK_SHAPES)});\n"
               f"                cuda in the simulator {' '.join(SIMULATOR_SHAPES)}.\n"
               "exit status: 0 ok, 1 a validation or timed call failed, 2 usage (bad flag, unavailable backend, "
               "--plot without matplotlib).")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                   help="backends to validate and time (default: every available one)")
    p.add_argument("--step-versions", nargs="+", type=int, default=None, metavar="V",
                   help="the cuda backend once per step-kernel version (1 2 3: rows 'cuda v1' ...; default: the "
                        "driver's choice, one 'cuda' row)")
    p.add_argument("--deepbench", action="store_true",
                   help="DeepBench's LSTM training shapes (the roofline model's): " + " ".join(DEEPBENCH_SHAPES))
    p.add_argument("--modes", nargs="+", choices=cell_names(), default=["lstm", "gru"],
                   help="rnn_modes (registered cells; default: lstm gru)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="default: float32")
    p.add_argument("--num-proj", type=int, default=0, metavar="P",
                   help="an LSTM projection of P outputs (0 < P <= H of every shape; cells that allow one; "
                        "default 0: none)")
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
    p.add_argument("--no-model", action="store_true",
                   help="without a GPU, do not print the profiler's model of the GPU kernels")
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
    if args.num_proj < 0:
        p.error(f"--num-proj: expected >= 0, got {args.num_proj}")
    return args


def _error(text: str) -> int:
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return 2


def choose_backends(args) -> tuple[list[str], dict, list[str], int | None]:
    """-> (backends to run, {backend: description}, notes to print, exit code when a named one is unavailable)."""
    requested = list(dict.fromkeys(args.backends)) if args.backends else None
    wanted = requested or [b for b in BACKENDS if not (b == "cudnn" and args.no_cudnn)]
    info = {"reference": "numbarnn.reference (NumPy, float64 inside)"}
    chosen = ["reference"] if "reference" in wanted else []
    notes = []
    for name in [b for b in BACKENDS if b in wanted and b != "reference"]:
        if name == "cuda":
            ok, simulated, why = cuda_status(args.simulator)
            if ok and simulated:
                notes.append("WARNING: the cuda backend runs in numba's CUDA simulator (--simulator): one Python "
                             "thread per CUDA thread, so its timings mean nothing about a GPU; they only show that "
                             "the path runs.")
        elif name == "cpu":
            ok, why = cpu_status()
        else:
            ok, why = torch_status("cpu" if name == "torch" else measure.TORCH_CUDA_DEVICE)
            if name == "cudnn" and measure.TORCH_CUDA_DEVICE != "cuda":
                why += " (a stand-in, not cuDNN)"
        info[name] = why
        if ok:
            chosen.append(name)
        elif requested:
            return chosen, info, notes, _error(f"--backends {name}: {why}")
        else:
            notes.append(f"note: {name} backend skipped: {why}")
    return [b for b in BACKENDS if b in chosen], info, notes, None


def default_shapes(args, backends: list[str], cuda_simulated: bool) -> list[tuple]:
    if "cudnn" in backends or ("cuda" in backends and not cuda_simulated):
        names = GPU_QUICK_SHAPES if args.quick else GPU_SHAPES
    elif "cuda" in backends:
        names = SIMULATOR_QUICK_SHAPES if args.quick else SIMULATOR_SHAPES
    else:
        names = CPU_QUICK_SHAPES if args.quick else CPU_SHAPES
    return [parse_shape(s) for s in names]


def print_gpu_model() -> None:
    """No GPU to time the kernels on: print the memory profiler's roofline MODEL of them instead."""
    try:
        text = model_report()
    except Exception as exc:   # informative only: the timings above stand on their own
        text = f"(no GPU model: {type(exc).__name__}: {exc})"
    print("\nNo GPU here, so no cuda timings. " + text)


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
    cuda_simulated = "cuda" in backends and settings.simulator()
    if args.deepbench and args.shapes:
        return _error("--deepbench and --shapes: give one of them")
    shapes = args.shapes or ([parse_shape(t) for t in DEEPBENCH_SHAPES] if args.deepbench
                             else default_shapes(args, backends, cuda_simulated))
    if args.num_proj:
        no_proj = [m for m in args.modes if not get_cell(m).projection]
        if no_proj:
            return _error(f"--num-proj: {', '.join(no_proj)} allow{'s' * (len(no_proj) == 1)} no projection "
                          f"(give --modes lstm, or cells registered with projection=True)")
        narrow = [measure.shape_label(s) for s in shapes if args.num_proj > s[0]]
        if narrow:
            return _error(f"--num-proj: {args.num_proj} > H in {' '.join(narrow)} (a projection has P <= H)")
    versions = list(dict.fromkeys(args.step_versions or []))
    if versions:
        from .kernels.driver import STEP_VERSIONS  # lazy: the kernels import numba.cuda
        if "cuda" not in backends:
            return _error("--step-versions: times the cuda backend, which is not among the backends run")
        bad = [v for v in versions if v not in STEP_VERSIONS]
        if bad:
            return _error(f"--step-versions: expected some of {STEP_VERSIONS}, got {bad}")
    if "cuda" in backends and not cuda_simulated:
        device = info["cuda"]
    elif "cudnn" in backends and measure.TORCH_CUDA_DEVICE == "cuda":
        device = info["cudnn"].rsplit(" on ", 1)[-1]
    else:
        device = f"CPU ({os.cpu_count()} cores)" + (", cuda backend in numba's CUDA simulator" if cuda_simulated
                                                     else "")
    print(f"device: {device}   [numba: {env}]")
    for b in backends:
        print(f"  {b:<9} {info[b]}")
    for note in notes:
        print(note)
    proj = f", projection P = {args.num_proj}" if args.num_proj else ""
    print(f"dtype {args.dtype}; one layer, unidirectional, I = H{proj}, full-length sequences; median of {args.reps} "
          f"call{'s' * (args.reps != 1)} after {args.warmup} warm-up call{'s' * (args.warmup != 1)}")
    print(f"validation: every named output vs the float64 reference at T={CHECK_T} (SPEC 10 tolerances), before "
          f"timing\n", flush=True)

    adapters = {}
    for b in backends:
        for adapter in ([measure.CudaAdapter(v) for v in versions] if b == "cuda" and versions
                        else [make_adapter(b)]):
            adapters[adapter.name] = adapter
    started = []
    try:
        for adapter in adapters.values():
            adapter.start()
            started.append(adapter)
        rows, failed = measure_all(args.modes, args.dtype, shapes, adapters, args.reps, args.warmup,
                                   log=lambda text: print(text, flush=True), num_proj=args.num_proj)
    finally:
        for adapter in started:
            adapter.stop()

    print()
    print(format_table(rows))
    print(f"\nratio = time / time of the baseline for the same mode and shape, the first of "
          f"{' > '.join(BASELINES)} timed (above 1: slower)\nerr vs f64 = this backend's worst relative error "
          f"‖out − ref‖/‖ref‖ over the outputs and gradients, against the float64 reference on the same inputs "
          f"(T={CHECK_T}; a failed check: not timed). The reference row is the float64 reference rounded to the "
          f"dtype: its value is that rounding, the floor for every backend.")

    if cuda_simulated:
        print("(cuda: numba's CUDA simulator, timings meaningless)")
    if ("cuda" not in backends or cuda_simulated) and not args.no_model:
        print_gpu_model()
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

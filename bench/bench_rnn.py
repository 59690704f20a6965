"""DeepBench-style benchmark of numbarnn's RNN kernels (CudnnRNNV3 / CudnnRNNBackpropV3) against cuDNN.

    python bench/bench_rnn.py                                 # LSTM and GRU, float32, the default shapes
    python bench/bench_rnn.py --quick                         # two small shapes, fewer repetitions
    python bench/bench_rnn.py --modes lstm --dtype float16 --shapes 1024x32x25 512x1x100 --csv out.csv

A shape is HxBxT: H hidden units (= input size I, as in DeepBench), B batch, T time steps; one layer,
unidirectional, linear input, full-length sequences (DeepBench's RNN training set-up).

For each shape:
1. validation: the cuda backend against the NumPy reference on the same H, B (and I) at T=2, in float64
   (tolerance 1e-10) and in the benchmark dtype (SPEC 10 tolerances: float32 1e-5 outputs / 1e-4 gradients,
   float16 1e-2), every named output (output, output_h, output_c, reserve_space, input_backprop,
   input_h_backprop, input_c_backprop, params_backprop).  A shape that fails is not timed; the exit code is 1.
2. timing of numbarnn's kernels with device arrays (numba.cuda.to_device; nothing goes through the host):
   `forward` = one training-mode cudnn_rnn_v3 call (it writes the reserve space), `fwd+bwd` = that call plus
   cudnn_rnn_backprop_v3.  Warm-up calls first (numba compiles every kernel on its first launch, so the
   compile stays out of the timing), numba.cuda.synchronize() before and after each timed call, the median
   of --reps calls.  The times include numbarnn's Python-side work (argument checks, launch overhead),
   because a user pays for it too.
3. the same two timings for cuDNN through torch.nn.LSTM / nn.GRU on cuda (training mode, the same weights
   loaded with numbarnn.params.to_torch_state_dict; backward = torch.autograd.grad of the same upstream
   gradients), when torch with CUDA is installed, and the relative difference of the two outputs.
The table shows milliseconds and the ratio numbarnn / cuDNN (above 1: numbarnn is slower).

Without a real GPU (NUMBA_ENABLE_CUDASIM=1, or no CUDA driver/device) nothing is timed: the script says so,
runs a tiny validation of the requested modes in numba's CUDA simulator, and exits 0 (1 if that fails).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

#: DeepBench-like training shapes (H, B, T): hidden sizes 256-1024, batch 1-64, 25-100 steps
DEFAULT_SHAPES = ["256x16x25", "512x32x25", "512x1x100", "1024x64x25", "1024x16x50", "256x64x100"]
QUICK_SHAPES = ["256x16x25", "512x4x25"]
MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
CSV_FIELDS = ["mode", "dtype", "H", "B", "T", "I", "check_rel_error", "check_ok", "numbarnn_fwd_ms",
              "cudnn_fwd_ms", "fwd_ratio", "numbarnn_fwdbwd_ms", "cudnn_fwdbwd_ms", "fwdbwd_ratio",
              "output_vs_cudnn", "launches_fwd", "launches_bwd", "reps", "device"]
TORCH_DEVICE = "cuda"   # where the cuDNN baseline runs ("cpu" only to test this script without a GPU)
FORWARD_NAMES = ("output", "output_h", "output_c", "reserve_space")
BACKWARD_NAMES = ("input_backprop", "input_h_backprop", "input_c_backprop", "params_backprop")


def parse_shape(text: str) -> tuple:
    try:
        H, B, T = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxBxT like 512x32x25, got {text!r}") from None
    if min(H, B, T) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return H, B, T


def simulator_enabled() -> bool:
    import numba
    return bool(numba.config.ENABLE_CUDASIM)


# --------------------------------------------------------------------------------------------------
# validation: cuda backend vs NumPy reference
# --------------------------------------------------------------------------------------------------

def make_case(mode: str, H: int, B: int, T: int, I: int, dtype, seed: int = 0, lengths=None):  # noqa: E741
    """A one-layer, unidirectional, linear-input case with data scaled like torch's default init."""
    from numbarnn.config import rnn_config
    from numbarnn.testing import make_rnn_case

    cfg = rnn_config(1, H, I, mode, input_mode="linear_input")
    return make_rnn_case(cfg, T, B, lengths, seed=seed, dtype=dtype, scale=1.0 / math.sqrt(max(H, I)))


def check_case(case) -> tuple[float, str, bool]:
    """Every named output of backend="cuda" vs backend="reference" on the same inputs.

    -> (worst relative error, the output it belongs to, all within the SPEC 10 tolerances).
    """
    from numbarnn.testing import TOLERANCES, relative_error, run_backward, run_forward

    tol_out, tol_grad = TOLERANCES[np.dtype(case.dtype)]
    fwd_cuda, fwd_ref = run_forward(case, "cuda"), run_forward(case, "reference")
    bwd_cuda, bwd_ref = run_backward(case, fwd_cuda, "cuda"), run_backward(case, fwd_ref, "reference")
    worst, worst_name, ok = 0.0, "-", True
    pairs = list(zip(FORWARD_NAMES, fwd_cuda[:4], fwd_ref[:4])) + list(zip(BACKWARD_NAMES, bwd_cuda, bwd_ref))
    for name, got, want in pairs:
        got = got.copy_to_host() if hasattr(got, "copy_to_host") else np.asarray(got)
        if got.shape != np.shape(want):
            return float("inf"), name, False
        err = relative_error(got, want)
        tol = tol_out if name in FORWARD_NAMES else tol_grad
        ok &= bool(err <= tol)
        if err >= worst:
            worst, worst_name = err, name
    return worst, worst_name, ok


def validate_shape(mode, H, B, I, dtype, T: int = 2, lengths=None, verbose=True) -> tuple[float, bool]:  # noqa: E741
    """float64 and the benchmark dtype at T steps; prints one line each.  -> (worst error in dtype, ok)."""
    ok, err_dt = True, float("nan")
    for dt in dict.fromkeys(["float64", dtype]):
        err, name, good = check_case(make_case(mode, H, B, T, I, dt, seed=H + B, lengths=lengths))
        ok &= good
        if dt == dtype:
            err_dt = err
        if verbose:
            print(f"  check {mode:<8} {dt:<8} H={H} B={B} T={T} I={I}: worst rel. error {err:.1e} ({name}) "
                  f"{'ok' if good else 'FAIL'}", flush=True)
    return err_dt, ok


def tiny_validation(modes, dtype) -> bool:
    """Simulator-sized checks (no timing): the benchmark's configuration and a ragged batch, per mode."""
    ok = True
    for mode in modes:
        ok &= validate_shape(mode, 3, 2, 2, dtype, T=3)[1]
        ok &= validate_shape(mode, 4, 3, 3, dtype, T=3, lengths=[3, 0, 2])[1]
    return ok


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------

def median_ms(fn, sync, reps: int, warmup: int) -> float:
    """Median wall time in ms of fn() over `reps` calls, synchronising before and after each one."""
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


def numbarnn_runners(case):
    """(forward, forward+backward) closures over device copies of the case's arrays."""
    from numba import cuda

    from numbarnn import ops

    dev = {k: (None if v is None else cuda.to_device(np.ascontiguousarray(v)))
           for k, v in dict(x=case.x, h0=case.h0, c0=case.c0, params=case.params, dy=case.dy, dhT=case.dhT,
                            dcT=case.dcT).items()}
    attrs = case.attrs

    def forward():
        return ops.cudnn_rnn_v3(dev["x"], dev["h0"], dev["c0"], dev["params"], None, is_training=True,
                                backend="cuda", **attrs)

    def forward_backward():
        y, hT, cT, reserve, host_reserved = forward()
        return ops.cudnn_rnn_backprop_v3(dev["x"], dev["h0"], dev["c0"], dev["params"], None, y, hT, cT,
                                         dev["dy"], dev["dhT"], dev["dcT"], reserve, host_reserved,
                                         backend="cuda", **attrs)

    return forward, forward_backward


def cudnn_available() -> str | None:
    """A description of cuDNN through torch when usable on cuda, else None."""
    try:
        import torch
    except Exception:
        return None
    try:
        if torch.cuda.is_available() and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled:
            return f"cuDNN {torch.backends.cudnn.version()} via torch {torch.__version__}"
    except Exception:
        pass
    return None


def torch_sync():
    import torch
    if TORCH_DEVICE == "cuda":
        torch.cuda.synchronize()


def cudnn_runners(case):
    """(forward, forward+backward, output of one forward as NumPy) for torch.nn.LSTM/GRU/RNN on cuda.

    Training mode, numbarnn's weights (to_torch_state_dict); the backward is torch.autograd.grad of the same
    upstream gradients with respect to the input, the initial states and every parameter (fresh buffers,
    like cudnn_rnn_backprop_v3's).
    """
    import torch

    from numbarnn.params import to_torch_state_dict

    cfg = case.cfg
    tdt = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}[str(case.dtype)]
    kw = dict(input_size=cfg.I, hidden_size=cfg.H, num_layers=cfg.L, bidirectional=cfg.D == 2)
    module = {"lstm": lambda: torch.nn.LSTM(**kw), "gru": lambda: torch.nn.GRU(**kw),
              "rnn_tanh": lambda: torch.nn.RNN(nonlinearity="tanh", **kw),
              "rnn_relu": lambda: torch.nn.RNN(nonlinearity="relu", **kw)}[cfg.rnn_mode]()
    module = module.to(dtype=tdt)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in to_torch_state_dict(cfg, case.params).items()}
    module.load_state_dict(state, strict=True)             # copies (and casts) into the module's parameters
    module = module.to(device=TORCH_DEVICE).train()

    def tensor(a, grad=False):
        return None if a is None else torch.tensor(np.asarray(a), device=TORCH_DEVICE, dtype=tdt, requires_grad=grad)

    x, h0, c0 = tensor(case.x, True), tensor(case.h0, True), tensor(case.c0, True)
    dy, dhT, dcT = tensor(case.dy), tensor(case.dhT), tensor(case.dcT)
    lstm = cfg.is_lstm
    inputs = [x, h0] + ([c0] if lstm else []) + list(module.parameters())

    def forward():
        return module(x, (h0, c0) if lstm else h0)

    def forward_backward():
        y, state_T = forward()
        outs, grads = ([y, state_T[0], state_T[1]], [dy, dhT, dcT]) if lstm else ([y, state_T], [dy, dhT])
        return torch.autograd.grad(outs, inputs, grads)

    with torch.no_grad():
        y_ref = forward()[0].double().cpu().numpy()
    return forward, forward_backward, y_ref


def fmt(v, spec=".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def bench(args) -> int:
    from numba import cuda

    from numbarnn.kernels import driver
    from numbarnn.testing import relative_error

    dev = cuda.get_current_device()
    name = getattr(dev, "name", "numba CUDA simulator")
    device = name.decode() if isinstance(name, bytes) else str(name)
    cudnn = None if args.no_cudnn else cudnn_available()
    print(f"device: {device}")
    print(f"baseline: {cudnn or 'none (torch with CUDA and cuDNN not available): numbarnn timings only'}")
    print(f"timing: median of {args.reps} calls after {args.warmup} warm-up calls, device arrays, dtype "
          f"{args.dtype}; one layer, unidirectional, I = H\n")
    print("validation (cuda backend vs NumPy reference, T=2, same H and B):", flush=True)

    rows, failed = [], False
    for mode in args.modes:
        for H, B, T in args.shapes:
            I = H  # noqa: E741 - DeepBench: input size = hidden size
            err, ok = validate_shape(mode, H, B, I, args.dtype)
            row = dict(mode=mode, dtype=args.dtype, H=H, B=B, T=T, I=I, check_rel_error=err, check_ok=ok,
                       reps=args.reps, device=device)
            rows.append(row)
            if not ok:
                failed = True
                continue
            case = make_case(mode, H, B, T, I, args.dtype, seed=1)
            fwd, fwdbwd = numbarnn_runners(case)
            row["numbarnn_fwd_ms"] = median_ms(fwd, cuda.synchronize, args.reps, args.warmup)
            row["numbarnn_fwdbwd_ms"] = median_ms(fwdbwd, cuda.synchronize, args.reps, args.warmup)
            launches = driver.last_launch_count()
            row["launches_fwd"], row["launches_bwd"] = launches["forward"].total, launches["backward"].total
            if cudnn:
                t_fwd, t_fwdbwd, y_cudnn = cudnn_runners(case)
                row["cudnn_fwd_ms"] = median_ms(t_fwd, torch_sync, args.reps, args.warmup)
                row["cudnn_fwdbwd_ms"] = median_ms(t_fwdbwd, torch_sync, args.reps, args.warmup)
                row["fwd_ratio"] = row["numbarnn_fwd_ms"] / row["cudnn_fwd_ms"]
                row["fwdbwd_ratio"] = row["numbarnn_fwdbwd_ms"] / row["cudnn_fwdbwd_ms"]
                y = fwd()[0].copy_to_host()
                row["output_vs_cudnn"] = relative_error(y, y_cudnn)
            print(f"  timed {mode} H={H} B={B} T={T}", flush=True)

    print()
    header = (f"{'mode':<8} {'dtype':<8} {'H':>5} {'B':>4} {'T':>4} {'check':>8} | {'fwd ms':>9} {'cuDNN':>9} "
              f"{'ratio':>6} | {'fwd+bwd ms':>10} {'cuDNN':>9} {'ratio':>6} | {'vs cuDNN':>8} {'launches f/b':>12}")
    print(header)
    print("-" * len(header))
    for r in rows:
        check = fmt(r["check_rel_error"], ".1e") if r["check_ok"] else "FAIL"
        launches = f"{r['launches_fwd']}/{r['launches_bwd']}" if "launches_fwd" in r else "-"
        print(f"{r['mode']:<8} {r['dtype']:<8} {r['H']:>5} {r['B']:>4} {r['T']:>4} {check:>8} | "
              f"{fmt(r.get('numbarnn_fwd_ms')):>9} {fmt(r.get('cudnn_fwd_ms')):>9} "
              f"{fmt(r.get('fwd_ratio'), '.2f'):>6} | "
              f"{fmt(r.get('numbarnn_fwdbwd_ms')):>10} {fmt(r.get('cudnn_fwdbwd_ms')):>9} "
              f"{fmt(r.get('fwdbwd_ratio'), '.2f'):>6} | {fmt(r.get('output_vs_cudnn'), '.1e'):>8} {launches:>12}")
    print("\nratio = numbarnn / cuDNN (above 1: numbarnn is slower); vs cuDNN = relative difference of the outputs")
    if args.csv:
        write_csv(args.csv, rows)
    if failed:
        print("validation FAILED for at least one shape: those shapes were not timed")
        return 1
    return 0


def write_csv(path: str, rows) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in CSV_FIELDS})
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["lstm", "gru"], choices=MODES)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "float64"])
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=None, metavar="HxBxT",
                   help=f"default: {' '.join(DEFAULT_SHAPES)}")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement (median); default 10, "
                                                          "--quick 3")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (compilation)")
    p.add_argument("--quick", action="store_true", help=f"shapes {' '.join(QUICK_SHAPES)}, 3 repetitions")
    p.add_argument("--csv", metavar="PATH", help="also write the results as CSV")
    p.add_argument("--no-cudnn", action="store_true", help="skip the torch/cuDNN baseline")
    p.add_argument("--tiny-validation", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)   # run bench() in the simulator
    args = p.parse_args(argv)
    if args.shapes is None:
        args.shapes = [parse_shape(s) for s in (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)]
    if args.reps is None:
        args.reps = 3 if args.quick else 10
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if simulator_enabled() or args.tiny_validation:
        if args.simulate:   # exercise the whole benchmark path on tiny shapes (for tests of this script)
            print("SIMULATOR RUN (--simulate): the timings below are of numba's CUDA simulator, not of a GPU")
            return bench(args)
        print("NO REAL GPU: numba's CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1), so nothing is timed.\n"
              "Tiny validation of the cuda backend against the NumPy reference in the simulator:", flush=True)
        ok = tiny_validation(args.modes, args.dtype)
        print("tiny validation " + ("passed" if ok else "FAILED") + "; no timings (run on a machine with a GPU)")
        return 0 if ok else 1
    from numba import cuda
    if not cuda.is_available():
        print("NO REAL GPU: no CUDA driver/device found, so nothing is timed.\n"
              "Running a tiny validation in numba's CUDA simulator instead:", flush=True)
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--tiny-validation", "--dtype", args.dtype,
               "--modes", *args.modes]
        return subprocess.run(cmd, env=env).returncode
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``numbarnn`` command line (also ``python -m numbarnn``).

    numbarnn check    [config flags]   forward + backward on random data: finite-difference check of the
                                       reference, every backend against the float64 reference (SPEC 10);
                                       with no config flags, a sweep of ~12 small configurations
    numbarnn explain  [config flags]   the opaque params layout, the reserve_space layout, the launch plan
    numbarnn kernels  [--json] [--cc 80 90]   registers / spills / occupancy of every kernel (no GPU needed)
    numbarnn profile  [config flags] [--json] [--gpu NAME]   memory profile in the CUDA simulator + roofline model
    numbarnn bench    [args]           validated timings of the available backends (numbarnn.bench)

No GPU: the cuda backend runs in numba's CUDA simulator. NUMBA_ENABLE_CUDASIM must be set before numba
is imported, so nothing here imports numba (or a module that does) at module level: `main` first decides
whether a real GPU is present (``nvidia-smi -L``, or NUMBARNN_REAL_GPU=1), sets NUMBA_ENABLE_CUDASIM=1 when
none is and the user did not set the variable, and only then imports numbarnn's ops and backends.

This module parses and prints; what a check does lives in numbarnn/checks.py (with numbarnn/verify.py's output
names and SPEC 10 tolerances), what the bench measures in numbarnn/measure.py.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import replace

from . import bench
from .analysis import profiler
from .analysis.profiler import add_arguments as add_profile_arguments
from .analysis.profiler import is_step_kernel   # one rule for "launched per step"
from .block_lstm_config import GATE_ORDER
from .checks import (BACKEND_NAMES, CUDA_BACKEND_MODULE, DIRECTIONS, DTYPES, INPUT_MODES, SWEEP,  # noqa: F401
                     CheckResult, Spec, _exc, check_spec, launch_info, load_cuda_backend, torch_available)
from .cells import load_cell_modules
from .device import REAL_GPU_VAR, SIM_VAR  # noqa: F401 (the variables the CLI honours)
from .device import use_simulator_unless_gpu as setup_cuda_environment
from .params import param_regions, params_size
from .reserve import reserve_entries, reserve_size

# ---------------------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------------------

def _fmt_err(e: float | None) -> str:
    return "-" if e is None else f"{e:.2e}"


def format_table(headers, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers).rstrip(), "-+-".join("-" * w for w in widths)] + [line(r).rstrip() for r in rows])


def rows_table(rows) -> str:
    body = [(r.name, r.backend, _fmt_err(r.error), f"{r.tolerance:.0e}", "ok" if r.ok else "FAIL")
            + ((r.note,) if any(x.note for x in rows) else ()) for r in rows]
    headers = ("name", "backend", "rel. error", "tolerance", "ok") + (("note",) if any(x.note for x in rows)
                                                                     else ())
    return format_table(headers, body)



# ---------------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------------

#: Spec field -> argparse dest of the config flags (all default to None: "not given")
CONFIG_DESTS = ("mode", "layers", "units", "input_size", "direction", "input_mode", "proj", "batch", "time",
                "lengths", "dtype", "dropout", "seed", "seed2", "data_seed", "batch_major", "blocklstm", "peephole",
                "v1", "cell_clip", "forget_bias", "seq_len_max", "zoneout")


def _int_list(text: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 7,5,5,2,1,1, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one length")
    return values


def _name_list(text: str) -> tuple:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [n for n in names if n not in BACKEND_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(BACKEND_NAMES)}, "
                                         f"got {text!r}")
    return tuple(dict.fromkeys(names))


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _nonnegative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration (the op attributes; defaults: lstm L=1 H=3 I=2 T=3 B=2 float32)")
    g.add_argument("--mode", help="rnn_mode: lstm, gru, rnn_tanh, rnn_relu, or a cell registered by --cells")
    g.add_argument("--cells", action="append", metavar="MODULE_OR_FILE",
                   help="import a module (numbarnn.contrib.cifg_lstm) or a .py file that registers cells with "
                        "numbarnn.cells.register, so that --mode can name them (repeatable)")
    g.add_argument("--layers", type=_positive, help="num_layers L")
    g.add_argument("--units", type=_positive, help="num_units H (cell size C with --blocklstm)")
    g.add_argument("--input-size", dest="input_size", type=_positive, help="input size I (default: H for "
                   "skip_input, else 2)")
    g.add_argument("--direction", choices=DIRECTIONS)
    g.add_argument("--input-mode", dest="input_mode", choices=INPUT_MODES)
    g.add_argument("--proj", type=_nonnegative, help="num_proj P (cells with a cell state; 0 = none)")
    g.add_argument("--batch", type=_nonnegative, help="batch B")
    g.add_argument("--time", type=_nonnegative, help="max time T")
    g.add_argument("--lengths", type=_int_list, help="sequence_lengths, e.g. 7,5,5,2,1,1 (sets B; T defaults "
                   "to the largest)")
    g.add_argument("--dtype", choices=DTYPES)
    g.add_argument("--dropout", type=float, help="dropout probability (applies with L > 1)")
    g.add_argument("--zoneout", type=float, help="haste's zoneout probability of h, in [0, 1) (SPEC 6.1)")
    g.add_argument("--seed", type=int, help="op attribute seed (dropout)")
    g.add_argument("--seed2", type=int, help="op attribute seed2 (dropout)")
    g.add_argument("--data-seed", dest="data_seed", type=int, help="seed of the random inputs and params")
    g.add_argument("--batch-major", dest="batch_major", action="store_true", default=None,
                   help="time_major=False: [B, T, ...] arrays")
    b = p.add_argument_group("BlockLSTM (--blocklstm: BlockLSTMV2 / BlockLSTMGradV2, or V1 with --v1)")
    b.add_argument("--blocklstm", action="store_true", default=None, help="check the BlockLSTM ops instead")
    b.add_argument("--peephole", action="store_true", default=None, help="use_peephole=True")
    b.add_argument("--v1", action="store_true", default=None, help="BlockLSTM / BlockLSTMGrad (layout i,ci,f,o)")
    b.add_argument("--cell-clip", dest="cell_clip", type=float, help="cell_clip (default: V1 3.0, V2 0 = off)")
    b.add_argument("--forget-bias", dest="forget_bias", type=float, help="forget_bias (V1, default 1.0)")
    b.add_argument("--seq-len-max", dest="seq_len_max", type=_nonnegative, help="seq_len_max (default T)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="numbarnn",
        description="cuDNN's RNN ops and TensorFlow's BlockLSTM ops as numba.cuda kernels, checked against a "
                    "NumPy reference. Without a GPU the cuda backend runs in numba's CUDA simulator.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    check = sub.add_parser("check", help="check forward/backward of every backend against the float64 reference",
                           description="Forward and backward on random data: a float64 finite-difference check of "
                                       "the reference, and every other backend against the float64 reference "
                                       "(SPEC 10 tolerances). Without configuration flags: a sweep of small "
                                       "configurations. Exit status 1 on any failure.")
    _add_config_flags(check)
    check.add_argument("--backends", type=_name_list,
                       help=f"comma-separated subset of {','.join(BACKEND_NAMES)} (default: all; cuda in the "
                            "simulator without a GPU; torch when it is installed)")
    check.add_argument("--quick", action="store_true", help="reference finite-difference checks only (fast)")
    check.add_argument("--tolerance", type=float, help="override every tolerance (for experiments)")
    check.add_argument("-v", "--verbose", action="store_true", help="print the full table of every sweep config")

    explain = sub.add_parser("explain", help="params layout, reserve_space layout and kernel launch plan",
                             description="Show the opaque params layout, what reserve_space holds and the kernel "
                                         "launch plan of one configuration.")
    _add_config_flags(explain)

    profile = sub.add_parser("profile", help="memory profile (requests, sectors, coalescing, bytes of R per step) "
                                             "of one forward + backward call in the CUDA simulator, and a "
                                             "roofline model of its time",
                             description="Runs cudnn_rnn_v3 + cudnn_rnn_backprop_v3 on the cuda backend in numba's "
                                         "CUDA simulator (always, GPU or not) and records every global and shared "
                                         "memory access (numbarnn.analysis.profiler). Defaults: H=I=32 B=8 T=3.")
    _add_config_flags(profile)
    add_profile_arguments(profile)

    sub.add_parser("kernels", help="registers, spills and occupancy of every kernel ([--json] [--cc 80 90])",
                   add_help=False)
    sub.add_parser("bench", help="validated timings per backend: reference (NumPy), cuda (GPU, or --simulator), "
                                 "cudnn (torch) [--quick] [--shapes HxBxT ...] [--csv PATH] [--plot PATH]",
                   add_help=False)
    return parser


def spec_from_args(args) -> Spec:
    """The single configuration the flags describe (unset flags take Spec's defaults)."""
    given = {k: getattr(args, k) for k in CONFIG_DESTS if getattr(args, k, None) is not None}
    spec = Spec(**given)
    if spec.lengths is not None:
        if args.batch is not None and args.batch != len(spec.lengths):
            raise ValueError(f"--lengths: expected --batch={args.batch} lengths, got {len(spec.lengths)}")
        spec = replace(spec, batch=len(spec.lengths))
        if args.time is None:
            spec = replace(spec, time=max(1, max(spec.lengths)))
        bad = [v for v in spec.lengths if not 0 <= v <= spec.time]
        if bad:
            raise ValueError(f"--lengths: expected every length in [0, T = {spec.time}], got {bad[0]}")
        if spec.blocklstm:
            raise ValueError("--lengths: BlockLSTM has no per-sequence lengths; use --seq-len-max")
    if spec.blocklstm:
        if spec.slm > spec.time or spec.slm < 0:
            raise ValueError(f"--seq-len-max: expected 0 <= seq_len_max <= T = {spec.time}, got {spec.slm}")
    else:
        spec.rnn_config()     # SPEC 11 checks of the attributes: a clear ValueError now, not a failed row later
    return spec


def _config_given(args) -> bool:
    return any(getattr(args, k, None) is not None for k in CONFIG_DESTS)


# ---------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------

def _print_launches(result: CheckResult, indent: str = "") -> None:
    for backend, counts in result.launches.items():
        for phase, (_, detail) in counts.items():
            print(f"{indent}{backend} kernel launches, {phase}: {detail}")


def cmd_check(args) -> int:
    spec = None
    if _config_given(args):
        try:
            setup_cuda_environment()       # before a --cells module can import numba
            load_cell_modules(args.cells)
            spec = spec_from_args(args)
        except (ValueError, TypeError) as exc:
            print(f"numbarnn check: error: {exc}", file=sys.stderr)
            return 2
    env = setup_cuda_environment()
    if args.quick:
        backends = ("reference",)
    elif args.backends is not None:
        backends = args.backends
    else:
        backends = tuple(b for b in BACKEND_NAMES if b != "torch") + (("torch",) if torch_available() else ())
    cuda_module = None
    if "cuda" in backends:
        cuda_module, why = load_cuda_backend()
        if cuda_module is None:
            if args.backends is not None and "cuda" in args.backends:
                print(f"numbarnn check: error: --backends cuda: {CUDA_BACKEND_MODULE} does not import ({why})",
                      file=sys.stderr)
                return 2
            print(f"note: cuda backend not available ({why}); checking the reference only")
            backends = tuple(b for b in backends if b != "cuda")
        else:
            print(f"cuda backend: {env}")
    print(f"backends: {', '.join(backends)}")

    if spec is not None:
        print(spec.label())
        result = check_spec(spec, backends, args.tolerance, cuda_module)
        print(rows_table(result.rows))
        for why in result.skipped:
            print(f"skipped {why}")
        _print_launches(result)
        verdict = "ok" if result.ok else "FAILED"
        print(f"{verdict} ({result.seconds:.1f} s)")
        return 0 if result.ok else 1

    results = []
    n = len(SWEEP)
    for k, spec in enumerate(SWEEP, 1):
        print(f"[{k}/{n}] {spec.label()} ...", end=" ", flush=True)
        result = check_spec(spec, backends, args.tolerance, cuda_module)
        results.append(result)
        print(f"{'ok' if result.ok else 'FAIL'} ({result.seconds:.1f} s)", flush=True)
        if args.verbose or not result.ok:
            print("    " + rows_table(result.rows).replace("\n", "\n    "))
            _print_launches(result, "    ")
    summary = []
    for k, result in enumerate(results, 1):
        for backend in dict.fromkeys(r.backend for r in result.rows):
            w = result.worst(backend)
            launches = result.launches.get(backend, {})
            worst = f"{w.name}: {_fmt_err(w.error)}" if w.error is not None else \
                f"{w.name}: {(w.note or 'error')[:48]}"
            summary.append((k, result.spec.label(), backend, worst, f"{w.tolerance:.0e}",
                            "/".join(str(launches[x][0]) for x in ("forward", "backward") if x in launches) or "-",
                            "ok" if all(r.ok for r in result.rows if r.backend == backend) else "FAIL"))
    print()
    print(format_table(("#", "configuration", "backend", "worst rel. error", "tolerance", "launches f/b", "ok"),
                       summary))
    failed = [r for r in results if not r.ok]
    total = sum(r.seconds for r in results)
    print(f"\n{n - len(failed)}/{n} configurations ok ({total:.1f} s)")
    return 1 if failed else 0


# explain ---------------------------------------------------------------------------------------------

def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def plan_table(plan: list[dict], call) -> str:
    """The driver's launch plan (numbarnn.kernels.driver.launch_plan) as a table plus a per-step summary."""
    rows = []
    for r in plan:
        grid = "x".join(str(g) for g in r["grid"]) if r["grid"] else "-"
        rows.append((r["phase"], "-" if r["layer"] is None else str(r["layer"]), r["kernel"], str(r["launches"]),
                     f"({grid}) x {r['block']}" if r["block"] else "-", _human(r["flops"]), _human(r["bytes"]) + "B"))
    out = [format_table(("phase", "layer", "kernel", "launches", "grid x block", "FLOP/launch", "bytes/launch"),
                        rows)]
    steps = max(call.lengths, default=0)
    for phase in ("forward", "backward"):
        total = sum(r["launches"] for r in plan if r["phase"] == phase)
        per_step = sum(r["launches"] for r in plan if r["phase"] == phase and is_step_kernel(r["kernel"])
                       ) // max(1, steps * call.config.L)
        out.append(f"{phase}: {total} launches in all; {per_step} per step per layer (both directions together), "
                   f"{steps} steps (max length)")
    return "\n".join(out)


def cmd_explain(args) -> int:
    env = setup_cuda_environment()
    try:
        load_cell_modules(args.cells)
        spec = spec_from_args(args)
    except (ValueError, TypeError) as exc:
        print(f"numbarnn explain: error: {exc}", file=sys.stderr)
        return 2
    if spec.blocklstm:
        return _explain_block(spec)
    call = spec.rnn_call(is_training=True)
    cfg = call.config
    module, why = load_cuda_backend()
    print(f"cuda backend: {env if module is not None else 'not available (' + str(why) + ')'}")
    print(f"configuration: {spec.label()}")
    print(f"  L={cfg.L} D={cfg.D} G={cfg.G} (gates {', '.join(cfg.gate_names)}) H={cfg.H} P={cfg.P} I={cfg.I} "
          f"input_mode={cfg.input_mode} time_major={call.time_major}")
    print(f"\nparams: {params_size(cfg)} elements (SPEC 4.2: every matrix, then every bias; row-major [out, in])")
    rows = [(str(r.offset), str(r.size), _shape(r.shape), f"{r.describe(cfg)} (linear id {r.linear_id})")
            for r in param_regions(cfg)]
    print(format_table(("offset", "size", "shape", "meaning"), rows))
    if cfg.skip_input:
        print("  (skip_input: the layer-0 W matrices are absent, W = identity; their biases remain)")
    if cfg.cell.diagonal:
        print("  (diagonal recurrence: each R_g slot holds a vector u_g [H], rh_g = u_g ⊙ h + bR_g; no "
              "recurrent product)")
    if cfg.cell.modulated:
        print(f"  (modulated state: gates {', '.join(cfg.cell.modulated)} take rh_g = R_g (m ⊙ h) + bR_g, m from the "
              f"other gates of the same step: two recurrent products per step)")
    if cfg.cell.layer_norm:
        print(f"  (layer normalisation across each row of {', '.join(cfg.cell.layer_norm)}: SPEC 13; gains and the "
              f"state's bias are the N regions at the end of the params)")
    print(f"\nreserve_space: {reserve_size(call)} elements for a training call (time-major, original time "
          f"indices, 0 past each sequence's length)")
    rows = [(e.name, str(e.offset), _shape(e.shape), e.meaning) for e in reserve_entries(call)]
    print(format_table(("name", "offset", "shape", "meaning"), rows))
    if cfg.dropout > 0 and cfg.L > 1:
        print("  (keep flags: a pure function of (seed, seed2, layer, t, b, j), SPEC 6)")
    if cfg.zoneout:
        print(f"  (zoneout={cfg.zoneout:g}: h' = h_new where zmask is 1, else h_prev; the mask a pure function of "
              f"(seed, seed2, pseudo-layer, t, b, j), SPEC 6.1; inference takes p*h_prev + (1-p)*h_new)")
    print("host_reserved: int8 fingerprint of the forward call (mode, shapes, dtype, lengths, dropout, seeds) and "
          "its nonce, checked by backprop (a reserve_space from another forward call is an error)")

    print("\nkernel launch plan (launch sizes of a real GPU; FLOPs and compulsory bytes are estimates):")
    if module is None:
        print(f"  not available: {why}")
    else:
        plan = module.launch_plan(call)
        print(plan if isinstance(plan, str) else plan_table(plan, call))
        if cfg.cell.diagonal or cfg.cell.modulated or cfg.cell.layer_norm or cfg.zoneout:   # the step kernels it falls back
            note = module.driver.step_plan(call, "forward", simulator=False).note
            if note:
                print(f"  step kernels: {note}")
    return 0


def _explain_block(spec: Spec) -> int:
    layout = "icfo" if spec.v1 else "ifco"
    T, B, I, C = spec.time, spec.batch, spec.I, spec.units
    print(f"configuration: {spec.label()}")
    print(f"\nw {_shape((I + C, 4 * C))}: rows 0..{I - 1} multiply x_t, rows {I}..{I + C - 1} multiply h_prev; "
          f"columns in gate blocks of C = {C}:")
    rows = [(g, f"{k * C}..{(k + 1) * C - 1}", {"i": "input gate", "ci": "cell input (tanh)", "f": "forget gate",
                                                 "o": "output gate"}[g]) for k, g in enumerate(GATE_ORDER[layout])]
    print(format_table(("gate", "columns of w / entries of b", "meaning"), rows))
    print(f"b {_shape((4 * C,))} in the same blocks; wci, wcf, wco {_shape((C,))} peepholes "
          f"({'used' if spec.peephole else 'ignored: use_peephole=False'})")
    print(f"\noutputs i, cs, f, o, ci, co, h: each {_shape((T, B, C))}, 0 at t >= seq_len_max = {spec.slm}; "
          f"they are also what the gradient op reads back (no separate reserve)")
    print(f"forget_bias={spec.forget_bias if spec.v1 else 0.0:g} cell_clip={spec.clip:g}"
          f"{' (off)' if spec.clip <= 0 else ''}")
    print("\nkernel launch plan (derived from the configuration):")
    print(f"  forward: 1 GEMM x @ w[:I] {_shape((spec.slm * B, I))} @ {_shape((I, 4 * C))}, then per step "
          f"(seq_len_max = {spec.slm}) 1 fused launch: h_p @ w[I:] + gates + cell update")
    print(f"  backward: per step 1-2 launches (pointwise dgates, dh = dgates @ w[I:]^T), then GEMMs for x_grad "
          f"and w_grad and reductions for b_grad{' and the peephole gradients' if spec.peephole else ''}")
    return 0


# kernels / bench ---------------------------------------------------------------------------------------

def cmd_kernels(argv) -> int:
    try:
        report = importlib.import_module("numbarnn.analysis.report")
    except Exception as exc:
        print(f"numbarnn kernels: error: numbarnn.analysis.report does not import ({_exc(exc)})", file=sys.stderr)
        return 2
    try:
        return int(report.main(list(argv)) or 0)
    except SystemExit as exc:     # its argparse: --help (0) or a bad flag (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def cmd_profile(args) -> int:
    """`numbarnn profile`: all of it lives in numbarnn.analysis.profiler (runs in the simulator, a subprocess
    if need be)."""
    return profiler.cli_main(args, spec_from_args)


def cmd_bench(argv) -> int:
    """`numbarnn bench [ARGS]` = numbarnn.bench.main(ARGS): validated timings per backend (reference, cuda, cudnn).

    It owns its flags and --help, and calls use_simulator_unless_gpu() itself before numba is imported; without
    a GPU it times the NumPy reference (the cuda backend only with --simulator, whose timings mean nothing).
    """
    return bench.main(list(argv))


# ---------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    """Entry point of `numbarnn` and `python -m numbarnn`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # kernels / bench pass their arguments through untouched (their own parsers own them)
    if argv and argv[0] == "kernels":
        return cmd_kernels(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # --help (0) or a bad flag (2, message already printed by argparse)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        if args.command == "check":
            return cmd_check(args)
        if args.command == "explain":
            return cmd_explain(args)
        if args.command == "profile":
            return cmd_profile(args)
    except BrokenPipeError:    # `numbarnn check | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    parser.print_help()        # pragma: no cover - subparsers are required
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

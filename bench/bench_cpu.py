"""The CPU backend against the reference and torch.nn on the CPU (issue 9), in one process, same threads.

    python bench/bench_cpu.py                 # the issue's shapes, markdown table on stdout
    python bench/bench_cpu.py --md PATH       # ... also written to PATH (bench/results/cpu.md)
    python bench/bench_cpu.py --quick         # small shapes (a smoke run)
    python bench/bench_cpu.py --tiny          # per-call cost at tiny sizes, one thread (with numbarnn.torch)
    python bench/bench_cpu.py --cells         # cells beyond cuDNN's (contrib: IndRNN, classic GRU, MGU, haste's
                                              # LayerNormLSTM / LayerNormGRU) and zoneout, beside the LSTM
    python bench/bench_cpu.py --train         # a training loop, numbarnn.torch beside torch.nn (bench_train_loop.py)
    python bench/bench_cpu.py --memory        # peak memory of training, each in its own process (bench_memory.py)
    python bench/bench_cpu.py --only bidirectional --backends cpu,cpu-apart,torch
                                              # a bidirectional layer's directions side by side or apart

For every shape: each implementation is validated first (its float32 outputs and gradients against the float64
reference within SPEC 10: 1e-5 outputs, 1e-4 gradients), then timed: the first call (cold: includes numba's
JIT compile, or its on-disk cache load, for "cpu") separately, then --reps interleaved rounds (default 3: every
shape's every backend once per round; median and best) of warm calls of forward (inference: is_training=False for numbarnn,
torch.no_grad for torch) and of forward+backward (training forward, backprop; torch: autograd).
Loss for backward: <y, dy> + <hT, dhT> (+ <cT, dcT>), the op's contract.

Settle: between one backend's calls and the next backend's, the bench sleeps --settle seconds (default
SETTLE_S).  The backends' idle thread pools keep spinning after a call (OpenBLAS's workers for ~0.1 s, libgomp's
briefly) and take cores from whatever runs next: measured in one process on this 2-core machine, torch.nn's
LSTM T=100 B=32 I=H=512 forward took 117 ms (median) with a 0.02 s pause after numbarnn's calls, 82 ms with
0.1 s, 70 ms with 0.2 s, and 69-71 ms with torch alone in its own process.  Tables measured without the pause
(bench/results/cpu.md before 2026-11-23) therefore favoured whichever backend ran second.

`cpu_rows(shapes=SHAPES, backends=("reference", "cpu", "torch"), reps=3)` returns the rows as dicts for
`numbarnn bench` (keys: shape, backend, cold_s, fwd_ms, fwdbwd_ms, fwd_ratio, fwdbwd_ratio (vs torch), err, and
the best-of-rounds twins fwd_best_ms, fwdbwd_best_ms, fwd_best_ratio, fwdbwd_best_ratio).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))   # this checkout's numbarnn

from numbarnn.config import rnn_config
from numbarnn.testing import make_rnn_case, relative_error, run_backward, run_forward


@dataclass(frozen=True)
class Shape:
    label: str
    mode: str
    T: int
    B: int
    H: int
    I: int
    L: int = 1
    direction: str = "unidirectional"
    zoneout: float = 0.0


SHAPES = (
    Shape("LSTM T=100 B=32 I=H=512", "lstm", 100, 32, 512, 512),
    Shape("GRU T=50 B=16 I=H=256", "gru", 50, 16, 256, 256),
    Shape("RNN-tanh T=100 B=32 I=H=512", "rnn_tanh", 100, 32, 512, 512),
    Shape("LSTM 2-layer bidirectional T=50 B=16 I=H=256", "lstm", 50, 16, 256, 256, 2, "bidirectional"),
)
QUICK = (Shape("LSTM T=8 B=4 I=H=16", "lstm", 8, 4, 16, 16), Shape("GRU T=6 B=3 I=H=8", "gru", 6, 3, 8, 8))
#: per-call cost (`--tiny`, one thread): a step of a sampling loop, of a cell-sized network, of a short batch
TINY = (Shape("LSTM T=1 B=1 I=8 H=16", "lstm", 1, 1, 16, 8), Shape("GRU T=1 B=1 I=8 H=16", "gru", 1, 1, 16, 8),
        Shape("LSTM T=10 B=4 I=32 H=64", "lstm", 10, 4, 64, 32),
        Shape("LSTM T=1 B=1 I=H=512", "lstm", 1, 1, 512, 512))     # a step of a large model: packing dominated
#: cells beyond cuDNN's (`--cells`, numbarnn.contrib): the cpu backend beside its built-in LSTM at the same shape
CELLS = (Shape("LSTM T=100 B=32 I=H=256", "lstm", 100, 32, 256, 256),
         Shape("IndRNN (tanh) T=100 B=32 I=H=256", "indrnn", 100, 32, 256, 256),
         Shape("IndRNN (relu) T=100 B=32 I=H=256", "indrnn_relu", 100, 32, 256, 256),
         Shape("classic GRU (gru_v1) T=100 B=32 I=H=256", "gru_v1", 100, 32, 256, 256),
         Shape("MGU T=100 B=32 I=H=256", "mgu", 100, 32, 256, 256),
         Shape("LSTM zoneout=0.1 T=100 B=32 I=H=256", "lstm", 100, 32, 256, 256, zoneout=0.1),
         Shape("LayerNormLSTM T=100 B=32 I=H=256", "layer_norm_lstm", 100, 32, 256, 256),
         Shape("LayerNormGRU T=100 B=32 I=H=256", "layer_norm_gru", 100, 32, 256, 256))
FMA_PORTS = 2          # FMA units per core: Zen 3, Zen 4 and Intel's server cores (AVX2/AVX-512) have two


def make_case(shape: Shape, dtype=np.float32):
    """Inputs ~ 0.1 N(0, 1); params ~ N(0, 1) * 0.5/sqrt(H) (torch.nn's init scale): a contracting recurrence,
    so float32 agrees with float64 after 100 steps (0.1 N(0, 1) weights at H=512 make RNN-tanh chaotic)."""
    from dataclasses import replace
    cfg = rnn_config(shape.L, shape.H, shape.I, shape.mode, direction=shape.direction, zoneout=shape.zoneout)
    case = make_rnn_case(cfg, shape.T, shape.B, None, seed=0, dtype=dtype, scale=0.1)
    return replace(case, params=(case.params * np.float32(5.0 / np.sqrt(shape.H))).astype(dtype))


# ---------------------------------------------------------------------------------------------------
# the implementations: (forward, forward+backward) callables returning named NumPy results
# ---------------------------------------------------------------------------------------------------

def numbarnn_runner(case, backend):
    from dataclasses import replace
    infer = replace(case, is_training=False)

    def fwd():
        y, hT, _, _, _ = run_forward(infer, backend)
        return {"output": y, "output_h": hT}

    def fwdbwd():
        out = run_forward(case, backend)
        dx, dh0, _, dparams = run_backward(case, out, backend)
        return {"output": out[0], "output_h": out[1], "input_backprop": dx, "input_h_backprop": dh0,
                "params_backprop": dparams}
    return fwd, fwdbwd


def torch_runner(case, dropin: bool = False):
    """torch.nn's module on the CPU, or with dropin=True numbarnn.torch's (the same calls, numbarnn's operator)."""
    import torch

    from numbarnn.params import from_torch_state_dict, to_torch_state_dict
    cfg = case.cfg
    nn = torch.nn
    if dropin:
        import numbarnn.torch as nn
    cls = {"lstm": nn.LSTM, "gru": nn.GRU}.get(cfg.rnn_mode)
    kw = {"input_size": cfg.I, "hidden_size": cfg.H, "num_layers": cfg.L, "bidirectional": cfg.D == 2}
    if cls is None:
        cls = nn.RNN
        kw["nonlinearity"] = "tanh" if cfg.rnn_mode == "rnn_tanh" else "relu"
    module = cls(**kw)
    module.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, np.float32))
                            for k, v in to_torch_state_dict(cfg, case.params).items()})
    lstm = cfg.has_cell_state
    x, h0 = torch.from_numpy(case.x), torch.from_numpy(case.h0)
    c0 = torch.from_numpy(case.c0) if lstm else None
    dy, dhT = torch.from_numpy(case.dy), torch.from_numpy(case.dhT)
    dcT = torch.from_numpy(case.dcT) if lstm else None

    def fwd():
        with torch.no_grad():
            y, state = module(x, (h0, c0) if lstm else h0)
        hT = state[0] if lstm else state
        return {"output": y.numpy(), "output_h": hT.numpy()}

    def fwdbwd():
        xg, hg = x.clone().requires_grad_(True), h0.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        y, state = module(xg, (hg, c0) if lstm else hg)
        hT = state[0] if lstm else state
        loss = (y * dy).sum() + (hT * dhT).sum()
        if lstm:
            loss = loss + (state[1] * dcT).sum()
        loss.backward()
        grads = {k: p.grad.numpy().astype(np.float64) for k, p in module.named_parameters()}
        return {"output": y.detach().numpy(), "output_h": hT.detach().numpy(), "input_backprop": xg.grad.numpy(),
                "input_h_backprop": hg.grad.numpy(), "params_backprop": from_torch_state_dict(cfg, grads)}
    return fwd, fwdbwd


def runner(case, backend):
    """backend: a numbarnn backend name, "torch" (torch.nn), "numbarnn.torch" (the drop-in, default backend) or
    "cpu-apart" (the cpu backend with a bidirectional layer's directions one after the other: the setting
    cpu_side_by_side off, to compare)."""
    if backend in ("torch", "numbarnn.torch"):
        return torch_runner(case, dropin=backend == "numbarnn.torch")
    if backend == "cpu-apart":
        from numbarnn import settings

        def apart(fn):
            def call():
                with settings.override(cpu_side_by_side=False):
                    return fn()
            return call
        return tuple(apart(fn) for fn in numbarnn_runner(case, "cpu"))
    return numbarnn_runner(case, backend)


# ---------------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------------

def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def validate(got: dict, ref: dict) -> float:
    """Worst relative error against the float64 reference; raises when outside SPEC 10 (float32)."""
    worst = 0.0
    for name, want in ref.items():
        err = relative_error(got[name], want)
        limit = 1e-5 if name in ("output", "output_h") else 1e-4
        if not err <= limit:
            raise AssertionError(f"{name}: relative error {err:.2e} > {limit:g} vs the float64 reference")
        worst = max(worst, err)
    return worst


#: seconds of pause before each backend's calls in a round (see the module docstring: "Settle")
SETTLE_S = 0.3


def cpu_rows(shapes=SHAPES, backends=("reference", "cpu", "torch"), reps=3, settle=SETTLE_S) -> list[dict]:
    """Rows (dicts) of the table: every shape and backend validated first, with its cold first call, then `reps`
    rounds that each time every shape's backends' forward and forward+backward in turn (interleaved: a burst of
    load from other processes on a shared machine hits every row of a round, not one row's whole series; the
    cells bench's ratios to the LSTM compare rows of the same rounds), each turn after a pause of `settle`
    seconds (the previous backend's thread pools go idle); median and best (min)."""
    import numba
    rows = []
    table = []                                   # per shape: backend -> (fwd, fwdbwd, row, fwd_s, fwdbwd_s)
    for shape in shapes:
        case = make_case(shape)
        ref = numbarnn_runner(case.astype(np.float64), "reference")[1]()
        runs = {}
        for backend in backends:
            if backend == "torch":
                try:
                    import torch  # noqa: F401
                except ImportError:
                    continue
            fwd, fwdbwd = runner(case, backend)
            t0 = time.perf_counter()
            got = fwdbwd()                     # cold: the first call (JIT compile or cache load for cpu)
            cold = time.perf_counter() - t0
            err = validate(got, ref)
            fwd()
            runs[backend] = (fwd, fwdbwd, {"shape": shape.label, "backend": backend, "cold_s": cold, "err": err,
                                           "threads": numba.get_num_threads()}, [], [])
        table.append(runs)
    for _ in range(reps):
        for runs in table:
            for fwd, fwdbwd, _row, fwd_s, fwdbwd_s in runs.values():
                time.sleep(settle)
                fwd_s.append(_seconds(fwd))
                fwdbwd_s.append(_seconds(fwdbwd))
    for runs in table:
        for fwd, fwdbwd, row, fwd_s, fwdbwd_s in runs.values():
            row.update(fwd_ms=1e3 * float(np.median(fwd_s)), fwdbwd_ms=1e3 * float(np.median(fwdbwd_s)),
                       fwd_best_ms=1e3 * min(fwd_s), fwdbwd_best_ms=1e3 * min(fwdbwd_s))
            rows.append(row)
        if "torch" not in runs:
            continue
        base = runs["torch"][2]
        for _fwd, _fwdbwd, r, _fwd_s, _fwdbwd_s in runs.values():
            for key in ("fwd", "fwdbwd", "fwd_best", "fwdbwd_best"):
                r[f"{key}_ratio"] = r[f"{key}_ms"] / base[f"{key}_ms"]
    return rows


def per_call_us(fn, calls: int, warm: int = 20) -> float:
    """Median microseconds of `calls` calls of fn, after `warm` calls."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(calls):
        times.append(_seconds(fn))
    return 1e6 * float(np.median(times))


def tiny_rows(shapes=TINY, backends=("cpu", "torch", "numbarnn.torch"), reps=3, calls=300) -> list[dict]:
    """Per-call cost at tiny sizes: each backend validated, then `reps` interleaved rounds of `calls` forward
    (inference) and `calls` forward+backward calls per backend; per round the median call, then the median of
    the rounds (keys: shape, backend, fwd_us, fwdbwd_us, fwd_ratio, fwdbwd_ratio vs torch.nn)."""
    rows = []
    for shape in shapes:
        case = make_case(shape)
        ref = numbarnn_runner(case.astype(np.float64), "reference")[1]()
        runs = {}
        for backend in backends:
            fwd, fwdbwd = runner(case, backend)
            validate(fwdbwd(), ref)
            runs[backend] = (fwd, fwdbwd, [], [])
        for _ in range(reps):
            for fwd, fwdbwd, fwd_us, fwdbwd_us in runs.values():
                fwd_us.append(per_call_us(fwd, calls))
                fwdbwd_us.append(per_call_us(fwdbwd, calls))
        base = runs.get("torch")
        for backend, (_, _, fwd_us, fwdbwd_us) in runs.items():
            row = {"shape": shape.label, "backend": backend, "fwd_us": float(np.median(fwd_us)),
                   "fwdbwd_us": float(np.median(fwdbwd_us))}
            if base is not None:
                row["fwd_ratio"] = row["fwd_us"] / float(np.median(base[2]))
                row["fwdbwd_ratio"] = row["fwdbwd_us"] / float(np.median(base[3]))
            rows.append(row)
    return rows


def tiny_markdown(rows) -> str:
    lines = ["| shape | backend | fwd (us) | fwd / torch | fwd+bwd (us) | fwd+bwd / torch |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        fr, br = (f"{r[k]:.2f}×" if k in r else "-" for k in ("fwd_ratio", "fwdbwd_ratio"))
        lines.append(f"| {r['shape']} | {r['backend']} | {r['fwd_us']:.0f} | {fr} | {r['fwdbwd_us']:.0f} | {br} |")
    return "\n".join(lines)


def clock_ghz() -> float | None:
    """The cores' clock, GHz: the kernel's maximum frequency where it publishes one (cpufreq), else the current
    one in /proc/cpuinfo (a VM's nominal clock), else None."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            return int(f.read()) / 1e6
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.lower().startswith("cpu mhz")]
        return max(mhz) / 1e3 if mhz else None
    except (OSError, ValueError):
        return None


def fma_peak_gflops(threads: int, fma_ports: int = FMA_PORTS) -> tuple[float, str] | None:
    """float32 FMA peak of `threads` cores: cores x FMA ports x lanes x 2 (multiply and add) x clock, and the
    formula with its numbers; None where the clock is unknown."""
    from numbarnn.cpu import microkernel
    ghz = clock_ghz()
    if ghz is None:
        return None
    lanes = microkernel.lanes_for(np.float32)
    peak = threads * fma_ports * lanes * 2 * ghz
    return peak, f"{threads} cores x {fma_ports} FMA ports x {lanes} lanes x 2 x {ghz:.2f} GHz = {peak:.0f} GFLOP/s"


def lstm_forward_flops(shape: Shape) -> float:
    """Multiply-adds x 2 of an LSTM forward: per step, row, layer and direction 4H x (I_l + H) (W x and R h)."""
    flops = 0.0
    for layer in range(shape.L):
        I_l = shape.I if layer == 0 else shape.H * (2 if shape.direction == "bidirectional" else 1)
        flops += (2 if shape.direction == "bidirectional" else 1) * 2.0 * 4 * shape.H * (I_l + shape.H)
    return flops * shape.T * shape.B


def peak_lines(rows, shapes, threads: int) -> list[str]:
    """For each LSTM shape: each backend's best forward in GFLOP/s and as a share of the FMA peak."""
    peak = fma_peak_gflops(threads)
    if peak is None:
        return ["FMA peak: the clock is unknown here (no cpufreq, no /proc/cpuinfo): not reported"]
    lines = [f"LSTM forward against the float32 FMA peak ({peak[1]}; {FMA_PORTS} FMA ports assumed: Zen 3/4 and "
             f"Intel's server cores have 2):"]
    for shape in shapes:
        if shape.mode != "lstm":
            continue
        for r in rows:
            if r["shape"] == shape.label and r["backend"] != "reference":
                gflops = lstm_forward_flops(shape) / (r["fwd_best_ms"] / 1e3) / 1e9
                lines.append(f"  {shape.label}, {r['backend']}: {gflops:.0f} GFLOP/s, {100 * gflops / peak[0]:.0f}% "
                             f"of the peak")
    return lines


def cell_lines(rows) -> list[str]:
    """Each cell's cpu time as a multiple of the first row's (the built-in LSTM at the same shape): medians, and
    in brackets the best rounds' (on a shared machine the medians of rows measured minutes apart swing with the
    load; the best rounds less)."""
    lstm = rows[0]
    return [f"{r['shape']}: forward {r['fwd_ms']:.1f} ms = {r['fwd_ms'] / lstm['fwd_ms']:.2f}x the LSTM's "
            f"(best {r['fwd_best_ms'] / lstm['fwd_best_ms']:.2f}x), forward+backward {r['fwdbwd_ms']:.1f} ms = "
            f"{r['fwdbwd_ms'] / lstm['fwdbwd_ms']:.2f}x (best {r['fwdbwd_best_ms'] / lstm['fwdbwd_best_ms']:.2f}x)"
            for r in rows[1:]]


def markdown(rows) -> str:
    lines = [("| shape | backend | cold first fwd+bwd (s) | fwd (ms) | fwd / torch | fwd+bwd (ms) | fwd+bwd / torch "
              "| best fwd (ms) | best fwd / torch | best fwd+bwd (ms) | best fwd+bwd / torch "
              "| max rel. err vs float64 ref |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        fr, br, bfr, bbr = (f"{r[k]:.2f}×" if k in r else "-"
                            for k in ("fwd_ratio", "fwdbwd_ratio", "fwd_best_ratio", "fwdbwd_best_ratio"))
        lines.append(f"| {r['shape']} | {r['backend']} | {r['cold_s']:.2f} | {r['fwd_ms']:.1f} | {fr} "
                     f"| {r['fwdbwd_ms']:.1f} | {br} | {r['fwd_best_ms']:.1f} | {bfr} | {r['fwdbwd_best_ms']:.1f} "
                     f"| {bbr} | {r['err']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="reference,cpu,torch")
    ap.add_argument("--md", help="also write the markdown table here")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help=f"seconds of pause before each backend's turn in a round (default {SETTLE_S})")
    ap.add_argument("--tiny", action="store_true",
                    help="per-call cost at tiny sizes instead (one thread; cpu, torch.nn and numbarnn.torch)")
    ap.add_argument("--calls", type=int, default=300, help="--tiny: calls per backend and round")
    ap.add_argument("--train", action="store_true",
                    help="the training-loop comparison instead (bench_train_loop.py; --quick: a small model)")
    ap.add_argument("--memory", action="store_true",
                    help="peak memory of training instead (bench_memory.py; --quick: a small model)")
    ap.add_argument("--cells", action="store_true",
                    help="cells beyond cuDNN's (numbarnn.contrib) on the cpu backend, beside the built-in LSTM")
    ap.add_argument("--only", metavar="TEXT",
                    help="only the rows whose shape's label contains TEXT (e.g. 'bidirectional')")
    args = ap.parse_args(argv)
    if args.train or args.memory:                 # the scripts beside this one, at their sizes or --quick's
        import importlib
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        quick = ["--T", "8", "--B", "4", "--I", "16", "--H", "16"] if args.quick else []
        rc = 0
        if args.train:
            rc |= importlib.import_module("bench_train_loop").main(quick + (["--steps", "3", "--warmup", "1"]
                                                                            if args.quick else []))
        if args.memory:
            rc |= importlib.import_module("bench_memory").main(quick)
        return rc
    import numba
    if args.tiny:
        numba.set_num_threads(1)
    try:
        import torch
        torch.set_num_threads(numba.get_num_threads())      # the same thread count for everyone
    except ImportError:
        pass
    if args.tiny:
        backends = tuple(b for b in ("cpu", "torch", "numbarnn.torch") if b == "cpu" or "torch" in sys.modules)
        rows = tiny_rows(TINY[:1] if args.quick else TINY, backends, args.reps, args.calls)
        print(f"one thread, float32, per call: median of {args.calls} calls, median of {args.reps} interleaved "
              "rounds (fwd: inference; fwd+bwd: training forward and backward)")
        print(tiny_markdown(rows))
        return 0
    if args.cells:
        import numbarnn.contrib.gru_v1  # noqa: F401  (registers gru_v1)
        import numbarnn.contrib.indrnn  # noqa: F401  (registers indrnn, indrnn_relu)
        import numbarnn.contrib.layer_norm_gru  # noqa: F401  (registers layer_norm_gru)
        import numbarnn.contrib.layer_norm_lstm  # noqa: F401  (registers layer_norm_lstm)
        import numbarnn.contrib.mgu  # noqa: F401  (registers mgu)
        shapes = tuple(Shape(s.label.replace("T=100 B=32 I=H=256", "T=8 B=4 I=H=16"), s.mode, 8, 4, 16, 16,
                             zoneout=s.zoneout) for s in CELLS) if args.quick else CELLS
        rows = cpu_rows(shapes, ("cpu",), args.reps, args.settle)
        print(f"cpu backend, threads: {numba.get_num_threads()} (numba), float32, median of {args.reps} rounds")
        print(markdown(rows))
        print("\n".join(cell_lines(rows)))
        return 0
    shapes = QUICK if args.quick else SHAPES
    if args.only:
        shapes = tuple(s for s in shapes if args.only in s.label)
        if not shapes:
            ap.error(f"--only {args.only!r}: no row's label contains it")
    rows = cpu_rows(shapes, tuple(args.backends.split(",")), args.reps, args.settle)
    table = markdown(rows)
    print(f"threads: {numba.get_num_threads()} (numba), float32, median and best of {args.reps} interleaved rounds, "
          f"{args.settle} s pause before each backend's turn")
    print(table)
    print("\n".join(peak_lines(rows, shapes, numba.get_num_threads())))
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

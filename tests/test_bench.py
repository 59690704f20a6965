"""`numbarnn bench` (numbarnn/bench.py): validated timings per backend, table, CSV, plot, CLI.

Tiny shapes and one repetition: these tests check that the benchmark validates before it times, refuses to
time what fails, reports and writes what it measured, and runs from the installed package without a GPU;
they do not check how fast anything is.  The cuda backend runs in numba's CUDA simulator (--simulator), and
torch on the CPU stands in for cuDNN when torch is installed.
"""
from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from numbarnn import bench, cli, device, measure
from numbarnn.verify import RNN_GRADIENTS, RNN_OUTPUTS, TOLERANCES

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
FAST = ["--reps", "1", "--warmup", "1", "--no-model"]
EXPECTED_COLUMNS = {"mode", "dtype", "H", "B", "T", "I", "backend", "fwd_ms", "fwdbwd_ms", "baseline", "fwd_ratio",
                    "fwdbwd_ratio", "check_rel_error", "check_output", "check_tolerance", "check_ok", "timed"}


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def table_rows(out: str) -> list[list[str]]:
    """The rows of the printed table (below its header), split into cells."""
    lines = out.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("mode ") and "fwd+bwd ms" in line)
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


@pytest.fixture
def timed_backends(monkeypatch):
    """Records which backend each time_backend call timed."""
    seen = []
    original = measure.time_backend

    def spy(backend, case, reps, warmup):
        seen.append(backend.name)
        return original(backend, case, reps, warmup)

    monkeypatch.setattr(measure, "time_backend", spy)
    return seen


# ---------------------------------------------------------------------------------------------------
# reference only (no GPU)
# ---------------------------------------------------------------------------------------------------

def test_reference_only_run_prints_a_table(capsys, timed_backends):
    assert bench.main(["--backends", "reference", "--modes", "lstm", "gru", "--shapes", "8x2x3", "4x1x2",
                       *FAST]) == 0
    out = capsys.readouterr().out
    for word in ("fwd ms", "fwd+bwd ms", "fwd ratio", "check", "validation"):
        assert word in out
    rows = table_rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [("lstm", "8x2x3", "reference"), ("lstm", "4x1x2", "reference"),
                                                  ("gru", "8x2x3", "reference"), ("gru", "4x1x2", "reference")]
    for r in rows:
        fwd, fwdbwd, ratio, check = float(r[4]), float(r[5]), float(r[6]), float(r[8])
        assert fwd > 0 and fwdbwd > 0 and ratio == 1.0 and check <= 1e-5     # float32: SPEC 10
    assert "FAIL" not in out
    assert timed_backends == ["reference"] * 4


def test_default_backends_without_gpu_say_what_cuda_needs(monkeypatch, capsys):
    monkeypatch.setattr(device, "real_gpu_present", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", None)        # importing torch would fail the run loudly
    assert bench.main(["--modes", "rnn_relu", "--shapes", "5x2x2", "--reps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    if SIMULATOR:
        assert "No GPU here" in out and "MODEL" in out and "not a measurement" in out     # the profiler's model
        assert "cuda backend skipped: needs a real GPU" in out and "--simulator" in out
        assert "cudnn backend skipped" in out and "torch backend skipped" in out
        assert {r[2] for r in table_rows(out)} <= {"reference", "cpu"}
        assert "reference" in {r[2] for r in table_rows(out)}


def test_csv_has_one_row_per_mode_shape_backend(tmp_path, capsys):
    path = tmp_path / "sub" / "bench.csv"
    assert bench.main(["--backends", "reference", "--modes", "lstm", "rnn_tanh", "--shapes", "6x3x2", "3x1x4",
                       "--dtype", "float64", "--csv", str(path), *FAST]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    rows = read_csv(path)
    assert EXPECTED_COLUMNS <= set(rows[0])
    assert sorted((r["mode"], r["H"], r["B"], r["T"], r["backend"]) for r in rows) == sorted(
        (m, h, b, t, "reference") for m in ("lstm", "rnn_tanh") for h, b, t in (("6", "3", "2"), ("3", "1", "4")))
    for r in rows:
        assert r["dtype"] == "float64" and r["I"] == r["H"]
        assert r["check_ok"] == "True" and r["timed"] == "True" and r["baseline"] == "reference"
        assert float(r["check_rel_error"]) <= 1e-12 and float(r["check_tolerance"]) == 1e-12
        assert float(r["fwd_ms"]) > 0 and float(r["fwdbwd_ms"]) > 0 and float(r["fwdbwd_ratio"]) == 1.0


def test_default_shapes_follow_the_backends():
    args = bench.parse_args([])
    cpu = bench.default_shapes(args, ["reference"], False)
    assert all(64 <= H <= 256 and 1 <= B <= 16 and 10 <= T <= 25 for H, B, T in cpu)
    assert bench.default_shapes(args, ["reference", "cudnn"], False) == [bench.parse_shape(s)
                                                                         for s in bench.GPU_SHAPES]
    assert bench.default_shapes(args, ["cuda"], False)[0] == bench.parse_shape(bench.GPU_SHAPES[0])
    sim = bench.default_shapes(args, ["reference", "cuda"], True)
    assert all(max(s) <= 5 for s in sim)
    quick = bench.parse_args(["--quick"])
    assert quick.reps == 3 and len(bench.default_shapes(quick, ["reference"], False)) == 2


@pytest.mark.parametrize("argv", [["--shapes", "8x2"], ["--shapes", "0x2x3"], ["--reps", "0"], ["--warmup", "0"],
                                  ["--backends", "tpu"], ["--dtype", "int8"]])
def test_bad_arguments_exit_2(argv, capsys):
    assert bench.main(argv) == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# validation gates the timing
# ---------------------------------------------------------------------------------------------------

def perturbed_reference(kind: str):
    """The reference backend with one wrong result, as the benchmark sees it."""
    class Perturbed(measure.OpsAdapter):
        def calls(self, case):
            forward, backward, named = super().calls(case)

            def bad_forward():
                y, hT, cT, reserve, host_reserved = forward()
                if kind == "nan":
                    y = y.copy()
                    y.flat[0] = np.nan
                return y, hT, cT, reserve, host_reserved

            def bad_backward(fwd):
                dx, dh0, dc0, dparams = backward(fwd)
                if kind == "scale":
                    dparams = (dparams * (1 + 1e-3)).astype(dparams.dtype)    # > the float32 gradient tolerance
                return dx, dh0, dc0, dparams

            def bad_named(fwd, grads):
                if kind == "raise":
                    raise RuntimeError("kernel exploded")
                return named(fwd, grads)

            return bad_forward, bad_backward, bad_named
    return Perturbed


@pytest.mark.parametrize("kind, words", [("scale", "params_backprop rel. error"), ("nan", "output rel. error nan"),
                                         ("raise", "RuntimeError: kernel exploded")])
def test_failed_validation_is_not_timed_and_exits_1(kind, words, monkeypatch, tmp_path, capsys, timed_backends):
    monkeypatch.setitem(measure.ADAPTERS, "reference", perturbed_reference(kind))
    path = tmp_path / "bench.csv"
    assert bench.main(["--backends", "reference", "--modes", "gru", "--shapes", "4x2x3", "--csv", str(path),
                       *FAST]) == 1
    out = capsys.readouterr().out
    assert "validation FAILED" in out and words in out and "not timed" in out
    (row,) = table_rows(out)
    assert row[:3] == ["gru", "4x2x3", "reference"] and row[4:6] == ["-", "-"] and "FAIL" in row
    assert timed_backends == []
    (r,) = read_csv(path)
    assert r["check_ok"] == "False" and r["timed"] == "False" and r["fwd_ms"] == "" and r["fwdbwd_ms"] == ""


def test_validate_compares_every_named_output():
    case = measure.make_case("lstm", 3, 2, 2, 3, np.float64).astype(np.float32)
    ref = measure.reference_outputs(case)
    assert set(ref) == set(RNN_OUTPUTS + RNN_GRADIENTS)
    check = measure.validate(measure.OpsAdapter(), case, ref)
    assert check.ok and 0 < check.error <= 1e-5 and check.tolerance in (1e-5, 1e-4)
    for name in ref:            # every output is looked at: a wrong one fails
        broken = dict(ref, **{name: ref[name] * 1.1})
        bad = measure.validate(measure.OpsAdapter(), case, broken)
        assert not bad.ok and bad.output == name and name in bad.message
        assert math.isclose(bad.error, 0.1 / 1.1, rel_tol=1e-4)        # ‖r − 1.1 r‖ / ‖1.1 r‖


def test_ratios_use_the_first_baseline_timed():
    def row(backend, fwd, fwdbwd, mode="lstm"):
        return measure.Row(mode, "float32", 8, 2, 3, 8, backend, fwd_ms=fwd, fwdbwd_ms=fwdbwd)

    rows = [row("reference", 4.0, 8.0), row("cuda", 1.0, 1.0), row("cudnn", 0.5, 2.0),
            row("reference", 2.0, 6.0, "gru"), row("cuda", 1.0, 2.0, "gru"), row("cudnn", None, None, "gru")]
    measure.add_ratios(rows)
    assert [(r.baseline, r.fwd_ratio, r.fwdbwd_ratio) for r in rows] == [
        ("cudnn", 8.0, 4.0), ("cudnn", 2.0, 0.5), ("cudnn", 1.0, 1.0),
        ("reference", 1.0, 1.0), ("reference", 0.5, 2 / 6), ("reference", None, None)]


# ---------------------------------------------------------------------------------------------------
# cuda backend (simulator) and cudnn (torch on the CPU as a stand-in)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not SIMULATOR, reason="the cuda backend in numba's CUDA simulator")
def test_cuda_in_the_simulator_validates_and_times(tmp_path, capsys, timed_backends):
    path = tmp_path / "bench.csv"
    assert bench.main(["--backends", "cuda", "reference", "--simulator", "--modes", "gru", "--shapes", "3x2x2",
                       "--dtype", "float64", "--csv", str(path), *FAST]) == 0
    out = capsys.readouterr().out
    assert "WARNING" in out and "simulator" in out and "mean nothing" in out
    assert timed_backends == ["reference", "cuda"]
    rows = {r["backend"]: r for r in read_csv(path)}
    cuda = rows["cuda"]
    assert cuda["check_ok"] == "True" and float(cuda["check_rel_error"]) <= TOLERANCES[np.dtype("float64")][0]
    assert float(cuda["fwd_ms"]) > 0 and float(cuda["fwdbwd_ms"]) > 0 and cuda["baseline"] == "reference"
    assert int(cuda["launches_fwd"]) > 0 and int(cuda["launches_bwd"]) > 0


@pytest.mark.skipif(not SIMULATOR, reason="the cuda backend in numba's CUDA simulator")
def test_error_column_is_each_backends_error_against_float64(tmp_path, capsys, timed_backends):
    """Issue 10: the "check" column showed the float32 reference's rounding of the reserve (2.7e-08 on every row).
    Now it is each backend's worst error over the outputs and gradients vs the float64 reference, and says so."""
    path = tmp_path / "bench.csv"
    assert bench.main(["--backends", "reference", "cuda", "--simulator", "--modes", "lstm", "--shapes", "4x2x2",
                       "--dtype", "float32", "--csv", str(path), *FAST]) == 0
    out = capsys.readouterr().out
    assert "err vs f64" in out and "err vs f64 = this backend's worst relative error" in out
    assert "float64 reference rounded to the dtype" in out
    rows = {r["backend"]: r for r in read_csv(path)}
    for r in rows.values():
        assert r["check_output"] != "reserve_space" and r["check_ok"] == "True", r
    assert rows["reference"]["check_rel_error"] != rows["cuda"]["check_rel_error"]
    assert 0 < float(rows["cuda"]["check_rel_error"]) <= 1e-4


@pytest.mark.skipif(not SIMULATOR, reason="the cuda backend in numba's CUDA simulator")
def test_step_versions_side_by_side(tmp_path, capsys, timed_backends):
    """--step-versions 1 2 3: one validated, timed row per version ("cuda v1" ...), each run with its kernels
    (the launch counts differ) and the driver's word on v3 in the note; NUMBARNN_STEP_VERSION is restored."""
    before = os.environ.get("NUMBARNN_STEP_VERSION")
    path = tmp_path / "bench.csv"
    assert bench.main(["--backends", "cuda", "--simulator", "--step-versions", "1", "2", "3", "--modes", "lstm",
                       "--shapes", "3x2x2", "--dtype", "float64", "--csv", str(path), *FAST]) == 0
    assert os.environ.get("NUMBARNN_STEP_VERSION") == before
    assert timed_backends == ["cuda v1", "cuda v2", "cuda v3"]
    rows = {r["backend"]: r for r in read_csv(path)}
    for r in rows.values():
        assert r["check_ok"] == "True" and float(r["check_rel_error"]) <= TOLERANCES[np.dtype("float64")][0], r
    assert [row[2:4] for row in table_rows(capsys.readouterr().out)] == [["cuda", "v1"], ["cuda", "v2"],
                                                                          ["cuda", "v3"]]
    # v1: a cell launch + a recurrent launch per step backward; v2: one fused launch (+1); v3: forward in one
    assert int(rows["cuda v1"]["launches_bwd"]) > int(rows["cuda v2"]["launches_bwd"])
    assert int(rows["cuda v3"]["launches_fwd"]) < int(rows["cuda v2"]["launches_fwd"])
    assert "co-resident" in rows["cuda v3"]["note"] and rows["cuda v2"]["note"] == ""


@pytest.mark.parametrize("argv, words", [(["--step-versions", "4"], "--step-versions: expected some of"),
                                         (["--backends", "reference", "--step-versions", "2"], "cuda backend"),
                                         (["--deepbench", "--shapes", "3x2x2"], "--deepbench and --shapes")])
def test_step_versions_and_deepbench_errors_exit_2(argv, words, capsys, timed_backends):
    extra = ["--simulator"] if "--backends" not in argv else []
    assert bench.main([*argv, *extra, *FAST]) == 2
    assert words in capsys.readouterr().err and timed_backends == []


def test_deepbench_shapes_are_the_models(monkeypatch, capsys):
    """--deepbench times the shapes the roofline model and bench/results/gpu_h100.md use."""
    from numbarnn.analysis import roofline
    seen = []

    def measure_all(modes, dtype, shapes, *args, **kwargs):
        seen.extend(shapes)
        return [], False

    monkeypatch.setattr(bench, "measure_all", measure_all)
    assert bench.main(["--backends", "reference", "--deepbench", *FAST]) == 0
    assert seen == list(roofline.DEEPBENCH)


@pytest.mark.skipif(not SIMULATOR, reason="no GPU: cuda needs --simulator")
def test_cuda_by_name_without_gpu_or_simulator_flag_exits_2(capsys, timed_backends):

    assert bench.main(["--backends", "cuda", "--shapes", "3x2x2", *FAST]) == 2
    err = capsys.readouterr().err
    assert "--backends cuda: needs a real GPU" in err and "--simulator" in err
    assert timed_backends == []


def test_cudnn_path_with_torch_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The cudnn backend's whole path (torch module with numbarnn's weights, autograd backward, gradients back
    to the opaque layout, validation, timing, ratios) with torch on the CPU standing in for cuDNN."""
    pytest.importorskip("torch")
    monkeypatch.setattr(measure, "TORCH_CUDA_DEVICE", "cpu")
    path = tmp_path / "bench.csv"
    assert bench.main(["--backends", "reference", "cudnn", "--modes", "lstm", "gru", "--shapes", "4x2x3",
                       "--dtype", "float64", "--csv", str(path), *FAST]) == 0
    assert "stand-in" in capsys.readouterr().out
    rows = read_csv(path)
    assert len(rows) == 4
    for r in rows:
        assert r["check_ok"] == "True" and float(r["check_rel_error"]) <= 1e-12 and r["baseline"] == "cudnn"
        assert float(r["fwdbwd_ms"]) > 0
        if r["backend"] == "cudnn":
            assert float(r["fwdbwd_ratio"]) == 1.0
    # the gradients are compared too: a wrong params_backprop from torch fails
    case = measure.make_case("gru", 3, 2, 2, 3, np.float64)
    ref = measure.reference_outputs(case)
    cudnn = measure.make_adapter("cudnn")
    got = measure.named_outputs(cudnn, case)
    assert set(got) == set(ref) - {"reserve_space"}
    assert not measure.validate(cudnn, case, dict(ref, params_backprop=-ref["params_backprop"])).ok


def test_torch_nn_on_the_cpu_is_a_row_and_the_baseline(tmp_path, capsys):
    """torch.nn on the CPU ("what a user without a GPU would pick instead"): validated like every backend, the
    baseline of the ratios, with as many threads as numba."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    path = tmp_path / "bench.csv"
    assert bench.main(["--backends", "reference", "torch", "--modes", "rnn_tanh", "--shapes", "5x3x4",
                       "--dtype", "float32", "--csv", str(path), *FAST]) == 0
    out = capsys.readouterr().out
    assert "torch.nn" in out and "cold ms" in out
    rows = {r["backend"]: r for r in read_csv(path)}
    assert set(rows) == {"reference", "torch"} and rows["torch"]["baseline"] == "torch"
    assert rows["torch"]["check_ok"] == "True" and 0 < float(rows["torch"]["check_rel_error"]) <= 1e-4
    assert float(rows["reference"]["cold_ms"]) > 0 and float(rows["torch"]["fwdbwd_ratio"]) == 1.0
    assert torch.get_num_threads() == threads          # restored after the run


def test_cudnn_runs_without_tf32_and_restores_the_flag(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(measure, "TORCH_CUDA_DEVICE", "cuda")     # only flags are set: no GPU needed
    rnn = getattr(torch.backends.cudnn, "rnn", None)
    if rnn is not None and hasattr(rnn, "fp32_precision"):
        read = lambda: rnn.fp32_precision          # noqa: E731
        before, during = read(), "ieee"
    else:
        read = lambda: torch.backends.cudnn.allow_tf32          # noqa: E731
        before, during = read(), False
    backend = measure.make_adapter("cudnn")
    backend.start()
    try:
        assert read() == during
    finally:
        backend.stop()
    assert read() == before


# ---------------------------------------------------------------------------------------------------
# --plot
# ---------------------------------------------------------------------------------------------------

def test_plot_without_matplotlib_exits_2_before_running(monkeypatch, tmp_path, capsys, timed_backends):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    path = tmp_path / "bench.png"
    assert bench.main(["--backends", "reference", "--shapes", "4x2x3", "--plot", str(path), *FAST]) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err and "not installed" in captured.err
    assert not path.exists() and timed_backends == []


def test_plot_calls_pyplot(monkeypatch, tmp_path, capsys):
    """With a stand-in for matplotlib (this environment need not have it): one group of bars per mode and
    shape, one bar series per backend, the file written by savefig."""
    calls = []

    class Axis:
        def bar(self, xs, ys, width, label):
            assert len(xs) == len(ys) and all(y > 0 for y in ys)
            calls.append(("bar", label, len(xs)))

        def __getattr__(self, name):
            return lambda *a, **k: calls.append((name,) + a)

    class Figure:
        def tight_layout(self):
            pass

        def savefig(self, path, dpi, format):
            Path(path).write_bytes(b"\x89PNG stand-in")

    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda rows, cols, **kw: (Figure(), [Axis() for _ in range(rows)])
    pyplot.close = lambda fig: calls.append(("close",))
    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda name: calls.append(("use", name))
    mpl.pyplot = pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    path = tmp_path / "plots" / "bench.png"
    assert bench.main(["--backends", "reference", "--modes", "lstm", "gru", "--shapes", "4x2x3", "3x1x2",
                       "--plot", str(path), *FAST]) == 0
    assert path.read_bytes().startswith(b"\x89PNG") and f"wrote {path}" in capsys.readouterr().out
    assert ("use", "Agg") in calls and calls.count(("bar", "reference", 4)) == 2 and ("close",) in calls
    assert ("set_xticklabels", ["lstm\n4x2x3", "lstm\n3x1x2", "gru\n4x2x3", "gru\n3x1x2"]) in calls


def test_plot_with_matplotlib_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert bench.main(["--backends", "reference", "--modes", "lstm", "gru", "--shapes", "4x2x3", "3x1x2",
                       "--plot", str(path), *FAST]) == 0
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


# ---------------------------------------------------------------------------------------------------
# CLI, installed package, the old script
# ---------------------------------------------------------------------------------------------------

def test_cli_bench_help(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for word in ("numbarnn bench", "--backends", "--simulator", "--csv", "--plot", "--quick", "--shapes",
                 "reference", "cudnn"):
        assert word in out


def test_cli_bench_quick_runs(capsys):
    assert cli.main(["bench", "--quick", "--shapes", "8x2x3", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [(r[0], r[1]) for r in rows if r[2] == "reference"] == [("lstm", "8x2x3"), ("gru", "8x2x3")]
    assert "FAIL" not in out


def test_installed_package_without_gpu_from_any_directory(tmp_path):
    """`python -m numbarnn bench` from outside the checkout, no GPU and no simulator variable set: the CLI
    decides (simulator), times what runs on the CPU (the reference; numbarnn's cpu backend and torch.nn on the
    CPU when they exist), and never asks torch for CUDA."""
    code = ("import sys\n"
            "from numbarnn.cli import main\n"
            "rc = main(['bench', '--quick', '--modes', 'lstm', '--shapes', '8x2x3', '--reps', '1'])\n"
            "t = sys.modules.get('torch')\n"
            "print('torch cuda initialized:', bool(t is not None and t.cuda.is_initialized()))\n"
            "sys.exit(rc)\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBARNN_REAL_GPU"] = "0"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "torch cuda initialized: False" in proc.stdout
    assert "cuda backend skipped: needs a real GPU" in proc.stdout and "--simulator" in proc.stdout
    rows = [(r[0], r[1], r[2]) for r in table_rows(proc.stdout)]
    assert rows[0] == ("lstm", "8x2x3", "reference") and {r[2] for r in rows} <= {"reference", "cpu", "torch"}
    assert ("torch" in {r[2] for r in rows}) == (importlib.util.find_spec("torch") is not None)


def test_bench_rnn_script_is_a_thin_wrapper(capsys):
    path = Path(__file__).resolve().parent.parent / "bench" / "bench_rnn.py"
    if not path.exists():
        pytest.skip("no source checkout")
    spec = importlib.util.spec_from_file_location("bench_rnn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main is bench.main
    assert module.main(["--backends", "reference", "--modes", "lstm", "--shapes", "3x2x2", *FAST]) == 0
    assert "fwd+bwd ms" in capsys.readouterr().out


def test_bench_cpu_script_validates_and_pauses_between_backends(tmp_path, monkeypatch, capsys):
    """bench/bench_cpu.py --quick (the issue-9 table's script): every row validated against the float64
    reference, timed, written as markdown; each backend's turn in a round starts after the --settle pause."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_cpu", root / "bench" / "bench_cpu.py")
    bench_cpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cpu", bench_cpu)      # its dataclasses look themselves up there
    spec.loader.exec_module(bench_cpu)
    pauses = []
    monkeypatch.setattr(bench_cpu.time, "sleep", pauses.append)
    md = tmp_path / "cpu.md"
    assert bench_cpu.main(["--quick", "--reps", "2", "--backends", "reference,cpu", "--settle", "0.125",
                           "--md", str(md)]) == 0
    out = capsys.readouterr().out                                    # the LSTM forward against the FMA peak
    assert "LSTM forward against the float32 FMA peak" in out or "the clock is unknown" in out
    assert pauses == [0.125] * (2 * 2 * len(bench_cpu.QUICK))       # reps x backends x shapes
    rows = [line for line in md.read_text().splitlines()[2:] if line.startswith("|")]
    assert len(rows) == 2 * len(bench_cpu.QUICK)
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[3]) > 0 and float(cells[5]) > 0 and float(cells[-1]) <= 1e-4
    # --only: the rows whose label contains the text (one row of a table timed alone); none: an error
    assert bench_cpu.main(["--quick", "--reps", "1", "--backends", "cpu", "--only", "GRU", "--md", str(md)]) == 0
    assert [line.split("|")[1].strip() for line in md.read_text().splitlines()[2:]] == ["GRU T=6 B=3 I=H=8"]
    with pytest.raises(SystemExit):
        bench_cpu.main(["--quick", "--only", "no such row"])


def test_bench_cpu_tiny_rows_validate_and_compare_with_torch(monkeypatch, capsys):
    """bench/bench_cpu.py --tiny: the per-call rows (cpu, and with torch torch.nn and numbarnn.torch), each
    validated first; ratios against torch.nn where it ran; the thread count one for everyone."""
    import numba
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_cpu", root / "bench" / "bench_cpu.py")
    bench_cpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cpu", bench_cpu)
    spec.loader.exec_module(bench_cpu)
    torch = sys.modules.get("torch")
    threads, torch_threads = numba.get_num_threads(), torch.get_num_threads() if torch else None
    try:
        assert bench_cpu.main(["--tiny", "--quick", "--reps", "1", "--calls", "3"]) == 0
        assert numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(threads)
        if torch:
            torch.set_num_threads(torch_threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| LSTM T=1")]
    backends = [line.split("|")[2].strip() for line in rows]
    assert backends == (["cpu", "torch", "numbarnn.torch"] if "torch" in sys.modules else ["cpu"])
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[4]) > 0


def test_num_proj_times_an_lstm_with_a_projection(tmp_path, capsys, timed_backends):
    """--num-proj P: every backend validated and timed on an LSTM with a projection (the cuda rows in the
    simulator: v2 with its project launches per step, v3 in one persistent launch per phase), P in the CSV."""
    path = tmp_path / "bench.csv"
    assert bench.main(["--backends", "reference", "cpu", "cuda", "--simulator", "--step-versions", "2", "3",
                       "--modes", "lstm", "--num-proj", "2", "--shapes", "4x3x3", "--dtype", "float64",
                       "--csv", str(path), *FAST]) == 0
    assert "projection P = 2" in capsys.readouterr().out
    rows = {r["backend"]: r for r in read_csv(path)}
    assert set(rows) == {"reference", "cpu", "cuda v2", "cuda v3"} == set(timed_backends)
    assert all(r["P"] == "2" and r["check_ok"] == "True" for r in rows.values()), rows
    assert int(rows["cuda v3"]["launches_fwd"]) < int(rows["cuda v2"]["launches_fwd"])
    assert "2 grid barriers" in rows["cuda v3"]["note"]


@pytest.mark.parametrize("argv, words", [(["--modes", "gru", "--num-proj", "2"], "gru allows no projection"),
                                         (["--modes", "lstm", "--num-proj", "5", "--shapes", "4x2x2"], "5 > H in 4x2x2"),
                                         (["--num-proj", "-1"], "--num-proj: expected >= 0")])
def test_num_proj_errors_exit_2(argv, words, capsys, timed_backends):
    assert bench.main(["--backends", "reference", *argv, *FAST]) == 2
    assert words in capsys.readouterr().err and timed_backends == []


def _bench_script(name):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_train_bench_runs_at_tiny_sizes(capsys):
    """bench/bench_small_train.py (examples/ddp_train.py's loop; the losses validated before anything is timed) at
    a tiny size.  (bench_train_loop.py and bench_memory.py: through bench_cpu.py's --train --memory below.)"""
    pytest.importorskip("torch")
    assert _bench_script("bench_small_train").main(["--rounds", "1", "--steps", "1", "--hidden", "4"]) == 0
    out = capsys.readouterr().out
    assert "losses agree" in out and "numbarnn.torch / torch.nn:" in out


def test_gpu_torch_script_validates_then_times(monkeypatch, capsys):
    """bench/gpu_torch.py (numbarnn.torch against torch.nn on CUDA tensors) on the CPU at a tiny shape: the two
    modules agree before anything is timed, and a disagreement is reported and not timed."""
    pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gpu_torch", root / "bench" / "gpu_torch.py")
    gpu_torch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_torch)
    result = gpu_torch.compare(6, 2, 3, "cpu", rounds=3)
    assert result["err"] <= gpu_torch.TOLERANCE and all(t > 0 for t in result["fwd"] + result["fwd+bwd"])
    monkeypatch.setattr(gpu_torch, "TOLERANCE", -1.0)
    assert "fwd" not in gpu_torch.compare(6, 2, 3, "cpu", rounds=3)
    assert "FAILED, not timed" in capsys.readouterr().out


def test_bench_cpu_cells_rows_compare_each_cell_with_the_lstm(monkeypatch, capsys):
    """bench/bench_cpu.py --cells --quick: the contrib cells (IndRNN) on the cpu backend, validated against the
    float64 reference, each stated as a multiple of the built-in LSTM's time at the same shape."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_cpu", root / "bench" / "bench_cpu.py")
    bench_cpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cpu", bench_cpu)
    spec.loader.exec_module(bench_cpu)
    assert bench_cpu.main(["--cells", "--quick", "--reps", "1", "--settle", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("x the LSTM's") == len(bench_cpu.CELLS) - 1 and "IndRNN (tanh)" in out and "MGU" in out
    assert "LayerNormLSTM" in out and "LayerNormGRU" in out


def test_bench_cpu_runs_the_training_loop_and_memory_comparisons(monkeypatch, capsys):
    """bench/bench_cpu.py --train --memory --quick: one entry point for the training-loop comparison (losses
    agree before anything is timed) and the peak memory of training, at a small size."""
    pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_cpu", root / "bench" / "bench_cpu.py")
    bench_cpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cpu", bench_cpu)
    spec.loader.exec_module(bench_cpu)
    monkeypatch.setattr(sys, "path", list(sys.path))                 # (it puts bench/ on the path)
    assert bench_cpu.main(["--train", "--memory", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "losses agree" in out and "numbarnn.torch / torch.nn" in out and "peak RSS growth" in out


def test_bench_cpu_apart_runs_the_cpu_backend_with_directions_one_after_the_other(monkeypatch):
    """bench_cpu.py's "cpu-apart" rows: the cpu backend's calls with the setting cpu_side_by_side off (to compare
    with "cpu", where a bidirectional layer's directions run side by side), the setting back on afterwards."""
    from numbarnn import settings
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_cpu", root / "bench" / "bench_cpu.py")
    bench_cpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cpu", bench_cpu)
    spec.loader.exec_module(bench_cpu)
    seen = []
    monkeypatch.setattr(bench_cpu, "numbarnn_runner", lambda case, backend: (
        lambda: seen.append((backend, "fwd", settings.get("cpu_side_by_side"))),
        lambda: seen.append((backend, "fwdbwd", settings.get("cpu_side_by_side")))))
    for backend in ("cpu-apart", "cpu"):
        for fn in bench_cpu.runner(None, backend):
            fn()
    assert seen == [("cpu", "fwd", False), ("cpu", "fwdbwd", False), ("cpu", "fwd", True), ("cpu", "fwdbwd", True)]

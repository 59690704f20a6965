"""The numbarnn command line: check, explain, kernels and bench, in-process through `main(argv)`.

The cuda backend is replaced by fake modules where the test is about the CLI's handling of a backend
(picked up when it imports, launch counts, failures detected); the real one, when it exists, gets one
tiny end-to-end check in the simulator.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from numbarnn import cli, device
from numbarnn.config import RNNCall, rnn_config
from numbarnn.params import param_regions
from numbarnn.reference import backend as reference_backend
from numbarnn.reserve import reserve_entries

TINY = ["--units", "2", "--time", "2", "--batch", "2", "--input-size", "2"]


def fake_backend(perturb: float = 0.0, plan=None) -> types.ModuleType:
    """A stand-in for numbarnn.kernels.backend: the reference, optionally with a wrong output."""
    mod = types.ModuleType(cli.CUDA_BACKEND_MODULE)
    for name in ("rnn_backward", "block_lstm", "block_lstm_grad", "swap01", "zeros"):
        setattr(mod, name, getattr(reference_backend, name))

    def rnn_forward(call, x, h0, c0, params):
        y, hT, cT, reserve = reference_backend.rnn_forward(call, x, h0, c0, params)
        return (y * (1 + perturb)).astype(y.dtype), hT, cT, reserve

    mod.rnn_forward = rnn_forward
    mod.last_launch_count = lambda: 7
    if plan is not None:
        mod.launch_plan = plan
    return mod


# ---------------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [
    ["--mode", "gru", "--layers", "2", "--direction", "bidirectional", "--lengths", "3,0,2", "--dtype", "float32",
     "--dropout", "0.5", "--seed", "3"],
    ["--mode", "lstm", "--proj", "2", "--units", "3", "--batch-major", "--dtype", "float64"],
    ["--mode", "rnn_relu", "--input-mode", "skip_input", "--dtype", "float16"],
    ["--blocklstm", "--v1", "--peephole", "--cell-clip", "0.2"],
    ["--blocklstm", "--seq-len-max", "2", "--time", "3"],
])
def test_check_reference_config_passes(flags, capsys):
    assert cli.main(["check", "--backends", "reference", *flags]) == 0
    out = capsys.readouterr().out
    assert "name" in out and "rel. error" in out and "tolerance" in out
    assert "(FD)" in out and "FAIL" not in out


def test_check_impossible_tolerance_fails(capsys):
    assert cli.main(["check", "--backends", "reference", "--dtype", "float64", "--tolerance", "1e-300"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out


@pytest.mark.parametrize("flags, message", [
    (["--mode", "bogus"], "rnn_mode: expected one of"),
    (["--backends", "reference,tpu"], "--backends"),
    (["--mode", "gru", "--proj", "2"], "num_proj"),
    (["--input-mode", "skip_input", "--units", "3", "--input-size", "2"], "skip_input"),
    (["--lengths", "3,9", "--time", "4"], "--lengths"),
    (["--lengths", "1,2", "--batch", "3"], "--lengths"),
    (["--dropout", "1.5", "--layers", "2"], "dropout"),
    (["--layers", "0"], "--layers"),
    (["--blocklstm", "--seq-len-max", "5", "--time", "3"], "--seq-len-max"),
])
def test_check_bad_flags_give_a_clear_error(flags, message, capsys):
    assert cli.main(["check", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err


def test_check_sweep_quick(capsys):
    assert cli.main(["check", "--quick"]) == 0
    out = capsys.readouterr().out
    n = len(cli.SWEEP)
    assert f"[1/{n}]" in out and f"[{n}/{n}]" in out
    assert f"{n}/{n} configurations ok" in out
    labels = " ".join(s.label() for s in cli.SWEEP)
    for needle in ("lstm", "gru", "rnn_tanh", "rnn_relu", "bidirectional", "proj=", "skip_input", "batch-major",
                   "dropout=", "float32", "float64", "BlockLSTM ", "BlockLSTMV2", "peephole"):
        assert needle in labels
    assert any(s.lengths and 0 in s.lengths for s in cli.SWEEP)


def test_cuda_backend_is_picked_up_when_it_imports(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, cli.CUDA_BACKEND_MODULE, fake_backend())
    assert cli.main(["check", *TINY, "--mode", "lstm", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "backends: reference, cpu, cuda" in out
    for name in ("output", "output_h", "output_c", "reserve_space", "input_backprop", "input_h_backprop",
                 "input_c_backprop", "params_backprop"):
        assert any(line.startswith(name + " ") and "| cuda" in line for line in out.splitlines()), name
    assert "cuda kernel launches, forward: 7" in out and "cuda kernel launches, backward: 7" in out


def test_wrong_cuda_backend_is_caught(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, cli.CUDA_BACKEND_MODULE, fake_backend(perturb=1e-3))
    assert cli.main(["check", *TINY, "--mode", "gru", "--backends", "reference,cuda", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.split("|")[:2]): line for line in out.splitlines() if "|" in line}
    assert "FAIL" in rows[("output", "cuda")] and "ok" in rows[("output", "reference")]
    assert "FAIL" not in rows[("output_h", "cuda")]     # only the perturbed output fails


def test_missing_cuda_backend_asked_for_explicitly(monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_cuda_backend", lambda: (None, "ModuleNotFoundError: none here"))
    assert cli.main(["check", *TINY, "--backends", "cuda"]) == 2
    assert "does not import" in capsys.readouterr().err
    assert cli.main(["check", *TINY]) == 0          # default: the reference and cpu, with a note
    assert "cuda backend not available" in capsys.readouterr().out


def _real_cuda_backend():
    try:
        return importlib.import_module(cli.CUDA_BACKEND_MODULE)
    except Exception:
        return None


@pytest.mark.skipif(_real_cuda_backend() is None, reason="numbarnn.kernels.backend does not import yet")
def test_real_cuda_backend_tiny_config(capsys):
    rc = cli.main(["check", *TINY, "--mode", "lstm", "--backends", "reference,cuda", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out


# ---------------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, flags, cfg_args", [
    ("lstm", ["--layers", "2", "--direction", "bidirectional", "--proj", "2", "--units", "3", "--input-size", "2",
              "--dropout", "0.5"], dict(num_layers=2, num_units=3, input_size=2, direction="bidirectional",
                                        num_proj=2, dropout=0.5)),
    ("gru", ["--input-mode", "skip_input", "--units", "2", "--layers", "2"],
     dict(num_layers=2, num_units=2, input_size=2, input_mode="skip_input")),
])
def test_explain_lists_every_region(mode, flags, cfg_args, capsys):
    assert cli.main(["explain", "--mode", mode, "--time", "3", "--batch", "2", *flags]) == 0
    out = capsys.readouterr().out
    cfg = rnn_config(rnn_mode=mode, **cfg_args)
    regions = param_regions(cfg)
    assert regions
    for r in regions:
        assert f"{r.describe(cfg)} (linear id {r.linear_id})" in out
    call = RNNCall(cfg, 3, 2, np.dtype(np.float32), True, True, (3, 3))
    lines = out.splitlines()
    for e in reserve_entries(call):
        assert any(line.startswith(f"{e.name} ") and f"| {e.offset} " in line for line in lines), e.name
    assert "kernel launch plan" in out


def test_explain_prints_the_drivers_launch_plan(capsys):
    assert cli.main(["explain", "--mode", "gru", "--layers", "2", "--units", "3", "--input-size", "2",
                     "--direction", "bidirectional", "--batch", "2", "--time", "3"]) == 0
    out = capsys.readouterr().out                   # the plan of a real GPU: step kernels v2
    assert "gru_forward_step_v2" in out and "gru_backward_step_v2" in out and "gemm v4 (dW = dgx^T x)" in out
    assert "forward: 16 launches in all; 1 per step per layer" in out   # the nonce's launch included
    assert "put4 (the reserve's nonce)" in out
    assert "backward: 39 launches in all; 1 per step per layer" in out
    assert "column_partials (dbW, dbR)" in out and "column_totals (dbW, dbR)" in out


def test_explain_plan_of_step_kernels_v1(capsys, monkeypatch):
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "1")
    assert cli.main(["explain", "--mode", "lstm", "--units", "3", "--input-size", "2", "--proj", "2",
                     "--batch", "2", "--time", "3"]) == 0
    out = capsys.readouterr().out
    assert "lstm_forward_step " in out and "project" in out and "recurrent_backward " in out
    assert "2 per step per layer" in out            # forward: step + project; backward: step + recurrent


def test_explain_names_the_cuda_backend_first_and_labels_every_plan_row_once(capsys):
    """Issue 10: the "cuda backend: ..." line comes first; no two launch-plan rows share a label (the h and c
    cast_copy rows were both "cast_copy (h0, c0 in)")."""
    assert cli.main(["explain", "--mode", "lstm", "--layers", "2", "--units", "3", "--input-size", "2",
                     "--batch", "2", "--time", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cuda backend: ") and not any(ln.startswith("cuda backend") for ln in lines[1:])
    from numbarnn.kernels import driver
    call = RNNCall(rnn_config(2, 3, 2, "lstm"), 3, 2, np.dtype(np.float32), True, True, (3, 3))
    labels = [(r["phase"], r["layer"], r["kernel"]) for r in driver.launch_plan(call)]
    assert len(labels) == len(set(labels)), [k for k in labels if labels.count(k) > 1]
    assert ("forward", 0, "cast_copy (h0 in)") in labels and ("forward", 0, "cast_copy (c0 in)") in labels


def test_explain_blocklstm(capsys):

    assert cli.main(["explain", "--blocklstm", "--v1", "--units", "2"]) == 0
    out = capsys.readouterr().out
    assert "cell input" in out and "forget gate" in out


# ---------------------------------------------------------------------------------------------------
# environment, kernels, bench, python -m numbarnn
# ---------------------------------------------------------------------------------------------------

def test_simulator_enabled_without_gpu(monkeypatch):
    monkeypatch.delenv(cli.SIM_VAR, raising=False)
    monkeypatch.setattr(device, "real_gpu_present", lambda: False)
    assert "simulator" in cli.setup_cuda_environment().lower()
    assert os.environ[cli.SIM_VAR] == "1"


def test_simulator_not_forced(monkeypatch):
    monkeypatch.delenv(cli.SIM_VAR, raising=False)
    monkeypatch.setattr(device, "real_gpu_present", lambda: True)
    assert cli.setup_cuda_environment() == "real GPU"
    assert cli.SIM_VAR not in os.environ
    monkeypatch.setenv(cli.SIM_VAR, "0")              # the user's choice is kept
    monkeypatch.setattr(device, "real_gpu_present", lambda: False)
    cli.setup_cuda_environment()
    assert os.environ[cli.SIM_VAR] == "0"


def test_real_gpu_variable_is_honoured(monkeypatch):
    device.real_gpu_present.cache_clear()
    try:
        monkeypatch.setenv(cli.REAL_GPU_VAR, "1")
        assert device.real_gpu_present() is True
    finally:
        device.real_gpu_present.cache_clear()


def test_kernels_delegates_to_report(monkeypatch):
    got = []
    report = types.ModuleType("numbarnn.analysis.report")
    report.main = lambda argv: got.append(argv) or 0
    monkeypatch.setitem(sys.modules, "numbarnn.analysis.report", report)
    assert cli.main(["kernels", "--json", "--cc", "80", "90"]) == 0
    assert got == [["--json", "--cc", "80", "90"]]


def test_bench_without_gpu_times_the_reference(monkeypatch, capsys):
    monkeypatch.setattr(device, "real_gpu_present", lambda: False)
    assert cli.main(["bench", "--quick", "--shapes", "8x2x3", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "cuda backend skipped: needs a real GPU" in out and "reference" in out


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != cli.SIM_VAR}
    env.update(extra)
    return env


def test_python_m_numbarnn_help():
    proc = subprocess.run([sys.executable, "-m", "numbarnn", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for word in ("check", "explain", "kernels", "bench"):
        assert word in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "numbarnn", "check", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--backends" in proc.stdout and "--blocklstm" in proc.stdout


def test_cli_sets_the_simulator_before_numba_is_imported():
    code = ("import numpy as np\n"
            "from numbarnn.cli import setup_cuda_environment\n"
            "setup_cuda_environment()\n"
            "from numba import cuda\n"
            "print(type(cuda.to_device(np.zeros(1))).__module__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_clean_env(**{cli.REAL_GPU_VAR: "0"}))
    assert proc.returncode == 0, proc.stderr
    assert "simulator" in proc.stdout


def test_launch_info_formats():
    class Log:
        total, per_step, steps, by_kernel = 9, 1, 3, {"gemm": 1, "forward_step": 3}

    mod = types.SimpleNamespace(last_launch_count=lambda: {"forward": Log(), "backward": 4})
    assert cli.launch_info(mod, "forward") == (9, "9 (1 per step x 3 steps; gemm 1, forward_step 3)")
    assert cli.launch_info(mod, "backward") == (4, "4")
    assert cli.launch_info(types.SimpleNamespace(), "forward") is None
    assert cli.launch_info(None, "forward") is None


def test_check_against_torch_nn(capsys):
    pytest.importorskip("torch")
    code = cli.main(["check", "--mode", "gru", "--layers", "2", "--direction", "bidirectional", "--lengths", "3,1",
                     "--time", "3", "--batch", "2", "--backends", "reference,torch"])
    out = capsys.readouterr().out
    assert code == 0, out
    torch_rows = [line for line in out.splitlines() if "| torch " in line]
    assert len(torch_rows) == 5 and all(line.rstrip().endswith("ok") for line in torch_rows), out


def test_check_skips_torch_where_torch_nn_cannot_follow(capsys):
    pytest.importorskip("torch")
    code = cli.main(["check", "--mode", "rnn_tanh", "--units", "3", "--input-size", "3", "--input-mode", "skip_input",
                     "--backends", "reference,torch"])
    out = capsys.readouterr().out
    assert code == 0 and "skipped torch: torch.nn has no skip_input" in out


def test_check_compares_cpu_against_the_reference(capsys):
    assert cli.main(["check", *TINY, "--mode", "gru", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "backends: reference, cpu" in out
    for name in ("output", "output_h", "reserve_space", "input_backprop", "params_backprop"):
        assert any(line.startswith(name + " ") and "| cpu" in line for line in out.splitlines()), name

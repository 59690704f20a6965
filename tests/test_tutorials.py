"""The tutorials and the example run end to end (each in a subprocess, in --quick mode) and pass their own checks.

Each tutorial asserts its results itself and exits non-zero on any failure; here we only run them.  The
subprocesses inherit NUMBA_ENABLE_CUDASIM from tests/conftest.py (NUMBARNN_REAL_GPU=1 runs them on a GPU).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
EXAMPLE = ROOT / "examples" / "char_lstm.py"
TIMEOUT_S = 240          # per script; each takes well under 30 s in the simulator on an idle machine


def run_script(path: Path, *args: str) -> tuple[str, float]:
    # the scripts import numbarnn from this checkout (a script's own folder comes first on sys.path, not the cwd)
    path_var = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, NUMBARNN_QUICK="1", PYTHONUNBUFFERED="1", PYTHONPATH=path_var)

    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{path.name} {' '.join(args)}: no exit after {TIMEOUT_S} s; output so far:\n{out[-4000:]}")
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, (f"{path.name} {' '.join(args)} exited with {proc.returncode} after "
                                  f"{elapsed:.1f} s\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n"
                                  f"{proc.stderr[-6000:]}")
    return proc.stdout, elapsed


def test_nine_numbered_tutorials_exist():
    assert [p.name[:2] for p in TUTORIALS] == ["01", "02", "03", "04", "05", "06", "07", "08", "09"], \
        [p.name for p in TUTORIALS]


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_and_passes_its_checks(path):
    out, elapsed = run_script(path, "--quick")
    number = path.name[:2]
    assert f"tutorial {number}: all checks passed" in out, out[-3000:]
    print(f"{path.name}: {elapsed:.1f} s")


def parse_losses(out: str) -> tuple[float, float]:
    match = re.search(r"first loss ([0-9.]+) -> final loss ([0-9.]+)", out)
    assert match, f"no 'first loss A -> final loss B' line in:\n{out[-3000:]}"
    return float(match.group(1)), float(match.group(2))


def test_char_lstm_loss_falls():
    out, elapsed = run_script(EXAMPLE, "--quick", "--steps", "30", "--sample-chars", "40")
    first, final = parse_losses(out)
    assert final < first, f"the loss did not fall: {first} -> {final}"
    train = [float(v) for v in re.findall(r"^step +\d+ +train loss ([0-9.]+)", out, flags=re.M)]
    assert len(train) >= 2 and train[-1] < train[0], train
    sample = out.split("sample (temperature 0.8):\n", 1)
    assert len(sample) == 2 and sample[1].strip().startswith("Alice "), out[-1000:]
    print(f"char_lstm.py: {elapsed:.1f} s, eval loss {first:.3f} -> {final:.3f}")


def test_char_lstm_is_deterministic_with_seed():
    args = ("--quick", "--steps", "6", "--sample-chars", "20", "--seed", "3")
    keep = lambda out: [ln for ln in out.splitlines() if not ln.startswith("trained ")]   # noqa: E731 (timings)
    first, _ = run_script(EXAMPLE, *args)
    second, _ = run_script(EXAMPLE, *args)
    assert keep(first) == keep(second)
    other, _ = run_script(EXAMPLE, "--quick", "--steps", "6", "--sample-chars", "20", "--seed", "4")
    assert keep(other) != keep(first)


def test_char_lstm_cuda_quick_in_the_simulator_is_practical_and_talks():
    """Issue 10: `--backend cuda --quick` in the simulator printed nothing for minutes (7.5 s per step at the
    quick size). Now it says the simulator is slow and which size is practical, picks that size, and reports
    every step."""
    if os.environ.get("NUMBARNN_REAL_GPU") == "1":
        pytest.skip("about the simulator")
    out, elapsed = run_script(EXAMPLE, "--backend", "cuda", "--quick", "--sample-chars", "3")
    assert "simulator" in out.splitlines()[0] and "practical there: --quick (H=4, T=4, B=2, 3 steps)" in out, out
    assert "training: 3 steps of B=2 windows x T=4 characters" in out and "CudnnLSTM(H=4)" in out, out
    assert len(re.findall(r"^step +\d+ +train loss [0-9.]+ +\([0-9.]+ s\)$", out, flags=re.M)) == 3, out
    print(f"char_lstm.py --backend cuda --quick (simulator): {elapsed:.1f} s")

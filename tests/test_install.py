"""Issue 10: the base package (`pip install .`, no extras) installs without the NVIDIA CUDA toolkit wheels
(~200 MB download, ~450 MB unpacked) and still runs the reference backend and the CUDA simulator.

Marked `slow`: it builds a fresh virtual environment and installs numbarnn and its dependencies from the package
index (about 25 s with a warm pip cache, measured on 2 cores). It skips, saying why, when pip cannot reach an index.
Run it alone with `python -m pytest -q -rs tests/test_install.py`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OFFLINE_SIGNS = ("No matching distribution found", "Could not find a version", "NewConnectionError",
                 "Temporary failure in name resolution", "Network is unreachable", "ConnectionError",
                 "Failed to establish a new connection", "ProxyError", "Read timed out")


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "PYTHONPATH")}
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600, **kw)


@pytest.mark.slow
def test_base_install_has_no_cuda_toolkit_wheels_and_runs_check(tmp_path):
    src = tmp_path / "src"                       # a copy: pip builds in the source tree (egg-info, build/)
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "numbarnn", src / "numbarnn", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    py = bin_dir / "python"
    install = _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)], cwd=tmp_path)
    if install.returncode != 0:
        out = install.stdout + install.stderr
        if any(sign in out for sign in OFFLINE_SIGNS):
            pytest.skip(f"pip cannot reach a package index to install numbarnn's dependencies: "
                        f"{out.strip().splitlines()[-1]}")
        pytest.fail(f"pip install of the base package failed:\n{out}")
    listed = _run([py, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"]).stdout.lower()
    names = {line.split("==")[0] for line in listed.splitlines() if "==" in line}
    assert "numba-cuda" in names and "numbarnn" in names, names
    heavy = sorted(n for n in names if n.startswith("nvidia-") or n == "cuda-toolkit")
    assert not heavy, f"the base install pulled the CUDA toolkit wheels: {heavy}"
    exe = bin_dir / "numbarnn"
    quick = _run([exe, "check", "--quick"], cwd=tmp_path)
    assert quick.returncode == 0, quick.stdout + quick.stderr
    sim = _run([exe, "check", "--mode", "gru", "--layers", "1", "--units", "3", "--backends", "reference,cuda"],
               cwd=tmp_path)                     # + the simulator (the cpu backend would compile its loops: ~18 s)
    assert sim.returncode == 0 and "| cuda " in sim.stdout, sim.stdout + sim.stderr
    kernels = _run([exe, "kernels", "--only", "gemm_v1_nn"], cwd=tmp_path)
    if kernels.returncode != 0:                  # no toolkit here: it says how to get it
        assert "numbarnn[cuda]" in kernels.stderr, kernels.stdout + kernels.stderr

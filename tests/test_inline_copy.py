"""numbarnn.kernels.inline_copy: numba-cuda's inliner copies a callee's IR in one piece (compile time).

The change must not change what numba compiles: the PTX of kernels that inline big device functions is
byte-identical with numba-cuda's own inline_ir and with the one-copy one (compiled in a subprocess without the
simulator, like the kernel report; marked `compile`).
"""
import os
import subprocess
import sys
import textwrap

import pytest

from numbarnn.kernels import inline_copy


def test_installed_where_numba_cuda_copies_per_block():
    import inspect

    from numba.cuda.core import inline_closurecall as icc
    assert inline_copy.install() in ("installed", "not installed: this numba-cuda's inline_ir has no per-block copy")
    current = icc.InlineWorker.inline_ir
    original = getattr(current, "numba_inline_ir", current)
    per_block = inline_copy.PER_BLOCK in textwrap.dedent(inspect.getsource(original))
    assert inline_copy.installed() == per_block
    if per_block:                          # numba-cuda 0.30: replaced once, and the original kept
        assert inline_copy.install() == "installed" and icc.InlineWorker.inline_ir is current
        inline_copy.uninstall()
        assert icc.InlineWorker.inline_ir is original and not inline_copy.installed()
        assert inline_copy.install() == "installed" and inline_copy.installed()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(inline_copy.SWITCH, "0")
    was = inline_copy.installed()
    inline_copy.uninstall()
    try:
        assert inline_copy.install() == f"not installed: {inline_copy.SWITCH}=0" and not inline_copy.installed()
    finally:
        monkeypatch.delenv(inline_copy.SWITCH)
        if was:
            assert inline_copy.install() == "installed"


#: kernels that inline big device functions: the persistent v3 backward (the step body, the staged products), a v2
#: step (the cell, the staging), BlockLSTM's step with peepholes and clipping
KERNELS = ("lstm_backward_persistent_v3", "gru_forward_step_v2", "block_lstm_forward_step_icfo_peephole_clip")


@pytest.mark.compile
def test_the_same_ptx_with_and_without_it():
    """Two processes (numba numbers what it compiles within a process, so a second compile of the same kernel in
    one process is named differently): each compiles the same kernels in the same order, one with numba-cuda's
    inline_ir, one with the one-copy one.  The PTX must be the same, byte for byte."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    digests = {}
    for mode in ("--with", "--without"):
        proc = subprocess.run([sys.executable, "-m", "numbarnn.kernels.inline_copy", mode, *KERNELS], env=env,
                              capture_output=True, text=True, timeout=900, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("total")]
        digests[mode] = {(name, dtype): digest for name, dtype, digest, _ in rows}
    assert set(digests["--with"]) == {(name, "float32") for name in KERNELS}
    assert digests["--with"] == digests["--without"]

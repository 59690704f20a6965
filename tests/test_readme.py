"""The README's Python examples run as written (the PyTorch one only when torch is installed)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_the_numpy_layer_and_torch_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert any("ops.cudnn_rnn_v3" in b for b in blocks)
    assert any("CudnnLSTM" in b for b in blocks)
    assert any("numbarnn.torch" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index, tmp_path, monkeypatch, capsys):
    """Each block exactly as printed, in a fresh namespace (issue 10: a prepended `import numpy as np` hid the
    CudnnLSTM example's NameError); no README block relies on an earlier one."""
    block = python_blocks()[index]
    if "import torch" in block:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)                          # the layer example writes lstm.npz
    exec(compile(block, f"README block {index}", "exec"), {"__name__": "__main__"})

    if index == 0:
        assert "(5, 3, 8) (448,)" in capsys.readouterr().out

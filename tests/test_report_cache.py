"""The kernel report's stored copy (numbarnn.analysis.report_cache): read back only under the same key (every
source file the kernels import, the compilers, the options), stored only when that key covers the compile."""
import json
import os
import sys
import types

import pytest

from numbarnn.analysis import report, report_cache
from numbarnn.kernels import registry


def _fake_compile(spec, ccs, block=report.DEFAULT_BLOCK):
    return [{"kernel": spec.name, "dtype": spec.dtype, "cc": f"{a}{b}", "registers": 32, "spill_stores": 0,
             "spill_loads": 0, "stack": 0, "shared": 0, "not_inlined": [], "block": block, "occupancy": 1.0,
             "module": spec.module, "ptx_sha256": f"{spec.name}-{spec.dtype}"} for a, b in ccs]


@pytest.fixture
def stored_at(tmp_path, monkeypatch):
    """The report as if outside the simulator, a fake (instant) compile that counts its calls, the stored copy in
    tmp_path."""
    path = tmp_path / "kernel_report.json"
    monkeypatch.setattr(report_cache, "PATH", str(path))
    monkeypatch.setattr(report, "_simulator_on", lambda: False)
    calls = []

    def counting(spec, ccs, block=report.DEFAULT_BLOCK):
        calls.append(spec.name)
        return _fake_compile(spec, ccs, block)
    monkeypatch.setattr(report, "compile_spec", counting)
    return path, calls


def test_a_whole_report_is_stored_and_read_back_under_the_same_key(stored_at):
    path, calls = stored_at
    info = {}
    rows = report.collect(jobs=1, info=info)
    n = len(registry.load_specs()[0])
    assert len(calls) == n and info["cached"] is False and info["miss"] == ["no stored report"]
    assert path.exists() and json.loads(path.read_text())["rows"] == rows
    again = report.collect(jobs=1, info=info)
    assert again == rows and info["cached"] is True and len(calls) == n          # nothing compiled the second time
    report.collect(jobs=1, info=info, cache=False)                              # --no-cache compiles anyway
    assert len(calls) == 2 * n


def test_a_partial_report_is_neither_read_nor_stored(stored_at):
    path, calls = stored_at
    report.collect(jobs=1, only="gemm_v1")
    assert calls and not path.exists()


def test_another_compiler_or_source_misses_and_says_why(stored_at, monkeypatch, tmp_path):
    path, calls = stored_at
    report.collect(jobs=1)
    n = len(calls)
    real = report_cache._compiler_versions
    monkeypatch.setattr(report_cache, "_compiler_versions", lambda: {**real(), "numba": "0.0.1"})
    info = {}
    report.collect(jobs=1, info=info)
    assert info["cached"] is False and len(calls) == 2 * n
    assert any(line.startswith("compilers:") and "0.0.1" in line for line in info["miss"]), info["miss"]
    # a numbarnn module's source changes: the key changes, and the miss names the file
    source = tmp_path / "fake_kernel_module.py"
    source.write_text("X = 1\n")
    module = types.ModuleType("numbarnn._fake_kernel_module")
    module.__file__ = str(source)
    monkeypatch.setitem(sys.modules, "numbarnn._fake_kernel_module", module)
    before = report_cache.source_key({})
    source.write_text("X = 2\n")
    after = report_cache.source_key({})
    assert before != after
    changed = [p for p in after["sources"] if after["sources"][p] != before["sources"][p]]
    assert len(changed) == 1 and changed[0].endswith("fake_kernel_module.py")


def test_a_compile_that_imports_an_unhashed_module_is_not_stored(stored_at, monkeypatch, tmp_path):
    """A numbarnn module imported while compiling (not when the specs loaded) is not in the key: no stored copy."""
    path, _ = stored_at
    source = tmp_path / "late.py"
    source.write_text("Y = 1\n")

    def importing(spec, ccs, block=report.DEFAULT_BLOCK):
        module = types.ModuleType("numbarnn._late_import")
        module.__file__ = str(source)
        sys.modules["numbarnn._late_import"] = module
        return _fake_compile(spec, ccs, block)
    monkeypatch.setattr(report, "compile_spec", importing)
    try:
        rows = report.collect(jobs=1)
    finally:
        sys.modules.pop("numbarnn._late_import", None)
    assert rows and not path.exists()


def test_store_is_atomic_and_refuses_quietly(tmp_path):
    key = {"format": report_cache.FORMAT, "options": {}, "compilers": {}, "sources": {"numbarnn/a.py": "1"}}
    target = tmp_path / "r.json"
    assert report_cache.store(key, [{"kernel": "k"}], str(target))
    assert report_cache.load(key, str(target)) == [{"kernel": "k"}]
    assert report_cache.load({**key, "sources": {"numbarnn/a.py": "2"}}, str(target)) is None
    assert report_cache.differences({**key, "sources": {"numbarnn/b.py": "2"}}, str(target)) == \
        ["new numbarnn/b.py", "gone numbarnn/a.py"]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]                  # no temporary file left
    assert report_cache.store(key, [], str(target / "under" / "a" / "file.json")) is False      # not a folder
    target.write_text("{not json")
    assert report_cache.load(key, str(target)) is None


def test_ptx_changes_compares_two_reports_kernel_by_kernel():
    old = [{"kernel": "a", "dtype": "float32", "cc": "80", "ptx_sha256": "1"},
           {"kernel": "b", "dtype": "float32", "cc": "80", "ptx_sha256": "2"}]
    new = [{"kernel": "a", "dtype": "float32", "cc": "80", "ptx_sha256": "1"},
           {"kernel": "b", "dtype": "float32", "cc": "80", "ptx_sha256": "3"},
           {"kernel": "c", "dtype": "float64", "cc": "90", "ptx_sha256": "4"}]
    assert report_cache.ptx_changes(old, new) == ["b float32 sm_80: PTX changed", "c float64 sm_90: new"]
    assert report_cache.ptx_changes(new, new) == []


def test_the_key_covers_the_kernel_modules_and_the_cells():
    registry.load_specs()
    sources = report_cache.source_key({})["sources"]
    for path in ("numbarnn/kernels/step_v3.py", "numbarnn/kernels/gemm.py", "numbarnn/cells/lstm.py",
                 "numbarnn/cells/spec.py", "numbarnn/contrib/peephole_lstm.py", "numbarnn/config.py"):
        assert path in sources, path


def test_the_ptx_digest_ignores_where_a_kernel_lives_not_what_it_does():
    ptx = (".visible .entry _ZN8numbarnn7kernels7step_v34stepB2v1E5ArrayIfLi1E(\n"
           "\tcall.uni _ZN8numbarnn7kernels6common3addEff, (%r1);\n\tadd.f32 %f1, %f2, %f3;\n")
    moved = ptx.replace("7step_v3", "8step_v3b").replace("6common", "5cells")
    assert report.ptx_digest(moved) == report.ptx_digest(ptx)
    assert report.ptx_digest(ptx.replace("add.f32", "sub.f32")) != report.ptx_digest(ptx)
    swapped = ptx.replace("_ZN8numbarnn7kernels6common3addEff", "_ZN8numbarnn7kernels7step_v34stepB2v1E5ArrayIfLi1E", 1)
    assert report.ptx_digest(swapped) != report.ptx_digest(ptx)     # which symbol is called where still counts


def test_the_ptx_digest_ignores_what_other_kernels_compiled_before_it():
    """numba names shared arrays from a per-process counter and declares the environments in the order it made
    them: a kernel compiled after others (a new kernel in the report) has the same digest; its code still counts."""
    env = ".common .global .align 8 .u64 _ZN08NumbaEnv8numbarnn7kernels4gemm{}E5ArrayIfLi1E;\n"
    body = (".shared .align 4 .b8 _cudapy_smem_{}[1024];\n.visible .entry _ZN8numbarnn7kernels4gemm2v2E(\n"
            "\tmov.u64 %rd1, _cudapy_smem_{};\n\tadd.f32 %f1, %f2, %f3;\n")
    first = env.format("1a") + env.format("1b") + body.format(1, 1)
    later = env.format("1b") + env.format("1a") + body.format(7, 7)
    assert report.ptx_digest(later) == report.ptx_digest(first)
    assert report.ptx_digest(later.replace("add.f32", "sub.f32")) != report.ptx_digest(first)
    two = body.format(1, 1) + body.format(2, 2)
    assert report.ptx_digest(two) != report.ptx_digest(body.format(1, 1) + body.format(2, 1))   # which array


def test_remembered_computes_once_per_key(tmp_path):
    path = str(tmp_path / "analysis.json")
    calls = []

    def compute():
        calls.append(1)
        return {"rows": len(calls)}
    assert report_cache.remembered(path, {"what": 1}, compute) == {"rows": 1}
    assert report_cache.remembered(path, {"what": 1}, compute) == {"rows": 1} and len(calls) == 1
    assert report_cache.remembered(path, {"what": 2}, compute) == {"rows": 2}          # other options: computed
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"

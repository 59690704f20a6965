"""Kernel report: log parser, occupancy, registry, and (marked `compile`) the real compile of every GEMM
specialisation for sm_80 and sm_90 in a subprocess without the CUDA simulator."""
import json
import os
import re
import subprocess
import sys

import pytest

from numbarnn.kernels import gemm as G
from numbarnn.analysis import report
from numbarnn.kernels import registry, v3_slices

# one real nvJitLink -verbose info log (sm_80), with spills edited in
CANNED_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN8numbarnn7kernels4gemm7gemm_v3B2v1E5ArrayIfLi2E1A7mutable7alignedE' for 'sm_80'
ptxas info    : Function properties for _ZN8numbarnn7kernels4gemm7gemm_v3B2v1E5ArrayIfLi2E1A7mutable7alignedE
ptxas         .     24 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 68 registers, used 1 barriers, 608 bytes cmem[0]
ptxas info    : Compile time = 96.559 ms
info    : 8 bytes gmem
info    : Function properties for '_ZN8numbarnn7kernels4gemm7gemm_v3B2v1E5ArrayIfLi2E1A7mutable7alignedE':
info    : used 68 registers, used 1 barriers, 24 stack, 4096 bytes smem, 608 bytes cmem[0], 0 bytes lmem
"""


def test_parse_canned_log():
    row = report.parse_info_log(CANNED_LOG)
    assert row == {"registers": 68, "spill_stores": 16, "spill_loads": 12, "stack": 24, "shared": 4096}
    clean = CANNED_LOG.replace("24 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads",
                               "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    clean = clean.replace("24 stack", "0 stack")
    assert report.parse_info_log(clean) == {"registers": 68, "spill_stores": 0, "spill_loads": 0, "stack": 0,
                                            "shared": 4096}


def test_parse_adds_spills_of_device_functions():
    extra = ("ptxas info    : Function properties for helper\n"
             "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n")
    row = report.parse_info_log(CANNED_LOG + extra)
    assert (row["registers"], row["spill_stores"], row["spill_loads"], row["stack"]) == (68, 20, 16, 24)


def test_parse_rejects_a_log_without_registers():
    with pytest.raises(ValueError, match="no register count"):
        report.parse_info_log("ptxas info    : 0 bytes gmem\n")


@pytest.mark.parametrize("cc,block,regs,smem,expected", [
    ((8, 0), 256, 32, 0, 1.0),          # 8 blocks x 8 warps = 64 warps
    ((8, 0), 256, 68, 4096, 0.375),     # 68*32 -> 2304 per warp: 28 warps -> 3 blocks
    ((8, 0), 256, 92, 8192, 0.25),      # 92*32 -> 3072 per warp: 21 warps -> 2 blocks
    ((8, 0), 256, 32, 48 * 1024, 0.375),  # (48 KiB + 1 KiB) each: 164 KiB holds 3 blocks
    ((9, 0), 256, 32, 48 * 1024 + 1024, 0.5),  # 228 KiB holds 4 (sm_90 counts the reserve in smem)
    ((8, 0), 64, 16, 0, 1.0),           # 32 blocks x 2 warps
    ((8, 0), 32, 16, 0, 0.5),           # the 32-block limit: 32 warps of 64
    ((8, 0), 256, 256, 0, 0.0),         # over 255 registers: cannot launch
    ((9, 0), 1024, 64, 0, 0.5),         # 64K registers hold 32 warps of 64 registers: 1 block
    ((9, 0), 1024, 65, 0, 0.0),         # 65*32 -> 2304 per warp, * 32 warps > 64K registers per block
])
def test_occupancy(cc, block, regs, smem, expected):
    assert report.occupancy(cc, block, regs, smem) == pytest.approx(expected)


def test_format_table_and_problems():
    rows = [
        {"kernel": "gemm_v3_nn", "dtype": "float32", "cc": "80", "registers": 68, "spill_stores": 0,
         "spill_loads": 0, "stack": 0, "shared": 4096, "block": 256, "occupancy": 0.375},
        {"kernel": "k_spill", "dtype": "float64", "cc": "90", "registers": 255, "spill_stores": 8,
         "spill_loads": 8, "stack": 8, "shared": 0, "block": 128, "occupancy": 0.125},
        {"kernel": "k_broken", "dtype": "float16", "cc": "80", "registers": None, "spill_stores": None,
         "spill_loads": None, "stack": None, "shared": None, "error": "TypingError: nope"},
        {"kernel": "k_call", "dtype": "float32", "cc": "90", "registers": 40, "spill_stores": 0,
         "spill_loads": 0, "stack": 0, "shared": 0, "not_inlined": ["_ZN5helper"], "block": 64, "occupancy": 0.5},
    ]
    text = report.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["kernel", "dtype", "cc", "regs"]
    assert "gemm_v3_nn" in lines[2] and "4096" in lines[2] and "38%" in lines[2]
    assert "TypingError: nope" in lines[4]
    found = report.problems(rows)
    assert len(found) == 3
    assert found[0].startswith("k_spill float64 sm_90: spills 8")
    assert found[1].startswith("k_broken float16 sm_80: compile error: TypingError")
    assert found[2] == "k_call float32 sm_90: device functions not inlined: _ZN5helper"


PTX_WITH_A_CALL = """\
.extern .func  (.param .b32 func_retval0) cudaCGSynchronize
(
	.param .b64 cudaCGSynchronize_param_0,
	.param .b32 cudaCGSynchronize_param_1
)
;
.visible .func  (.param .b32 func_retval0) _ZN8numbarnn6helperEf(
	.param .b32 _ZN8numbarnn6helperEf_param_0
)
{
	ret;
}
.weak .func _ZN8numbarnn7no_argsEv()
{
	ret;
}
.visible .entry _ZN8numbarnn6kernelE(
"""


def test_functions_left_are_the_defined_funcs_not_the_extern_ones():
    assert report.functions_left(PTX_WITH_A_CALL) == ["_ZN8numbarnn6helperEf", "_ZN8numbarnn7no_argsEv"]
    assert report.functions_left(PTX_WITH_A_CALL.split(".visible .func")[0]) == []


# ------------------------------------------------------------------------------------------------
# registry
# ------------------------------------------------------------------------------------------------
def _kernel(a, n):
    a[0] = n


def test_spec_forms():
    s3 = registry._make_spec(("k", _kernel, "void(float64[::1], int64)"), "m")
    assert (s3.name, s3.dtype, s3.block, s3.module) == ("k", "float64", None, "m")
    s5 = registry._make_spec(("k", "float16", _kernel, "void(float16[::1], int64)", 128), "m")
    assert (s5.dtype, s5.block) == ("float16", 128)
    with pytest.raises(registry.RegistryError, match="must be"):
        registry._make_spec(("k", _kernel), "m")
    with pytest.raises(registry.RegistryError, match="block must be a positive int"):
        registry._make_spec(("k", "float32", _kernel, "void(float32[::1], int64)", 0), "m")


def test_registry_finds_gemm_and_tolerates_missing_modules(monkeypatch):
    monkeypatch.setattr(registry, "KERNEL_MODULES", registry.KERNEL_MODULES + ("numbarnn.kernels.not_yet",
                                                                              "not_a_package.kernels"))
    specs, problems = registry.load_specs()
    assert not [p for p in problems if "not_yet" in p or "not_a_package" in p]
    gemm = {(s.name, s.dtype) for s in specs if s.module == "numbarnn.kernels.gemm"}
    assert gemm == {(name, dtype) for name, dtype, *_ in G.kernel_specs()}


def test_registry_reports_broken_modules_and_register(monkeypatch, tmp_path):
    (tmp_path / "broken_kernels_mod.py").write_text("raise ImportError('half written')\n")
    (tmp_path / "extra_kernels_mod.py").write_text(
        "from numbarnn.kernels import registry\n"
        "def k(a):\n    a[0] = 1\n"
        "registry.register('extra_k', None, k, 'void(float32[::1])', block=64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTERED", [])
    monkeypatch.setattr(registry, "KERNEL_MODULES", registry.KERNEL_MODULES + ("broken_kernels_mod",
                                                                              "extra_kernels_mod"))
    specs, problems = registry.load_specs()
    assert any(p.startswith("broken_kernels_mod: ImportError: half written") for p in problems)
    extra = [s for s in specs if s.name == "extra_k"]
    assert len(extra) == 1 and extra[0].dtype == "float32" and extra[0].block == 64
    assert extra[0].module == "extra_kernels_mod"
    with pytest.raises(registry.RegistryError, match="half written"):
        registry.all_specs()


# ------------------------------------------------------------------------------------------------
# real compiles (no GPU needed, but no simulator either): slow, marked `compile`
# ------------------------------------------------------------------------------------------------
def _env_without_simulator():
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


DEVICE_FUNCTION_PROGRAM = """
import json
from numba import cuda
from numba.cuda import dispatcher
from numbarnn.analysis import report
from numbarnn.kernels import common

@common.device
def twice(x):
    return x + x

def kernel(a):
    a[0] = twice(a[0])

ptx, _ = cuda.compile_ptx(kernel, "void(float32[::1])", cc=(9, 0))
print(json.dumps(dict(left=report.functions_left(ptx), add="add.f32" in ptx,
                      forceinline=twice.targetoptions["forceinline"], gpu=cuda.is_available(),
                      cc=dispatcher.get_current_device().compute_capability)))
"""


@pytest.mark.compile
def test_a_device_function_compiles_without_a_gpu_and_is_inlined():
    """common.device: a kernel calling one compiles with compile_ptx on a machine without a GPU (numba asks for the
    current device: sm_80 stands in) and NVVM inlines it (no .func left in the PTX)."""
    proc = subprocess.run([sys.executable, "-c", DEVICE_FUNCTION_PROGRAM], env=_env_without_simulator(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["left"] == [] and out["add"] and out["forceinline"], out
    if not out["gpu"]:
        assert out["cc"] == [8, 0], out


@pytest.mark.compile
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills():
    """The CI gate: every registered specialisation of every module compiles for real GPUs through NVVM +
    nvJitLink, with no spills and no device function left as a call (run without the simulator, as `numbarnn
    kernels` does).  The report is read from its stored copy when every source file the kernels import and every
    compiler is unchanged since it was compiled (numbarnn.analysis.report_cache; tests/test_report_cache.py)."""
    proc = subprocess.run([sys.executable, "-m", "numbarnn.analysis.report", "--json"],
                          env=_env_without_simulator(), capture_output=True, text=True, timeout=1800)
    assert proc.stdout, proc.stderr
    result = json.loads(proc.stdout)
    rows = result["rows"]
    for r in rows:
        assert set(report.ROW_KEYS) <= set(r), r
        assert not r.get("error"), r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["not_inlined"] == [], r                  # every device function inlined by NVVM
        assert 0 < r["registers"] <= 255 and r["stack"] >= 0 and r["shared"] >= 0, r
        assert 0 < r["occupancy"] <= 1, r
    specs, broken = registry.load_specs()
    assert broken == []
    got = [(r["kernel"], r["dtype"], r["cc"]) for r in rows]
    expected = {(spec.name, spec.dtype, cc) for spec in specs for cc in ("80", "90")}
    assert set(got) == expected and len(got) == len(expected)   # each once
    names = {name for name, _, _ in got}
    for kernel in ("lstm_forward_step_proj", "lstm_backward_step", "project", "gru_forward_step",
                   "gru_backward_step", "rnn_tanh_forward_step", "rnn_relu_backward_step", "recurrent_backward",
                   "dropout_forward", "column_sums", "column_partials", "column_totals", "gemm_v3_tn", "gemm_v4_tn",
                   "dropout_keep_mask_kernel"):
        assert kernel in names, kernel
    assert any(n.startswith("block_lstm_") for n in names)
    assert result["problems"] == [] and proc.returncode == 0, result["problems"]
    # shared memory of the tiled versions is what the tiles need (float32: v2 2 * 16*16 * 4, v3 2 * 8*64 * 4)
    by_key = {key: r for key, r in zip(got, rows)}
    assert by_key[("gemm_v1_nn", "float32", "80")]["shared"] == 0
    assert by_key[("gemm_v2_nn", "float32", "80")]["shared"] == 2 * 16 * 16 * 4
    assert by_key[("gemm_v3_nn", "float64", "80")]["shared"] == 2 * 8 * 64 * 8
    # v4: 2 operands x 2 buffers x BK=4 rows of 128 + 8 (padding) float32
    assert by_key[("gemm_v4_nn", "float32", "80")]["shared"] == 2 * 2 * 4 * (128 + 8) * 4
    # the roofline model's v3 co-residency uses this register count: it must follow the kernel
    assert by_key[("lstm_forward_persistent_v3", "float32", "90")]["registers"] == v3_slices.V3_REGISTERS
    assert by_key[("lstm_backward_persistent_v3", "float32", "90")]["registers"] == v3_slices.V3_BACKWARD_REGISTERS
    # the report states the persistent kernels' co-residency at H = 256, 512, 1024 (issue 8 item 3)
    co = result["co_residency"]
    assert {(e["kernel"], e["cc"], e["H"], e["D"]) for e in co} == {
        (k, cc, H, D) for k in ("lstm_forward_persistent_v3", "lstm_backward_persistent_v3") for cc in ("80", "90")
        for H in report.CO_RESIDENCY_H for D in (1, 2)}
    print(f"\nkernel report: {len(rows)} rows in {result['seconds']} s")


def test_persistent_co_residency_from_the_compiled_registers():
    """At 168 registers (the forward, sm_90) an H100 holds 6 blocks of 64 threads per SM (792) by registers, and
    at H = 1024 5 (660) by shared memory (the R slice of TJ = 2, the h tile and the splits' partial sums: 38.2 KB
    + 1 KB reserved a block): v3 fits up to H = 1024 one direction (512 blocks of TJ = 2), not bidirectional
    (1024); an A100 at 218 registers holds 4 per SM (432): H = 1024 does not fit at all.  Other kernels and
    dtypes are not rows of this statement."""
    rows = [{"kernel": "lstm_forward_persistent_v3", "dtype": "float32", "cc": "90", "registers": 168},
            {"kernel": "lstm_backward_persistent_v3", "dtype": "float32", "cc": "80", "registers": 218},
            {"kernel": "lstm_backward_persistent_v3", "dtype": "float64", "cc": "80", "registers": 175},
            {"kernel": "gemm_v4_nn", "dtype": "float32", "cc": "90", "registers": 128}]
    co = report.persistent_co_residency(rows)
    assert len(co) == 2 * len(report.CO_RESIDENCY_H) * 2
    by = {(e["cc"], e["H"], e["D"]): e for e in co}
    assert by[("90", 1024, 1)]["co_resident"] and by[("90", 1024, 1)]["blocks"] == 512
    assert not by[("90", 1024, 2)]["co_resident"] and by[("90", 1024, 2)]["limit"] == 5 * 132
    assert by[("90", 512, 2)]["limit"] == 6 * 132
    assert by[("90", 256, 1)]["TJ"] == 8 and by[("90", 256, 1)]["blocks"] == 32
    assert by[("80", 512, 2)]["co_resident"] and by[("80", 512, 2)]["limit"] == 4 * 108
    assert not by[("80", 1024, 1)]["co_resident"]
    text = report.format_co_residency(co)
    assert "H100 SXM" in text and "A100 SXM" in text and "H=1024 bidir: 1024/660 NO, v2 runs" in text


@pytest.mark.compile
def test_main_leaves_the_simulator_by_itself(capfd):
    """Called in this (simulator) process, main re-runs itself without NUMBA_ENABLE_CUDASIM."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or os.environ.get("NUMBARNN_REAL_GPU") == "1"
    code = report.main(["--json", "--only", "gemm_v1_nn", "--cc", "80", "--jobs", "1"])
    out = capfd.readouterr().out
    result = json.loads(out)
    names = sorted({r["kernel"] for r in result["rows"] if r["kernel"].startswith("gemm_")})
    assert names == ["gemm_v1_nn", "gemm_v1_nn_batched"]
    assert {r["cc"] for r in result["rows"] if r["kernel"].startswith("gemm_")} == {"80"}
    assert code == (1 if result["problems"] else 0)


def test_bad_cc_is_refused(capsys):
    assert report.main(["--cc", "75"]) == 2  # refused before any subprocess or compile
    assert "--cc: expected some of 80 90, got '75'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# issue 10: progress, --only that matches nothing, missing CUDA compiler libraries (no compile needed)
# ------------------------------------------------------------------------------------------------
class _Tty:
    """A stderr that says it is a terminal and keeps what was written."""

    def __init__(self, tty: bool):
        self.tty, self.parts = tty, []

    def isatty(self):
        return self.tty

    def write(self, text):
        self.parts.append(text)

    def flush(self):
        pass

    def text(self):
        return "".join(self.parts)


def _fake_compile(spec, ccs, block=report.DEFAULT_BLOCK):
    return [{"kernel": spec.name, "dtype": spec.dtype, "cc": f"{a}{b}", "registers": 32, "spill_stores": 0,
             "spill_loads": 0, "stack": 0, "shared": 0, "not_inlined": [], "block": block, "occupancy": 1.0,
             "module": spec.module}
            for a, b in ccs]


_real_toolkit_problem = report.toolkit_problem


@pytest.fixture
def in_process(monkeypatch):
    """report.main as if outside the simulator, with a fake (instant) compile."""
    monkeypatch.setattr(report, "_simulator_on", lambda: False)
    monkeypatch.setattr(report, "compile_spec", _fake_compile)
    monkeypatch.setattr(report, "toolkit_problem", lambda: None)


@pytest.mark.parametrize("tty", [True, False])
def test_kernels_shows_progress_on_a_terminal_only(in_process, monkeypatch, capsys, tty):
    n = len([s for s in registry.load_specs()[0] if "gemm" in s.name])
    err = _Tty(tty)
    monkeypatch.setattr(sys, "stderr", err)
    assert report.main(["--only", "gemm", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "gemm" in out and f"{2 * n} rows" in out
    assert "compiling every kernel for sm_80, sm_90" in err.text()
    assert (f"[{n}/{n}]" in err.text()) == tty and bool(re.search(rf"\[ *1/{n}\]", err.text())) == tty, err.text()


def test_kernels_json_prints_nothing_else(in_process, monkeypatch, capsys):
    err = _Tty(True)
    monkeypatch.setattr(sys, "stderr", err)
    assert report.main(["--only", "gemm", "--jobs", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"]
    assert err.text() == ""


def test_kernels_only_that_matches_nothing_fails(in_process, capsys):
    assert report.main(["--only", "nosuchkernel", "--jobs", "1"]) == 2
    captured = capsys.readouterr()
    assert "no kernel name contains 'nosuchkernel'" in captured.err
    assert "kernel" not in captured.out                    # no empty table


def test_kernels_only_that_matches_nothing_fails_through_the_cli():
    """The same through `numbarnn kernels` from a simulator process (it re-runs itself without it)."""
    from numbarnn import cli
    assert cli.main(["kernels", "--only", "nosuchkernel"]) == 2


def test_kernels_says_how_to_get_missing_cuda_libraries(in_process, monkeypatch, capsys):
    from cuda import pathfinder
    monkeypatch.setattr(report, "toolkit_problem", _real_toolkit_problem)   # the fixture's stub undone

    def not_found(lib):
        raise pathfinder.DynamicLibNotFoundError(f"lib{lib} not found")
    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
    assert report.main(["--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "numbarnn[cuda]" in err and "nvvm" in err and "nvJitLink" in err


def test_toolkit_found_here():
    assert report.toolkit_problem() is None

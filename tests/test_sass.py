"""The SASS of the kernels' hot loops (numbarnn/analysis/sass.py): the parser on a canned listing, and (marked
`compile`: NVVM, nvJitLink and nvdisasm, no GPU, no simulator) the instruction counts of v3's product loops,
which the constant-trip, unsigned-index k loops brought down (issue 8: what a latency-bound kernel with one warp
per scheduler spends its time on)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from numbarnn.analysis import sass

# nvdisasm's layout (sm_90), shortened: an outer loop .L_x_1 around an inner loop .L_x_2, and a forward branch
CANNED = """\
        .text._Z6kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   STS [R3], R2 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_2:
        /*0040*/                   LDS R5, [R6] ;
        /*0050*/                   LDS R7, [R6+0x84] ;
        /*0060*/                   FFMA R8, R5, R7, R8 ;
        /*0070*/                   FFMA R9, R5, R7, R9 ;
        /*0080*/                   ISETP.NE.AND P0, PT, R10, RZ, PT ;
        /*0090*/               @P0 BRA `(.L_x_2) ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00b0*/              @!P1 BRA `(.L_x_3) ;
        /*00c0*/                   BRA `(.L_x_1) ;
.L_x_3:
        /*00d0*/                   EXIT ;
"""


def test_loops_of_a_canned_listing():
    found = sass.loops(CANNED)
    assert [(lp.first, lp.last) for lp in found] == [(4, 9), (1, 12)]     # forward branches are not loops
    inner, outer = sass.hot_loops(CANNED)
    assert inner == found[0] and outer == found[1] and outer.contains(inner) and not inner.contains(outer)
    assert inner.instructions == 6 and inner.fma == 2 and inner.count("LDS") == 2 and inner.count("BRA") == 1
    assert outer.count("BAR") == 2 and outer.count("LDG") == 1
    row = sass.summary(CANNED)
    assert row == {"inner_instructions": 6, "inner_fma": 2, "inner_lds": 2, "inner_lds_vector": 0,
                   "inner_per_fma": 3.0, "chunk_instructions": 12, "chunk_fma": 2}
    # a vector load counts as an LDS and as a vector one; a predicated one too
    vector = CANNED.replace("LDS R5, [R6] ;", "LDS.128 R4, [R6] ;").replace("   LDS R7", "@P2 LDS.U.64 R7")
    assert sass.summary(vector)["inner_lds"] == 2 and sass.summary(vector)["inner_lds_vector"] == 2
    assert sass.summary("        /*0000*/    EXIT ;\n")["inner_per_fma"] is None
    text = sass.format_rows([{"kernel": "k", "dtype": "float32", "cc": "90", **row}])
    assert "instr/fma" in text and "3.0" in text
    # --loops: every loop, outermost first, with its depth; a branch to itself (the trap after EXIT) is no loop
    trap = ".L_x_9:\n        /*00e0*/                   BRA `(.L_x_9) ;\n"
    rows = sass.loop_rows(CANNED + trap)
    assert [(r["depth"], r["first"], r["last"], r["instructions"]) for r in rows] == [(0, 1, 12, 12), (1, 4, 9, 6)]
    assert rows[0]["sts"] == 1 and rows[0]["ldg"] == 1 and rows[0]["bar"] == 2 and rows[1]["fma"] == 2
    text = sass.format_loops("k", rows)
    assert text.splitlines()[2].startswith("    [4..9] instructions 6 fma 2 lds 2")


def _env_without_simulator():
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


MEASURE = """
import hashlib, json, sys
from numbarnn.analysis import report_cache, sass
from numbarnn.kernels import registry
from numba import cuda
names = ("lstm_forward_persistent_v3", "lstm_backward_persistent_v3", "lstm_forward_step_v2", "lstm_backward_step_v2")
specs = [s for s in registry.all_specs() if s.name in names and s.dtype == "float32"]

def measure():
    rows = {s.name: sass.kernel_summary(s, (9, 0)) for s in specs}
    for s in specs:
        if s.name.endswith("_v2"):
            rows[s.name]["loops"] = sass.loop_rows(sass.disassemble(cuda.compile_ptx(s.pyfunc, s.signature, cc=(9, 0))[0]))
    rows["per_step_768x16"] = sass.per_step_v3(768, 16)
    return rows

program = hashlib.sha256(sys.argv[1].encode()).hexdigest()[:16]          # this program's text
print(json.dumps(report_cache.remembered(sys.argv[2], {"program": program}, measure)))
"""

#: the measured rows, kept with the key of the kernels' sources and the compilers (numbarnn.analysis.report_cache):
#: read back while both are unchanged; commit it with a change to the kernels
STORED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stored", "sass_loops.json")


# nvdisasm comes with the cuda extra, but an environment can lack it (with `.[test,torch]`, torch's CUDA build can
# pin a cuda-toolkit without its nvdisasm extra): the tests that need it skip, saying which package provides it
needs_nvdisasm = pytest.mark.skipif(sass.nvdisasm_path() is None, reason=sass.NVDISASM_MISSING)


@pytest.mark.compile
@needs_nvdisasm
def test_v3_product_loops_issue_few_instructions_per_fma():
    """The LSTM's persistent v3 kernels at the report's slice (H = 512, TJ = 4) and v2's step kernels at their GPU
    tiles, float32, sm_90.  Before the
    rewrite the forward's k loop took 79 instructions for 8 FMAs (9.9: numba's range iterator and the
    wrap-around of signed indices around every shared load) and the backward's 105 for 4 (26.2); now the k loop
    is 8 ks unrolled with constant offsets (forward 85 for 32: 2.7, the floor being 2.25 = 5 loads per 4 FMAs),
    and the backward's whole round, staging and barriers included, 268 for 33 (8.1); with 16-byte vector loads
    (4 ks a load) the forward's k loop takes 56 for 32 (1.75)."""
    proc = subprocess.run([sys.executable, "-c", MEASURE, MEASURE, STORED], env=_env_without_simulator(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    fwd, bwd = rows["lstm_forward_persistent_v3"], rows["lstm_backward_persistent_v3"]
    assert fwd["inner_fma"] >= 32 and fwd["inner_per_fma"] <= 2.0, fwd
    assert bwd["inner_fma"] >= 32 and bwd["inner_per_fma"] <= 9.0, bwd
    # the k loops' shared loads are 16-byte vectors (rows of the tiles 16-byte aligned, staging.pitch): every
    # one of v3's and of v2's forward, the dgh tile's of v2's backward (its R tile is read down a column);
    # forward v3 85 instructions per 32 FMAs with scalar loads, 56 with LDS.128; v2 110 per 64 -> 86
    for name in ("lstm_forward_persistent_v3", "lstm_backward_persistent_v3", "lstm_forward_step_v2"):
        assert rows[name]["inner_lds"] and rows[name]["inner_lds_vector"] == rows[name]["inner_lds"], rows[name]
    assert 2 * rows["lstm_backward_step_v2"]["inner_lds_vector"] == rows["lstm_backward_step_v2"]["inner_lds"]
    # v2's k loops the same way (whole chunks, unrolled, unsigned indices): before 65 instructions per 18
    # FMAs (3.6) forward, 129 per 16 (8.1) backward; then 110 per 64 (1.7) and 80 per 32 (2.5); with vector
    # loads 86 per 64 (1.3) and 56 per 32 (1.8)
    for name in ("lstm_forward_step_v2", "lstm_backward_step_v2"):
        assert rows[name]["inner_fma"] >= 32 and rows[name]["inner_per_fma"] <= 2.0, rows[name]
    # v2's staging (staging.py): ~40 instructions per staged element of R before (a 64-bit row x width product
    # and signed indices' wrap-around each; forward 343 per 8 stores), now 175 per 16; the backward's chunk loop
    # was 1,062 instructions (a length lookup per staged dgh element too), now 289
    for name in ("lstm_forward_step_v2", "lstm_backward_step_v2"):
        staging = [r for r in rows[name]["loops"] if r["sts"] and not r["fma"]]
        assert all(r["instructions"] <= 15 * r["sts"] for r in staging), rows[name]["loops"]
    chunk = max(rows["lstm_backward_step_v2"]["loops"], key=lambda r: r["instructions"])
    assert chunk["fma"] >= 32 and chunk["instructions"] <= 300, chunk
    # per step and thread at H = 768, B = 16 (TJ = 2: 32 rows a block of 64 threads, 16 in the batch: two splits
    # of K), before these changes 41,016 (forward) and 192,672 (backward) instructions, then 6,312 and 14,592,
    # with vector loads 4,884 and 12,144; in the wider blocks step_v3.choose runs on an H100 (96 threads
    # forward: 3 splits, 8 rounds; 128 backward: 4 splits, 24 rounds) 3,256 and 6,072
    step = rows["per_step_768x16"]
    fwd, bwd = step["forward"], step["backward"]
    assert (fwd["TJ"], fwd["threads"], fwd["rounds"]) == (2, 96, 8), step
    assert (bwd["TJ"], bwd["threads"], bwd["rounds"]) == (2, 128, 24), step
    assert fwd["per_step"] <= 3700 and bwd["per_step"] <= 7000, step


def test_command_line_says_what_it_needs():
    """Under the simulator (no real compile possible) the tool says so and exits 2; without nvdisasm it names the
    package that provides it and exits 2; with it, a name nothing matches exits 2 naming it."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-m", "numbarnn.analysis.sass"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2 and "NUMBA_ENABLE_CUDASIM" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "numbarnn.analysis.sass", "--only", "no_such_kernel"],
                          env=_env_without_simulator(), capture_output=True, text=True, timeout=120, check=False)
    needs = sass.NVDISASM_MISSING if sass.nvdisasm_path() is None else "no_such_kernel"
    assert proc.returncode == 2 and needs in proc.stderr, proc.stderr

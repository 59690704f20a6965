"""The "cpu" backend (numbarnn/cpu: BLAS + numba.njit) against the float64 NumPy reference (SPEC 2-10).

Every comparison runs the same op with backend="cpu" and backend="reference" on the same inputs and compares
output, output_h, output_c, reserve_space (without the nonce) and the four backprop results as
‖cpu − reference‖/‖reference‖ within SPEC 10 (float64 1e-12, float32 1e-5 / 1e-4, float16 1e-2).  Covered:
every cell (the built-ins and the contrib user cells peephole_lstm, cifg_lstm, plus one registered here),
1-2 layers, both directions, projection, skip/linear/auto input, ragged lengths with 0s, time/batch-major,
dropout p 0/0.3/1 with masks bit-identical to the reference's Philox, inference, T == 0 / B == 0, the
reserve layout shared both ways, inputs not mutated, BlockLSTM V1/V2 and grads, finite differences of the
contrib cells through ops.cudnn_rnn_backprop_v3(backend="cpu"), and the default backend without a GPU.
"""
from __future__ import annotations

import functools
import os
import threading
import time

import numpy as np
import pytest
from conftest import MINGRU, QUICK, TOL, assert_close, compare_cpu, cpu_cells, describe, named
from hypothesis import example, given, settings
from hypothesis import strategies as st

from numbarnn import ops
from numbarnn.backends import get_default_backend, set_default_backend
from numbarnn.block_lstm_config import validate_block_lstm, validate_block_lstm_grad
from numbarnn.cells import CellSpec, dsigmoid, dtanh
from numbarnn.config import rnn_config
from numbarnn.cpu import backend as cpu_backend
from numbarnn.cpu import philox as cpu_philox
from numbarnn.reference import backend as ref_backend
from numbarnn.reference.philox import dropout_keep_mask
from numbarnn.testing import (
    check_rnn_gradients,
    make_rnn_case,
    relative_error,
    rnn_cases,
    rnn_configs,
    run_backward,
    run_forward,
)

ALL_CELLS = cpu_cells()     # the built-ins, the contrib cells (registered now) and conftest's MINGRU


# ----------------------------------------------------------------------------------------------
# hypothesis: every configuration the cuda backend is tested on, every cell, every dtype
# ----------------------------------------------------------------------------------------------

@settings(QUICK, max_examples=40)
@given(rnn_cases(rnn_configs(modes=ALL_CELLS, max_units=5, max_input=4), max_T=5, max_B=5))
def test_hypothesis_float64(case):
    compare_cpu(case)


@settings(QUICK, max_examples=25)
@given(rnn_cases(rnn_configs(modes=ALL_CELLS), dtype=np.float32))
def test_hypothesis_float32(case):
    compare_cpu(case)


@settings(QUICK, max_examples=12)
@given(rnn_cases(rnn_configs(modes=ALL_CELLS), dtype=np.float16))
def test_hypothesis_float16(case):
    compare_cpu(case)


@settings(QUICK, max_examples=10)
@given(rnn_cases(rnn_configs(modes=ALL_CELLS)).map(lambda c: c.__class__(**{**c.__dict__, "is_training": False})))
def test_hypothesis_inference(case):
    compare_cpu(case)


FIXED = {   # rnn_config args, T, B, lengths, time_major
    "lstm-bi-proj-T7B6": (dict(num_layers=2, num_units=4, input_size=3, rnn_mode="lstm", direction="bidirectional",
                               num_proj=3, dropout=0.3, seed=2**32 - 1, seed2=2**32 - 2), 7, 6, [7, 5, 5, 2, 1, 1],
                          True),
    "peephole-bi-proj-bm": (dict(num_layers=2, num_units=4, input_size=3, rnn_mode="peephole_lstm",
                                 direction="bidirectional", num_proj=2, dropout=0.3, seed=-1, seed2=5),
                            5, 4, [5, 0, 3, 1], False),
    "cifg-skip-zero-lengths": (dict(num_layers=2, num_units=3, input_size=3, rnn_mode="cifg_lstm",
                                    input_mode="skip_input", direction="bidirectional"), 3, 3, [0, 0, 0], True),
    "gru-bi-auto-bm": (dict(num_layers=2, num_units=3, input_size=3, rnn_mode="gru", input_mode="auto_select",
                            direction="bidirectional", dropout=1.0, seed=3, seed2=4), 4, 5, [1, 4, 0, 2, 4], False),
    "rnn_tanh-L3-dropout": (dict(num_layers=3, num_units=2, input_size=2, rnn_mode="rnn_tanh",
                                 direction="bidirectional", dropout=0.3, seed=2**32 + 1, seed2=2**32 - 1),
                            3, 2, [3, 1], True),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("key", list(FIXED))
def test_fixed_cases(key, dtype):
    args, T, B, lengths, tm = FIXED[key]
    case = make_rnn_case(rnn_config(**args), T, B, lengths, seed=len(key), dtype=dtype, time_major=tm)
    f_cpu, _ = compare_cpu(case)
    y = f_cpu[0] if tm else np.swapaxes(f_cpu[0], 0, 1)
    for b, n in enumerate(case.lengths):              # SPEC 5: 0 past each length
        assert not y[n:, b].any(), f"output: nonzero past length {n} in row {b} ({describe(case)})"


def test_all_zero_lengths_pass_states_through():
    cfg = rnn_config(1, 3, 2, "lstm")
    case = make_rnn_case(cfg, 3, 3, [0, 0, 0], seed=1)
    f, b = compare_cpu(case)
    assert not f[0].any()
    np.testing.assert_array_equal(f[1], case.h0)
    np.testing.assert_array_equal(f[2], case.c0)
    np.testing.assert_array_equal(b[1], case.dhT)
    np.testing.assert_array_equal(b[2], case.dcT)
    assert not b[0].any() and not b[3].any()


@pytest.mark.parametrize("T,B", [(0, 3), (3, 0), (0, 0)])
def test_empty_time_or_batch(T, B):
    cfg = rnn_config(2, 3, 2, "lstm", direction="bidirectional", num_proj=2, dropout=0.3)
    case = make_rnn_case(cfg, T, B, None, seed=3)
    f, b = compare_cpu(case)
    np.testing.assert_array_equal(f[1], case.h0)
    assert not b[3].any()


def test_inputs_not_mutated_and_calls_repeat_bit_for_bit():
    cfg = rnn_config(2, 4, 3, "gru", direction="bidirectional", dropout=0.3, seed=1, seed2=2)
    case = make_rnn_case(cfg, 4, 3, [4, 2, 0], seed=5, dtype=np.float32)
    before = {k: getattr(case, k).copy() for k in ("x", "h0", "params", "dy", "dhT")}
    f1, f2 = run_forward(case, "cpu"), run_forward(case, "cpu")
    fwd_copy = [a.copy() for a in f1]
    b1, b2 = run_backward(case, f1, "cpu"), run_backward(case, f1, "cpu")
    for a, b in zip(named(f1, b1).values(), named(f2, b2).values()):
        assert a.tobytes() == b.tobytes()
    for k, v in before.items():
        assert getattr(case, k).tobytes() == v.tobytes(), f"{k}: mutated"
    for a, b in zip(f1, fwd_copy):
        assert a.tobytes() == b.tobytes(), "forward outputs mutated by the backprop"


def test_philox_masks_bit_identical():
    for args in [(2**32 - 1, 2**32 - 2, 1, 7, 6, 6, 0.3), (-(2**40) - 3, 5, 3, 3, 2, 5, 0.5), (0, 0, 2, 4, 3, 2, 1.0),
                 (1, 2, 1, 2, 3, 4, 0.0)]:
        got = cpu_philox.dropout_keep_mask(*args)
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got.astype(bool), dropout_keep_mask(*args), err_msg=str(args))


@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_nan_propagates_like_the_reference(mode):
    cfg = rnn_config(1, 3, 2, mode)
    for dtype in (np.float32, np.float64):
        case = make_rnn_case(cfg, 3, 2, None, seed=1, dtype=dtype)
        x = case.x.copy()
        x[1, 0, 0] = np.nan
        got, want = run_forward(case, "cpu", x=x), run_forward(case, "reference", x=x)
        np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]))


# ----------------------------------------------------------------------------------------------
# finite differences through the public ops on backend="cpu" (the user cells have no hand-written oracle)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,args", [
    ("peephole_lstm", dict(num_proj=2, direction="bidirectional", dropout=0.3, seed=7, seed2=8)),
    ("cifg_lstm", dict(num_proj=0, direction="bidirectional", input_mode="skip_input")),
    ("cifg_lstm", dict(num_proj=2)),
    (MINGRU.name, dict(direction="bidirectional")),
])
def test_finite_differences_of_user_cells_on_cpu(mode, args):
    cfg = rnn_config(2, 3, 3, mode, **args)
    case = make_rnn_case(cfg, 4, 3, [4, 1, 3], seed=11)
    errs = check_rnn_gradients(case, backend="cpu")
    assert max(errs.values()) < 1e-6, errs


# ----------------------------------------------------------------------------------------------
# BlockLSTM V1/V2 and grads
# ----------------------------------------------------------------------------------------------
BLOCK_ARGS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")


@settings(QUICK, max_examples=30)
@given(dims=st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(1, 4), st.integers(1, 5)),
       layout=st.sampled_from(["icfo", "ifco"]), peephole=st.booleans(),
       forget_bias=st.sampled_from([0.0, 1.0, -0.6]), cell_clip=st.sampled_from([0.0, 0.4]),
       s_frac=st.floats(0, 1), dtype=st.sampled_from(["float64", "float32", "float16"]),
       seed=st.integers(0, 2**32 - 1))
@example(dims=(4, 3, 3, 4), layout="icfo", peephole=True, forget_bias=1.0, cell_clip=0.4, s_frac=1.0,
         dtype="float32", seed=1)
def test_block_lstm_matches_reference(dims, layout, peephole, forget_bias, cell_clip, s_frac, dtype, seed):
    T, B, I, C = dims
    S = int(round(s_frac * T))
    rng = np.random.default_rng(seed)
    shapes = dict(x=(T, B, I), cs_prev=(B, C), h_prev=(B, C), w=(I + C, 4 * C), wci=(C,), wcf=(C,), wco=(C,),
                  b=(4 * C,))
    inp = {k: (0.7 * rng.standard_normal(s)).astype(dtype) for k, s in shapes.items()}
    up = {k: rng.standard_normal((T, B, C)).astype(dtype) for k in ("cs_grad", "h_grad")}
    call = validate_block_lstm(layout, S, **inp, forget_bias=forget_bias, cell_clip=cell_clip,
                               use_peephole=peephole)
    args = [inp[k] for k in BLOCK_ARGS]
    ref_fwd = ref_backend.block_lstm(call, *args)
    got_fwd = cpu_backend.block_lstm(call, *args)
    saved = dict(zip(("i", "cs", "f", "o", "ci", "co", "h"), ref_fwd))
    gcall = validate_block_lstm_grad(layout, S, **inp, **saved, **up, use_peephole=peephole)
    ref_bwd = ref_backend.block_lstm_grad(gcall, *args, *ref_fwd, up["cs_grad"], up["h_grad"])
    got_bwd = cpu_backend.block_lstm_grad(gcall, *args, *ref_fwd, up["cs_grad"], up["h_grad"])
    t_out, t_grad = TOL[np.dtype(dtype)]
    for k, (g, w) in enumerate(zip(tuple(got_fwd) + tuple(got_bwd), tuple(ref_fwd) + tuple(ref_bwd))):
        assert g.dtype == w.dtype and g.shape == w.shape, k
        err = relative_error(g, w)
        assert err <= (t_out if k < 7 else t_grad), f"output {k}: relative error {err:.3g}"
    for g in got_fwd:
        assert not np.any(g[S:])


@pytest.mark.parametrize("v1", [True, False])
def test_block_lstm_public_ops_on_cpu(v1):
    rng = np.random.default_rng(4)
    T, B, I, C = 4, 2, 3, 3
    x, cs, h = rng.standard_normal((T, B, I)), rng.standard_normal((B, C)), rng.standard_normal((B, C))
    w, b = rng.standard_normal((I + C, 4 * C)) * 0.5, rng.standard_normal(4 * C)
    wci, wcf, wco = rng.standard_normal(C), rng.standard_normal(C), rng.standard_normal(C)
    fwd, grad = (ops.block_lstm, ops.block_lstm_grad) if v1 else (ops.block_lstm_v2, ops.block_lstm_grad_v2)
    outs = {be: fwd(3, x, cs, h, w, wci, wcf, wco, b, use_peephole=True, backend=be) for be in ("reference", "cpu")}
    for g, r in zip(outs["cpu"], outs["reference"]):
        assert relative_error(g, r) <= 1e-12
    up = rng.standard_normal((T, B, C)), rng.standard_normal((T, B, C))
    grads = {be: grad(3, x, cs, h, w, wci, wcf, wco, b, *outs["reference"], *up, use_peephole=True, backend=be)
             for be in ("reference", "cpu")}
    for g, r in zip(grads["cpu"], grads["reference"]):
        assert relative_error(g, r) <= 1e-12


# ----------------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------------

def test_default_backend_without_gpu_is_cpu(monkeypatch):
    monkeypatch.delenv("NUMBARNN_BACKEND", raising=False)
    set_default_backend(None)
    assert get_default_backend() == "cpu"          # tests run without a real GPU (the simulator at most)
    case = make_rnn_case(rnn_config(1, 3, 2, "gru"), 3, 2, None, seed=2, dtype=np.float32)
    a, b = named(run_forward(case)), named(run_forward(case, "cpu"))
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k
    monkeypatch.setenv("NUMBARNN_BACKEND", "reference")
    assert get_default_backend() == "reference"


def test_parallel_step_loops_agree(monkeypatch):
    """The prange twins of the step loops (used for wide steps, cells.PARALLEL_MIN_WORK) give the same bits."""
    from numbarnn.cpu import cells
    cfg = rnn_config(2, 4, 3, "lstm", direction="bidirectional", num_proj=3, dropout=0.3, seed=1, seed2=2)
    case = make_rnn_case(cfg, 4, 3, [4, 0, 2], seed=9)
    serial = run_forward(case, "cpu")
    serial_b = run_backward(case, serial, "cpu")
    monkeypatch.setattr(cells, "PARALLEL_MIN_WORK", 1)
    monkeypatch.setattr(cells.numba, "get_num_threads", lambda: 2)
    par = run_forward(case, "cpu")
    par_b = run_backward(case, par, "cpu")
    for a, b in zip(named(serial, serial_b).values(), named(par, par_b).values()):
        assert a.tobytes() == b.tobytes()


def test_step_loop_cache_keys_follow_the_cells_code():
    """The on-disk cache of the step loops is keyed by `cells.variant_key`: cells of the same shape (G, S, V)
    but different math, and a cell whose code changes under the same name, never share an entry."""
    from numbarnn.cells import get_cell
    from numbarnn.cpu import cells
    tanh_cell, relu_cell = get_cell("rnn_tanh"), get_cell("rnn_relu")
    assert (tanh_cell.G, tanh_cell.S, tanh_cell.V) == (relu_cell.G, relu_cell.S, relu_cell.V)
    keys = {cells.variant_key(c, dt, proj, par) for c in (tanh_cell, relu_cell) for dt in ("float32", "float64")
            for proj in (False, True) for par in (False, True)}
    assert len(keys) == 16

    def backward_other(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
        z, n = saved[0], saved[1]
        dwx[0] = dm * (h - n) * dsigmoid(z)
        dwx[1] = dm * (1.0 - z) * dtanh(n) * 2.0     # a changed constant
        drh[1] = 0.0 * dm
        return dm * z, dc

    changed = CellSpec(name=MINGRU.name, gates=MINGRU.gates, saved=MINGRU.saved, forward=MINGRU.forward,
                       backward=backward_other, split_recurrent=MINGRU.split_recurrent)
    assert cells.variant_key(changed, "float32", False, False) != cells.variant_key(MINGRU, "float32", False, False)
    # every function a cell gives keys its loops: output_backward of a layer-normalised cell, modulation_backward of
    # a modulated one, changed alone
    import dataclasses

    import numbarnn.contrib.gru_v1  # noqa: F401  (registers gru_v1)
    import numbarnn.contrib.layer_norm_lstm  # noqa: F401  (registers layer_norm_lstm)
    ln, mod = get_cell("layer_norm_lstm"), get_cell("gru_v1")
    out_bwd, mod_bwd = ln.output_backward, mod.modulation_backward

    def output_backward(dm, n, saved, v, dwx, drh):
        return 2.0 * out_bwd(dm, n, saved, v, dwx, drh)

    def modulation_backward(dmod, mod, saved, v, h, dwx, drh):
        mod_bwd(2.0 * dmod, mod, saved, v, h, dwx, drh)
    for cell, changed in ((ln, dataclasses.replace(ln, output_backward=output_backward)),
                          (mod, dataclasses.replace(mod, modulation_backward=modulation_backward))):
        assert cells.variant_key(changed, "float32", False, False) != cells.variant_key(cell, "float32", False, False)


def test_step_loop_cache_keys_follow_the_library_sources(monkeypatch):
    """variant_key (the cache key of every step and fused loop) changes with `cells.sources_fingerprint`, the
    hash of numbarnn/cpu and numbarnn/cells."""
    from numbarnn.cells import get_cell
    from numbarnn.cpu import cells
    fingerprint = cells.sources_fingerprint()
    assert len(fingerprint) == 64 and fingerprint == cells.sources_fingerprint()
    key = cells.variant_key.__wrapped__(get_cell("lstm"), "float32", False, False)
    monkeypatch.setattr(cells, "sources_fingerprint", lambda: "another version of the library")
    assert cells.variant_key.__wrapped__(get_cell("lstm"), "float32", False, False) != key


_STALE_PROBE = """
import numpy as np
from numbarnn.config import rnn_config
from numbarnn.testing import make_rnn_case, run_forward
case = make_rnn_case(rnn_config(1, 5, 3, "lstm"), 3, 2, [3, 2], seed=0, dtype=np.float64)
print(run_forward(case, "cpu")[0].tobytes().hex())
"""


def test_an_edit_to_the_library_recompiles_the_cached_loops(tmp_path):
    """numba invalidates a cached function when its own file changes, not when code it compiles in from another
    file does: the fused loops (fused.py) inline cells.py's helper twins.  In a copy of the package, an edit to
    cells.py's sigmoid twin must change the cpu output in the next process (before `cells.sources_fingerprint`
    joined the cache key it did not: the stale machine code ran)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    src = Path(__file__).parent.parent / "numbarnn"
    shutil.copytree(src, tmp_path / "numbarnn", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")} | {"PYTHONPATH": str(tmp_path)}

    def probe():
        done = subprocess.run([sys.executable, "-c", _STALE_PROBE], cwd=tmp_path, env=env, capture_output=True, check=False,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    before = probe()
    assert probe() == before                                  # the cache itself is deterministic
    path = tmp_path / "numbarnn" / "cpu" / "cells.py"
    code = path.read_text()
    line = "        return half * th(half * x) + half             # = 1/(1+e^-x), no exp to overflow\n"
    assert line in code
    path.write_text(code.replace(line, "        return half\n"))
    assert probe() != before

_CACHE_PROBE = """
import gc
import numpy as np
import numbarnn.contrib.gru_v1
import numbarnn.contrib.layer_norm_lstm
from numba.core.registry import CPUDispatcher
from numbarnn.config import rnn_config
from numbarnn.testing import make_rnn_case, run_backward, run_forward
for mode, zoneout in (("layer_norm_lstm", 0.0), ("layer_norm_lstm", 0.2), ("gru_v1", 0.0)):
    # the fused loops; with zoneout the BLAS-loop path's row loops; a modulated cell's backward (BLAS loop)
    case = make_rnn_case(rnn_config(1, 5, 3, mode, zoneout=zoneout), 3, 2, [3, 2], seed=0, dtype=np.float32)
    run_backward(case, run_forward(case, "cpu"), "cpu")
print(sorted(d.py_func.__qualname__ for d in gc.get_objects() if isinstance(d, CPUDispatcher)   # compiled here:
             and d.py_func.__module__.startswith("numbarnn.cpu") and d.signatures               # not cached, or
             and (type(d._cache).__name__ == "NullCache" or d.stats.cache_misses)))             # not found
"""


def test_a_new_process_loads_the_cached_loops_instead_of_compiling_them():
    """The cpu backend's loops are compiled once per machine, then loaded (cells.cached_step): a second process
    running a layer-normalised cell (fused, and with zoneout the BLAS-loop path) and a modulated cell compiles
    none of them.  Their loops once kept a compiled helper in their closure, which numba's cache cannot key (~15 s
    of compiling in every process), or were not cached at all (~6 s with zoneout, ~1 s a modulated cell's
    backward); cached_step refuses such a closure (TypeError, tested below)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}

    def compiled():
        done = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    compiled()                                                # (compiles what the cache does not hold yet)
    assert compiled() == "[]"


def test_a_cached_loop_refuses_a_compiled_function_in_its_closure():
    from numba import njit

    from numbarnn.cpu import cells
    helper = njit(lambda a: a)

    def loop(a):
        return helper(a)
    with pytest.raises(TypeError, match="closure value 'helper' is a CPUDispatcher"):
        cells.cached_step(loop, False, None, 1, 1, 1, 1)


# ----------------------------------------------------------------------------------------------
# the workspace (numbarnn/cpu/workspace.py): scratch reused across calls, never read stale, never returned
# ----------------------------------------------------------------------------------------------

WORKSPACE_CASES = [   # (config, T, B, lengths, training): every path that takes scratch
    (rnn_config(2, 4, 3, "lstm", direction="bidirectional", num_proj=3, dropout=0.3, seed=4), 5, 3, [5, 2, 0], True),
    (rnn_config(1, 5, 3, "gru"), 4, 3, [4, 4, 1], True),
    (rnn_config(3, 3, 3, MINGRU.name, direction="bidirectional", input_mode="skip_input"), 3, 2, None, True),
    (rnn_config(2, 4, 3, "rnn_relu", direction="bidirectional"), 4, 2, [3, 1], False),
    (rnn_config(1, 3, 2, "peephole_lstm"), 3, 2, None, True),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_workspace_is_never_read_before_it_is_written(dtype):
    """Every scratch buffer full of NaN before each call (and larger than the call needs, as after a bigger
    call): outputs and gradients still equal the reference's, so no step reads what an earlier call left."""
    from dataclasses import replace

    from numbarnn.cpu import workspace
    big = make_rnn_case(rnn_config(2, 6, 5, "lstm", direction="bidirectional", num_proj=4), 7, 6, None, seed=1,
                        dtype=dtype)
    run_backward(big, run_forward(big, "cpu"), "cpu")              # grow every buffer past the cases below
    run_forward(replace(big, is_training=False), "cpu")            # (an inference call's reserve is scratch)
    assert workspace.held_bytes() > 0
    for k, (cfg, T, B, lengths, training) in enumerate(WORKSPACE_CASES):
        case = replace(make_rnn_case(cfg, T, B, lengths, seed=10 + k, dtype=dtype), is_training=training)
        workspace.poison(np.nan)
        f_cpu = run_forward(case, "cpu")
        f_ref = run_forward(case, "reference")
        if not training:
            assert_close(named(f_cpu), named(f_ref), dtype, describe(case) + " [poisoned workspace]")
            continue
        workspace.poison(np.nan)
        assert_close(named(f_cpu, run_backward(case, f_cpu, "cpu")), named(f_ref, run_backward(case, f_ref,
                     "reference")), dtype, describe(case) + " [poisoned workspace]")


def test_workspace_results_do_not_alias_scratch():
    """What a call returns is its own memory: a later call (same shape, other data) and a poisoned workspace
    leave it as it was; the inference output is copied out of the scratch reserve."""
    from dataclasses import replace

    from numbarnn.cpu import workspace
    cfg = rnn_config(2, 4, 3, "lstm", direction="bidirectional")
    a = make_rnn_case(cfg, 4, 3, [4, 1, 3], seed=1, dtype=np.float32)
    b = make_rnn_case(cfg, 4, 3, [4, 1, 3], seed=2, dtype=np.float32)
    for training in (False, True):
        ca, cb = replace(a, is_training=training), replace(b, is_training=training)
        fa = run_forward(ca, "cpu")
        ba = run_backward(ca, fa, "cpu") if training else ()
        kept = [np.array(v, copy=True) for v in (*fa, *ba)]
        fb = run_forward(cb, "cpu")
        if training:
            run_backward(cb, fb, "cpu")
        workspace.poison(np.nan)
        for got, want in zip((*fa, *ba), kept):
            assert got.tobytes() == want.tobytes(), f"a result changed after another call (training={training})"


def test_workspace_is_per_thread_and_released():
    """Two threads running different shapes at once get their own scratch and the right answers; release()
    frees this thread's scratch and the next call allocates it again."""
    from numbarnn.cpu import workspace
    cases = [make_rnn_case(rnn_config(1, 6, 4, "lstm"), 6, 5, [6, 3, 6, 1, 2], seed=1, dtype=np.float32),
             make_rnn_case(rnn_config(2, 3, 2, "gru", direction="bidirectional"), 5, 2, None, seed=2,
                           dtype=np.float32)]
    want = [named(run_forward(c, "reference"), run_backward(c, run_forward(c, "reference"), "reference"))
            for c in cases]
    got, errors = [None, None], []

    def work(k):
        try:
            for _ in range(20):
                f = run_forward(cases[k], "cpu")
                got[k] = named(f, run_backward(cases[k], f, "cpu"))
        except Exception as e:   # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        assert_close(got[k], want[k], np.float32, describe(cases[k]) + " [thread]")
    run_forward(cases[0], "cpu")
    assert workspace.release() > 0 and workspace.held_bytes() == 0
    assert_close(named(run_forward(cases[0], "cpu")), named(run_forward(cases[0], "reference")), np.float32,
                 describe(cases[0]) + " [after release]")


def test_scratch_views_are_reused_until_their_buffer_grows():
    """A repeated request gets the same view; a larger request under the name replaces the buffer, and every
    shape asked of the old one is then a view of the new one (no stale view is handed out)."""
    from numbarnn.workspace import ScratchPool

    pool = ScratchPool(allocate=lambda n, dtype: np.empty(n, dtype=dtype), fill=lambda buf, v: buf.fill(v))
    small = pool.get("a", (2, 3), np.float32)
    assert pool.get("a", (2, 3), np.float32) is small
    assert np.shares_memory(pool.get("a", [3, 2], np.float32), small)       # a list shape: served, not kept
    big = pool.get("a", (4, 5), np.float32)                                  # grows: a new buffer
    again = pool.get("a", (2, 3), np.float32)
    assert again is not small and np.shares_memory(again, big) and not np.shares_memory(again, small)
    assert pool.get("a", (2, 3), np.float64).dtype == np.float64             # another dtype, another buffer
    assert pool.release() > 0 and pool.get("a", (2, 3), np.float32) is not again


def test_release_workspaces_frees_what_the_backends_hold():
    """numbarnn.release_workspaces(): the public way to give the scratch back (cpu here; cuda's pool too when
    the kernels are imported), and the backend works after it."""
    import numbarnn
    from numbarnn.cpu import workspace
    case = make_rnn_case(rnn_config(1, 4, 3, "gru"), 4, 2, None, seed=6, dtype=np.float32)
    run_forward(case, "cpu")
    held = workspace.held_bytes()
    assert held > 0 and numbarnn.release_workspaces() >= held and workspace.held_bytes() == 0
    assert numbarnn.release_workspaces() == 0
    compare_cpu(case)


# ---------------------------------------------------------------------------------------------------
# one thread budget: BLAS at most at numba's thread count during a call, put back afterwards
# ---------------------------------------------------------------------------------------------------

def test_blas_runs_on_numbas_thread_count_during_a_call(monkeypatch):
    import numba

    from numbarnn.cpu import network, threads

    libs = threads._blas_libraries()
    if not libs or max(lib.num_threads for lib in libs) < 2:
        pytest.skip("NumPy's BLAS runs one thread here already (nothing to lower)")
    seen, real = [], network.backward

    def backward(*args):
        seen.append([lib.num_threads for lib in libs])
        return real(*args)

    monkeypatch.setattr(network, "backward", backward)
    case = make_rnn_case(rnn_config(1, 3, 2, "lstm"), 3, 2, None, seed=0)
    before, numba_before = [lib.num_threads for lib in libs], numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        out = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, backend="cpu")
        ops.cudnn_rnn_backprop_v3(case.x, case.h0, case.c0, case.params, None, *out[:3], case.dy, case.dhT,
                                  case.dcT, out[3], out[4], backend="cpu")
    finally:
        numba.set_num_threads(numba_before)
    assert seen == [[1] * len(libs)]
    assert [lib.num_threads for lib in libs] == before


@pytest.fixture(params=["own", "torch"])
def pool(request):
    """The call's threads `threads.team` uses: numbarnn's own helpers (the setting cpu_torch_pool off), or torch's
    OpenMP workers (torch imported; skipped where torch is absent or its parallel backend is not OpenMP)."""
    from numbarnn import settings
    from numbarnn.cpu import threads
    if request.param == "torch":
        pytest.importorskip("torch")
        if threads._torch_openmp() is None:
            pytest.skip("torch's parallel backend is not an OpenMP runtime numbarnn finds")
    with settings.override(cpu_torch_pool=request.param == "torch"):
        yield request.param


def test_side_by_side_runs_the_second_piece_on_the_helper_in_the_callers_settings(pool):
    """threads.side_by_side: both results, the second on numbarnn's helper thread, in the caller's settings; an
    exception of either piece is raised in the caller, only once both have finished."""
    from numbarnn import settings
    from numbarnn.cpu import threads

    def where():
        return threading.current_thread().name, settings.get("cpu_fused")

    with settings.override(cpu_fused=False):
        here, there = threads.side_by_side(where, where)
    assert here == (threading.current_thread().name, False)
    assert there[0].startswith("numbarnn") and there[1] is False
    finished = []

    def slow():
        time.sleep(0.05)
        finished.append(True)

    def fails():
        raise ValueError("first")

    with pytest.raises(ValueError, match="first"):
        threads.side_by_side(fails, slow)
    assert finished == [True]                           # the helper's piece had finished before the raise
    with pytest.raises(ZeroDivisionError):
        threads.side_by_side(lambda: None, lambda: 1 / 0)


def test_team_runs_its_pieces_at_once_on_as_many_threads(pool):
    """threads.team: pieces[0] on the caller, every other on a helper of its own, all at once (a barrier of all
    pieces would time out otherwise), results in order, however many pieces (the helpers grow); a piece that asks
    for a team runs its pieces itself (a helper waiting on helpers could wait forever); the first error raised
    once every piece finished."""
    from numbarnn.cpu import threads
    for n in (2, 4, 3):
        barrier = threading.Barrier(n, timeout=30)

        def piece(i, barrier=barrier):
            barrier.wait()
            return i, threading.current_thread().name

        got = threads.team([functools.partial(piece, i) for i in range(n)])
        assert [i for i, _ in got] == list(range(n))
        names = [name for _, name in got]
        assert names[0] == threading.current_thread().name and len(set(names)) == n
        assert all(name.startswith("numbarnn") for name in names[1:])

    def nested():
        return threads.team([threading.current_thread, threading.current_thread])

    inner = threads.team([lambda: None, nested])[1]
    assert inner[0] is inner[1] and inner[0].name.startswith("numbarnn")
    finished = []

    def slow():
        time.sleep(0.05)
        finished.append(True)

    with pytest.raises(KeyError):
        threads.team([slow, lambda: {}["x"], slow])
    assert finished == [True, True]


def test_team_runs_on_torchs_openmp_workers_where_torch_has_them():
    """With torch imported (its wheel's OpenMP runtime), a team's other pieces run on torch's OpenMP workers, not
    numbarnn's helpers: the runtime is the one under torch's directory, or the only one in the process (loaded
    before torch, by numba's OpenMP layer: torch's libraries then bind to it, one soname), the workers are
    OpenMP's (their thread numbers), torch's thread count is what it was; the setting off gives numbarnn's
    helpers."""
    import re

    torch = pytest.importorskip("torch")
    from numbarnn import settings
    from numbarnn.cpu import threads
    openmp = threads._torch_openmp()
    if openmp is None:
        pytest.skip("torch's parallel backend is not an OpenMP runtime numbarnn finds")
    with open("/proc/self/maps") as maps:
        runtimes = {os.path.realpath(p) for p in re.findall(r"(/\S*/lib(?:g|i|)omp[^/\s]*\.so[^/\s]*)$", maps.read(),
                                                             re.MULTILINE)}
    home = os.path.dirname(os.path.realpath(torch.__file__))
    mine = {p for p in runtimes if p.startswith(home)}
    assert os.path.realpath(openmp._name) in (mine or runtimes) and len(mine or runtimes) == 1
    before = torch.get_num_threads()

    def where():
        return threading.current_thread().name, openmp.omp_get_thread_num(), threads._helping()

    me = threading.current_thread().name
    assert threads.team([where, where]) == [(me, 0, False), ("numbarnn-openmp-1", 1, True)]
    assert torch.get_num_threads() == before
    with settings.override(cpu_torch_pool=False):
        name, number, helping = threads.team([where, where])[1]
    assert name.startswith("numbarnn") and not name.startswith("numbarnn-openmp") and number == 0 and helping


def test_a_forked_child_runs_its_teams_on_its_own_threads():
    """libgomp's workers do not survive a fork: a child of a process whose team ran on torch's OpenMP workers
    makes its own helpers (its team finishes, on numbarnn's helper threads)."""
    import multiprocessing

    pytest.importorskip("torch")
    from numbarnn.cpu import threads
    if threads._torch_openmp() is None:
        pytest.skip("torch's parallel backend is not an OpenMP runtime numbarnn finds")
    threads.team([functools.partial(time.sleep, 0.01)] * 2)       # torch's workers ran a team in the parent
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as child:
        got = child.apply_async(_team_in_child).get(timeout=60)
    assert got[0] is None and got[1][0] == 1 and got[1][1].startswith("numbarnn") and "openmp" not in got[1][1]


def _team_in_child():
    from numbarnn.cpu import threads
    return threads._torch_openmp(), threads.team([lambda: 1, lambda: threading.current_thread().name])


def test_relay_runs_each_chain_in_order_and_moves_chains_to_a_free_thread(pool):
    """threads.relay: every (chain, link) once, a chain's links in order and never two at once; a thread that is
    late leaves its chain to the others (here the helper sleeps before it takes anything: the caller runs both
    chains' first links meanwhile); each thread keeps its own chain when none is late; an error stops every
    chain and is raised."""
    from numbarnn.cpu import threads
    log, lock = [], threading.Lock()
    running = set()

    def run(c, k):
        with lock:
            assert c not in running                     # one link of a chain at a time
            running.add(c)
            log.append((c, k, threading.current_thread().name))
        time.sleep(0.002)
        with lock:
            running.discard(c)

    team = threads.team

    def late_helper(pieces):                            # the helper starts 20 ms after the caller
        def late(piece):
            def go():
                time.sleep(0.02)
                return piece()
            return go
        return team([pieces[0]] + [late(p) for p in pieces[1:]])

    for teams, links in ((team, 6), (late_helper, 12), (team, 1)):
        log.clear()
        threads.team = teams
        try:
            threads.relay(run, 2, links)
        finally:
            threads.team = team
        assert sorted((c, k) for c, k, _ in log) == [(c, k) for c in range(2) for k in range(links)]
        for c in range(2):
            assert [k for c2, k, _ in log if c2 == c] == list(range(links))
        me = threading.current_thread().name
        if teams is late_helper:                        # the caller ran both chains' first links alone
            assert [(c, name) for c, _, name in log[:2]] == [(0, me), (1, me)]
            assert any(name != me for _, _, name in log)
    failed = []

    def fails(c, k):
        failed.append((c, k))
        if (c, k) == (1, 0):
            raise KeyError("x")
        time.sleep(0.01)

    with pytest.raises(KeyError):
        threads.relay(fails, 2, 50)
    assert len(failed) < 10                             # no new link after the error


def test_helpers_leave_blas_alone(pool):
    """budget and serial_blas change nothing on a helper thread: threadpoolctl lets only the first thread that sets
    OpenBLAS's count change it while that thread lives, and a helper lives as long as the process."""
    from numbarnn.cpu import threads
    libs = threads._blas_libraries()
    calls = []

    def watch():
        for lib in libs:
            real = lib.set_num_threads
            lib.set_num_threads = lambda n, real=real: calls.append(n) or real(n)
        try:
            with threads.serial_blas():
                with threads.budget():
                    pass
        finally:
            for lib in libs:
                del lib.set_num_threads
    threads.team([lambda: None, watch])
    assert calls == []


def test_matmul_in_slices_on_the_calls_threads(monkeypatch):
    """threads.matmul: inside serial_blas, a product in row slices on the call's threads, the same values as one
    product (a transposed operand too); outside, or small, one product on the caller."""
    import numba

    from numbarnn.cpu import threads
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((37, 300)), rng.standard_normal((37, 11))
    pieces = []
    team = threads.team
    monkeypatch.setattr(threads, "team", lambda p: pieces.append(len(p)) or team(p))
    monkeypatch.setattr(threads, "SPLIT_MIN_MACS", 0)
    old = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        with threads.serial_blas():
            out = threads.matmul(a.T, b, np.full((300, 11), np.nan))
        np.testing.assert_allclose(out, a.T @ b, rtol=1e-13, atol=1e-13)
        threads.matmul(a.T, b, out)
    finally:
        numba.set_num_threads(old)
    monkeypatch.setattr(threads, "SPLIT_MIN_MACS", 1 << 40)
    with threads.serial_blas():
        threads.matmul(a.T, b, out)
    assert pieces == [2, 1 if any(lib.num_threads > 1 for lib in threads._blas_libraries()) else 2, 1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_side_by_side_in_a_forked_child():
    """A child forked after the helper thread started gets its own helper (the parent's thread does not exist in
    the child: a job handed to it would wait forever)."""
    from numbarnn.cpu import threads
    assert threads.side_by_side(lambda: 1, lambda: 2) == (1, 2)      # the parent's helper is up
    pid = os.fork()
    if pid == 0:                                                    # the child: exit 0 only if both pieces ran
        try:
            os._exit(0 if threads.side_by_side(lambda: 1, lambda: 2) == (1, 2) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's side_by_side hung")

"""Step kernels v1, v2 (numbarnn/kernels/step_v2.py) and v3 (step_v3.py) pass the same simulator tests against
the reference.

Every case runs under NUMBARNN_STEP_VERSION=1, 2 and 3 (`version` fixture) through the whole op (both
backends, every named output of forward and backward, the reference backprop on the kernels' reserve:
`conftest.compare_backends`).  The cases cover every cell (lstm, gru, rnn_tanh, rnn_relu and the contrib
peephole_lstm and cifg_lstm), ragged lengths with 0, both directions, projection, dropout, float16/32/64.

The simulator's v2 tiles (step_v2.SIM_TILES: TJ = 3 units, TB = 4 rows, KC = 2 columns) divide none of the
sizes below (asserted), so every kernel has partial unit, row and K tiles and the guards are exercised.
The R traffic of v2 is measured, not assumed: the kernels run on an R that counts its element reads.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import SIMULATOR, compare_backends, examples, planned_and_launched
from hypothesis import given, settings

import numbarnn.contrib.cifg_lstm  # noqa: F401  (registers the contrib cells)
import numbarnn.contrib.peephole_lstm  # noqa: F401
from numbarnn.cells import get_cell
from numbarnn.config import RNNCall, rnn_config
from numbarnn.kernels import driver, step_v2, target
from numbarnn.kernels.cell_steps import FORWARD_ARGS, make_forward_step, used_args
from numbarnn.kernels.common import acc_dtype, jit
from numbarnn.kernels.recurrent import make_recurrent_backward
from numbarnn.kernels.simulator import CountingMatrix
from numbarnn.testing import make_rnn_case, rnn_cases, run_backward, run_forward

numba_cuda = pytest.importorskip("numba.cuda")
TILES = step_v2.SIM_TILES
#: the R-read counts pass a Python object (CountingMatrix) to the kernels, which only the simulator allows
counts_reads = pytest.mark.skipif(not SIMULATOR, reason="counts R reads in the simulator (a Python object as an "
                                  "argument); on a GPU ncu counts the bytes: bench/gpu_profile.py")


@pytest.fixture(params=driver.STEP_VERSIONS, ids=[f"v{v}" for v in driver.STEP_VERSIONS])
def version(request, monkeypatch):
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", str(request.param))
    return request.param


#          id: (rnn_config args, T, B, lengths, dtypes)
CASES = {
    "lstm-bi-H5B5": (dict(num_layers=1, num_units=5, input_size=3, rnn_mode="lstm", direction="bidirectional"),
                     3, 5, [3, 0, 2, 1, 3], (np.float64,)),
    "lstm-bi-proj-dropout": (dict(num_layers=2, num_units=5, input_size=2, rnn_mode="lstm",
                                  direction="bidirectional", num_proj=3, dropout=0.3, seed=2**32 - 1, seed2=3),
                             2, 5, [2, 1, 0, 1, 2], (np.float64,)),
    "gru-bi-dropout": (dict(num_layers=2, num_units=4, input_size=3, rnn_mode="gru", direction="bidirectional",
                            dropout=0.3, seed=-5, seed2=11),
                       2, 5, [2, 1, 0, 2, 1], (np.float64, np.float16)),
    "rnn_tanh-uni-skip": (dict(num_layers=2, num_units=4, input_size=4, rnn_mode="rnn_tanh",
                               input_mode="skip_input"),
                          3, 6, [3, 2, 0, 1, 3, 2], (np.float64,)),
    "rnn_relu-bi-B3": (dict(num_layers=1, num_units=5, input_size=2, rnn_mode="rnn_relu",
                            direction="bidirectional"),
                       3, 3, [1, 3, 0], (np.float32,)),
    "peephole-bi-proj": (dict(num_layers=1, num_units=4, input_size=3, rnn_mode="peephole_lstm",
                              direction="bidirectional", num_proj=2),
                         3, 5, [3, 0, 1, 2, 2], (np.float16,)),
    "peephole-uni": (dict(num_layers=1, num_units=5, input_size=2, rnn_mode="peephole_lstm"),
                     2, 5, [2, 1, 0, 2, 1], (np.float64,)),
    "cifg-bi-proj": (dict(num_layers=1, num_units=4, input_size=2, rnn_mode="cifg_lstm", direction="bidirectional",
                          num_proj=3),
                     2, 5, [2, 2, 0, 1, 1], (np.float32,)),
    "lstm-all-zero-lengths": (dict(num_layers=1, num_units=4, input_size=2, rnn_mode="lstm"),
                              2, 5, [0, 0, 0, 0, 0], (np.float64,)),
}

PARAMS = [pytest.param(key, np.dtype(dt).name, id=f"{key}-{np.dtype(dt).name}")
          for key, (*_, dtypes) in CASES.items() for dt in dtypes]


def case_of(key, dtype):
    args, T, B, lengths, _ = CASES[key]
    return make_rnn_case(rnn_config(**args), T, B, lengths, seed=sum(map(ord, key)), dtype=np.dtype(dtype))


def test_simulator_tiles_leave_partial_tiles():
    """The cases' H, P, G*H and B are not multiples of the simulator's tiles, so partial tiles happen."""
    assert TILES.TB > 1 and TILES.TJ > 1 and TILES.KC > 1 and TILES.threads < TILES.TJ * TILES.TB
    for key in CASES:
        cfg = case_of(key, "float64").cfg
        B = CASES[key][2]
        assert cfg.H % TILES.TJ and B % TILES.TB, key
        assert cfg.P % TILES.KC or cfg.G * cfg.H % TILES.KC or cfg.P % TILES.TJ, key


@pytest.mark.parametrize("key,dtype", PARAMS)
def test_versions_against_reference(key, dtype, version):
    """Forward and backward, every named output, within SPEC 10's tolerance of the reference."""
    case = case_of(key, dtype)
    compare_backends(case, context=f" [step v{version}]")
    log = driver.last_launch_count()
    assert log["forward"].step_version == log["backward"].step_version == version
    if version == 2 and max(case.lengths) > 0:
        assert log["forward"].by_kernel["forward_step_v2"] == case.cfg.L * max(case.lengths), log
        assert "forward_step" not in log["forward"].by_kernel and "backward_step_v2" not in log["forward"].by_kernel
    if version == 3 and max(case.lengths) > 0:           # every case's slice fits the simulator's: persistent
        for phase in ("forward", "backward"):
            assert log[phase].by_kernel[f"{phase}_persistent_v3"] == case.cfg.L, log[phase]
            assert log[phase].per_step == 0, log[phase]


@pytest.mark.parametrize("key,dtype", [("lstm-bi-proj-dropout", "float32")])
def test_inference(key, dtype, version):
    from dataclasses import replace

    compare_backends(replace(case_of(key, dtype), is_training=False), context=f" [step v{version}]")


@pytest.mark.parametrize("v", ["2", "3"])
@settings(max_examples=examples(3))
@given(case=rnn_cases(max_T=3, max_B=5, dtype=np.float64))
def test_hypothesis_v2_v3(v, case):
    """A few random configurations (every built-in mode, projection, dropout, skip input) under v2 and v3 (v3
    where its slices fit the simulator's, else v2: either way against the reference)."""
    import os

    old = os.environ.get("NUMBARNN_STEP_VERSION")
    os.environ["NUMBARNN_STEP_VERSION"] = v
    try:
        compare_backends(case, context=f" [step v{v}]")
    finally:
        if old is None:
            del os.environ["NUMBARNN_STEP_VERSION"]
        else:
            os.environ["NUMBARNN_STEP_VERSION"] = old


# ----------------------------------------------------------------------------------------------
# launches per step
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,num_proj", [("lstm", 0), ("lstm", 2), ("gru", 0)])
def test_v2_launches_per_step(mode, num_proj, monkeypatch):
    """v2: forward 1 launch per step (+ project); backward 1 per step + 1 to finish dh0 (no projection),
    2 per step with a projection (v1's backward step + recurrent_backward_v2)."""
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "2")
    cfg = rnn_config(1, 4, 2, mode, direction="bidirectional", num_proj=num_proj)
    T = 3
    case = make_rnn_case(cfg, T, 5, [3, 1, 0, 2, 3], seed=1)
    run_backward(case, run_forward(case, "cuda"), "cuda")
    fwd, bwd = driver.last_launch_count()["forward"], driver.last_launch_count()["backward"]
    assert fwd.per_step == (2 if num_proj else 1), fwd
    assert fwd.by_kernel["forward_step_v2"] == T, fwd
    if num_proj:
        assert bwd.per_step == 2, bwd
        assert bwd.by_kernel["backward_step"] == bwd.by_kernel["recurrent_backward_v2"] == T, bwd
    else:
        assert bwd.per_step == 1, bwd
        assert bwd.by_kernel["backward_step_v2"] == T + 1, bwd
        assert "recurrent_backward" not in bwd.by_kernel and "backward_step" not in bwd.by_kernel, bwd


@pytest.mark.parametrize("mode,proj,lengths", [("lstm", 2, [3, 1, 0, 2, 3]), ("gru", 0, [3, 1, 0, 2, 3]),
                                               ("rnn_tanh", 0, [0, 0, 0, 0, 0])])
def test_launch_plan_matches_v2(mode, proj, lengths, monkeypatch):
    """driver.launch_plan describes the v2 launches the driver really makes (and names the v2 kernels)."""
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "2")
    cfg = rnn_config(1, 4, 2, mode, direction="bidirectional", num_proj=proj)
    T, B = 3, 5
    plan, _, _, _ = planned_and_launched(make_rnn_case(cfg, T, B, lengths, seed=2))
    call = RNNCall(cfg, T, B, np.dtype(np.float64), True, True, tuple(lengths))
    names = {r["kernel"] for r in plan}
    if max(lengths):
        assert f"{mode}_forward_step_v2" in names, names
        assert ("recurrent_backward_v2" if proj else f"{mode}_backward_step_v2") in names, names
    gpu_plan = driver.launch_plan(call, gpu=True)
    row = next(r for r in gpu_plan if r["kernel"].endswith("forward_step_v2")) if max(lengths) else None
    if row is not None:
        assert row["block"] == step_v2.GPU_TILES_F64.threads and row["grid"] == (1, 1, 2), row


def test_tiles_narrow_where_the_grid_leaves_sms_idle(monkeypatch):
    """step_v2.tiles on a GPU: the GPU tiles, or NARROW_TILES (half the units a block, the same 8 rows and 64
    threads) where the GPU tiles' grid has fewer blocks than the GPU has SMs; the simulator's own tiles."""
    assert step_v2.tiles("float32", simulator=True, H=768, B=16, sms=132) == step_v2.SIM_TILES
    narrow, gpu = step_v2.NARROW_TILES, step_v2.GPU_TILES
    assert (narrow.TB, narrow.threads, narrow.KC) == (gpu.TB, gpu.threads, gpu.KC) and narrow.TJ == gpu.TJ // 2
    for H, B, D, expected in [(768, 16, 1, narrow),          # 24 x 2 = 48 blocks on 132 SMs
                              (256, 4, 1, narrow), (512, 32, 1, narrow),
                              (1024, 64, 1, gpu),             # 32 x 8 = 256 blocks
                              (768, 48, 2, gpu)]:             # 24 x 6 x 2 = 288
        assert step_v2.tiles("float32", simulator=False, H=H, B=B, D=D, sms=132) == expected, (H, B, D)
        assert step_v2.tiles("float16", simulator=False, H=H, B=B, D=D, sms=132) == expected, (H, B, D)
    assert step_v2.tiles("float64", simulator=False, H=768, B=16, sms=132) == step_v2.NARROW_TILES_F64
    assert step_v2.tiles("float64", simulator=False, H=1024, B=64, sms=132) == step_v2.GPU_TILES_F64
    assert step_v2.tiles("float32", simulator=False, H=768, B=16, sms=48) == gpu      # 48 blocks fill 48 SMs
    assert step_v2.tiles("float32", simulator=False) == gpu                            # no layer given
    monkeypatch.setenv("NUMBARNN_V2_NARROW", "0")
    assert step_v2.tiles("float32", simulator=False, H=768, B=16, sms=132) == gpu      # switched off
    monkeypatch.delenv("NUMBARNN_V2_NARROW")

    def no_gpu():
        raise RuntimeError("no GPU")
    monkeypatch.setattr(target, "device_geometry", no_gpu)
    assert step_v2.tiles("float32", simulator=False, H=768, B=16) == gpu               # no GPU: the GPU tiles
    monkeypatch.setattr(target, "device_geometry", lambda: ((9, 0), 132))
    assert step_v2.tiles("float32", simulator=False, H=768, B=16) == narrow            # this process's GPU


@pytest.mark.skipif(not SIMULATOR, reason="runs the narrow GPU tiles in the simulator")
@pytest.mark.parametrize("mode,proj", [("gru", 0), ("lstm", 2)])
def test_narrow_tiles_against_the_reference(mode, proj, monkeypatch):
    """The whole op with v2 at NARROW_TILES (64 threads, 16 units x 8 rows), as a GPU runs it on a small grid:
    a partial unit tile (H = 20), a partial row tile (B = 9, ragged with a 0), a partial K chunk, both
    directions; with a projection recurrent_backward_v2 too."""
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "2")
    asked = []

    def narrow(dtype="float32", simulator=None, **layer):
        asked.append(layer)
        return step_v2.NARROW_TILES
    monkeypatch.setattr(step_v2, "tiles", narrow)
    cfg = rnn_config(1, 20, 3, mode, direction="bidirectional", num_proj=proj)
    case = make_rnn_case(cfg, 2, 9, [2, 1, 0, 2, 2, 1, 2, 1, 2], seed=5, dtype=np.float32)
    compare_backends(case, context=" (v2, narrow tiles)")
    assert driver.last_launch_count()["forward"].by_kernel["forward_step_v2"] == 2
    assert dict(H=20, B=9, D=2) in asked and len(asked) == 2, asked      # forward's and backward's tiles


def test_step_version_choice(monkeypatch):
    for bad in ("4", "0", "v2"):
        monkeypatch.setenv("NUMBARNN_STEP_VERSION", bad)
        with pytest.raises(ValueError, match="NUMBARNN_STEP_VERSION"):
            driver.step_version()
    for good in ("1", "2", "3"):
        monkeypatch.setenv("NUMBARNN_STEP_VERSION", good)
        assert driver.step_version() == int(good)
    monkeypatch.delenv("NUMBARNN_STEP_VERSION")
    assert driver.step_version() == (1 if SIMULATOR else 3)    # the simulator's default is v1, a GPU's v3


# ----------------------------------------------------------------------------------------------
# R traffic per step, counted
# ----------------------------------------------------------------------------------------------

def _forward_args(cell, dtype, H, B, D, T, rng):
    G, P, acc = cell.G, H, acc_dtype(dtype)
    to = numba_cuda.to_device
    return dict(
        s=0, lens=to(np.full(B, T, np.int32)),
        gx=to(rng.standard_normal((D, T, B, G * H)).astype(dtype)),
        unit_params=to(rng.standard_normal((D, 2 * G + cell.V, H)).astype(dtype)),
        R_fwd=CountingMatrix(rng.standard_normal((G * H, P)).astype(dtype)),
        R_rev=CountingMatrix(rng.standard_normal((G * H, P)).astype(dtype)),
        h_in=to(rng.standard_normal((D, B, P)).astype(acc)), h_out=to(np.zeros((D, B, P), acc)),
        c=to(np.zeros((D, B, H), acc)), y=to(np.zeros((T, B, D * P), dtype)),
        acts=to(np.zeros((D, T, B, cell.S * H), dtype)), cs=to(np.zeros((D, T, B, H), dtype)), ms=None)


@counts_reads
@pytest.mark.parametrize("B", [4, 5])
def test_r_reads_per_step(B):
    """v2 reads every element of R once per row tile (ceil(B / TB) x |R| per direction, the count
    step_v2.r_bytes_per_step gives); v1 reads it once per batch row (B x |R|); the results agree."""
    cell, dtype, H, D, T = get_cell("lstm"), "float32", 5, 2, 1
    names = used_args(FORWARD_ARGS, cell, False)
    outs = {}
    for v in (1, 2):
        args = _forward_args(cell, dtype, H, B, D, T, np.random.default_rng(0))
        if v == 1:
            kernel, grid, block = jit(make_forward_step, cell, dtype, False), (2, B, D), 3
        else:
            kernel = jit(step_v2.make_forward_step_v2, cell, dtype, False, TILES)
            grid, block = step_v2.grid(H, B, D, TILES), TILES.threads
        kernel[grid, block](*[args[n] for n in names])
        reads = len(args["R_fwd"].reads) + len(args["R_rev"].reads)
        size = args["R_fwd"].a.size
        outs[v] = args["h_out"].copy_to_host()
        if v == 1:
            assert reads == D * B * size
        else:
            assert reads * 4 == step_v2.r_bytes_per_step(cell.G, H, H, B, D, 4, TILES)
            assert reads == D * -(-B // TILES.TB) * size
            assert len(set(args["R_fwd"].reads)) == size        # every element, none skipped
    np.testing.assert_allclose(outs[2], outs[1], rtol=1e-6, atol=1e-6)


@counts_reads
def test_r_reads_backward_per_step():
    """recurrent_backward_v2 reads R once per row tile (v1: once per row), with the same dh."""
    dtype, G, H, B, D, T = "float64", 3, 5, 5, 2, 1
    rng = np.random.default_rng(1)
    to = numba_cuda.to_device
    dgh = to(rng.standard_normal((D, T, B, G * H)))
    lens = to(np.array([1, 1, 0, 1, 1], np.int32))
    dh_in = rng.standard_normal((D, B, H))
    direct = rng.standard_normal((D, B, H))
    mats = [rng.standard_normal((G * H, H)) for _ in range(D)]
    outs = {}
    for v in (1, 2):
        R = [CountingMatrix(m) for m in mats]
        out = to(direct.copy())
        if v == 1:
            jit(make_recurrent_backward, dtype)[(2, B, D), 3](0, lens, dgh, R[0], R[1], to(dh_in), out)
            assert sum(len(m.reads) for m in R) == D * 4 * R[0].a.size     # 4 active rows, each reads all R
        else:
            jit(step_v2.make_recurrent_backward_v2, dtype, TILES)[step_v2.grid(H, B, D, TILES), TILES.threads](
                0, lens, dgh, R[0], R[1], to(dh_in), out)
            assert sum(len(m.reads) for m in R) == D * -(-B // TILES.TB) * R[0].a.size
        outs[v] = out.copy_to_host()
    np.testing.assert_allclose(outs[2], outs[1], rtol=1e-13, atol=1e-13)
    assert (outs[2][:, 2] == dh_in[:, 2]).all()          # the length-0 row carries dh


def test_gpu_tiles_read_r_once_at_b8():
    """The issue's target: R bytes per step <= 1.25 x |R| at B = 8 with the GPU tiles (v1: 8 x |R|)."""
    G, H, itemsize = 4, 512, 4
    R_bytes = G * H * H * itemsize
    assert step_v2.r_bytes_per_step(G, H, H, 8, 1, itemsize, step_v2.GPU_TILES) <= 1.25 * R_bytes
    assert step_v2.GPU_TILES.threads % 32 == 0 and step_v2.GPU_TILES.TJ == 32

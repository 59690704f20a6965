"""Step kernel v3 (numbarnn/kernels/step_v3.py): the persistent forward and backward and their per-step
variants.

numba's simulator runs cooperative grids of one block only; numbarnn's fix to it (numbarnn/kernels/simulator.py)
runs all blocks of a cooperative launch at once, with a real grid barrier.  So:
- the step bodies run on many blocks through the per-step variants: `forward_step_v3` against v1's
  `forward_step`, `backward_step_v3` against v2's `backward_step_v2` (the same arguments), on the same
  inputs, step by step (both directions, ragged lengths with 0, partial unit and row tiles, float16/32/64);
- the persistent loops run through the whole op (NUMBARNN_STEP_VERSION=3) against the reference, forward and
  backward: on one block (every cell), and on many blocks (the grid barrier: test_persistent_on_many_blocks);
- with a projection (two phases and two grid barriers per step, a second slice per block: W_proj's rows
  forward, R's columns of the projected outputs backward) the same, on many blocks;
- the driver says which version ran and why (v3 falls back to v2 when a slice does not fit or too many blocks).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import SIMULATOR, compare_backends, planned_and_launched

import numbarnn.contrib.cifg_lstm  # noqa: F401  (registers the contrib cells)
import numbarnn.contrib.peephole_lstm  # noqa: F401
from numbarnn.cells import get_cell
from numbarnn.config import rnn_config
from numbarnn.kernels import driver, step_v2, step_v3, target, v3_slices
from numbarnn.kernels.cell_steps import FORWARD_ARGS, make_forward_step, used_args
from numbarnn.kernels.common import acc_dtype, jit
from numbarnn.testing import make_rnn_case

numba_cuda = pytest.importorskip("numba.cuda")
SL = v3_slices.SIM_SLICE
CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu", "peephole_lstm", "cifg_lstm")
TOL = {"float64": 1e-13, "float32": 1e-5, "float16": 1e-3}


def _run_steps(version, cell, dtype, H, B, D, T, lens, seed=0, sl=SL):
    """Run T steps of one layer's forward step kernel (v1 or the v3 per-step variant) on random inputs."""
    rng = np.random.default_rng(seed)
    G, acc = cell.G, acc_dtype(dtype)
    to = numba_cuda.to_device
    args = dict(lens=to(np.asarray(lens, np.int32)),
                gx=to(rng.standard_normal((D, T, B, G * H)).astype(dtype)),
                unit_params=to((0.5 * rng.standard_normal((D, 2 * G + cell.V, H))).astype(dtype)),
                R_fwd=to((0.5 * rng.standard_normal((G * H, H))).astype(dtype)),
                R_rev=to((0.5 * rng.standard_normal((G * H, H))).astype(dtype)),
                c=to(rng.standard_normal((D, B, H)).astype(acc)), y=to(np.zeros((T, B, D * H), dtype)),
                acts=to(np.zeros((D, T, B, cell.S * H), dtype)), cs=to(np.zeros((D, T, B, H), dtype)), ms=None)
    h_in, h_out = to(rng.standard_normal((D, B, H)).astype(acc)), to(np.zeros((D, B, H), acc))
    if version == 1:
        kernel, grid, block = jit(make_forward_step, cell, dtype, False), (2, B, D), -(-H // 2)
    else:
        kernel, grid, block = jit(step_v3.make_forward_step_v3, cell, dtype, sl), (-(-H // sl.TJ), 1, D), sl.threads
    names = used_args(FORWARD_ARGS, cell, False)
    for s in range(max(lens)):
        args.update(s=s, h_in=h_in, h_out=h_out)
        kernel[grid, block](*[args[n] for n in names])
        h_in, h_out = h_out, h_in
    out = {"h": h_in.copy_to_host(), "y": args["y"].copy_to_host(), "acts": args["acts"].copy_to_host()}
    if cell.cell_state:
        out.update(c=args["c"].copy_to_host(), cs=args["cs"].copy_to_host())
    return out


@pytest.mark.parametrize("name,dtype", [(c, "float64") for c in CELLS] + [("lstm", "float32"),
                                                                          ("gru", "float16")])
def test_per_step_body_on_many_blocks_equals_v1(name, dtype):
    """H = 5 units over TJ = 3 (2 blocks, the last partial), B = 5 rows over TB = 4, both directions."""
    cell = get_cell(name)
    H, B, D, T, lens = 5, 5, 2, 3, [3, 0, 2, 1, 3]
    assert H % SL.TJ and B % SL.TB and H > SL.TJ and H <= SL.KMAX
    want = _run_steps(1, cell, dtype, H, B, D, T, lens)
    got = _run_steps(3, cell, dtype, H, B, D, T, lens)
    for key, w in want.items():
        np.testing.assert_allclose(got[key].astype(np.float64), w.astype(np.float64), rtol=TOL[dtype],
                                   atol=TOL[dtype], err_msg=f"{key} ({name}, {dtype})")


def _run_backward_steps(version, cell, dtype, H, B, D, T, lens, seed=0, sl=SL):
    """Run a layer's fused backward (s = max(len)-1 .. 0, then -1) with v2's step kernel or v3's per-step
    variant on random inputs (the same arguments: BACKWARD_V2_ARGS); -> every output."""
    rng = np.random.default_rng(seed)
    G, S, V, acc = cell.G, cell.S, cell.V, acc_dtype(dtype)
    to = numba_cuda.to_device

    def rand(*shape, of=dtype):
        return to((0.5 * rng.standard_normal(shape)).astype(of))

    args = dict(lens=to(np.asarray(lens, np.int32)), dy=rand(T, B, D * H), y=rand(T, B, D * H), h0=rand(D, B, H),
                c0=rand(D, B, H) if cell.cell_state else None, acts=rand(D, T, B, S * H),
                cs=rand(D, T, B, H) if cell.cell_state else None,
                unit_params=rand(D, 2 * G + V, H), R_fwd=rand(G * H, H), R_rev=rand(G * H, H),
                dh=rand(D, B, H, of=acc), dc=rand(D, B, H, of=acc) if cell.cell_state else None,
                dgx=to(np.zeros((D, T, B, G * H), dtype)), dgh=to(np.zeros((D, T, B, G * H), dtype)),
                dvec=to(np.zeros((D, T, B, V * H), dtype)) if V else None, h_prev=to(np.zeros((D, T, B, H), dtype)))
    if version == 2:
        t = step_v2.SIM_TILES
        kernel, grid, block = jit(step_v2.make_backward_step_v2, cell, dtype, t), step_v2.grid(H, B, D, t), t.threads
    else:
        kernel, grid, block = jit(step_v3.make_backward_step_v3, cell, dtype, sl), (-(-H // sl.TJ), 1, D), sl.threads
    names = step_v2.backward_v2_args(cell)
    for s in range(max(lens) - 1, -2, -1):
        args.update(s=s)
        kernel[grid, block](*[args[n] for n in names])
    return {k: args[k].copy_to_host() for k in ("dh", "dc", "dgx", "dgh", "dvec", "h_prev") if args[k] is not None}


@pytest.mark.parametrize("name,dtype", [(c, "float64") for c in CELLS] + [("lstm", "float32"),
                                                                          ("gru", "float16")])
def test_backward_per_step_body_on_many_blocks_equals_v2(name, dtype):
    """H = 5 units over TJ = 3 (2 blocks, the last partial), B = 5 rows over TB = 4, both directions: the v3
    backward body (R's columns kept in shared memory, dgh staged per gate) gives v2's dgx, dgh, dvec, h_prev,
    dh0 and dc0."""
    cell = get_cell(name)
    H, B, D, T, lens = 5, 5, 2, 3, [3, 0, 2, 1, 3]
    assert H % SL.TJ and B % SL.TB and H > SL.TJ and H <= SL.KMAX
    want = _run_backward_steps(2, cell, dtype, H, B, D, T, lens)
    got = _run_backward_steps(3, cell, dtype, H, B, D, T, lens)
    assert np.abs(want["dgh"]).max() > 0 and np.abs(want["dh"]).max() > 0
    for key, w in want.items():
        np.testing.assert_allclose(got[key].astype(np.float64), w.astype(np.float64), rtol=TOL[dtype],
                                   atol=TOL[dtype], err_msg=f"{key} ({name}, {dtype})")


@pytest.mark.parametrize("name,dtype,sl,B,lens", [
    # no prefetch (PF False: what `plan` picks where the prefetched values would not fit in registers, float64
    # at TJ = 1), 4 rows a thread, TB = 8 > B: one split
    ("lstm", "float64", SL._replace(RB=4, PF=False), 5, [3, 0, 2, 1, 3]),
    ("gru", "float32", SL._replace(RB=4, PF=False), 5, [3, 0, 2, 1, 3]),
    ("rnn_tanh", "float16", SL._replace(RB=4, PF=False), 5, [3, 0, 2, 1, 3]),
    # 4 row groups of 1 row: a tile of 1 row splits K 4 ways over 3 chunks (a split with no chunk), 2 rows 2 ways
    ("lstm", "float64", SL._replace(RG=4, RB=1), 5, [3, 0, 2, 1, 3]),
    ("peephole_lstm", "float32", SL._replace(RG=4, RB=1), 2, [3, 1]),
    ("cifg_lstm", "float64", SL._replace(RG=4, RB=1), 1, [3]),
])
def test_step_bodies_on_other_slices(name, dtype, sl, B, lens):
    """The forward and backward bodies on many blocks against v1 and v2 (as above) with other slices: without
    prefetching, and with the splits of K a small batch leaves to idle row groups (`make_split_k`)."""
    cell = get_cell(name)
    assert not v3_slices.prefetches("float64", v3_slices.Slice(TJ=1, RG=64, RB=1, KC=32, KMAX=512))
    assert v3_slices.prefetches("float32", v3_slices.plan(4, 768, 768, "float32", simulator=False))
    H, D, T = 5, 2, 3
    for run, version in ((_run_steps, 1), (_run_backward_steps, 2)):
        want = run(version, cell, dtype, H, B, D, T, lens)
        got = run(3, cell, dtype, H, B, D, T, lens, sl=sl)
        for key, w in want.items():
            np.testing.assert_allclose(got[key].astype(np.float64), w.astype(np.float64), rtol=TOL[dtype],
                                       atol=TOL[dtype], err_msg=f"{key} ({name}, {dtype}, after v{version})")


@pytest.mark.parametrize("mode,dtype,lengths", [("lstm", "float64", [3, 0, 2, 1, 3]),
                                                ("gru", "float64", [2, 2, 1, 0, 2]),
                                                ("rnn_relu", "float32", [1, 3, 3, 0, 2]),
                                                ("peephole_lstm", "float16", [3, 1, 0, 2, 2]),
                                                ("cifg_lstm", "float64", [2, 0, 1, 2, 2]),
                                                ("rnn_tanh", "float64", [0, 0, 0, 0, 0])])
def test_persistent_on_one_block_against_reference(mode, dtype, lengths, monkeypatch):
    """The whole op under NUMBARNN_STEP_VERSION=3: forward and backward = one persistent launch per layer each
    (odd and even step counts: h ends in either ping-pong buffer; no steps: no launch); every output and
    gradient against the reference."""
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "3")
    cfg = rnn_config(2, SL.TJ, 2, mode, dropout=0.3, seed=3, seed2=4)
    case = make_rnn_case(cfg, 3, 5, lengths, seed=5, dtype=np.dtype(dtype))
    compare_backends(case, context=" [step v3]")
    fwd = driver.last_launch_count()["forward"]
    steps = max(lengths)
    assert fwd.step_version == 3 and "co-resident" in fwd.note, fwd
    assert fwd.by_kernel.get("forward_persistent_v3", 0) == (cfg.L if steps else 0), fwd
    assert fwd.per_step == 0 and "forward_step" not in fwd.by_kernel, fwd
    bwd = driver.last_launch_count()["backward"]
    assert bwd.step_version == 3 and "co-resident" in bwd.note, bwd
    assert bwd.by_kernel.get("backward_persistent_v3", 0) == (cfg.L if steps else 0), bwd
    assert bwd.per_step == 0 and not any("step" in name for name in bwd.by_kernel), bwd


#: on a GPU these small grids are co-resident (v3 runs); in the simulator the cooperative limit is lowered to 1 block
SIM_ONLY = pytest.mark.skipif(not SIMULATOR, reason="a GPU holds these grids co-resident: v3 runs, not v2")


@pytest.mark.parametrize("proj,H,direction,why", [pytest.param(2, 7, "unidirectional", "do not fit", marks=SIM_ONLY),
                                                  pytest.param(0, 5, "unidirectional", "co-resident", marks=SIM_ONLY),
                                                  pytest.param(0, 3, "bidirectional", "co-resident", marks=SIM_ONLY),
                                                  pytest.param(2, 5, "unidirectional", "co-resident", marks=SIM_ONLY)])
def test_falls_back_to_v2_and_says_why(proj, H, direction, why, monkeypatch):
    """A slice that does not fit (here H = 7 W_proj columns > the simulator slice's 6): v2.  More blocks than can
    be co-resident (here: the simulator's cooperative limit set to one block, as numba's own simulator has
    it): v2, for both phases, with or without a projection, saying why."""
    from numbarnn.kernels import simulator
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "3")
    monkeypatch.setattr(simulator, "COOPERATIVE_BLOCKS", 1)
    cfg = rnn_config(1, H, 2, "lstm", direction=direction, num_proj=proj)
    case = make_rnn_case(cfg, 2, 3, [2, 1, 0], seed=6)
    compare_backends(case, context=" [step v3 -> v2]")
    fwd, bwd = driver.last_launch_count()["forward"], driver.last_launch_count()["backward"]
    assert fwd.step_version == 2 and why in fwd.note, fwd
    assert fwd.by_kernel["forward_step_v2"] == 2 and "forward_persistent_v3" not in fwd.by_kernel, fwd
    assert fwd.by_kernel.get("project", 0) == (2 if proj else 0), fwd
    assert bwd.step_version == 2 and why in bwd.note and "backward_persistent_v3" not in bwd.by_kernel, bwd
    assert bwd.by_kernel.get("backward_step_v2", 0) + bwd.by_kernel.get("recurrent_backward_v2", 0) > 0, bwd


#: (mode, direction, H): in the simulator (slices of TJ = 3 units, P <= 6) 2 blocks per direction, the last
#: partial; on a GPU (TJ = 16 at these widths) 5-7 blocks per direction
MANY_BLOCKS = ([("lstm", "bidirectional", 5), ("gru", "unidirectional", 6), ("peephole_lstm", "bidirectional", 4)]
               if SIMULATOR else [("lstm", "bidirectional", 100), ("gru", "unidirectional", 70)])


@pytest.mark.parametrize("mode,direction,H", MANY_BLOCKS)
def test_persistent_on_many_blocks(mode, direction, H, monkeypatch):
    """v3 runs grids of many blocks (H / TJ per direction, a partial last slice), forward and backward: the grid
    barrier between steps must hold (every block reads every other block's h, or dgh, of the step before), for
    ragged lengths with a 0, two layers, against the reference.  The simulator runs the blocks of a cooperative
    launch at once (numbarnn/kernels/simulator.py), so this runs without a GPU too."""
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "3")
    cfg = rnn_config(2, H, 7, mode, direction=direction)
    case = make_rnn_case(cfg, 9 if not SIMULATOR else 5, 6, [9, 4, 0, 1, 9, 6] if not SIMULATOR else
                         [5, 3, 0, 1, 5, 4], seed=8)
    compare_backends(case, context=" [step v3, many blocks]")
    fwd, bwd = driver.last_launch_count()["forward"], driver.last_launch_count()["backward"]
    assert fwd.step_version == 3 and fwd.by_kernel["forward_persistent_v3"] == cfg.L, fwd
    assert bwd.step_version == 3 and bwd.by_kernel["backward_persistent_v3"] == cfg.L, bwd
    assert v3_slices.blocks_needed(H, cfg.D, v3_slices.plan(get_cell(mode).G, H, H, "float64")) > 1


#: (mode, dtype, direction, H, P, lengths): in the simulator 2 blocks per direction (TJ = 3), TQ = 1 or 2
#: projected outputs per block, the last block's partial; dropout between the 2 layers
PROJ_CASES = [("lstm", "float64", "bidirectional", 5, 3, [4, 2, 0, 1, 4]),
              ("lstm", "float32", "unidirectional", 6, 2, [3, 4, 1, 0, 2]),
              ("peephole_lstm", "float64", "bidirectional", 4, 4, [2, 0, 3, 1, 3]),
              ("cifg_lstm", "float16", "unidirectional", 5, 1, [4, 4, 2, 3, 0])]


#: on a GPU (TJ = 16: 7 blocks per direction, TQ = 6, the last block's 1 output) the same in float32 and
#: float64.  Weights of scale 0.5 make this recurrence chaotic at H = 100: float32 rounding grows about 2.5x a
#: step, and the cpu backend itself is 3e-3 off the float64 reference (seen on the H100: the kernels were right,
#: the case was ill-conditioned).  Scale 0.2 keeps it contractive (the cpu backend 4e-7 off in float32).
GPU_PROJ_CASES = [("lstm", "float32", "bidirectional", 100, 37, [9, 4, 0, 1, 9]),
                  ("lstm", "float64", "bidirectional", 100, 37, [9, 4, 0, 1, 9])]


@pytest.mark.parametrize("mode,dtype,direction,H,P,lengths", PROJ_CASES if SIMULATOR else GPU_PROJ_CASES)
def test_persistent_with_projection(mode, dtype, direction, H, P, lengths, monkeypatch):
    """v3 with a projection: forward and backward one persistent launch per layer each (no project and no
    recurrent_backward launches), two grid barriers per step, on many blocks, against the reference: every
    output and gradient (dW_proj from dh_total, dR from h_prev, both written by the backward's dh phase)."""
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "3")
    cfg = rnn_config(2, H, 3, mode, direction=direction, num_proj=P, dropout=0.25, seed=7, seed2=1)
    case = make_rnn_case(cfg, max(lengths), len(lengths), lengths, seed=9, dtype=np.dtype(dtype),
                         scale=0.5 if SIMULATOR else 0.2)
    compare_backends(case, context=" [step v3, projection]")
    fwd, bwd = driver.last_launch_count()["forward"], driver.last_launch_count()["backward"]
    assert fwd.step_version == 3 and "2 grid barriers" in fwd.note, fwd
    assert fwd.by_kernel["forward_persistent_v3"] == cfg.L and "project" not in fwd.by_kernel, fwd
    assert bwd.step_version == 3 and "2 grid barriers" in bwd.note, bwd
    assert bwd.by_kernel["backward_persistent_v3"] == cfg.L, bwd
    assert not any("step" in name or "recurrent" in name for name in bwd.by_kernel), bwd
    sl = v3_slices.plan(get_cell(mode).G, H, P, dtype, has_proj=True)
    assert v3_slices.blocks_needed(H, cfg.D, sl) > cfg.D and sl.TQ * -(-H // sl.TJ) >= P


def test_gpu_slices_and_plan():
    """The slice fits the shared-memory budget; H = 256/512/1024 float32 LSTM slices (TJ 8/4/2)."""
    slices = v3_slices.gpu_slices(4, "float32")
    assert {H: sl.TJ for H, sl in slices.items()} == {256: 8, 512: 4, 1024: 2}
    for H, sl in slices.items():
        assert sl.KMAX >= H and v3_slices.slice_bytes(4, sl, "float32") <= v3_slices.SMEM_BUDGET
        assert sl.threads == v3_slices.THREADS
    assert v3_slices.plan(4, 8, 7, "float64", simulator=True) is None       # P > the simulator's KMAX
    # with a projection: TQ projected outputs per block cover P (TQ <= TJ), both phases' slices fit
    for H, P in ((1024, 512), (1024, 256), (512, 512), (768, 200), (256, 1)):
        sl = v3_slices.plan(4, H, P, "float32", simulator=False, has_proj=True)
        assert sl is not None and 1 <= sl.TQ <= sl.TJ and sl.TQ * -(-H // sl.TJ) >= P, (H, P, sl)
        assert sl.KMAX >= P and sl.HMAX >= H and v3_slices.slice_bytes(4, sl, "float32") <= v3_slices.SMEM_BUDGET


@pytest.mark.parametrize("mode,proj,H,lengths", [("lstm", 0, SL.TJ, [3, 1, 0, 2, 3]),
                                                 ("gru", 0, SL.TJ, [0, 0, 0, 0, 0]),
                                                 ("lstm", 2, SL.TJ, [3, 1, 0, 2, 3]),
                                                 ("lstm", 2, SL.TJ, [0, 0, 0, 0, 0])])
def test_launch_plan_matches_v3(mode, proj, H, lengths, monkeypatch):
    """driver.launch_plan lists the persistent launches (forward and backward, one per layer) the driver makes
    under NUMBARNN_STEP_VERSION=3, with a projection too (no project or recurrent_backward launches then)."""
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "3")
    cfg = rnn_config(2, H, 2, mode, num_proj=proj)
    plan, _, _, _ = planned_and_launched(make_rnn_case(cfg, 3, 5, lengths, seed=2))
    persistent = {r["kernel"]: r["launches"] for r in plan if "persistent" in r["kernel"]}
    assert not any(r["kernel"] in ("project", "recurrent_backward_v2") for r in plan), plan
    if not max(lengths):
        assert persistent == {}
    else:
        assert persistent == {f"{mode}_forward_persistent_v3": 1, f"{mode}_backward_persistent_v3": 1}
        assert len([r for r in plan if "persistent" in r["kernel"]]) == 2 * cfg.L


# ---------------------------------------------------------------------------------------------------
# wider blocks: the same slice run by more row groups (v3_slices.widen / widths / choose)
# ---------------------------------------------------------------------------------------------------

def test_widths_cut_the_rounds_a_thread_runs():
    """At H = 768, B = 16 (TJ = 2, 32 rows a block of 64 threads, 16 in the batch: 2 splits of 24 chunks, 12
    rounds a thread) 96 threads split K 3 ways (8 rounds), 128 threads 4 ways (6); the same R slice, so the
    same blocks.  A width whose larger h tile does not fit the budget is left out (H = 1024: TJ = 2 at 128
    threads), as is one that cuts no round (H = 512, B = 16: 96 threads hold 24 rows, one split)."""
    from numbarnn.kernels.v3_slices import v3_rounds
    base = v3_slices.plan(4, 768, 768, "float32", simulator=False)
    assert base.threads == v3_slices.THREADS and base.TJ == 2 and v3_rounds(16, base) == 12
    got = v3_slices.widths(4, base, 16, "float32")
    assert [(w.threads, v3_rounds(16, w)) for w in got] == [(128, 6), (96, 8), (64, 12)]
    assert all(w._replace(RG=base.RG) == base for w in got)                 # only the row groups differ
    assert {v3_slices.blocks_needed(768, 1, w) for w in got} == {384}
    for w in got:
        assert v3_slices.slice_bytes(4, w, "float32") <= v3_slices.SMEM_BUDGET
    big = v3_slices.plan(4, 1024, 1024, "float32", simulator=False)
    assert v3_slices.widen(4, big, "float32", 128) is None                  # 44 KB > the budget
    assert v3_slices.widths(4, big, 64, "float32") == [big]
    assert v3_slices.widen(4, base, "float32", 80) is None                  # not a multiple of KC = 32
    assert v3_slices.widen(4, base._replace(RB=2), "float32", 128) is None  # GPU slices have RB = 1
    mid = v3_slices.plan(4, 512, 512, "float32", simulator=False)            # TJ = 4: 16 rows of 64 threads
    assert [w.threads for w in v3_slices.widths(4, mid, 64, "float32")] == [128, 96, 64]
    # B = 16: 128 threads split K 2 ways; 96 (24 rows) would not split it at all, so they help nothing
    assert [w.threads for w in v3_slices.widths(4, mid, 16, "float32")] == [128, 64]


class FakeDevice:
    """step_v3.choose's view of a GPU: an H100's geometry and a device that answers max_cooperative_grid_blocks
    from `registers` (its own figure, not choose's estimate); records the slices it was asked about."""

    def __init__(self, monkeypatch, registers, cc=(9, 0), sms=132):
        self.asked = []

        def limit(phase, cell, dtype, sl, has_proj):
            self.asked.append(sl.threads)
            return v3_slices.v3_limit(cc, sms, cell.G, sl, dtype, registers)

        monkeypatch.setattr(target, "device_geometry", lambda: (cc, sms))
        monkeypatch.setattr(step_v3, "device_cooperative_limit", limit)
        # on a GPU choose remembers its answers per process: a fresh memo for this device, the real one kept
        monkeypatch.setattr(step_v3, "_choose_on_gpu", functools.lru_cache(step_v3._choose_on_gpu.__wrapped__))


@pytest.mark.parametrize("phase,registers,B,threads,asked", [
    # the estimate (172 forward at TJ = 2) rules 128 threads out (2 blocks an SM: 264 < 384) without compiling
    ("forward", 172, 16, 96, [96]),
    # backward (168): 128 threads fit 3 an SM, 396 >= 384
    ("backward", 168, 16, 128, [128]),
    # the device takes more registers than estimated: 96 threads no longer fit, 64 do (two kernels compiled)
    ("forward", 228, 16, 64, [96, 64]),
    # B = None (what the launch plan asks without a batch): plan's block only
    ("forward", 172, None, 64, [64]),
])
def test_choose_runs_the_widest_co_resident_block(phase, registers, B, threads, asked, monkeypatch):
    dev = FakeDevice(monkeypatch, registers)
    sl, why = step_v3.choose(get_cell("lstm"), "float32", 768, 768, 1, False, simulator=False, phase=phase, B=B)
    assert sl is not None and sl.threads == threads and sl.TJ == 2, why
    assert f"of {threads} threads" in why and "384 blocks" in why, why
    assert dev.asked == asked


def test_choose_without_a_device_geometry_keeps_the_plan(monkeypatch):
    FakeDevice(monkeypatch, 172)
    monkeypatch.setenv("NUMBARNN_V3_WIDE", "0")                   # switched off: plan's block
    sl, why = step_v3.choose(get_cell("lstm"), "float32", 768, 768, 1, False, simulator=False, B=16)
    assert sl.threads == v3_slices.THREADS, why
    monkeypatch.delenv("NUMBARNN_V3_WIDE")

    def no_gpu():
        raise RuntimeError("no GPU")

    monkeypatch.setattr(target, "device_geometry", no_gpu)
    sl, why = step_v3.choose(get_cell("lstm"), "float32", 768, 768, 1, False, simulator=False, B=16)
    assert sl.threads == v3_slices.THREADS, why
    # bidirectional at 768 (768 blocks): no width is co-resident, nor plan's (5 an SM with 172 registers)
    FakeDevice(monkeypatch, 172)
    sl, why = step_v3.choose(get_cell("lstm"), "float32", 768, 768, 2, False, simulator=False, B=16)
    assert sl is None and "768 blocks of 64 threads needed, only 660" in why, why


@pytest.mark.parametrize("mode,proj", [("lstm", 0), ("gru", 0), ("lstm", 2)])
def test_persistent_with_a_wider_block(mode, proj, monkeypatch):
    """The whole op with the slices run by more row groups than the block `plan` sizes them for, forward and
    backward against the reference, on many blocks, both directions, the block size the driver launches being
    the slice's.  In the simulator 4 row groups of 1 row (12 threads, not the simulator slice's 6): a row tile
    of 4 of the 5 rows, then one of 1 row whose chunks 4 splits share.  On a GPU (H = 100: chunks of KC = 32
    columns to split) the widest block `widen` allows, whether or not `choose` would pick it (float64, TJ = 8:
    LSTM 96 threads, one split; GRU and the projected LSTM 256 threads, the 5 rows' chunks split 4 ways)."""
    real = step_v3.choose

    def choose(cell, dtype, H, P, D, has_proj, **kw):
        sl, why = real(cell, dtype, H, P, D, has_proj, **kw)
        if sl is None:
            return sl, why
        if SIMULATOR:
            return sl._replace(RG=4, RB=1), why
        base = v3_slices.plan(cell.G, H, P, dtype, simulator=False, has_proj=has_proj)
        wide = max((w for w in (v3_slices.widen(cell.G, base, dtype, t) for t in v3_slices.WIDTHS) if w is not None),
                   key=lambda w: w.threads)
        return wide, why

    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "3")
    monkeypatch.setattr(step_v3, "choose", choose)
    H = 5 if SIMULATOR else 100
    cfg = rnn_config(2, H, 3, mode, direction="bidirectional", num_proj=proj if SIMULATOR else proj * 18)
    case = make_rnn_case(cfg, 4, 5, [4, 2, 0, 1, 3], seed=11, scale=0.5 if SIMULATOR else 0.2)
    compare_backends(case, context=" [step v3, a wider block]")
    fwd, bwd = driver.last_launch_count()["forward"], driver.last_launch_count()["backward"]
    assert fwd.step_version == 3 and bwd.step_version == 3, (fwd, bwd)
    assert fwd.by_kernel["forward_persistent_v3"] == cfg.L and bwd.by_kernel["backward_persistent_v3"] == cfg.L

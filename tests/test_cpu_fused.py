"""The cpu backend's fused forward (numbarnn/cpu/fused.py): its micro-kernel, its packing, and the whole op.

The hypothesis tests of test_cpu_backend.py run the fused loop too (it is the forward without a projection),
at H <= 5: one partial unit tile.  Here the shapes span several unit tiles (LANES units each) and several row
tiles (NR rows each), both with a partial last tile, with unsorted ragged lengths (so the row order matters),
in the serial and the parallel twin, against the reference and against the BLAS loop it replaced.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import replace

import numpy as np
import pytest
from conftest import QUICK, compare_cpu, cpu_cells, named
from hypothesis import given, settings
from hypothesis import strategies as st

from numbarnn import settings as numbarnn_settings
from numbarnn.cells import CellSpec, dtanh, get_cell, register, tanh
from numbarnn.config import rnn_config
from numbarnn.reserve import reserve_contents
from numbarnn.cpu import cells, fused, fused_plan, microkernel, network, threads
from numbarnn.testing import make_rnn_case, relative_error, run_backward, run_forward

ALL_CELLS = cpu_cells()     # the built-ins, the contrib cells (registered now) and conftest's MINGRU


@pytest.mark.parametrize("compute", ["float32", "float64"])
@pytest.mark.parametrize("G,V", [(1, None), (3, None), (4, None), (4, 1), (4, 2), (6, 3)])
@pytest.mark.parametrize("K", [0, 1, 37])
def test_product_tile_is_a_matrix_product(compute, G, V, K):
    """out[g, r, u] = sum_k panel[g // V, k, g % V, u] row_r[k], for rows anywhere in memory (given by address),
    in one pass over k (V = G) or several (this host's `vectors_per_pass`, or V given)."""
    from numba import njit
    LANES, NR = microkernel.lanes_for(compute), microkernel.rows_for(G)
    tile = microkernel.product_tile(compute, G, NR, LANES, V)
    V = V or microkernel.vectors_per_pass(G, NR)

    @njit
    def run(panel, rows, out):
        tile(panel.ctypes.data, rows.ctypes.data, panel.shape[1], out.ctypes.data)

    rng = np.random.default_rng(K + G)
    panel = rng.standard_normal((G // V, K, V, LANES)).astype(compute)
    source = rng.standard_normal((3 * NR, K)).astype(compute)            # rows picked out of order
    picked = rng.permutation(3 * NR)[:NR]
    rows = np.array([source[i].ctypes.data for i in picked], dtype=np.int64)
    out = np.full((G, NR, LANES), np.nan, dtype=compute)
    run(panel, rows, out)
    want = np.einsum("pkvu,rk->pvru", panel.astype(np.float64),
                     source[picked].astype(np.float64)).reshape(G, NR, LANES)
    tol = 1e-12 if compute == "float64" else 1e-5
    assert np.abs(out - want).max() <= tol * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("G", [1, 4])
def test_product_tile_with_a_bias_starts_every_row_from_it(G):
    """bias=True: out[g, r, u] = b[g, u] + sum_k ..., the same b for every row (the fused forward's biases)."""
    from numba import njit
    compute = "float32"
    LANES, NR = microkernel.lanes_for(compute), microkernel.rows_for(G)
    tile = microkernel.product_tile(compute, G, NR, LANES, bias=True)

    @njit
    def run(panel, rows, out, b):
        tile(panel.ctypes.data, rows.ctypes.data, panel.shape[1], out.ctypes.data, b.ctypes.data)

    rng = np.random.default_rng(G)
    V = microkernel.vectors_per_pass(G, NR)
    for K in (0, 9):
        panel = rng.standard_normal((G // V, K, V, LANES)).astype(compute)
        source = rng.standard_normal((NR, K)).astype(compute)
        b = rng.standard_normal((G, LANES)).astype(compute)
        out = np.full((G, NR, LANES), np.nan, dtype=compute)
        run(panel, np.array([r.ctypes.data for r in source], np.int64), out, b)
        want = b[:, None, :] + np.einsum("pkvu,rk->pvru", panel, source).reshape(G, NR, LANES)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_copy_values_copies_n_values_and_rejects_strided_arrays(dtype):
    """The fused loops' constant-size copies (`fused.copy_values`, LLVM's memcpy): n values of a contiguous row,
    the rest untouched; a strided or 2-d array or mixed dtypes are a TypeError when the loop compiles."""
    from numba import njit

    @njit
    def copy(dst, src, n):
        fused.copy_values(dst[1:], src[2:], n)

    src = np.arange(20, dtype=dtype)
    for n in (0, 3, 8, 16):
        dst = np.full(20, -1, dtype)
        copy(dst, src, n)
        assert dst[0] == -1 and np.array_equal(dst[1:1 + n], src[2:2 + n]) and (dst[1 + n:] == -1).all()

    @njit
    def strided(dst, src):
        fused.copy_values(dst[::2], src, 4)

    @njit
    def flat(dst, src):
        fused.copy_values(dst, src, 4)

    for fn, args in ((strided, (np.zeros(8, dtype), src)), (flat, (np.zeros((2, 4), dtype), src)),
                     (flat, (np.zeros(8, np.int64), src))):
        with pytest.raises(Exception, match="copy_values"):
            fn(*args)


def test_bias_tiles_lay_out_unit_tiles_with_zeros_past_H():
    G, H, NT, LANES = 3, 5, 2, 4
    b = np.arange(G * H, dtype=np.float32) + 1
    out = microkernel.bias_tiles(b, H, NT, LANES, np.full((NT, G, LANES), np.nan, np.float32))
    for jt in range(NT):
        for g in range(G):
            for u in range(LANES):
                j = jt * LANES + u
                assert out[jt, g, u] == (b[g * H + j] if j < H else 0.0), (jt, g, u)


def test_product_tile_rejects_a_pass_width_that_does_not_divide_G():
    with pytest.raises(ValueError, match="V=3 must divide G=4"):
        microkernel.product_tile("float32", 4, 2, 8, 3)


@pytest.mark.parametrize("machine,nbytes,registers", [("x86_64", 16, 16), ("x86_64", 32, 16), ("x86_64", 64, 32),
                                                      ("aarch64", 16, 32), ("arm64", 16, 32)])
def test_tile_shapes_keep_the_accumulators_in_registers(monkeypatch, machine, nbytes, registers):
    """Every tile shape fits the register file (accumulators + panel vectors + a broadcast), its pass width is
    the one product_tile uses, and NR is a power of two; the shapes measured: LSTM one pass of 4 x 4 with
    AVX-512, two passes of 2 x 4 with 16 registers (one pass of 4 x 3 spilled on Zen 3: 43% of peak).
    AArch64 (NEON: 32 registers of 16 bytes) gets AVX-512's shapes on 4-lane vectors (not measured here)."""
    monkeypatch.setattr(microkernel, "simd_bytes", lambda: nbytes)
    monkeypatch.setattr(microkernel, "machine", lambda: machine)
    assert microkernel.registers() == registers
    for G in range(1, 13):
        V, NR = microkernel.tile_shape(G)
        assert G % V == 0 and microkernel.fits(V, NR) and NR in (1, 2, 4, 8), (G, V, NR)
        assert V * NR + V + 1 <= registers
        assert microkernel.vectors_per_pass(G, NR) == V
        assert microkernel.panel_shape(3, 5, G, np.float32) == (3, G // V, 5, V, nbytes // 4)
    assert microkernel.tile_shape(4) == ((4, 4) if registers == 32 else (2, 4))
    assert microkernel.fits(4, 3) == (registers == 32)


@pytest.mark.parametrize("V", [1, 3])
def test_pack_lays_out_unit_tiles_with_zeros_past_H(V):
    G, H, K, LANES = 3, 5, 4, 4
    W = np.arange(G * H * K, dtype=np.float32).reshape(G * H, K) + 1
    out = np.full((2, G // V, K, V, LANES), np.nan, dtype=np.float32)
    microkernel.pack(W, out)
    for jt in range(2):
        for g in range(G):
            for u in range(LANES):
                j = jt * LANES + u
                want = W[g * H + j] if j < H else np.zeros(K)
                assert (out[jt, g // V, :, g % V, u] == want).all(), (jt, g, u)


@pytest.mark.parametrize("G, U, V", [(1, 2, 2), (1, 2, 1), (2, 2, 2)])
def test_pack_by_tiles_of_unit_tiles(G, U, V):
    """pack(W, out, U): a tile's vector w holds gate w % G of unit tile jt*U + w // G, zeros past H (a one-gate
    cell's forward pairs unit tiles, `microkernel.units_per_pass`); the forward's product of a packed tile then
    gives W's rows in that order."""
    H, K, LANES = 11, 3, 4
    W = np.arange(G * H * K, dtype=np.float32).reshape(G * H, K) + 1
    NT = 2                                                      # 2 tiles of U unit tiles: 16 units, 11 real
    out = np.full((NT, G * U // V, K, V, LANES), np.nan, dtype=np.float32)
    microkernel.pack(W, out, U)
    for jt in range(NT):
        for w in range(G * U):
            g, unit_tile = w % G, jt * U + w // G
            for u in range(LANES):
                j = unit_tile * LANES + u
                want = W[g * H + j] if j < H else np.zeros(K)
                assert (out[jt, w // V, :, w % V, u] == want).all(), (jt, w, u)
    assert microkernel.units_per_pass(1) == 2 and microkernel.units_per_pass(3) == 1


@pytest.mark.parametrize("V", [1, 2])
def test_pack_columns_lays_out_column_tiles_with_zeros_past_P(V):
    K, P, MV, LANES = 3, 11, 2, 4
    R = np.arange(K * P, dtype=np.float32).reshape(K, P) + 1
    out = np.full((2, MV // V, K, V, LANES), np.nan, dtype=np.float32)
    microkernel.pack_columns(R, out)
    for ct in range(2):
        for m in range(MV):
            for u in range(LANES):
                col = (ct * MV + m) * LANES + u
                want = R[:, col] if col < P else np.zeros(K)
                assert (out[ct, m // V, :, m % V, u] == want).all(), (ct, m, u)


def _wide_case(mode, dtype, **kw):
    """H spans two full unit tiles and a partial one; B two full row tiles and a partial one."""
    cfg_kw = {"direction": "bidirectional", "dropout": 0.3, "seed": 3, "seed2": 4} | kw
    LANES = microkernel.lanes_for(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    NR = microkernel.rows_for(rnn_config(1, 4, 4, mode).G)
    H, B, T = 2 * LANES + 3, 2 * NR + 1, 5
    lengths = [(2, T, 0, 4, 1, T, 3, 0, T, 2, 1, 4)[b % 12] for b in range(B)]   # unsorted, with 0 and T
    layers = cfg_kw.pop("layers", 2)
    I = H if cfg_kw.get("input_mode") == "skip_input" else 7
    cfg = rnn_config(layers, H, I, mode, **cfg_kw)
    return make_rnn_case(cfg, T, B, lengths, seed=11, dtype=dtype)


@pytest.mark.parametrize("mode", ALL_CELLS)
def test_wide_shapes_against_the_reference(mode):
    case = _wide_case(mode, np.float32)
    compare_cpu(case)
    compare_cpu(replace(case, is_training=False))          # inference: the loop writes no reserve


@pytest.mark.parametrize("mode", ["lstm", "peephole_lstm", "cifg_lstm"])
def test_wide_shapes_with_projection(mode):
    """P = LANES + 5 < H: the projection's columns span a partial column tile; training and inference."""
    case = _wide_case(mode, np.float32, num_proj=microkernel.lanes_for(np.float32) + 5)
    compare_cpu(case)
    compare_cpu(replace(case, is_training=False))


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("input_mode", ["linear_input", "skip_input"])
def test_wide_shapes_dtypes_and_skip_input(dtype, input_mode):
    compare_cpu(_wide_case("lstm", dtype, input_mode=input_mode))
    compare_cpu(_wide_case("gru", dtype, input_mode=input_mode, direction="unidirectional", layers=1))


def test_training_inference_and_skip_input_share_one_compiled_loop():
    """`save` and `skip` are run-time flags of the fused forward: training and inference, linear and skip input
    run the same machine code (one numba overload), and each writes what it should (compare: the reserve only
    when training)."""
    H = microkernel.lanes_for(np.float32) + 3
    loop = fused.forward_group(rnn_config(1, H, H, "gru").cell, "float32", False)   # what both loops run
    before = len(loop.overloads)
    for input_mode in ("linear_input", "skip_input"):
        case = make_rnn_case(rnn_config(1, H, H, "gru", input_mode=input_mode), 3, 2, [3, 1], seed=5,
                             dtype=np.float32)
        compare_cpu(case)
        compare_cpu(replace(case, is_training=False))
    assert len(loop.overloads) == max(before, 1)
    for is_training in (True, False):              # zoneout (a run-time argument): the same compiled loop too
        compare_cpu(make_rnn_case(rnn_config(1, H, H, "gru", zoneout=0.4), 3, 2, [3, 1], seed=5, dtype=np.float32,
                                  is_training=is_training))
    assert len(loop.overloads) == max(before, 1)


@pytest.mark.parametrize("kw", [{}, dict(num_proj=microkernel.lanes_for(np.float64) + 1),
                                dict(input_mode="skip_input")])
@pytest.mark.parametrize("is_training", [True, False])
def test_zoneout_in_the_fused_loops(monkeypatch, kw, is_training):
    """Zoneout (SPEC 6.1) inside the fused loops over several unit and row tiles, partial ones too, 2 layers
    bidirectional, unsorted ragged lengths with 0, float64 against the reference (training: the mask, backward
    too; inference: the expectation); with a projection, of the projected h (P = LANES + 1: two vectors); with
    skip input.  The BLAS loops fail if called."""
    def fail(*args, **kwargs):
        raise AssertionError("the BLAS loop ran")

    monkeypatch.setattr(network, "blas_forward", fail)
    monkeypatch.setattr(cells, "pick", fail)
    case = _wide_case("lstm", np.float64, zoneout=0.3, **kw)
    compare_cpu(replace(case, is_training=is_training))


def test_zoneout_row_groups_give_the_same_bits(monkeypatch):
    """Zoneout's masks, h' and backward split in the parallel loops (3 row groups) as in the serial ones."""
    case = _wide_case("lstm", np.float32, num_proj=5, zoneout=0.2)
    runs = []
    for groups in (1, 3):
        _use_row_groups(monkeypatch, groups)
        fwd = run_forward(case, "cpu")
        runs.append(named(fwd, run_backward(case, fwd, "cpu")) | {"reserve": reserve_contents(fwd[3])})
    for name, a in runs[0].items():
        assert a.tobytes() == runs[1][name].tobytes(), name


@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize("groups", [2, 3, 5])
def test_row_groups_give_the_same_bits(monkeypatch, mode, groups):
    """Any number of row groups (each group its own time loop over its row tiles, on its own thread; 5 is more
    groups than row tiles) gives the same bits as one group (the serial loops), and both run one compiled
    body: the group functions have one overload each (a group index passed unsigned would compile the body a
    second time)."""
    case = _wide_case(mode, np.float32, num_proj=5 if mode == "lstm" else 0)
    _use_row_groups(monkeypatch, 1)
    serial = run_forward(case, "cpu")
    serial = named(serial, run_backward(case, serial, "cpu"))
    _use_row_groups(monkeypatch, groups)
    ran = _count_helpers(monkeypatch)
    par = run_forward(case, "cpu")
    par = named(par, run_backward(case, par, "cpu"))
    for name, a in serial.items():
        assert a.tobytes() == par[name].tobytes(), name
    # every group past the first ran on a helper thread, in the forward and in the backward's time loop
    assert len(ran) >= 2 * (groups - 1) and all(name.startswith("numbarnn") for name in ran)
    cell, proj, MV = case.cfg.cell, case.cfg.has_proj, fused.COLUMN_VECTORS
    for loop, group in ((fused.forward_loop(cell, "float32", True, proj), fused.forward_group(cell, "float32", proj)),
                        (fused.backward_loop(cell, "float32", True, MV, proj),
                         fused.backward_group(cell, "float32", MV, proj))):
        assert loop.group is group and len(group.overloads) == 1


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_torchs_openmp_workers_give_the_same_bits_as_numbarnns_helpers(monkeypatch, mode):
    """Row groups, sides and product slices on torch's OpenMP workers (`threads._torch_openmp`) give the bits of
    numbarnn's own helpers (the setting cpu_torch_pool off): forward, backward and the reserve, a bidirectional
    layer with a projection, and the pieces past the first ran on OpenMP's workers."""
    pytest.importorskip("torch")
    if threads._torch_openmp() is None:
        pytest.skip("torch's parallel backend is not an OpenMP runtime numbarnn finds")
    monkeypatch.setattr(threads, "SPLIT_MIN_MACS", 0)
    _use_row_groups(monkeypatch, 2)
    case = _wide_case(mode, np.float32, num_proj=5 if mode == "lstm" else 0)
    runs = []
    for pool in (False, True):
        ran = _count_helpers(monkeypatch)
        with numbarnn_settings.override(cpu_torch_pool=pool):
            fwd = run_forward(case, "cpu")
            runs.append(named(fwd, run_backward(case, fwd, "cpu")) | {"reserve": reserve_contents(fwd[3])})
        assert ran and all(name.startswith("numbarnn-openmp") == pool for name in ran)
    for name, a in runs[0].items():
        assert a.tobytes() == runs[1][name].tobytes(), name


@pytest.mark.parametrize("mode, kw", [("lstm", dict(num_proj=5)), ("gru", {}), ("lstm", dict(input_mode="skip_input")),
                                      ("lstm", dict(zoneout=0.2, direction="unidirectional", layers=3))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_on_the_calls_threads(monkeypatch, mode, kw, dtype):
    """On two threads the fused backward runs every layer's time loop in row groups (a lower layer's too, after
    the upper layer's products) and each weight-gradient product in two slices, one per thread, with BLAS on one
    thread in each (no BLAS pool woken to spin beside the loops): the same gradients as the reference, with a
    projection, GRU's own R-side gradients, skip input, zoneout, three layers."""
    import numba
    monkeypatch.setattr(threads, "SPLIT_MIN_MACS", 0)
    _use_row_groups(monkeypatch, 2)
    matmuls, matmul = [], np.matmul

    def recorded(*args, **kwargs):
        matmuls.append((threading.current_thread().name, threads._blas_libraries()[0].num_threads))
        return matmul(*args, **kwargs)
    case = _wide_case(mode, dtype, **kw)
    old = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        fwd = run_forward(case, "cpu")
        ran = _count_helpers(monkeypatch)
        monkeypatch.setattr(np, "matmul", recorded)
        got = run_backward(case, fwd, "cpu")
    finally:
        numba.set_num_threads(old)
    monkeypatch.setattr(np, "matmul", matmul)
    want = run_backward(case.astype(np.float64), run_forward(case.astype(np.float64), "reference"), "reference")
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for name, a, b in zip(("dx", "dh0", "dc0", "dparams"), got, want):
        if b is not None:
            assert relative_error(a, b) < tol, name
    L, D = case.cfg.L, case.cfg.D
    # per pseudo-layer a time loop's second group, and per pseudo-layer a slice of its products, on a helper
    assert len(ran) == 2 * L * D and all(name.startswith("numbarnn") for name in ran)
    assert matmuls and all(n == 1 for _, n in matmuls)
    assert any(name.startswith("numbarnn") for name, _ in matmuls)


def test_two_callers_share_the_helpers(monkeypatch):
    """Two threads of a program calling at once, each call in row groups (and product slices where the thread may
    set BLAS to one thread: threadpoolctl lets one thread do so) on the helpers, which the two calls share, one
    piece after another: each gets what it gets alone (to rounding: the products' slicing moves bits)."""
    import numba
    monkeypatch.setattr(threads, "SPLIT_MIN_MACS", 0)
    _use_row_groups(monkeypatch, 2)
    cases = [_wide_case("lstm", np.float32, num_proj=5), _wide_case("gru", np.float64, layers=3)]
    old = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        def both(case):
            fwd = run_forward(case, "cpu")
            return named(fwd, run_backward(case, fwd, "cpu"))
        alone = [both(case) for case in cases]
        got, errors = [[], []], []

        def caller(k):
            try:
                numba.set_num_threads(2)                 # (numba's count is per thread)
                for _ in range(3):
                    got[k].append(both(cases[k]))
            except BaseException as e:                   # noqa: BLE001  (reported below)
                errors.append(e)
        workers = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
    finally:
        numba.set_num_threads(old)
    assert not errors and all(len(g) == 3 for g in got)
    for k in range(2):
        for run in got[k]:
            for name, a in alone[k].items():
                assert relative_error(run[name], a) < (1e-6 if a.dtype == np.float32 else 1e-13), (k, name)


def _count_helpers(monkeypatch) -> list:
    """From now on every piece `threads.team` hands to a helper records the helper thread's name in the list."""
    team = threads.team

    def counted(pieces):
        def there(piece):
            def run():
                ran.append(threading.current_thread().name)
                return piece()
            return run
        return team(pieces[:1] + [there(p) for p in pieces[1:]])
    ran = []
    monkeypatch.setattr(threads, "team", counted)
    return ran


def _side_by_side(monkeypatch, on: bool) -> list:
    """Every bidirectional layer from now on runs its directions side by side (on: whatever its size and thread
    count) or one after the other, in plans cached apart until the test ends -> the list that counts the calls
    the helper thread ran."""
    monkeypatch.setattr(fused, "side_by_side", lambda D, threads, macs: on and D == 2)
    monkeypatch.setattr(fused_plan, "layer_sides", functools.lru_cache(_LAYER_SIDES.__wrapped__))
    monkeypatch.setattr(fused_plan, "forward_plan", functools.lru_cache(_FORWARD_PLAN.__wrapped__))
    monkeypatch.setattr(fused_plan, "backward_plan", functools.lru_cache(_BACKWARD_PLAN.__wrapped__))
    ran = []
    helper = threads.side_by_side

    def counted(first, second):
        def there():
            ran.append(threading.current_thread().name)
            return second()
        return helper(first, there)

    monkeypatch.setattr(threads, "side_by_side", counted)
    return ran


@pytest.mark.parametrize("mode, kw", [("lstm", dict(num_proj=5, zoneout=0.2)), ("gru", {}),
                                      ("lstm", dict(input_mode="skip_input"))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_directions_side_by_side_against_the_reference(monkeypatch, mode, kw, dtype):
    """The two directions of each layer on two threads (fused.side_by_side), forward and backward, training and
    inference: 2 layers with dropout, ragged unsorted lengths with 0, partial tiles, with a projection and
    zoneout, GRU's own R-side gradients, skip input; against the reference, the helper thread used."""
    ran = _side_by_side(monkeypatch, True)
    case = _wide_case(mode, dtype, **kw)
    compare_cpu(case)
    compare_cpu(replace(case, is_training=False))
    assert ran and all(name.startswith("numbarnn") for name in ran)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_directions_side_by_side_give_the_same_bits(monkeypatch, mode):
    """Side by side or one after the other, the same bits when BLAS runs on one thread both ways (side by side,
    each direction's products run on one BLAS thread: OpenBLAS's bits depend on its thread count)."""
    case = _wide_case(mode, np.float32, num_proj=5 if mode == "lstm" else 0)
    runs = []
    with threads.serial_blas():
        for on in (False, True):
            ran = _side_by_side(monkeypatch, on)
            fwd = run_forward(case, "cpu")
            runs.append(named(fwd, run_backward(case, fwd, "cpu")) | {"reserve": reserve_contents(fwd[3])})
            assert bool(ran) == on
    for name, a in runs[0].items():
        assert a.tobytes() == runs[1][name].tobytes(), name


def test_the_setting_keeps_directions_apart(monkeypatch):
    """cpu_side_by_side False: one direction after the other even where fused.side_by_side says yes."""
    ran = _side_by_side(monkeypatch, True)
    case = _wide_case("lstm", np.float32)
    with numbarnn_settings.override(cpu_side_by_side=False):
        fwd = run_forward(case, "cpu")
        run_backward(case, fwd, "cpu")
    assert ran == []
    fwd = run_forward(case, "cpu")
    assert ran


def test_when_directions_run_side_by_side():
    """Two directions on exactly two threads, each direction big enough to pay the helper's hand-off."""
    big = fused.SIDE_MIN_MACS
    assert fused.side_by_side(2, 2, big)
    assert not fused.side_by_side(2, 2, big - 1)       # a small call: the hand-off (~0.1 ms) would dominate
    assert not fused.side_by_side(1, 2, big)           # one direction
    assert not fused.side_by_side(2, 1, big)           # one thread
    assert not fused.side_by_side(2, 4, big)           # more threads: each direction's loop in row groups


def _use_row_groups(monkeypatch, groups: int) -> None:
    """Every call from now on runs in `groups` row groups: the plans (cached per call signature, not per row
    groups) made in caches of their own until the test ends, the forward's checked."""
    monkeypatch.setattr(fused, "row_groups", lambda *a: groups)
    forward_plan = functools.lru_cache(_FORWARD_PLAN.__wrapped__)

    def checked(*args):
        plan = forward_plan(*args)
        assert all(lay.groups == groups for lay in plan.layers)
        return plan

    monkeypatch.setattr(fused_plan, "forward_plan", checked)
    monkeypatch.setattr(fused_plan, "backward_plan", functools.lru_cache(_BACKWARD_PLAN.__wrapped__))


_FORWARD_PLAN, _BACKWARD_PLAN = fused_plan.forward_plan, fused_plan.backward_plan
_LAYER_SIDES = fused_plan.layer_sides


def _closure(dispatcher) -> dict:
    fn = dispatcher.py_func
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))


@pytest.mark.parametrize("NRW, NR", [(6, 4), (12, 8), (4, 4), (3, 2)])
def test_wide_tiles_cover_a_group_with_the_fewest_rows(NRW, NR):
    """A row group's n active rows as wide tiles then narrow ones: no cover of whole tiles computes fewer rows,
    and of the covers that compute as few, it has the most wide tiles (the faster kernel)."""
    for n in range(0, 60):
        a = fused.wide_tiles(n, NRW, NR)
        rows = a * NRW + -(-max(0, n - a * NRW) // NR) * NR
        covers = [(w * NRW + m * NR, w) for w in range(n // NRW + 2) for m in range(n // NR + 2)
                  if w * NRW + m * NR >= n]
        fewest = min(r for r, _ in covers)
        assert rows == fewest and a == max(w for r, w in covers if r == fewest), (n, a)
        assert a * NRW < n + NRW or n == 0                   # no wide tile of spare rows only
    assert [fused.wide_tiles(n, 6, 4) for n in (16, 8, 5, 32)] == [2, 0, 1, 4]     # 6+6+4, 4+4, 6, 4x6+2x4


def test_product_tile_writes_into_a_wider_tiles_scratch():
    """out_rows: a tile of NR rows writes rows 0 .. NR-1 of each gate's NRW rows (the wide tile's scratch), the
    rest untouched."""
    from numba import njit
    compute, G, NR, NRW = "float32", 4, 2, 3
    LANES = microkernel.lanes_for(compute)
    V = microkernel.vectors_per_pass(G, NR)
    tile = microkernel.product_tile(compute, G, NR, LANES, V, bias=True, out_rows=NRW)

    @njit
    def run(panel, rows, out, b):
        tile(panel.ctypes.data, rows.ctypes.data, panel.shape[1], out.ctypes.data, b.ctypes.data)

    rng = np.random.default_rng(5)
    panel = rng.standard_normal((G // V, 11, V, LANES)).astype(compute)
    source = rng.standard_normal((NR, 11)).astype(compute)
    b = rng.standard_normal((G, LANES)).astype(compute)
    out = np.full((G, NRW, LANES), np.nan, dtype=compute)
    run(panel, np.array([r.ctypes.data for r in source], np.int64), out, b)
    want = b[:, None, :] + np.einsum("pkvu,rk->pvru", panel, source).reshape(G, NR, LANES)
    np.testing.assert_allclose(out[:, :NR], want, rtol=1e-5, atol=1e-5)
    assert np.isnan(out[:, NR:]).all()


def test_wide_tiles_give_the_same_bits(monkeypatch):
    """The LSTM's loops with a wide tile (NR + NR // 2 rows, forced where this host's rule has none) in two row
    groups (rows dealt one by one) give the bits of the loops without one in one group: each row's products sum
    k in the same order whatever its tile and group.  The loops' cache keys carry the wide rows."""
    case = _wide_case("lstm", np.float32, num_proj=5)
    G, MV = case.cfg.G, fused.COLUMN_VECTORS
    runs = []
    for groups, NRW in ((1, microkernel.rows_for), (2, lambda G: microkernel.rows_for(G) * 3 // 2)):
        monkeypatch.setattr(microkernel, "wide_rows", NRW)
        monkeypatch.setattr(fused, "wide_rows", NRW)
        _clear_loops()
        _use_row_groups(monkeypatch, groups)
        fwd = run_forward(case, "cpu")
        runs.append(named(fwd, run_backward(case, fwd, "cpu")) | {"reserve": reserve_contents(fwd[3])})
        assert f" {NRW(G)} " in fused._forward_key(case.cfg.cell, "float32", True)
        assert f" {NRW(MV)} " in fused._backward_key(case.cfg.cell, "float32", MV, True)
    _clear_loops()
    for name, a in runs[0].items():
        assert a.tobytes() == runs[1][name].tobytes(), name


def test_group_rows_interleave_row_tiles():
    order = np.array([7, 3, 0, 5, 1, 6, 2, 4, 8])
    got = fused.group_rows(order, 2, 2)          # tiles [7 3] [0 5] [1 6] [2 4] [8]
    assert got.tolist() == [[7, 3, 1, 6, 8], [0, 5, 2, 4, -1]]
    assert fused.group_rows(order, 1, 4).tolist() == [order.tolist()]
    assert fused.group_rows(order[:1], 3, 4).tolist() == [[7], [-1], [-1]]


@pytest.mark.parametrize("mode", ["lstm", "peephole_lstm", "rnn_relu"])
def test_fused_and_blas_loops_agree(monkeypatch, mode):
    """The fused loop and the BLAS loop it replaced agree (to float32 rounding; they sum in other orders),
    and the backward (the same for both) gives the same gradients from either reserve."""
    case = _wide_case(mode, np.float32)
    got = run_forward(case, "cpu")
    monkeypatch.setenv("NUMBARNN_CPU_FUSED", "0")           # the BLAS loops
    want = run_forward(case, "cpu")
    for name, a in named(got).items():
        assert relative_error(a, named(want)[name]) <= 1e-6, name
    for a, b in zip(run_backward(case, got, "cpu"), run_backward(case, want, "cpu")):
        assert relative_error(a, b) <= 1e-5


@settings(QUICK, max_examples=25)
@given(mode=st.sampled_from(ALL_CELLS), H=st.integers(1, 40), B=st.integers(1, 11), T=st.integers(1, 4),
       bidirectional=st.booleans(), seed=st.integers(0, 2**16))
def test_hypothesis_wide(mode, H, B, T, bidirectional, seed):
    rng = np.random.default_rng(seed)
    cfg = rnn_config(1, H, 3, mode, direction="bidirectional" if bidirectional else "unidirectional")
    lengths = rng.integers(0, T + 1, size=B)
    compare_cpu(make_rnn_case(cfg, T, B, lengths, seed=seed, dtype=np.float32))


@pytest.fixture
def vector_width(monkeypatch):
    """Run the fused loops as compiled for another vector width (AVX2: 32 bytes, SSE/NEON: 16): the loops are
    built again with that width's LANES and NR (LLVM splits the wider IR vectors for this CPU if needed)."""
    def use(nbytes):
        monkeypatch.setattr(microkernel, "simd_bytes", lambda: nbytes)
        monkeypatch.setattr(microkernel, "machine", lambda: "x86_64")
        _clear_loops()
    yield use
    _clear_loops()


def _clear_loops():
    for factory in (fused.forward_group, fused.forward_loop, fused.backward_group, fused.backward_loop):
        factory.cache_clear()


@pytest.mark.parametrize("nbytes", [16, 32])
@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_other_vector_widths(vector_width, nbytes, mode):
    """The loops as built for 16 registers (LSTM two passes of 2 x 4, GRU one of 3 x 4, RNN 1 x 8), whatever
    this host's ISA (an AVX-512 host runs 4 x 4 otherwise).

    Each call below is another compiled loop pair (~12 s into an empty numba cache), so each checks something
    the others do not: GRU and RNN float32 the loops without a projection at this width (one pass of 3 x 4,
    1 x 8); the LSTM float32 with a projection (its forward and backward run the same two-pass W and R tiles as
    without one, plus the projection's panel at this width); the LSTM float64 the double-precision loop at half
    the lanes (2 at 16 bytes), in the two-pass tile.  The pointwise code of GRU and RNN in float64 is the same at
    every width (tested at the host's, test_wide_shapes_dtypes_and_skip_input and test_cpu_backend.py)."""
    vector_width(nbytes)
    assert microkernel.lanes_for(np.float32) == nbytes // 4 and microkernel.tile_shape(4) == (2, 4)   # 2 passes, 16 registers
    if mode == "lstm":
        compare_cpu(_wide_case(mode, np.float32, num_proj=nbytes // 4 + 1))
        compare_cpu(_wide_case(mode, np.float64, layers=1, direction="unidirectional"))
    else:
        compare_cpu(_wide_case(mode, np.float32))


def test_bench_cpu_fused_runs_at_tiny_sizes(capsys):
    """bench/bench_cpu_fused.py validates before it times: its micro-kernel sections at tiny sizes (the script
    had assumed NR divides B, which broke on AVX2's NR)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "bench" / "bench_cpu_fused.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_fused", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.product_only(T=2, B=5, H=16, reps=1, pause=0.0)
    bench.tile_shapes(K=16, B=5, steps=1, reps=1)
    out = capsys.readouterr().out
    assert "OpenBLAS np.matmul" in out
    for G, V, NR in bench.SHAPES_TRIED:
        assert f"G={G} V={V} NR={NR:2d}" in out
        assert ("spills" in out.split(f"G={G} V={V} NR={NR:2d}")[1].splitlines()[0]) == (not microkernel.fits(V, NR))


def _leaky_forward(wx, rh, v, h, c, saved):
    g = tanh(wx[0] + rh[0])
    c_new = 0.5 * c + g
    saved[0] = g
    return tanh(c_new), c_new


def _leaky_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    tc = tanh(c_new)
    dcell = dc + dm * dtanh(tc)
    dwx[0] = dcell * dtanh(saved[0])
    return 0.0, 0.5 * dcell


#: a one-gate cell with a state and a projection (this file only): its forward row tiles (NR = rows_for(1),
#: 8 with 16 registers) differ from the projection's own tile shape (tile_shape(4): NR 4)
LEAKY = register(CellSpec(name="test_fused_leaky", gates=("g",), saved=("g",), forward=_leaky_forward,
                          backward=_leaky_backward, cell_state=True, projection=True))


@pytest.mark.parametrize("nbytes", [32])
def test_projection_panel_follows_the_forward_row_tiles(vector_width, nbytes):
    """The forward's projection reads W_proj^T by the micro-kernel with the FORWARD's NR (rows_for(G)); its
    panel must be packed for that NR's pass width.  With 16 registers and G = 1 the two differ (1 vector per
    pass for 8 rows, 2 for tile_shape(4)'s 4 rows): packed by tile_shape, that projection was wrong.

    At AVX2's width (the case that was wrong) only: 16-byte vectors have the same 16 registers, so the same
    pass widths and row tiles (what this checks); a 16-byte loop with a projection is test_other_vector_widths'
    LSTM.  (A 16-byte LEAKY was one more compiled loop pair, ~12-19 s into an empty numba cache, for this test
    alone.)"""
    vector_width(nbytes)
    assert microkernel.rows_for(1) == 8 and microkernel.vectors_per_pass(fused.COLUMN_VECTORS, 8) != microkernel.tile_shape(4)[0]
    compare_cpu(_wide_case(LEAKY.name, np.float32, num_proj=nbytes // 4 + 1))


# ---------------------------------------------------------------------------------------------------
# tile shapes measured on the machine (numbarnn/cpu/tuning.py); the tests run the static rule otherwise
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def tuning_file(monkeypatch, tmp_path):
    """Tuning on, its file in tmp_path, nothing measured yet in this process; the loops rebuilt afterwards."""
    from numbarnn.cpu import tuning
    path = tmp_path / tuning.FILENAME
    monkeypatch.setattr(tuning, "enabled", lambda: True)
    monkeypatch.setattr(tuning, "cache_path", lambda: str(path))
    monkeypatch.setattr(tuning, "_measured", {})
    microkernel._chosen_shape.cache_clear()
    yield path
    microkernel._chosen_shape.cache_clear()
    _clear_loops()


def test_tile_shapes_are_measured_once_per_machine_and_read_back(tuning_file, monkeypatch):
    import json

    from numbarnn.cpu import tuning
    regs, simd = microkernel.registers(), microkernel.simd_bytes()
    fake = {shape: float(k) for k, shape in enumerate(reversed(tuning.candidates(4, regs)))}   # the last: fastest
    timed = []
    monkeypatch.setattr(tuning, "measure", lambda G, V, NR: timed.append((V, NR)) or fake[(V, NR)])
    best = tuning.candidates(4, regs)[0]
    assert tuning.chosen(4, regs, simd) == best and sorted(timed) == sorted(list(fake) * tuning.ROUNDS)
    assert timed[:len(fake)] == timed[len(fake):2 * len(fake)]          # rounds: every shape once, in turn
    entry = json.loads(tuning_file.read_text())[tuning.key(4, regs, simd)]
    assert entry["shape"] == list(best) and entry["static"] == list(microkernel._tile_shape(4, regs))
    assert tuning.cpu_model() in tuning.key(4, regs, simd)
    monkeypatch.setattr(tuning, "_measured", {})                       # a new process: read, not measured
    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured again"))
    assert tuning.chosen(4, regs, simd) == best and tuning.table()[tuning.key(4, regs, simd)]["shape"] == list(best)
    tuning_file.write_text("{not json")                                # unreadable: measured again, not a crash
    monkeypatch.setattr(tuning, "_measured", {})
    monkeypatch.setattr(tuning, "measure", lambda G, V, NR: fake[(V, NR)])
    assert tuning.chosen(4, regs, simd) == best and json.loads(tuning_file.read_text())


def test_the_wide_tile_is_measured_against_the_tile_and_read_back(tuning_file, monkeypatch):
    """`tuning.chosen_wide`: the tile shape's NR against NR + NR // 2 rows over the same rows (whole tiles of both),
    in rounds; the rule's choice (wide where it fits) replaced only by one MARGIN faster (as shapes); written, and
    read back by a later process; no measurement where no wider tile fits; the rule without tuning."""
    import json

    from numbarnn.cpu import tuning
    regs, simd = 16, 32                                  # AVX2's LSTM: 2 x 4, wide 2 x 6
    monkeypatch.setattr(microkernel, "tile_shape", lambda G: {4: (2, 4), 3: (3, 4)}[G])
    timed = []
    for ahead, rows in ((1.02, 6), (1.10, 4)):                     # the tile ahead of the rule's wide one
        monkeypatch.setattr(tuning, "_measured", {})
        tuning_file.unlink(missing_ok=True)
        monkeypatch.setattr(tuning, "measure", lambda G, V, NR, B: timed.append((V, NR, B)) or
                            (60.0 * ahead if NR == 4 else 60.0))
        assert tuning.chosen_wide(4, regs, simd) == rows
        entry = json.loads(tuning_file.read_text())[tuning.key(4, regs, simd) + " | wide rows of 2x4"]
        assert entry["rows"] == rows and entry["static"] == 6
    assert sorted(set(timed)) == [(2, 4, 24), (2, 6, 24)] and len(timed) == 4 * tuning.ROUNDS
    monkeypatch.setattr(tuning, "_measured", {})                       # a new process: read, not measured
    monkeypatch.setattr(tuning, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert tuning.chosen_wide(4, regs, simd) == 4
    assert tuning.chosen_wide(3, regs, simd) == 4                      # 3 x 6 does not fit: nothing to measure
    monkeypatch.setattr(tuning, "enabled", lambda: False)
    assert tuning.chosen_wide(4, regs, simd) == microkernel.wide_rule(4, regs) == 6
    assert microkernel.wide_candidate(1, 8, 16) == 8 and microkernel.wide_candidate(3, 4, 16) == 4
    assert microkernel.wide_candidate(4, 4, 32) == 6                   # AVX-512: measured, never the rule
    monkeypatch.setattr(microkernel, "tile_shape", lambda G: (4, 4))
    assert microkernel.wide_rule(4, 32) == 4


def test_cpus_that_share_a_model_name_are_told_apart():
    """A VM names Zen 3 and Zen 4 both "AMD EPYC": the key carries the core and the family/model numbers."""
    from numbarnn.cpu import tuning

    def info(model):
        block = f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n" \
                "model name\t: AMD EPYC\n"
        return block + "\n" + block.replace("processor\t: 0", "processor\t: 1").replace(str(model), "99")

    zen3, zen4 = tuning.describe_cpu(info(1), "znver3"), tuning.describe_cpu(info(17), "znver4")
    assert zen3 == "AMD EPYC (znver3, family 25 model 1)" and zen4 == "AMD EPYC (znver4, family 25 model 17)"
    assert tuning.describe_cpu(info(17), "generic") == "AMD EPYC (family 25 model 17)"
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\n\nHardware\t: BCM2835\n"           # ARM: the board, at the end
    assert tuning.describe_cpu(arm, "cortex-a72") == "BCM2835 (cortex-a72)"
    assert tuning.cpu_model() in tuning.key(4, 16, 32)


def test_a_shape_replaces_the_static_rule_only_by_a_margin(tuning_file, monkeypatch):
    """Each shape keeps its best of the interleaved rounds; another shape than the static rule's wins only when it
    is MARGIN faster (a noisy machine's one-off 64.6 against 63.6 GFLOP/s once chose a shape the op ran ~15%
    slower in)."""
    from numbarnn.cpu import tuning
    regs, simd = microkernel.registers(), microkernel.simd_bytes()
    static = microkernel._tile_shape(4, regs)
    other = next(s for s in tuning.candidates(4, regs) if s != static)
    for ahead, wins in ((1.02, False), (1.10, True)):
        monkeypatch.setattr(tuning, "_measured", {})
        tuning_file.unlink(missing_ok=True)
        rounds = iter(range(1000))                                       # the other shape's best is a late round

        def measure(G, V, NR):
            late = next(rounds) > 2 * len(tuning.candidates(4, regs))
            return 60.0 * (ahead if (V, NR) == other and late else 1.0) if (V, NR) in (static, other) else 1.0

        monkeypatch.setattr(tuning, "measure", measure)
        assert tuning.chosen(4, regs, simd) == (other if wins else static)
    assert tuning.pick({static: 50.0, other: 80.0}, static) == other and tuning.pick({other: 1.0}, static) == other


def test_measure_checks_the_product_and_returns_gflops():
    from numbarnn.cpu import tuning
    V, NR = microkernel._tile_shape(3, microkernel.registers())
    assert tuning.measure(3, V, NR, K=16, B=5, repeats=1) > 0


def test_a_chosen_shape_other_than_the_rule_computes_the_same(tuning_file, monkeypatch):
    """Whatever shape a machine chooses is threaded through the packing, the micro-kernels and the loops'
    cache keys: LSTM forced onto a shape the static rule does not pick, against the reference.  With a
    projection: its forward and backward run the W, R and dh products in that shape as the loops without one do,
    and the projection's panel too (a loop pair without a projection was ~15 s more of numba compiling for the
    same tiles)."""
    from numbarnn.cpu import tuning
    regs = microkernel.registers()
    other = next(s for s in tuning.candidates(4, regs) if s != microkernel._tile_shape(4, regs))
    monkeypatch.setattr(tuning, "measure", lambda G, V, NR: 2.0 if (G, V, NR) == (4, *other) else 1.0)
    _clear_loops()
    assert microkernel.tile_shape(4) == other and microkernel.vectors_per_pass(4, other[1]) == other[0]
    assert f"{other}" in fused._forward_key(get_cell("lstm"), "float32", False)     # numba's cache key too
    compare_cpu(_wide_case("lstm", np.float32, num_proj=3))

"""The per-call caches of tiny calls: each one keyed so that a hit equals a miss and a changed key misses; and
numbarnn.torch's per-signature fast path (inference and training) against its general path.

Covered: the cpu backend's fused forward plan (`fused_plan.forward_plan`) and backward plan
(`fused_plan.backward_plan`), the compiled weight packing (`fused_plan.fused_prepare`, against the NumPy packing
it replaced), the bias sums (`network.bias_sums`, bit for bit NumPy's), inference outputs written whole without
zeroing, the offsets of `params.unpack` and `reserve.reserve_views`, the backend modules by name
(`backends.get_backend`), the nonce recorded in host_reserved (`config._recorded_nonce`), and numba's thread count
without its locks (`cpu.threads.num_threads`).
"""
from __future__ import annotations

import sys
import types

import numba
import numpy as np
import pytest

from numbarnn import backends, ops
from numbarnn.config import RNNCall, _recorded_nonce, check_reserve_nonce, rnn_config
from numbarnn.cpu import fused_plan, microkernel, network, threads, workspace
from numbarnn.params import _layer_spans, params_size, unpack
from numbarnn.reserve import reserve_entries, reserve_views
from numbarnn.testing import make_rnn_case, run_backward, run_forward


def _case(mode="lstm", T=3, B=2, I=5, H=6, L=1, direction="unidirectional", proj=0, lengths=None, dtype=np.float32,
          training=True):
    from dataclasses import replace
    cfg = rnn_config(L, H, I, mode, direction=direction, num_proj=proj)
    case = make_rnn_case(cfg, T, B, lengths, seed=3, dtype=dtype)
    return replace(case, is_training=training)


def _run(case):
    out = run_forward(case, "cpu")
    grads = run_backward(case, out, "cpu") if case.is_training else ()
    return [np.array(a, copy=True) for a in (*out[:3], *grads) if a is not None]


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert np.array_equal(u, v, equal_nan=True)


@pytest.mark.parametrize("kw", [dict(), dict(mode="gru"), dict(L=2, direction="bidirectional"), dict(proj=4),
                                dict(lengths=[3, 1]), dict(dtype=np.float64), dict(training=False)])
def test_plans_hit_equals_miss(kw):
    case = _case(**kw)
    fused_plan.forward_plan.cache_clear()
    fused_plan.backward_plan.cache_clear()
    miss = _run(case)                                            # the plans worked out
    info_f, info_b = fused_plan.forward_plan.cache_info(), fused_plan.backward_plan.cache_info()
    assert info_f.misses >= 1 and info_f.hits == 0
    hit = _run(case)                                             # the same signature: found
    assert fused_plan.forward_plan.cache_info().hits > info_f.hits
    assert fused_plan.forward_plan.cache_info().misses == info_f.misses
    if case.is_training:
        assert fused_plan.backward_plan.cache_info().hits > info_b.hits
        assert fused_plan.backward_plan.cache_info().misses == info_b.misses
    _same(miss, hit)


@pytest.mark.parametrize("change", ["T", "B", "H", "lengths", "dtype", "mode", "training"])
def test_plans_changed_key_misses(change):
    base = dict(T=3, B=2, H=6)
    other = {"T": dict(T=4), "B": dict(B=3), "H": dict(H=7), "lengths": dict(lengths=[2, 3]),
             "dtype": dict(dtype=np.float64), "mode": dict(mode="gru"), "training": dict(training=False)}[change]
    _run(_case(**base))
    before = fused_plan.forward_plan.cache_info().misses
    got = _run(_case(**{**base, **other}))
    assert fused_plan.forward_plan.cache_info().misses == before + 1
    fused_plan.forward_plan.cache_clear()
    fused_plan.backward_plan.cache_clear()
    _same(got, _run(_case(**{**base, **other})))                 # and equals what a cold cache computes


def test_plans_follow_the_thread_count_and_the_tile():
    """Row groups follow numba's thread count, panel shapes the vector width and tile shape, the loops the cell:
    all in the keys (a call with another thread count gets the same results)."""
    case = _case(T=4, B=16, H=32, I=32)
    ref = _run(case)
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        _same(ref, _run(case))
    finally:
        numba.set_num_threads(old)
    call = RNNCall(case.cfg, 4, 16, np.dtype(np.float32), True, True, (4,) * 16)
    ct, cell, tile = np.dtype(np.float32), case.cfg.cell, microkernel.geometry(4)
    for plan in (fused_plan.forward_plan, fused_plan.backward_plan):
        one = plan(call, ct, tile, 1, cell)
        assert plan(call, ct, tile, 1, cell) is one                              # a hit
        assert plan(call, ct, tile, 2, cell) is not one                          # threads
        assert plan(call, ct, (tile[0], tile[1], tile[2] * 2), 1, cell) is not one   # tile
        assert plan(call, ct, (tile[0] // 2,) + tile[1:], 1, cell) is not one    # vector width
        assert plan(call, np.dtype(np.float64), tile, 1, cell) is not one        # compute dtype
        assert plan(RNNCall(case.cfg, 5, 16, np.dtype(np.float32), True, True, (5,) * 16), ct, tile, 1,
                    cell) is not one                                             # the call
    from dataclasses import replace
    twin = replace(cell)                                                          # a cell registered again
    plan = fused_plan.forward_plan
    assert twin == cell and plan(call, ct, tile, 1, twin) is plan(call, ct, tile, 1, cell)


@pytest.mark.parametrize("ct", [np.float32, np.float64])
@pytest.mark.parametrize("mode,proj,skip", [("lstm", 0, False), ("gru", 0, False), ("lstm", 3, False),
                                            ("rnn_tanh", 0, True)])
def test_fused_prepare_matches_the_numpy_packing(ct, mode, proj, skip):
    """`fused_prepare` writes what `microkernel.pack`, `pack_columns`, `bias_tiles` and the padding wrote before."""
    ct = np.dtype(ct)
    H, I, B = 5, 5 if skip else 7, 3
    cfg = rnn_config(1, H, I, mode, "skip_input" if skip else "linear_input", num_proj=proj)
    rng = np.random.default_rng(0)
    params = rng.standard_normal(params_size(cfg)).astype(ct)
    lp = unpack(cfg, params)[0]
    P, G = cfg.P, cfg.G
    z = fused_plan.fused_sizes(cfg, I, ct, microkernel.geometry(G))
    HP = z.HP
    h = rng.standard_normal((B, P)).astype(ct)
    c = rng.standard_normal((B, H)).astype(ct)
    spans = np.array([-1 if s is None else s[0] for s in _layer_spans(cfg, cfg.cell)[0]], np.int64)
    got = [np.full(z.W_panels, np.nan, ct), np.full(z.R_panels, np.nan, ct), np.full(z.Wq_panels, np.nan, ct),
           np.full((z.NT, G, z.LANES), np.nan, ct), np.full((z.NT, G, z.LANES), np.nan, ct),
           np.full((1, HP), np.nan, ct), np.full((2, B, max(HP, P)), np.nan, ct), np.full((B, HP), np.nan, ct)]
    fused_plan.fused_prepare(params, spans, I, H, cfg.V, h, c if cfg.has_cell_state else np.zeros((0, 0), ct), *got,
                          True)
    U = microkernel.units_per_pass(G)                   # 2 for rnn_tanh: its tiles pair unit tiles
    Rp = np.empty(z.R_panels, ct)
    microkernel.pack(lp.R, Rp, U)
    np.testing.assert_array_equal(got[1], Rp)
    if not skip:
        Wp = np.empty(z.W_panels, ct)
        microkernel.pack(lp.W, Wp, U)
        np.testing.assert_array_equal(got[0], Wp)
    if proj:
        Wq = np.empty(z.Wq_panels, ct)
        microkernel.pack_columns(lp.W_proj.T, Wq)
        np.testing.assert_array_equal(got[2], Wq)
    for b, out in ((lp.bW, got[3]), (lp.bR, got[4])):
        np.testing.assert_array_equal(out, microkernel.bias_tiles(b, H, z.NT, z.LANES, np.empty_like(out)))
    np.testing.assert_array_equal(got[5], np.zeros((1, HP), ct))
    want_h = np.zeros((2, B, max(HP, P)), ct)
    want_h[0, :, :P] = h
    np.testing.assert_array_equal(got[6], want_h)
    want_c = np.zeros((B, HP), ct)
    if cfg.has_cell_state:
        want_c[:, :H] = c
    np.testing.assert_array_equal(got[7], want_c)


@pytest.mark.parametrize("ct", [np.float32, np.float64])
def test_bias_sums_bit_for_bit_numpys(ct):
    rng = np.random.default_rng(1)
    for N in (1, 2, 3, 8, 17, 129, 1000, 5000):
        for C in (2, 3, 16, 48, 256):
            gx = (rng.standard_normal((N, C)) * rng.uniform(0.1, 100)).astype(ct)
            gh = (rng.standard_normal((N, C)) * rng.uniform(0.1, 100)).astype(ct)
            bW, bR = np.full(C, np.nan, ct), np.full(C, np.nan, ct)
            network.bias_sums(gx, gh, bW, bR, 0, C)
            assert np.array_equal(bW, np.sum(gx, axis=0)) and np.array_equal(bR, np.sum(gh, axis=0)), (N, C)
            # a slice of the columns (a thread's part): only those written, the same bits
            c0, c1 = C // 3, C - C // 4
            part = np.full(C, np.nan, ct), np.full(C, np.nan, ct)
            network.bias_sums(gx, gh, *part, c0, c1)
            for got, want in zip(part, (bW, bR)):
                assert np.array_equal(got[c0:c1], want[c0:c1]) and np.isnan(np.delete(got, np.s_[c0:c1])).all()
            # gh the same array as gx (the forward direction without split gates): the same sums in both
            shared = np.full(C, np.nan, ct), np.full(C, np.nan, ct)
            network.bias_sums(gx, gx, *shared, c0, c1)
            for got in shared:
                assert np.array_equal(got[c0:c1], bW[c0:c1]) and np.isnan(np.delete(got, np.s_[c0:c1])).all()


@pytest.mark.parametrize("ct", [np.float32, np.float64])
def test_sum_of_outer_is_numpys_product_and_a_step_of_one_row_its_outer_product(ct, monkeypatch):
    """network.sum_of_outer: a^T b, NumPy's bits at K = 3 and a strided a; at K = 1 (a call of one step and one
    row) the outer product without matmul, the same bits; a T=1 B=1 call's weight gradients take that path."""
    rng = np.random.default_rng(0)
    for K in (1, 3):
        wide = rng.standard_normal((K, 14)).astype(ct)
        a, b = wide[:, 2:9], rng.standard_normal((K, 5)).astype(ct)            # a [K, 7], strided
        out = np.full((7, 5), np.nan, ct)
        assert network.sum_of_outer(a, b, out) is out
        assert np.array_equal(out, np.matmul(a.T, b))
    used = []
    real = network.sum_of_outer
    monkeypatch.setattr(network, "sum_of_outer", lambda a, b, out: used.append(a.shape[0]) or real(a, b, out))
    case = make_rnn_case(rnn_config(1, 16, 8, "lstm"), 1, 1, None, seed=0, dtype=ct)
    run_backward(case, run_forward(case, "cpu"), "cpu")
    assert used == [1, 1]                                # dW and dR


def test_inference_outputs_written_whole_without_zeroing():
    """A full-length inference call no longer zeroes its y scratch: every element is written (poisoned scratch
    leaves no NaN); a ragged call of the same shape still gets zeros where no step runs."""
    full, ragged = _case(training=False), _case(training=False, lengths=[3, 1])
    want_full, want_ragged = _run(full), _run(ragged)
    for case, want in ((full, want_full), (ragged, want_ragged), (full, want_full)):
        workspace.poison(np.nan)
        got = _run(case)
        assert not any(np.isnan(a).any() for a in got)
        _same(got, want)
    assert np.all(want_ragged[0][1:, 1] == 0)                   # row 1 ran one step


def test_unpack_and_reserve_views_offsets_per_signature():
    for mode, L, direction, proj in (("lstm", 2, "bidirectional", 3), ("gru", 1, "unidirectional", 0)):
        cfg = rnn_config(L, 6, 5, mode, direction=direction, num_proj=proj)
        params = np.arange(params_size(cfg), dtype=np.float64)
        for lp, spans in zip(unpack(cfg, params), _layer_spans(cfg, cfg.cell)):
            for view, span in zip((lp.W, lp.R, lp.W_proj, lp.bW, lp.bR, lp.V), spans):
                assert (view is None) == (span is None)
                if view is not None:
                    assert view.shape == span[1] and view.reshape(-1)[0] == span[0]
                    assert np.shares_memory(view, params)
        for T, B in ((3, 2), (4, 2)):
            call = RNNCall(cfg, T, B, np.dtype(np.float32), True, True, (T,) * B)
            entries = reserve_entries(call)
            reserve = np.arange(sum(e.size for e in entries), dtype=np.float64)
            views = reserve_views(call, reserve)
            assert list(views) == [e.name for e in entries]
            for e in entries:
                assert views[e.name].shape == e.shape and views[e.name].reshape(-1)[0] == e.offset


def test_get_backend_by_name_follows_the_registry(monkeypatch):
    from numbarnn.cpu import backend as cpu_backend
    from numbarnn.reference import backend as reference_backend
    assert backends.get_backend("cpu") is cpu_backend
    assert backends.get_backend("cpu") is cpu_backend                  # a hit
    monkeypatch.setitem(backends.BACKENDS, "cpu", "numbarnn.reference.backend")
    assert backends.get_backend("cpu") is reference_backend            # the registry changed: looked up again
    monkeypatch.undo()
    assert backends.get_backend("cpu") is cpu_backend
    stand_in = types.ModuleType("numbarnn.cpu.backend")               # a stand-in put in sys.modules (the CLI's
    monkeypatch.setitem(sys.modules, "numbarnn.cpu.backend", stand_in)  # tests do this to the cuda backend)
    assert backends.get_backend("cpu") is stand_in
    monkeypatch.undo()
    assert backends.get_backend("cpu") is cpu_backend
    with pytest.raises(ValueError, match="backend"):
        backends.get_backend("nope")
    with pytest.raises(ValueError, match="backend"):
        backends.get_backend(["cpu"])


def test_recorded_nonce_hit_equals_miss_and_mismatch_raises():
    case = _case()
    y, hT, cT, reserve, host = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, backend="cpu",
                                                 rnn_mode="lstm")
    _recorded_nonce.cache_clear()
    check_reserve_nonce(host, reserve)                                # miss
    check_reserve_nonce(host, reserve)                                # hit
    assert _recorded_nonce.cache_info().hits >= 1
    y2, hT2, cT2, reserve2, host2 = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, backend="cpu",
                                                     rnn_mode="lstm")
    check_reserve_nonce(host2, reserve2)
    with pytest.raises(ValueError, match="different forward calls"):
        check_reserve_nonce(host, reserve2)                           # another call's nonce: refused
    with pytest.raises(ValueError, match="host_reserved"):
        check_reserve_nonce(host.astype(np.int16), reserve)           # not host_reserved: decode's message


def test_num_threads_equals_numbas_without_its_locks(monkeypatch):
    """Once numba's threads are up, `threads.num_threads` / `set_num_threads` read and set numba's count through
    its layer's functions, not numba's locked get/set_num_threads (which it defines only when it launches its
    threads, after this module is imported: the lock-free path was once never taken), and agree with numba."""
    old = numba.get_num_threads()                                      # (launches numba's threads)
    assert threads._layer_functions() is not None
    try:
        for n in sorted({1, old}):
            threads.set_num_threads(n)
            assert numba.get_num_threads() == n
            with monkeypatch.context() as m:
                m.setattr(numba, "get_num_threads", lambda: pytest.fail("numba's locked getter was called"))
                m.setattr(numba, "set_num_threads", lambda n: pytest.fail("numba's locked setter was called"))
                assert threads.num_threads() == n
                threads.set_num_threads(n)
    finally:
        numba.set_num_threads(old)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_numpy_gather_of_the_weight_views(dtype):
    """`_WeightViews.array` (the eager CPU gather by NumPy): the buffer torch.cat gathers, read from the weights'
    memory at every call (an in-place change shows), rebuilt when a weight's memory changes; None for weights
    NumPy cannot compute in (bfloat16: the torch gather casts them)."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    from numbarnn import torch_tensors
    dt = getattr(torch, dtype)
    m = nt.LSTM(3, 4, bias=False).to(dt)                      # (no biases: zero regions in the buffer)
    lay, views, w = m._layout, m._weight_views, m._flat_weights
    got = views.array(lay.spans, lay.size, w, dt)
    if dtype == "bfloat16":
        assert got is None
        return
    want = torch_tensors._opaque_params(lay.spans, w, w[0], lay.size).numpy()
    assert np.array_equal(got, want) and got.dtype == want.dtype
    entry = views._entry
    with torch.no_grad():
        m.weight_hh_l0.mul_(2.0)                              # in place: the same entry, the new values
    again = views.array(lay.spans, lay.size, m._flat_weights, dt)
    assert views._entry is entry
    assert np.array_equal(again, torch_tensors._opaque_params(lay.spans, m._flat_weights, w[0], lay.size).numpy())
    assert views.array(lay.spans, lay.size, m._flat_weights, torch.float16) is None      # another dtype
    m.weight_ih_l0.data = m.weight_ih_l0.data * 3.0          # new memory: rebuilt
    third = views.array(lay.spans, lay.size, m._flat_weights, dt)
    assert views._entry is not entry
    assert np.array_equal(third, torch_tensors._opaque_params(lay.spans, m._flat_weights, w[0], lay.size).numpy())


def _general(module, *args):
    """module(*args) by the general eager path (the inference fast path declined)."""
    import numbarnn.torch as nt
    fast = nt._NumbaRNNBase._fast
    nt._NumbaRNNBase._fast = lambda *a: None
    try:
        return module(*args)
    finally:
        nt._NumbaRNNBase._fast = fast


def _leaves(out) -> list:
    torch = pytest.importorskip("torch")
    return torch.utils._pytree.tree_leaves(out)


#: (module, its arguments, dtype, initial state) of the fast path's equality tests
FAST_PATH_CASES = [
    ("GRU", {}, "float32", None),
    ("LSTM", {"num_layers": 2, "bidirectional": True, "batch_first": True}, "float32", "given"),
    ("LSTM", {"proj_size": 3}, "float64", "given"),
    ("RNN", {"nonlinearity": "relu", "batch_first": True}, "float64", None),
    ("GRU", {"num_layers": 2, "dropout": 0.5}, "float32", "given"),   # eval mode: no dropout, the fast path
]


@pytest.mark.parametrize("mode, kw, dtype, state", FAST_PATH_CASES)
def test_inference_fast_path_equals_the_general_path(mode, kw, dtype, state):
    """An eager CPU inference call takes the per-signature fast path (`_NumbaRNNBase._fast`) and returns,
    bit for bit, what the general path returns (and what torch.nn returns, to rounding), for a second call of
    the signature too, after an in-place weight change and with another batch size."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    m = getattr(nt, mode)(5, 4, **kw).to(dt).eval()
    ref = getattr(torch.nn, mode)(5, 4, **kw).to(dt).eval()
    calls = m._fast_calls.entries
    D, L, P = 2 if kw.get("bidirectional") else 1, kw.get("num_layers", 1), kw.get("proj_size") or 4
    for B in (3, 1, 3):
        x = torch.randn((B, 2, 5) if kw.get("batch_first") else (2, B, 5), dtype=dt)
        args = [x]
        if state == "given":
            h = torch.randn(L * D, B, P, dtype=dt)
            args.append((h, torch.randn(L * D, B, 4, dtype=dt)) if mode == "LSTM" else h)
        ref.load_state_dict(m.state_dict())
        with torch.no_grad():
            fast, general, want = m(*args), _general(m, *args), ref(*args)
        assert (x.shape, dt, m.batch_first, 0.0, False) in calls   # the fast path ran
        for a, b, c in zip(_leaves(fast), _leaves(general), _leaves(want)):
            assert a.shape == b.shape == c.shape and a.dtype == b.dtype == dt
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            next(m.parameters()).mul_(0.5)                   # in place: the next call sees it
    assert len(calls) == 2                                   # one entry per signature (B = 3, B = 1)


def test_inference_fast_path_declines_what_it_does_not_run():
    """Gradients, active dropout, another backend, autocast and non-float32/64 input take the general path;
    errors keep torch.nn's messages; torch's thread count is untouched."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    m = nt.GRU(5, 4, num_layers=2, dropout=0.5)
    x = torch.randn(2, 3, 5)
    threads_before = torch.get_num_threads()
    m(x)                                                     # training mode, dropout active
    with torch.no_grad():
        m.eval()(x)
        assert len(m._fast_calls.entries) == 1         # only the eval-mode call
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x)
        half = nt.GRU(5, 4).to(torch.bfloat16).eval()
        half(x.to(torch.bfloat16))
    assert len(m._fast_calls.entries) == 1 and not half._fast_calls.entries
    m.train()
    m._fast_calls.entries.clear()
    m(x)                                                     # grad mode, weights need gradients
    with torch.no_grad(), pytest.raises(TypeError, match="float32"):
        m(x.double())                                        # weights float32, input float64: torch.nn's error
    assert not m._fast_calls.entries
    ref = nt.GRU(5, 4, backend="reference").eval()
    with torch.no_grad():
        ref(x)
    assert not ref._fast_calls.entries
    from numbarnn.backends import get_default_backend, set_default_backend
    from numbarnn.cpu import backend as cpu_backend
    if get_default_backend() == "cpu":                       # a module without a backend follows the default
        m.eval()
        with torch.no_grad():
            m(x)                                             # the signature's entry made on the cpu backend
        set_default_backend("reference")
        try:
            with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
                mp.setattr(cpu_backend, "rnn_forward", lambda *a: pytest.fail("the cpu backend ran"))
                m(x)                                         # the same signature: now the reference's
        finally:
            set_default_backend(None)
        m.train()
    with torch.no_grad(), pytest.raises(RuntimeError, match="input.size\\(-1\\) must be equal to input_size"):
        m(torch.randn(2, 3, 6))
    with torch.no_grad(), pytest.raises(RuntimeError, match="Expected hidden size"):
        m(x, torch.randn(1, 3, 4))
    assert torch.get_num_threads() == threads_before


def test_inference_fast_path_takes_zoneouts_expectation():
    """Eval-mode zoneout (its expectation) on the fast path equals the general path bit for bit; training-mode
    zoneout (masks drawn per call) declines it."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    torch.manual_seed(0)
    m = nt.GRU(5, 4, num_layers=2, zoneout=0.3).eval()
    x, h = torch.randn(3, 2, 5), torch.randn(2, 2, 4)
    with torch.no_grad():
        fast, general = m(x, h), _general(m, x, h)
        plain = nt.GRU(5, 4, num_layers=2).eval()
        plain.load_state_dict(m.state_dict())
        assert not torch.equal(plain(x, h)[0], fast[0])               # the expectation was taken
    assert (x.shape, x.dtype, False, 0.3, False) in m._fast_calls.entries
    for a, b in zip(_leaves(fast), _leaves(general)):
        assert torch.equal(a, b)
    m.train()
    m._fast_calls.entries.clear()
    with torch.no_grad():
        m(x, h)
    assert not m._fast_calls.entries


def _grads_of(module, args, create_graph=False, general=False) -> list:
    """The outputs of module(*args) (general: by the general path) and the gradients of a fixed function of all
    of them with respect to the input, the given state and every weight that requires one."""
    torch = pytest.importorskip("torch")
    out = _leaves(_general(module, *args) if general else module(*args))
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in out)
    wrt = [a for a in _leaves(args) if a.requires_grad] + [w for w in module.parameters() if w.requires_grad]
    return [o.detach() for o in out] + list(torch.autograd.grad(loss, wrt, create_graph=create_graph))


@pytest.mark.parametrize("mode, kw, dtype, state", FAST_PATH_CASES)
def test_training_fast_path_equals_the_general_path(mode, kw, dtype, state):
    """An eager CPU call that needs gradients takes the per-signature fast path (`_FastRNNFunction`): outputs and
    gradients (input, given state, weights) bit for bit the general path's and torch.nn's to rounding."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    torch.manual_seed(1)
    dt = getattr(torch, dtype)
    m = getattr(nt, mode)(5, 4, **kw).to(dt)
    if kw.get("dropout"):
        m.eval()
    ref = getattr(torch.nn, mode)(5, 4, **kw).to(dt).train(m.training)
    D, L, P = 2 if kw.get("bidirectional") else 1, kw.get("num_layers", 1), kw.get("proj_size") or 4
    for B in (3, 1):
        x = torch.randn((B, 2, 5) if kw.get("batch_first") else (2, B, 5), dtype=dt, requires_grad=True)
        args = [x]
        if state == "given":
            h = torch.randn(L * D, B, P, dtype=dt, requires_grad=True)
            args.append((h, torch.randn(L * D, B, 4, dtype=dt, requires_grad=True)) if mode == "LSTM" else h)
        ref.load_state_dict(m.state_dict())
        fast = _grads_of(m, args)
        assert (x.shape, dt, m.batch_first, 0.0, True) in m._fast_calls.entries      # the fast path ran
        general = _grads_of(m, args, general=True)
        want = _grads_of(ref, args)
        assert len(fast) == len(general) == len(want)
        for a, b, c in zip(fast, general, want):
            assert a.shape == b.shape == c.shape and a.dtype == b.dtype == dt
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_training_fast_path_second_derivatives_and_autograd_rules():
    """On the fast path: create_graph=True gives gradients autograd differentiates again (gradgradcheck), and
    gradcheck's batched gradients (vmap over backward) work; unused outputs, a frozen weight, a second backward
    with retain_graph, and an in-place weight change between forward and backward (autograd's error) behave as
    in torch.nn."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    torch.manual_seed(2)
    m = nt.LSTM(3, 2, batch_first=True).double()
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    h = (torch.randn(1, 2, 2, dtype=torch.float64, requires_grad=True),
         torch.randn(1, 2, 2, dtype=torch.float64, requires_grad=True))
    m(x, h)
    assert (x.shape, torch.float64, True, 0.0, True) in m._fast_calls.entries
    torch.autograd.gradcheck(lambda x, h0, c0: m(x, (h0, c0))[0], (x, *h), check_batched_grad=True)   # (vmap)
    torch.autograd.gradgradcheck(lambda x, h0, c0: m(x, (h0, c0))[0], (x, *h))
    first = _grads_of(m, [x, h], create_graph=True)
    assert all(g.requires_grad for g in first[3:])                 # a graph: differentiable again
    for a, b in zip(first, _grads_of(m, [x, h], general=True)):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)
    ref = torch.nn.LSTM(3, 2, batch_first=True).double()
    ref.load_state_dict(m.state_dict())
    (g_fast,), (g_ref,) = (torch.autograd.grad(mod(x, h)[1][0].sum(), [x]) for mod in (m, ref))   # h_n only
    torch.testing.assert_close(g_fast, g_ref)
    m.weight_hh_l0.requires_grad_(False)                         # a frozen weight gets no gradient
    y, _ = m(x, h)
    y.sum().backward(retain_graph=True)
    once = m.weight_ih_l0.grad.clone()
    y.sum().backward()                                           # a second backward of the same graph
    torch.testing.assert_close(m.weight_ih_l0.grad, 2 * once)
    assert m.weight_hh_l0.grad is None
    m.weight_hh_l0.requires_grad_(True)
    y, _ = m(x, h)
    with torch.no_grad():
        m.weight_ih_l0.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

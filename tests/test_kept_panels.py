"""The cpu backend's packed weights kept between calls of few rows (`numbarnn/cpu/panels.py`): reused only while
the weights are bit for bit those they were packed from, per thread, bounded, freed by release_workspaces, and
never trusted after a pack that did not finish.  Every test compares with calls that pack afresh."""
from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

import numbarnn
from numbarnn.config import rnn_config
from numbarnn.cpu import network, panels
from numbarnn.testing import make_rnn_case, run_forward


@pytest.fixture(autouse=True)
def _keep_small(monkeypatch):
    """Keep the panels of these tiny networks too (the rule skips them: a pack costs less than the look-up)."""
    monkeypatch.setattr(panels, "KEEP_WEIGHTS", 0)
    panels.KEPT.release()
    yield
    panels.KEPT.release()


def _case(mode="lstm", L=1, direction="unidirectional", proj=0, input_mode="linear_input", T=1, B=1, seed=3,
          dtype=np.float32):
    H = 6
    cfg = rnn_config(L, H, H if input_mode == "skip_input" else 5, mode, input_mode, direction, proj)
    return replace(make_rnn_case(cfg, T, B, seed=seed, dtype=dtype), is_training=False)


def _fresh(case, monkeypatch):
    """The outputs of a call that packs into scratch (nothing kept)."""
    with monkeypatch.context() as m:
        m.setattr(panels, "KEEP_ROWS", -1)
        return [np.array(a) for a in run_forward(case, "cpu")[:3]]


def _lookups(monkeypatch) -> list:
    """Whether each later call found its panels already packed."""
    seen, real = [], panels.KEPT.lookup

    def lookup(*args):
        kept = real(*args)
        seen.append(kept[1])
        return kept
    monkeypatch.setattr(panels.KEPT, "lookup", lookup)
    return seen


def _same(got, want):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("kw", [dict(), dict(mode="gru"), dict(L=2, direction="bidirectional"), dict(proj=4),
                                dict(mode="rnn_tanh", input_mode="skip_input"), dict(dtype=np.float64)])
def test_an_inference_loop_packs_once_and_agrees(kw, monkeypatch):
    case = _case(**kw)
    want = _fresh(case, monkeypatch)
    seen = _lookups(monkeypatch)
    for _ in range(3):
        _same(run_forward(case, "cpu")[:3], want)
    assert seen == [False, True, True]
    assert panels.KEPT.held_bytes() > 0


@pytest.mark.parametrize("where", ["first", "last", "middle", "negative zero"])
def test_weights_changed_in_place_are_packed_again(where, monkeypatch):
    """A change anywhere in the buffer (past the first block of the comparison too), even 0.0 -> -0.0, repacks."""
    case = _case(L=2, direction="bidirectional", proj=4)
    run_forward(case, "cpu")
    params = case.params                                  # the caller's array, written in place
    i = {"first": 0, "last": params.size - 1, "middle": params.size // 2}.get(where)
    if where == "negative zero":
        i = params.size // 3
        params[i] = 0.0
        run_forward(case, "cpu")                          # kept with +0.0
        params[i] = -0.0
    else:
        params[i] += 0.5
    seen = _lookups(monkeypatch)
    _same(run_forward(case, "cpu")[:3], _fresh(case, monkeypatch))
    assert seen == [False]


def test_a_pack_that_did_not_finish_is_not_trusted(monkeypatch):
    case = _case(L=2)
    run_forward(case, "cpu")
    case.params[-1] += 1.0                                # new weights: this call packs, then fails midway
    real, calls = network.fused_forward, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(*args, **kw)
    with monkeypatch.context() as m:
        m.setattr(network, "fused_forward", failing)
        with pytest.raises(RuntimeError):
            run_forward(case, "cpu")
    case.params[-1] -= 1.0                                # back to the bits of the last commit
    seen = _lookups(monkeypatch)
    _same(run_forward(case, "cpu")[:3], _fresh(case, monkeypatch))
    assert seen == [False]


def test_release_workspaces_frees_them_and_the_next_call_packs(monkeypatch):
    case = _case()
    run_forward(case, "cpu")
    held = panels.KEPT.held_bytes()
    assert held > 0 and numbarnn.release_workspaces() >= held and panels.KEPT.held_bytes() == 0
    seen = _lookups(monkeypatch)
    _same(run_forward(case, "cpu")[:3], _fresh(case, monkeypatch))
    assert seen == [False]


def test_bounded_per_thread_least_recently_used_first(monkeypatch):
    cases = [_case(T=1, B=b) for b in range(1, panels.KEEP_CONFIGS + 2)]   # one plan (so one entry) per batch size
    for case in cases:
        run_forward(case, "cpu")
    assert len(panels.KEPT._store()) == panels.KEEP_CONFIGS
    seen = _lookups(monkeypatch)
    run_forward(cases[-1], "cpu")                         # the most recent: kept
    run_forward(cases[0], "cpu")                          # the oldest: gone
    assert seen == [True, False]


def test_threads_keep_their_own(monkeypatch):
    """Two threads alternating two sets of weights of one configuration: each thread's panels are its own."""
    a = _case(seed=1)
    b = replace(a, params=_case(seed=2).params)
    want = {id(a): _fresh(a, monkeypatch), id(b): _fresh(b, monkeypatch)}
    errors = []

    def loop(case):
        try:
            for _ in range(20):
                _same(run_forward(case, "cpu")[:3], want[id(case)])
        except Exception as exc:                          # pragma: no cover (reported below)
            errors.append(exc)
    workers = [threading.Thread(target=loop, args=(c,)) for c in (a, b)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors


def test_the_rule_keeps_only_small_calls_of_large_weights(monkeypatch):
    monkeypatch.setattr(panels, "KEEP_WEIGHTS", 16384)
    seen = _lookups(monkeypatch)
    run_forward(_case(), "cpu")                           # 6 units: packing is cheaper than the look-up
    assert seen == []
    monkeypatch.setattr(panels, "KEEP_WEIGHTS", 0)
    run_forward(_case(T=panels.KEEP_ROWS + 1), "cpu")     # many rows: packing is a small share
    assert seen == []
    run_forward(_case(T=2, B=3), "cpu")
    assert seen == [False]


def test_torch_weights_written_through_data_are_seen(monkeypatch):
    """numbarnn.torch in an inference loop: a write through `.data` (no version counter moves) still shows."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    torch.manual_seed(0)
    ours, theirs = nt.LSTM(5, 6, num_layers=2), torch.nn.LSTM(5, 6, num_layers=2)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(1, 1, 5)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(ours(x)[0], theirs(x)[0])
        for p, q in zip(ours.parameters(), theirs.parameters()):
            p.data.copy_(p.data * 0.5 + 0.25)
            q.data.copy_(q.data * 0.5 + 0.25)
        torch.testing.assert_close(ours(x)[0], theirs(x)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_same_bits_compares_every_block_bit_for_bit(dtype):
    a = np.random.default_rng(0).standard_normal(3 * 4096 * 2 + 7).astype(dtype)   # several blocks and a tail
    assert panels.same_bits(panels.bits(a), panels.bits(a.copy()))
    for i in (0, 4095, 4096, a.size // 2, a.size - 1):
        b = a.copy()
        b[i] = np.nextafter(b[i], np.inf, dtype=dtype)    # one ulp
        assert not panels.same_bits(panels.bits(a), panels.bits(b)), i
    z, nz = np.zeros(a.size, dtype), np.zeros(a.size, dtype)
    nz[-1] = -0.0
    assert not panels.same_bits(panels.bits(z), panels.bits(nz))
    nan = np.full(a.size, np.nan, dtype)
    assert panels.same_bits(panels.bits(nan), panels.bits(nan.copy()))    # the same NaN bits: the same weights


@pytest.mark.parametrize("kept", [True, False])
def test_panels_start_at_a_cache_line(kept, monkeypatch):
    """The packed panels the micro-kernel reads vector by vector, kept or in the workspace's scratch, start at a
    multiple of 64 bytes (NumPy's 16-byte alignment made every 64-byte load of an AVX-512 host straddle two cache
    lines); every scratch array of the call too."""
    from numbarnn.cpu import workspace
    case = _case(L=2, direction="bidirectional", proj=4, B=3, T=2)
    with monkeypatch.context() as m:
        if not kept:
            m.setattr(panels, "KEEP_ROWS", -1)
        run_forward(case, "cpu")
    arrays = [a for k in panels.KEPT._store().values() for layer in k.layers for a in layer if a.size]
    assert bool(arrays) == kept
    arrays += [b for b in workspace.POOL._buffers().values() if b.size]
    assert arrays and all(a.ctypes.data % 64 == 0 for a in arrays)

"""cuDNN-style RNN ops on the NumPy reference backend (SPEC sections 2-8, 10, 12). Pure NumPy, no simulator.

What is checked (every call names backend="reference"):
- the forward against an independent, row-by-row, step-by-step implementation of the SPEC 2 equations
  written here from the canonical weights (layout, gate order, reversal within lengths, dropout masks);
- every backprop output against central finite differences in float64: hypothesis cases over every
  feature, a grid of 4 modes x L=1..3 x both directions on a ragged T=7, B=6 batch, and full
  element-by-element finite differences on small cases; random upstream gradients for y, h and c;
- ragged lengths: zeros past each length, final states after the last valid step (= running the row alone,
  with T = its length and with the full T), len 0 rows, padded input gradients 0;
- the reverse direction equals a unidirectional network with the reverse weights on sequences reversed
  within their lengths; a bidirectional stack equals its mirror image (directions swapped);
- a batch equals its rows run one by one (forward and backprop); batch-major equals time-major transposed;
- repeated calls are bit-identical; inputs are never mutated; T == 0 and B == 0;
- dropout: p=0 == none, inference applies none, p=1 zeroes layer>0 inputs, the mask in the reserve is
  numbarnn.reference.philox.dropout_keep_mask and the next layer sees y*keep/(1-p); empty reserve in inference;
- non-LSTM output_c / input_c_backprop conventions;
- float16/float32 within SPEC 10 tolerances of float64; the golden sums of SPEC 12.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbarnn import ops
from numbarnn.config import decode_host_reserved, rnn_config, validate_forward
from numbarnn.reference.philox import dropout_keep_mask
from numbarnn.reserve import read_nonce, reserve_contents, reserve_size, reserve_views

from numbarnn.testing import (TOLERANCES, check_rnn_gradients, directional_check, make_rnn_case, relative_error,
                              rnn_cases, rnn_configs, rnn_loss)

BACKEND = "reference"


def examples(n: int) -> int:
    """n examples under the default (ci) profile, proportionally more under a larger one (thorough)."""
    return int(n * max(1.0, settings.default.max_examples / 25))

MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
FD_TOL = 1e-6          # relative error of central differences (eps 1e-6) in float64


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def attrs(cfg, time_major=True) -> dict:
    return dict(rnn_mode=cfg.rnn_mode, input_mode=cfg.input_mode, direction=cfg.direction, dropout=cfg.dropout,
                seed=cfg.seed, seed2=cfg.seed2, num_proj=cfg.num_proj, time_major=time_major)


def fwd(case, is_training=None, **over):
    """cudnn_rnn_v3 on the reference backend -> (y, hT, cT, reserve, host_reserved)."""
    kw = dict(input=case.x, input_h=case.h0, input_c=case.c0, params=case.params,
              sequence_lengths=case.lengths)
    kw.update(over)
    return ops.cudnn_rnn_v3(**kw, is_training=case.is_training if is_training is None else is_training,
                            backend=BACKEND, **attrs(case.cfg, case.time_major))


def bwd(case, out, **over):
    """cudnn_rnn_backprop_v3 on the reference backend -> (dx, dh0, dc0, dparams)."""
    y, hT, cT, reserve, host_reserved = out
    kw = dict(input=case.x, input_h=case.h0, input_c=case.c0, params=case.params,
              sequence_lengths=case.lengths, output=y, output_h=hT, output_c=cT, output_backprop=case.dy,
              output_h_backprop=case.dhT, output_c_backprop=case.dcT, reserve_space=reserve,
              host_reserved=host_reserved)
    kw.update(over)
    return ops.cudnn_rnn_backprop_v3(**kw, backend=BACKEND, **attrs(case.cfg, case.time_major))


def lens_of(case) -> np.ndarray:
    return np.full(case.B, case.T, np.int32) if case.lengths is None else np.asarray(case.lengths)


def to_tm(a):
    """Batch-major -> time-major (and back): swap the first two axes."""
    return None if a is None else np.swapaxes(a, 0, 1)


def time_major_case(case):
    """The same case in time-major layout."""
    if case.time_major:
        return case
    return replace(case, x=to_tm(case.x).copy(), h0=to_tm(case.h0).copy(), c0=None if case.c0 is None else
                   to_tm(case.c0).copy(), dy=to_tm(case.dy).copy(), dhT=to_tm(case.dhT).copy(),
                   dcT=None if case.dcT is None else to_tm(case.dcT).copy(), time_major=True)


def canonical(cfg, params):
    return ops.cudnn_rnn_params_to_canonical(cfg.L, cfg.H, cfg.I, params, cfg.rnn_mode, cfg.input_mode,
                                             cfg.direction, cfg.num_proj)


def to_params(cfg, weights, biases):
    return ops.cudnn_rnn_canonical_to_params(cfg.L, cfg.H, cfg.I, weights, biases, cfg.rnn_mode, cfg.input_mode,
                                             cfg.direction, cfg.num_proj)


def per_pseudo_layer(cfg, weights, biases):
    """Split the canonical lists (SPEC 4.3) into one (W list or None, R list, W_proj or None, bW, bR) per p."""
    G, out, wi, bi = cfg.G, [], iter(weights), iter(biases)
    for p, layer, d in cfg.pseudo_layers():
        W = [next(wi) for _ in range(G)] if cfg.has_w(layer) else None
        R = [next(wi) for _ in range(G)]
        Wp = next(wi) if cfg.has_proj else None
        bW = [next(bi) for _ in range(G)]
        bR = [next(bi) for _ in range(G)]
        out.append((W, R, Wp, bW, bR))
    assert next(wi, None) is None and next(bi, None) is None
    return out


def join_pseudo_layers(blocks):
    weights, biases = [], []
    for W, R, Wp, bW, bR in blocks:
        weights += (list(W) if W is not None else []) + list(R) + ([Wp] if Wp is not None else [])
        biases += list(bW) + list(bR)
    return weights, biases


def reverse_rows(a, lens):
    """Time-major [T, B, ...]: reverse each row b within its first lens[b] steps; padding stays (copied)."""
    out = np.array(a, copy=True)
    for b, n in enumerate(lens):
        out[:n, b] = a[:n, b][::-1]
    return out


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def naive_cell(mode, W, R, Wp, bW, bR, x, h, c):
    """One step of SPEC 2 for one row, gate by gate. W None = skip_input (identity)."""
    Wx = [(x if W is None else W[g] @ x) + bW[g] for g in range(len(R))]
    Rh = [R[g] @ h + bR[g] for g in range(len(R))]
    if mode == "rnn_relu":
        return np.maximum(0.0, Wx[0] + Rh[0]), c
    if mode == "rnn_tanh":
        return np.tanh(Wx[0] + Rh[0]), c
    if mode == "lstm":
        i, f = sigmoid(Wx[0] + Rh[0]), sigmoid(Wx[1] + Rh[1])
        g, o = np.tanh(Wx[2] + Rh[2]), sigmoid(Wx[3] + Rh[3])
        c_new = f * c + i * g
        m = o * np.tanh(c_new)
        return (Wp @ m if Wp is not None else m), c_new
    r, z = sigmoid(Wx[0] + Rh[0]), sigmoid(Wx[1] + Rh[1])
    n = np.tanh(Wx[2] + r * Rh[2])
    return (1.0 - z) * n + z * h, c


def naive_forward(cfg, x, h0, c0, params, lens, keep=None):
    """Independent SPEC 2/3/5/6 forward, time-major float64, row by row. keep: {layer: [T, B, D*P] 0/1}."""
    T, B = x.shape[:2]
    D, P = cfg.D, cfg.P
    blocks = per_pseudo_layer(cfg, *canonical(cfg, params))
    hT = np.array(h0, np.float64)
    cT = np.array(c0, np.float64) if cfg.has_cell_state else None
    inp = np.asarray(x, np.float64)
    for layer in range(cfg.L):
        if layer > 0 and keep is not None:
            inp = inp * keep[layer] / (1.0 - cfg.dropout) if cfg.dropout < 1 else inp * 0.0
        out = np.zeros((T, B, D * P))
        for d in range(D):
            p = layer * D + d
            W, R, Wp, bW, bR = blocks[p]
            for b in range(B):
                h = hT[p, b].copy()
                c = cT[p, b].copy() if cT is not None else None
                steps = range(lens[b]) if d == 0 else reversed(range(lens[b]))
                for t in steps:
                    h, c = naive_cell(cfg.rnn_mode, W, R, Wp, bW, bR, inp[t, b], h, c)
                    out[t, b, d * P:(d + 1) * P] = h
                hT[p, b] = h
                if cT is not None:
                    cT[p, b] = c
        inp = out
    return inp, hT, cT


def keep_masks(cfg, T, B, is_training=True):
    if not (is_training and cfg.dropout > 0 and cfg.L > 1):
        return None
    return {layer: dropout_keep_mask(cfg.seed, cfg.seed2, layer, T, B, cfg.D * cfg.P, cfg.dropout).astype(float)
            for layer in range(1, cfg.L)}


def call_of(case, is_training=True):
    call, _ = validate_forward(case.x, case.h0, case.c0, case.params, case.lengths, is_training=is_training,
                               **attrs(case.cfg, case.time_major))
    return call


def full_fd(loss, a, eps=1e-6):
    """Element-by-element central differences of the scalar `loss` at `a` (float64)."""
    g = np.zeros(a.shape)
    flat = g.reshape(-1)
    for k in range(a.size):
        e = np.zeros(a.size)
        e[k] = eps
        e = e.reshape(a.shape)
        flat[k] = (loss(a + e) - loss(a - e)) / (2 * eps)
    return g


def assert_grads_close(an, fd, name, tol=1e-6):
    err = np.max(np.abs(an - fd)) / max(np.max(np.abs(fd)), 1e-3) if an.size else 0.0
    assert err < tol, f"{name}: max abs error {err:.3g} relative to the largest gradient"


def assert_padded_input_grads_zero(case, dx):
    """SPEC 5: input_backprop at t >= len[b] is exactly 0."""
    dx_tm = dx if case.time_major else to_tm(dx)
    for b, n in enumerate(lens_of(case)):
        assert not np.any(dx_tm[n:, b]), f"input_backprop of row {b} is nonzero past its length {n}"


def assert_empty_rows_pass_state_grads(case, grads):
    """SPEC 5: len 0 rows: input_h_backprop row = output_h_backprop row (likewise c)."""
    dx, dh0, dc0, _ = grads
    axis = 1 if case.time_major else 0
    for b in np.flatnonzero(lens_of(case) == 0):
        np.testing.assert_array_equal(np.take(dh0, b, axis), np.take(case.dhT, b, axis))
        if case.cfg.has_cell_state:
            np.testing.assert_array_equal(np.take(dc0, b, axis), np.take(case.dcT, b, axis))


# ----------------------------------------------------------------------------------------------
# forward against an independent implementation of the SPEC equations
# ----------------------------------------------------------------------------------------------
@settings(max_examples=examples(100))
@given(rnn_cases(max_T=4, max_B=3))
def test_forward_matches_naive_spec_implementation(case):
    """Forward (training and inference, either layout) equals the row-by-row SPEC 2/3/5/6 implementation."""
    tm = time_major_case(case)
    lens = lens_of(case)
    for is_training in (True, False):
        y, hT, cT, reserve, _ = fwd(case, is_training=is_training)
        ref_y, ref_h, ref_c = naive_forward(case.cfg, tm.x, tm.h0, tm.c0, case.params, lens,
                                            keep_masks(case.cfg, case.T, case.B, is_training))
        if not case.time_major:
            y, hT, cT = to_tm(y), to_tm(hT), (to_tm(cT) if case.cfg.has_cell_state else cT)
        np.testing.assert_allclose(y, ref_y, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(hT, ref_h, rtol=1e-12, atol=1e-12)
        if case.cfg.has_cell_state:
            np.testing.assert_allclose(cT, ref_c, rtol=1e-12, atol=1e-12)
        else:
            assert cT.shape == (0,) and cT.dtype == case.dtype
        for b, n in enumerate(lens):
            assert not np.any(y[n:, b]), "output past a sequence's length must be 0"
        if is_training:
            assert reserve.ndim == 1 and reserve.size == reserve_size(call_of(case)) and reserve.dtype == case.dtype
        else:
            assert reserve.shape == (0,)


def test_forward_literal_lstm_step():
    """One LSTM step by hand: x=1, h=0, c=0.5, every W entry 0.1, R 0.2, bW 0.05, bR -0.05 (L=1, H=I=1)."""
    cfg = rnn_config(1, 1, 2, "lstm")
    n = ops.cudnn_rnn_params_size(1, 1, 2, "lstm")
    assert n == 4 * 2 + 4 * 1 + 8
    params = np.concatenate([np.full(8, 0.1), np.full(4, 0.2), np.full(4, 0.05), np.full(4, -0.05)])
    x = np.ones((1, 1, 2))
    h0 = np.zeros((1, 1, 1))
    c0 = np.full((1, 1, 1), 0.5)
    y, hT, cT, _, _ = ops.cudnn_rnn_v3(x, h0, c0, params, rnn_mode="lstm", backend=BACKEND)
    a = 0.2                                  # W x + bW + R h + bR = 0.1 + 0.1 + 0.05 - 0.05
    s, g = 1 / (1 + np.exp(-a)), np.tanh(a)
    c = s * 0.5 + s * g
    np.testing.assert_allclose(cT[0, 0, 0], c, rtol=1e-14)
    np.testing.assert_allclose(y[0, 0, 0], s * np.tanh(c), rtol=1e-14)
    np.testing.assert_array_equal(hT, y)
    assert cfg.G == 4


def test_forward_literal_gru_reset_after_matmul():
    """GRU: r multiplies (R_n h + bR_n), bR_n inside (SPEC 2). H=I=1, distinct values per gate."""
    # W_r, W_z, W_n, R_r, R_z, R_n | bW_r, bW_z, bW_n, bR_r, bR_z, bR_n
    params = np.array([0.3, -0.2, 0.5, 0.7, 0.1, -0.4, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06])
    x, h = 0.9, -0.6
    y, hT, _, _, _ = ops.cudnn_rnn_v3(np.full((1, 1, 1), x), np.full((1, 1, 1), h), None, params,
                                      rnn_mode="gru", backend=BACKEND)
    r = sigmoid(0.3 * x + 0.01 + 0.7 * h + 0.04)
    z = sigmoid(-0.2 * x + 0.02 + 0.1 * h + 0.05)
    n = np.tanh(0.5 * x + 0.03 + r * (-0.4 * h + 0.06))
    np.testing.assert_allclose(y[0, 0, 0], (1 - z) * n + z * h, rtol=1e-14)


# ----------------------------------------------------------------------------------------------
# backprop against finite differences
# ----------------------------------------------------------------------------------------------
@settings(max_examples=examples(150))
@given(rnn_cases(max_T=4, max_B=4), st.integers(0, 2**31 - 1))
def test_gradients_finite_differences(case, seed):
    """Every backprop output, every feature (hypothesis: modes, L, directions, projection, skip/linear/auto,
    ragged lengths incl. 0, layouts, dropout incl. p=1), random upstream gradients of y, h and c."""
    report = check_rnn_gradients(case, backend=BACKEND, seed=seed)
    expected = {"input_backprop", "input_h_backprop", "params_backprop"} | \
        ({"input_c_backprop"} if case.cfg.has_cell_state else set())
    assert set(report) == expected
    assert max(report.values()) < FD_TOL, report
    grads = bwd(case, fwd(case))
    assert_padded_input_grads_zero(case, grads[0])
    assert_empty_rows_pass_state_grads(case, grads)


GRID = [(mode, L, direction) for mode in MODES for L in (1, 2, 3) for direction in ("unidirectional",
                                                                                   "bidirectional")]


@pytest.mark.parametrize("mode, L, direction", GRID)
def test_gradients_ragged_grid(mode, L, direction):
    """4 modes x L=1..3 x both directions on T=7, B=6 with lengths like [7,5,5,2,1,1] (unsorted, one 0),
    input modes, projection, layouts and dropout varied along the grid; 4 random directions per output."""
    k = GRID.index((mode, L, direction))
    H = 3
    input_mode = ("linear_input", "skip_input", "auto_select")[k % 3]
    I = H if input_mode == "skip_input" or k % 2 else 2  # noqa: E741 (auto_select then picks either)
    num_proj = (0, 2, 1)[L - 1] if mode == "lstm" else 0
    dropout = {1: 0.0, 2: 0.4, 3: (1.0 if direction == "bidirectional" else 0.25)}[L]
    cfg = rnn_config(L, H, I, mode, input_mode, direction, num_proj, dropout, seed=11 * k - 40, seed2=k)
    lengths = [[7, 5, 5, 2, 1, 1], [1, 5, 7, 0, 2, 5], [2, 7, 1, 5, 1, 5]][k % 3]
    case = make_rnn_case(cfg, 7, 6, lengths, seed=k, time_major=bool(k % 4 < 2))
    fwd_out = fwd(case)
    grads = bwd(case, fwd_out)
    rng = np.random.default_rng(k)
    names = ("input", "input_h", "input_c", "params")
    args = {"input": case.x, "input_h": case.h0, "input_c": case.c0, "params": case.params}
    keys = {"input": "x", "input_h": "h0", "input_c": "c0", "params": "params"}
    for name, g in zip(names, grads):
        if name == "input_c" and not cfg.has_cell_state:
            continue
        err = directional_check(lambda v: rnn_loss(case, BACKEND, **{keys[name]: v}), args[name], g, rng,
                                directions=4)
        assert err < FD_TOL, f"{name}_backprop: {err:.3g}"
    assert_padded_input_grads_zero(case, grads[0])
    assert_empty_rows_pass_state_grads(case, grads)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["bidirectional-skip-dropout", "projection-batch-major-p1", "linear-3-layers"])
def test_gradients_element_by_element(mode, variant):
    """Full central-difference gradients of every input, element by element, on small cases."""
    if variant == "bidirectional-skip-dropout":
        cfg = rnn_config(2, 2, 2, mode, "skip_input", "bidirectional", 0, 0.5, seed=3, seed2=9)
        case = make_rnn_case(cfg, 3, 3, [3, 0, 2], seed=1)
    elif variant == "projection-batch-major-p1":
        cfg = rnn_config(2, 3, 2, mode, "linear_input", "bidirectional", 2 if mode == "lstm" else 0, 1.0, seed=5)
        case = make_rnn_case(cfg, 3, 2, [1, 3], seed=2, time_major=False)
    else:
        cfg = rnn_config(3, 2, 3, mode, "auto_select", "unidirectional", 1 if mode == "lstm" else 0)
        case = make_rnn_case(cfg, 4, 2, None, seed=3)
    dx, dh0, dc0, dparams = bwd(case, fwd(case))
    assert_grads_close(dx, full_fd(lambda v: rnn_loss(case, BACKEND, x=v), case.x), "input_backprop")
    assert_grads_close(dh0, full_fd(lambda v: rnn_loss(case, BACKEND, h0=v), case.h0), "input_h_backprop")
    assert_grads_close(dparams, full_fd(lambda v: rnn_loss(case, BACKEND, params=v), case.params),
                       "params_backprop")
    if cfg.has_cell_state:
        assert_grads_close(dc0, full_fd(lambda v: rnn_loss(case, BACKEND, c0=v), case.c0), "input_c_backprop")
    else:
        assert dc0.shape == (0,)


def test_gradients_each_upstream_alone():
    """Each upstream gradient on its own (the others 0) reaches the inputs correctly."""
    cfg = rnn_config(2, 3, 2, "lstm", "linear_input", "bidirectional", 2, 0.3, seed=1)
    base = make_rnn_case(cfg, 4, 3, [4, 0, 2], seed=7)
    zero = dict(dy=np.zeros_like(base.dy), dhT=np.zeros_like(base.dhT), dcT=np.zeros_like(base.dcT))
    for keep in ("dy", "dhT", "dcT"):
        case = replace(base, **{k: v for k, v in zero.items() if k != keep})
        report = check_rnn_gradients(case, backend=BACKEND)
        assert max(report.values()) < FD_TOL, (keep, report)
    case = replace(base, **zero)
    dx, dh0, dc0, dparams = bwd(case, fwd(case))
    for g in (dx, dh0, dc0, dparams):
        assert not np.any(g)


def test_padded_output_backprop_is_ignored():
    """SPEC 5: output_backprop at padded positions changes nothing."""
    cfg = rnn_config(2, 2, 3, "gru", "linear_input", "bidirectional")
    case = make_rnn_case(cfg, 5, 3, [5, 2, 0], seed=4)
    grads = bwd(case, fwd(case))
    dy = case.dy.copy()
    dy[2:, 1] = 1e3
    dy[:, 2] = -7.0
    grads2 = bwd(replace(case, dy=dy), fwd(case))
    for a, b in zip(grads, grads2):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------
# ragged lengths, rows, directions, layouts
# ----------------------------------------------------------------------------------------------
nodrop_cases = rnn_cases(configs=rnn_configs(dropout=False), max_T=5, max_B=4)


def row_case(case, b, T=None, lengths="keep"):
    """Row b of a time-major case alone; T cuts the time axis; lengths "keep" = [len_b], None = all T."""
    T = case.T if T is None else T
    sl = slice(b, b + 1)
    lens = np.asarray([lens_of(case)[b]], np.int32) if lengths == "keep" else lengths
    return replace(case, T=T, B=1, lengths=lens, x=case.x[:T, sl].copy(), h0=case.h0[:, sl].copy(),
                   c0=None if case.c0 is None else case.c0[:, sl].copy(), dy=case.dy[:T, sl].copy(),
                   dhT=case.dhT[:, sl].copy(), dcT=None if case.dcT is None else case.dcT[:, sl].copy())


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


@settings(max_examples=examples(60))
@given(nodrop_cases)
def test_batch_equals_rows_run_one_by_one(case):
    """Row alone with T = its length (no lengths) and with the full T: same outputs, final states and
    gradients (params_backprop sums over rows). len 0 rows: output 0, final state = initial state."""
    case = time_major_case(case)
    lens = lens_of(case)
    y, hT, cT, _, _ = out = fwd(case)
    dx, dh0, dc0, dparams = bwd(case, out)
    dparams_sum = np.zeros_like(dparams)
    for b, n in enumerate(lens):
        assert not np.any(y[n:, b])
        if n == 0:
            np.testing.assert_array_equal(hT[:, b], case.h0[:, b])
            if case.cfg.has_cell_state:
                np.testing.assert_array_equal(cT[:, b], case.c0[:, b])
        short = row_case(case, b, T=int(n), lengths=None)
        ys, hs, cs, _, _ = out_s = fwd(short)
        close(y[:n, b:b + 1], ys)
        close(hT[:, b:b + 1], hs)
        dxs, dhs, dcs, dps = bwd(short, out_s)
        close(dx[:n, b:b + 1], dxs)
        close(dh0[:, b:b + 1], dhs)
        if case.cfg.has_cell_state:
            close(cT[:, b:b + 1], cs)
            close(dc0[:, b:b + 1], dcs)
        full = row_case(case, b)
        yf, hf, cf, _, _ = out_f = fwd(full)
        close(y[:, b:b + 1], yf)
        close(hT[:, b:b + 1], hf)
        dxf, dhf, dcf, dpf = bwd(full, out_f)
        close(dx[:, b:b + 1], dxf)
        close(dh0[:, b:b + 1], dhf)
        close(dps, dpf)
        dparams_sum += dpf
    close(dparams, dparams_sum)


def test_zero_length_rows():
    """len 0: output row all 0, final state = initial state, state gradients pass straight through."""
    for mode in MODES:
        cfg = rnn_config(2, 3, 2, mode, "linear_input", "bidirectional", 2 if mode == "lstm" else 0, 0.5, seed=2)
        case = make_rnn_case(cfg, 4, 3, [0, 3, 0], seed=5)
        y, hT, cT, _, _ = out = fwd(case)
        dx, dh0, dc0, _ = grads = bwd(case, out)
        for b in (0, 2):
            assert not np.any(y[:, b])
            assert not np.any(dx[:, b])
            np.testing.assert_array_equal(hT[:, b], case.h0[:, b])
            np.testing.assert_array_equal(dh0[:, b], case.dhT[:, b])
            if cfg.has_cell_state:
                np.testing.assert_array_equal(cT[:, b], case.c0[:, b])
                np.testing.assert_array_equal(dc0[:, b], case.dcT[:, b])
        assert np.any(y[:, 1])
        assert_empty_rows_pass_state_grads(case, grads)
        # all rows empty: nothing runs at all
        empty = replace(case, lengths=np.zeros(3, np.int32))
        y, hT, cT, _, _ = out = fwd(empty)
        dx, dh0, dc0, dparams = bwd(empty, out)
        assert not np.any(y) and not np.any(dx) and not np.any(dparams)
        np.testing.assert_array_equal(hT, case.h0)
        np.testing.assert_array_equal(dh0, case.dhT)
        if cfg.has_cell_state:
            np.testing.assert_array_equal(cT, case.c0)
            np.testing.assert_array_equal(dc0, case.dcT)


@settings(max_examples=examples(50))
@given(rnn_cases(configs=rnn_configs(max_layers=1, dropout=False), max_T=5, max_B=4, time_major=True))
def test_reverse_direction_is_forward_on_reversed_rows(case):
    """Bidirectional L=1: the reverse half equals a unidirectional network with the reverse direction's weights
    run on each sequence reversed within its length (outputs, final states, and every gradient when only the
    reverse half receives upstream gradients)."""
    cfg = case.cfg
    if cfg.D == 1:
        cfg = rnn_config(1, cfg.H, cfg.I, cfg.rnn_mode, cfg.input_mode, "bidirectional", cfg.num_proj)
        case = make_rnn_case(cfg, case.T, case.B, case.lengths, seed=case.T * 7 + case.B)
    P, lens = cfg.P, lens_of(case)
    blocks = per_pseudo_layer(cfg, *canonical(cfg, case.params))
    uni = rnn_config(1, cfg.H, cfg.I, cfg.rnn_mode, cfg.input_mode, "unidirectional", cfg.num_proj)
    uni_params = to_params(uni, *join_pseudo_layers(blocks[1:]))
    # only the reverse half gets upstream gradients
    dy = case.dy.copy()
    dy[..., :P] = 0.0
    dhT = case.dhT.copy()
    dhT[0] = 0.0
    dcT = None if case.dcT is None else case.dcT.copy()
    if dcT is not None:
        dcT[0] = 0.0
    case = replace(case, dy=dy, dhT=dhT, dcT=dcT)
    rcase = replace(case, cfg=uni, params=uni_params, x=reverse_rows(case.x, lens), h0=case.h0[1:].copy(),
                    c0=None if case.c0 is None else case.c0[1:].copy(), dy=reverse_rows(dy[..., P:], lens),
                    dhT=dhT[1:].copy(), dcT=None if dcT is None else dcT[1:].copy())
    y, hT, cT, _, _ = out = fwd(case)
    yu, hu, cu, _, _ = out_u = fwd(rcase)
    close(y[..., P:], reverse_rows(yu, lens))
    close(hT[1:], hu)
    if cfg.has_cell_state:
        close(cT[1:], cu)
    dx, dh0, dc0, dparams = bwd(case, out)
    dxu, dhu, dcu, dpu = bwd(rcase, out_u)
    close(dx, reverse_rows(dxu, lens))
    close(dh0[1:], dhu)
    assert not np.any(dh0[0])
    if cfg.has_cell_state:
        close(dc0[1:], dcu)
        assert not np.any(dc0[0])
    dblocks = per_pseudo_layer(cfg, *canonical(cfg, dparams))
    w_fwd, b_fwd = join_pseudo_layers(dblocks[:1])
    assert not any(np.any(a) for a in w_fwd + b_fwd), "the forward direction received gradient"
    close(to_params(uni, *join_pseudo_layers(dblocks[1:])), dpu)


def mirror_params(cfg, params):
    """Swap the two directions of every layer; layers > 0 also swap the [fwd | rev] halves of W's columns."""
    blocks = per_pseudo_layer(cfg, *canonical(cfg, params))
    P, out = cfg.P, []
    for layer in range(cfg.L):
        for W, R, Wp, bW, bR in (blocks[2 * layer + 1], blocks[2 * layer]):
            if W is not None and layer > 0:
                W = [np.concatenate([w[:, P:], w[:, :P]], axis=1) for w in W]
            out.append((W, R, Wp, bW, bR))
    return to_params(cfg, *join_pseudo_layers(out))


def swap_pairs(a):
    """[L*2, ...] states: swap entries 2l and 2l+1."""
    return a.reshape((-1, 2) + a.shape[1:])[:, ::-1].reshape(a.shape)


def swap_halves(a, P):
    return np.concatenate([a[..., P:], a[..., :P]], axis=-1)


@settings(max_examples=examples(40))
@given(rnn_cases(configs=rnn_configs(max_layers=3, dropout=False), max_T=5, max_B=3, time_major=True))
def test_bidirectional_stack_mirror_symmetry(case):
    """A bidirectional stack run on rows reversed within their lengths, with the directions' weights swapped,
    gives the reversed outputs with the [fwd | rev] halves swapped, and the states of each layer swapped."""
    cfg = case.cfg
    if cfg.D == 1:
        return
    P, lens = cfg.P, lens_of(case)
    y, hT, cT, _, _ = fwd(case)
    m = replace(case, params=mirror_params(cfg, case.params), x=reverse_rows(case.x, lens),
                h0=swap_pairs(case.h0), c0=None if case.c0 is None else swap_pairs(case.c0))
    ym, hm, cm, _, _ = fwd(m)
    close(ym, swap_halves(reverse_rows(y, lens), P))
    close(hm, swap_pairs(hT))
    if cfg.has_cell_state:
        close(cm, swap_pairs(cT))


@settings(max_examples=examples(40))
@given(rnn_cases(max_T=4, max_B=4, time_major=True))
def test_batch_major_equals_time_major_transposed(case):
    """time_major=False: input [B, T, I], output [B, T, D*P], states [B, L*D, P/H], forward and backprop,
    dropout included; the results are the time-major ones transposed, bit for bit."""
    tm_out = fwd(case)
    tm_grads = bwd(case, tm_out)
    bm = replace(case, x=to_tm(case.x).copy(), h0=to_tm(case.h0).copy(), c0=None if case.c0 is None else
                 to_tm(case.c0).copy(), dy=to_tm(case.dy).copy(), dhT=to_tm(case.dhT).copy(),
                 dcT=None if case.dcT is None else to_tm(case.dcT).copy(), time_major=False)
    bm_out = fwd(bm)
    bm_grads = bwd(bm, bm_out)
    cfg = case.cfg
    LD = cfg.L * cfg.D
    assert bm_out[0].shape == (case.B, case.T, cfg.D * cfg.P)
    assert bm_out[1].shape == (case.B, LD, cfg.P)
    np.testing.assert_array_equal(bm_out[0], to_tm(tm_out[0]))
    np.testing.assert_array_equal(bm_out[1], to_tm(tm_out[1]))
    if cfg.has_cell_state:
        assert bm_out[2].shape == (case.B, LD, cfg.H)
        np.testing.assert_array_equal(bm_out[2], to_tm(tm_out[2]))
        np.testing.assert_array_equal(bm_grads[2], to_tm(tm_grads[2]))
    else:
        assert bm_out[2].shape == (0,)
    np.testing.assert_array_equal(reserve_contents(bm_out[3]), reserve_contents(tm_out[3]))
    assert bm_grads[0].shape == bm.x.shape and bm_grads[1].shape == bm.h0.shape
    np.testing.assert_array_equal(bm_grads[0], to_tm(tm_grads[0]))
    np.testing.assert_array_equal(bm_grads[1], to_tm(tm_grads[1]))
    np.testing.assert_array_equal(bm_grads[3], tm_grads[3])


# ----------------------------------------------------------------------------------------------
# determinism, no mutation, empty shapes
# ----------------------------------------------------------------------------------------------
@settings(max_examples=examples(20))
@given(rnn_cases(max_T=4, max_B=3))
def test_repeated_calls_are_bit_identical(case):
    first = fwd(case)
    first_grads = bwd(case, first)
    for _ in range(2):
        again = fwd(case)
        for a, b in zip(first[:3], again[:3]):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        # the reserve and host_reserved are bit-identical except for the per-call nonce (numbarnn.reserve)
        assert first[3].dtype == again[3].dtype and first[3].shape == again[3].shape
        np.testing.assert_array_equal(reserve_contents(first[3]), reserve_contents(again[3]))
        rec1, rec2 = decode_host_reserved(first[4]), decode_host_reserved(again[4])
        assert rec1.pop("nonce") == [int(v) for v in read_nonce(first[3])]
        assert rec2.pop("nonce") == [int(v) for v in read_nonce(again[3])]
        assert rec1 == rec2
        for a, b in zip(first_grads, bwd(case, again)):
            np.testing.assert_array_equal(a, b)


@settings(max_examples=examples(20))
@given(rnn_cases(max_T=4, max_B=3))
def test_inputs_are_never_mutated(case):
    args = dict(x=case.x, h0=case.h0, c0=case.c0, params=case.params, lengths=case.lengths, dy=case.dy,
                dhT=case.dhT, dcT=case.dcT)
    saved = copy.deepcopy(args)
    out = fwd(case)
    saved_out = copy.deepcopy(out)
    bwd(case, out)
    for name, a in args.items():
        if a is None:
            assert saved[name] is None
        else:
            np.testing.assert_array_equal(a, saved[name], err_msg=f"{name} was modified")
            assert a.dtype == saved[name].dtype
    for a, b in zip(out, saved_out):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("time_major", [True, False])
@pytest.mark.parametrize("T, B", [(0, 3), (3, 0), (0, 0)])
def test_empty_time_or_batch(mode, time_major, T, B):
    """T == 0 or B == 0: correctly shaped outputs, output_h = input_h (and c), gradients shaped like inputs."""
    cfg = rnn_config(2, 3, 2, mode, "linear_input", "bidirectional", 2 if mode == "lstm" else 0, 0.5, seed=1)
    for lengths in (None, np.zeros(B, np.int32)):
        case = make_rnn_case(cfg, T, B, lengths, seed=0, time_major=time_major)
        y, hT, cT, reserve, host_reserved = out = fwd(case)
        yshape = (T, B, 2 * cfg.P) if time_major else (B, T, 2 * cfg.P)
        assert y.shape == yshape and y.dtype == np.float64
        np.testing.assert_array_equal(hT, case.h0)
        if cfg.has_cell_state:
            np.testing.assert_array_equal(cT, case.c0)
        else:
            assert cT.shape == (0,)
        assert reserve.ndim == 1 and host_reserved.dtype == np.int8
        dx, dh0, dc0, dparams = bwd(case, out)
        assert dx.shape == case.x.shape and dparams.shape == case.params.shape
        assert not np.any(dparams)
        np.testing.assert_array_equal(dh0, case.dhT)
        if cfg.has_cell_state:
            np.testing.assert_array_equal(dc0, case.dcT)
        else:
            assert dc0.shape == (0,)


# ----------------------------------------------------------------------------------------------
# dropout (SPEC 6) and the reserve (SPEC 7)
# ----------------------------------------------------------------------------------------------
def with_dropout(case, p, seed=None, seed2=None):
    cfg = replace(case.cfg, dropout=p, seed=case.cfg.seed if seed is None else seed,
                  seed2=case.cfg.seed2 if seed2 is None else seed2)
    return replace(case, cfg=cfg)


multi_layer = rnn_configs(max_layers=3, dropout=False).filter(lambda c: c.L > 1)


@settings(max_examples=examples(25))
@given(rnn_cases(configs=multi_layer, max_T=4, max_B=3), st.sampled_from([0.25, 0.5, 0.9]))
def test_dropout_off_cases_are_identical(case, p):
    """p=0 in training == p>0 in inference == no dropout at all: bit for bit; inference has an empty reserve
    and an empty host_reserved; p=0 records no mask."""
    ref = fwd(with_dropout(case, 0.0), is_training=True)
    inference = fwd(with_dropout(case, p), is_training=False)
    inference0 = fwd(with_dropout(case, 0.0), is_training=False)
    for k in range(3):
        np.testing.assert_array_equal(ref[k], inference[k])
        np.testing.assert_array_equal(ref[k], inference0[k])
    for out in (inference, inference0):
        assert out[3].shape == (0,) and out[3].dtype == case.dtype
        assert out[4].shape == (0,) and out[4].dtype == np.int8
    views = reserve_views(call_of(with_dropout(case, 0.0)), ref[3])
    assert not any(name.startswith("keep") for name in views)


@settings(max_examples=examples(25))
@given(rnn_cases(configs=multi_layer, max_T=4, max_B=3), st.sampled_from([0.2, 0.5, 0.75, 1.0]),
       st.integers(-2**40, 2**40), st.integers(0, 2**33))
def test_dropout_mask_in_reserve_and_applied(case, p, seed, seed2):
    """The mask recorded for every layer is dropout_keep_mask(seed, seed2, l, T, B, D*P, p), and layer l sees
    y_{l-1} * keep / (1-p) (p=1: zeros): the top layer alone, run on that input, gives the same output."""
    case = time_major_case(with_dropout(case, p, seed, seed2))
    cfg, T, B = case.cfg, case.T, case.B
    y, hT, cT, reserve, _ = fwd(case)
    views = reserve_views(call_of(case), reserve)
    top_input = None
    for layer in range(1, cfg.L):
        keep = dropout_keep_mask(seed, seed2, layer, T, B, cfg.D * cfg.P, p)
        np.testing.assert_array_equal(views[f"keep{layer}"], keep.astype(np.float64))
        if p == 1.0:
            assert not np.any(keep)
        top_input = views[f"y{layer - 1}"] * keep * (0.0 if p == 1.0 else 1.0 / (1.0 - p))
    np.testing.assert_array_equal(views[f"y{cfg.L - 1}"], y)
    # the top layer alone: a 1-layer network with input size D*P and that layer's weights
    top = cfg.L - 1
    blocks = per_pseudo_layer(cfg, *canonical(cfg, case.params))[top * cfg.D:]
    one = rnn_config(1, cfg.H, cfg.D * cfg.P, cfg.rnn_mode, "linear_input", cfg.direction, cfg.num_proj)
    sl = slice(top * cfg.D, (top + 1) * cfg.D)
    top_case = replace(case, cfg=one, params=to_params(one, *join_pseudo_layers(blocks)), x=top_input,
                       h0=case.h0[sl].copy(), c0=None if case.c0 is None else case.c0[sl].copy(), is_training=False)
    yt, ht, ct, _, _ = fwd(top_case)
    close(y, yt)
    close(hT[sl], ht)
    if cfg.has_cell_state:
        close(cT[sl], ct)
    if p == 1.0:  # the top layer's result does not depend on x at all
        y2 = fwd(replace(case, x=case.x + 1.0))[0]
        np.testing.assert_array_equal(y, y2)


def test_dropout_mask_depends_on_seeds_and_layer():
    cfg = rnn_config(3, 4, 2, "rnn_tanh", "linear_input", "bidirectional", 0, 0.5, seed=1, seed2=2)
    case = make_rnn_case(cfg, 4, 3, None, seed=0)
    v = reserve_views(call_of(case), fwd(case)[3])
    assert not np.array_equal(v["keep1"], v["keep2"])
    frac = np.mean(np.concatenate([v["keep1"].ravel(), v["keep2"].ravel()]))
    assert 0.3 < frac < 0.7
    for other in (with_dropout(case, 0.5, seed=2), with_dropout(case, 0.5, seed2=3)):
        assert not np.array_equal(reserve_views(call_of(other), fwd(other)[3])["keep1"], v["keep1"])
    # training with p > 0 really changes the output; inference with p > 0 does not
    assert not np.array_equal(fwd(case)[0], fwd(with_dropout(case, 0.0))[0])
    np.testing.assert_array_equal(fwd(case, is_training=False)[0], fwd(with_dropout(case, 0.0))[0])


# ----------------------------------------------------------------------------------------------
# non-LSTM state conventions (SPEC 3, 8)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["gru", "rnn_tanh", "rnn_relu"])
def test_non_lstm_c_conventions(mode):
    """output_c is (0,); input_c is ignored (None or any array, any dtype); input_c_backprop is zeros shaped
    like input_c (empty if None); output_c / output_c_backprop are ignored."""
    cfg = rnn_config(2, 3, 2, mode, "linear_input", "bidirectional")
    case = make_rnn_case(cfg, 3, 2, [3, 1], seed=0)
    ref = fwd(case)
    ref_grads = bwd(case, ref)
    assert ref[2].shape == (0,) and ref[2].dtype == np.float64
    assert ref_grads[2].shape == (0,) and ref_grads[2].dtype == np.float64
    for c0 in (np.ones((4, 2, 3)), np.full((5, 7), 3.0), np.zeros((2,), np.float32)):
        out = fwd(case, input_c=c0)
        for a, b in zip(out[:3] + (reserve_contents(out[3]),), ref[:3] + (reserve_contents(ref[3]),)):

            np.testing.assert_array_equal(a, b)
        grads = bwd(case, out, input_c=c0, output_c=np.ones(3), output_c_backprop=np.ones((1, 2)))
        assert grads[2].shape == c0.shape and grads[2].dtype == np.float64 and not np.any(grads[2])
        for k in (0, 1, 3):
            np.testing.assert_array_equal(grads[k], ref_grads[k])


# ----------------------------------------------------------------------------------------------
# dtypes (SPEC 10)
# ----------------------------------------------------------------------------------------------
@settings(max_examples=examples(30))
@given(rnn_cases(max_T=4, max_B=3), st.sampled_from([np.float32, np.float16]))
def test_low_precision_within_tolerance(case, dtype):
    """float16/float32 results come back in the input dtype and within SPEC 10 of the float64 reference run on
    the same (rounded) inputs."""
    low = case.astype(dtype)
    ref = low.astype(np.float64)
    out, ref_out = fwd(low), fwd(ref)
    grads, ref_grads = bwd(low, out), bwd(ref, ref_out)
    tol_out, tol_grad = TOLERANCES[np.dtype(dtype)]
    for name, a, b in zip(("output", "output_h", "output_c", "reserve_space"), out[:3] + (reserve_contents(out[3]),),
                          ref_out[:3] + (reserve_contents(ref_out[3]),)):
        assert a.dtype == np.dtype(dtype), name
        assert a.shape == b.shape, name
        assert relative_error(a, b) <= tol_out, (name, relative_error(a, b))
    assert out[4].dtype == np.int8
    for name, a, b in zip(("input", "input_h", "input_c", "params"), grads, ref_grads):
        assert a.dtype == np.dtype(dtype), name
        assert relative_error(a, b) <= tol_grad, (name, relative_error(a, b))


# ----------------------------------------------------------------------------------------------
# golden values (SPEC 12)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, L, H, I, B, T, expected, atol", [
    ("lstm", 4, 200, 200, 20, 10, 231833.22, 1e-2),
    ("gru", 4, 200, 200, 20, 10, 56000.0, 1e-6),
    ("rnn_tanh", 4, 200, 200, 20, 10, 56000.0, 1e-6),
    ("rnn_relu", 2, 8, 4, 4, 2, 130688.0, 0.0),
])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_golden_sums(mode, L, H, I, B, T, expected, atol, dtype):  # noqa: E741
    """TF's cudnn_rnn_ops_test inference values: params, input, input_h, input_c all 1, auto_select."""
    n = ops.cudnn_rnn_params_size(L, H, I, mode, "auto_select")
    ones = lambda *s: np.ones(s, dtype)  # noqa: E731
    out = ops.cudnn_rnn_v3(ones(T, B, I), ones(L, B, H), ones(L, B, H) if mode == "lstm" else None, ones(n),
                           rnn_mode=mode, input_mode="auto_select", dropout=0.5, is_training=False,
                           backend=BACKEND)
    y, hT, cT, reserve, _ = out
    total = float(np.sum(y, dtype=np.float64) + np.sum(hT, dtype=np.float64))
    if mode == "lstm":
        total += float(np.sum(cT, dtype=np.float64))
    assert abs(total - expected) <= atol, total
    assert reserve.shape == (0,)

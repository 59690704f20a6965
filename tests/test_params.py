"""Parameter layouts and converters (SPEC 4): params size, the opaque buffer, the canonical lists and their
shapes (skip_input and projection included), PyTorch state_dict and TF CudnnCompatible cells.

The expected shapes, sizes and layouts are computed here independently from the SPEC text; the round trips
go both ways; converted parameters are also checked by running the network (backend="reference").
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbarnn import ops
from numbarnn.config import rnn_config
from numbarnn.params import from_tf_cells, from_torch_state_dict, to_tf_cells, to_torch_state_dict
from numbarnn.testing import make_rnn_case, rnn_configs

BACKEND = "reference"


def examples(n: int) -> int:
    """n examples under the default (ci) profile, proportionally more under a larger one (thorough)."""
    return int(n * max(1.0, settings.default.max_examples / 25))

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}

all_configs = rnn_configs(max_layers=3, max_units=5, max_input=5)


def attrs(cfg) -> dict:
    return dict(num_layers=cfg.L, num_units=cfg.H, input_size=cfg.I, rnn_mode=cfg.rnn_mode,
                input_mode=cfg.input_mode, direction=cfg.direction, num_proj=cfg.num_proj)


def spec_shapes(cfg):
    """SPEC 4.1/4.3, written out: (weight shapes, bias shapes) in canonical order."""
    G, H, P, D = GATES[cfg.rnn_mode], cfg.H, cfg.P, cfg.D
    weights, biases = [], []
    for layer in range(cfg.L):
        I_l = cfg.I if layer == 0 else D * P
        for _ in range(D):
            if not (cfg.input_mode == "skip_input" and layer == 0):
                weights += [(H, I_l)] * G
            weights += [(H, P)] * G
            if cfg.num_proj:
                weights += [(P, H)]
            biases += [(H,)] * (2 * G)
    return weights, biases


def spec_params_size(cfg) -> int:
    """SPEC 4.2's formula."""
    G, H, P, D, L = GATES[cfg.rnn_mode], cfg.H, cfg.P, cfg.D, cfg.L
    n = 0
    for layer in range(L):
        I_p = cfg.I if layer == 0 else D * P
        skip0 = cfg.input_mode == "skip_input" and layer == 0
        n += D * ((0 if skip0 else G * H * I_p) + G * H * P + (P * H if cfg.num_proj else 0))
    return n + L * D * 2 * G * H


def random_params(cfg, seed=0, dtype=np.float64):
    n = ops.cudnn_rnn_params_size(**attrs(cfg))
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


# ----------------------------------------------------------------------------------------------
# sizes, shapes, opaque layout
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, expected", [
    # TF's own formula for the plain cases: G*H*(I + H) + 2*G*H per first layer, G*H*(D*H + H) + 2*G*H above
    (dict(num_layers=1, num_units=2, input_size=3, rnn_mode="lstm"), 4 * 2 * (3 + 2) + 2 * 4 * 2),
    (dict(num_layers=2, num_units=3, input_size=2, rnn_mode="gru", direction="bidirectional"),
     2 * (3 * 3 * (2 + 3) + 2 * 3 * 3) + 2 * (3 * 3 * (6 + 3) + 2 * 3 * 3)),
    (dict(num_layers=1, num_units=4, input_size=4, rnn_mode="rnn_tanh", input_mode="skip_input"), 4 * 4 + 2 * 4),
    (dict(num_layers=1, num_units=4, input_size=4, rnn_mode="rnn_tanh", input_mode="auto_select"), 4 * 4 + 2 * 4),
    (dict(num_layers=1, num_units=4, input_size=3, rnn_mode="rnn_relu", input_mode="auto_select"),
     4 * 3 + 4 * 4 + 2 * 4),
    # projection: W [4H, I], R [4H, P], W_proj [P, H], 8H biases
    (dict(num_layers=1, num_units=5, input_size=3, rnn_mode="lstm", num_proj=2), 20 * 3 + 20 * 2 + 2 * 5 + 40),
    (dict(num_layers=4, num_units=200, input_size=200, rnn_mode="lstm", input_mode="auto_select"),
     3 * (4 * 200 * 400) + 4 * 200 * 200 + 4 * 8 * 200),
])
def test_params_size_examples(kw, expected):
    assert ops.cudnn_rnn_params_size(**kw) == expected


@settings(max_examples=examples(100))
@given(all_configs)
def test_shapes_and_size_follow_the_spec(cfg):
    weights, biases = spec_shapes(cfg)
    assert [tuple(s) for s in ops.cudnn_rnn_canonical_weight_shapes(**attrs(cfg))] == weights
    assert [tuple(s) for s in ops.cudnn_rnn_canonical_bias_shapes(**attrs(cfg))] == biases
    n = ops.cudnn_rnn_params_size(**attrs(cfg))
    assert n == spec_params_size(cfg)
    assert n == sum(int(np.prod(s)) for s in weights + biases)
    # dropout and seeds never change the layout
    assert n == ops.cudnn_rnn_params_size(**attrs(cfg), dropout=0.5, seed=3, seed2=4)


@settings(max_examples=examples(100))
@given(all_configs, st.sampled_from([np.float64, np.float32, np.float16]))
def test_canonical_round_trips(cfg, dtype):
    """params -> canonical -> params and canonical -> params -> canonical are identities; the buffer is every
    weight flattened C-order in canonical order, then every bias (SPEC 4.2); results keep the dtype."""
    params = random_params(cfg, 1, dtype)
    w, b = ops.cudnn_rnn_params_to_canonical(params=params, **attrs(cfg))
    assert [a.shape for a in w] == spec_shapes(cfg)[0] and [a.shape for a in b] == spec_shapes(cfg)[1]
    assert all(a.dtype == dtype for a in w + b)
    np.testing.assert_array_equal(np.concatenate([a.ravel() for a in w + b]), params)
    back = ops.cudnn_rnn_canonical_to_params(weights=w, biases=b, **attrs(cfg))
    assert back.dtype == dtype and back.shape == params.shape
    np.testing.assert_array_equal(back, params)
    # the other way round, from fresh canonical arrays
    rng = np.random.default_rng(2)
    w2 = [rng.standard_normal(s).astype(dtype) for s in spec_shapes(cfg)[0]]
    b2 = [rng.standard_normal(s).astype(dtype) for s in spec_shapes(cfg)[1]]
    p2 = ops.cudnn_rnn_canonical_to_params(weights=w2, biases=b2, **attrs(cfg))
    w3, b3 = ops.cudnn_rnn_params_to_canonical(params=p2, **attrs(cfg))
    for x, y in zip(w2 + b2, w3 + b3):
        np.testing.assert_array_equal(x, y)
    # fresh arrays both ways: writing to the results touches neither params nor the canonical lists
    before = params.copy()
    for a in w + b:
        a[...] = 7
    np.testing.assert_array_equal(params, before)
    p2[...] = 7
    assert not any(np.any(a == 7) for a in w2 + b2)


def test_opaque_layout_literal():
    """A 1-layer bidirectional rnn_tanh, H=1, I=2: W_f [1,2], R_f, W_r [1,2], R_r, then bW_f, bR_f, bW_r, bR_r."""
    kw = dict(num_layers=1, num_units=1, input_size=2, rnn_mode="rnn_tanh", direction="bidirectional")
    params = np.arange(1.0, 11.0)
    w, b = ops.cudnn_rnn_params_to_canonical(params=params, **kw)
    np.testing.assert_array_equal(w[0], [[1, 2]])
    np.testing.assert_array_equal(w[1], [[3]])
    np.testing.assert_array_equal(w[2], [[4, 5]])
    np.testing.assert_array_equal(w[3], [[6]])
    assert [float(v[0]) for v in b] == [7, 8, 9, 10]


def test_layout_is_used_by_the_network():
    """The forward reads gate g's W from canonical slot g: a GRU whose only nonzero weight is W_n (slot 2)
    and R_z (slot 4) behaves as the SPEC equations with those matrices."""
    cfg = rnn_config(1, 2, 2, "gru")
    w = [np.zeros(s) for s in spec_shapes(cfg)[0]]
    b = [np.zeros(s) for s in spec_shapes(cfg)[1]]
    w[2] = np.array([[1.0, 0.0], [0.0, -1.0]])      # W_n
    w[4] = np.array([[0.5, 0.0], [0.0, 0.5]])       # R_z
    params = ops.cudnn_rnn_canonical_to_params(weights=w, biases=b, **attrs(cfg))
    x = np.array([[[0.3, 0.6]]])
    h0 = np.array([[[0.2, -0.4]]])
    y = ops.cudnn_rnn_v3(x, h0, None, params, rnn_mode="gru", backend=BACKEND)[0]
    z = 1 / (1 + np.exp(-0.5 * h0[0, 0]))
    n = np.tanh(w[2] @ x[0, 0])
    np.testing.assert_allclose(y[0, 0], (1 - z) * n + z * h0[0, 0], rtol=1e-14)


# ----------------------------------------------------------------------------------------------
# PyTorch state_dict (SPEC 4.4)
# ----------------------------------------------------------------------------------------------
def torch_names(cfg):
    names = []
    for layer in range(cfg.L):
        for d in range(cfg.D):
            s = f"_l{layer}" + ("_reverse" if d else "")
            names += [f"weight_ih{s}", f"weight_hh{s}", f"bias_ih{s}", f"bias_hh{s}"]
            if cfg.num_proj:
                names.append(f"weight_hr{s}")
    return names


@settings(max_examples=examples(60))
@given(all_configs)
def test_torch_state_dict_round_trip(cfg):
    """Names, shapes and contents as SPEC 4.4 (gates stacked in cuDNN order), and back to the same params."""
    params = random_params(cfg, 3)
    sd = to_torch_state_dict(cfg, params)
    assert sorted(sd) == sorted(torch_names(cfg))
    G, H, P = cfg.G, cfg.H, cfg.P
    blocks = iter(ops.cudnn_rnn_params_to_canonical(params=params, **attrs(cfg))[0])
    biases = iter(ops.cudnn_rnn_params_to_canonical(params=params, **attrs(cfg))[1])
    for layer in range(cfg.L):
        I_l = cfg.I if layer == 0 else cfg.D * P
        for d in range(cfg.D):
            s = f"_l{layer}" + ("_reverse" if d else "")
            W = [next(blocks) for _ in range(G)] if cfg.has_w(layer) else [np.eye(H)] * G
            R = [next(blocks) for _ in range(G)]
            assert sd["weight_ih" + s].shape == (G * H, I_l)
            np.testing.assert_array_equal(sd["weight_ih" + s], np.concatenate(W))
            np.testing.assert_array_equal(sd["weight_hh" + s], np.concatenate(R))
            if cfg.num_proj:
                np.testing.assert_array_equal(sd["weight_hr" + s], next(blocks))
                assert sd["weight_hr" + s].shape == (P, H)
            np.testing.assert_array_equal(sd["bias_ih" + s], np.concatenate([next(biases) for _ in range(G)]))
            np.testing.assert_array_equal(sd["bias_hh" + s], np.concatenate([next(biases) for _ in range(G)]))
    back = from_torch_state_dict(cfg, sd)
    assert back.dtype == params.dtype
    np.testing.assert_array_equal(back, params)
    # and state_dict -> params -> state_dict
    sd2 = to_torch_state_dict(cfg, back)
    for k in sd:
        np.testing.assert_array_equal(sd[k], sd2[k])


def test_torch_state_dict_without_biases_and_errors():
    cfg = rnn_config(2, 3, 2, "lstm", direction="bidirectional", num_proj=2)
    sd = to_torch_state_dict(cfg, random_params(cfg))
    no_bias = {k: v for k, v in sd.items() if not k.startswith("bias")}
    params = from_torch_state_dict(cfg, no_bias)
    _, biases = ops.cudnn_rnn_params_to_canonical(params=params, **attrs(cfg))
    assert not any(np.any(b) for b in biases)
    with pytest.raises(ValueError, match="weight_hh_l1_reverse"):
        from_torch_state_dict(cfg, {k: v for k, v in sd.items() if k != "weight_hh_l1_reverse"})
    with pytest.raises(ValueError, match="weight_hr_l0"):
        from_torch_state_dict(cfg, {k: v for k, v in sd.items() if k != "weight_hr_l0"})
    with pytest.raises(ValueError, match=r"weight_ih_l1"):
        from_torch_state_dict(cfg, dict(sd, weight_ih_l1=sd["weight_ih_l1"][:, :-1]))
    skip = rnn_config(1, 3, 3, "gru", "skip_input")
    sd = to_torch_state_dict(skip, random_params(skip))
    np.testing.assert_array_equal(sd["weight_ih_l0"], np.tile(np.eye(3), (3, 1)))
    with pytest.raises(ValueError, match=r"weight_ih_l0"):
        from_torch_state_dict(skip, dict(sd, weight_ih_l0=sd["weight_ih_l0"] * 2))


def test_torch_state_dict_skip_input_is_the_same_network():
    """skip_input exported as identity W runs identically as a linear_input network."""
    skip = rnn_config(2, 3, 3, "lstm", "skip_input", "bidirectional")
    lin = rnn_config(2, 3, 3, "lstm", "linear_input", "bidirectional")
    case = make_rnn_case(skip, 4, 2, [4, 2], seed=0)
    lin_params = from_torch_state_dict(lin, to_torch_state_dict(skip, case.params))
    common = dict(rnn_mode="lstm", direction="bidirectional", backend=BACKEND)
    a = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, case.lengths, input_mode="skip_input", **common)
    b = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, lin_params, case.lengths, input_mode="linear_input", **common)
    for u, v in zip(a[:3], b[:3]):
        np.testing.assert_allclose(u, v, rtol=1e-13, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# TF CudnnCompatible cells (SPEC 4.4)
# ----------------------------------------------------------------------------------------------
TF_LSTM_ORDER = (0, 2, 1, 3)   # TF packs i, g, f, o


def equal_bias_params(cfg, params):
    """The same params with bW and bR both replaced by (bW + bR)/2 where TF keeps one sum (GRU n: kept apart)."""
    w, b = ops.cudnn_rnn_params_to_canonical(params=params, **attrs(cfg))
    G = cfg.G
    out = []
    for p in range(cfg.L * cfg.D):
        bW, bR = b[2 * G * p:2 * G * p + G], b[2 * G * p + G:2 * G * (p + 1)]
        for g in range(G):
            if cfg.rnn_mode == "gru" and g == 2:
                continue
            bW[g] = bR[g] = (bW[g] + bR[g]) / 2
        out += bW + bR
    return ops.cudnn_rnn_canonical_to_params(weights=w, biases=out, **attrs(cfg))


@settings(max_examples=examples(60))
@given(all_configs)
def test_tf_cells_layout_and_round_trip(cfg):
    params = random_params(cfg, 4)
    cells = to_tf_cells(cfg, params)
    G, H, P, D = cfg.G, cfg.H, cfg.P, cfg.D
    w, b = ops.cudnn_rnn_params_to_canonical(params=params, **attrs(cfg))
    wi, bi = iter(w), iter(b)
    for layer in range(cfg.L):
        I_l = cfg.I if layer == 0 else D * P
        for d in range(D):
            pre = f"cell_{layer}/" + ("" if D == 1 else ("fw/" if d == 0 else "bw/"))
            W = [next(wi) for _ in range(G)] if cfg.has_w(layer) else [np.eye(H)] * G
            R = [next(wi) for _ in range(G)]
            Wp = next(wi) if cfg.num_proj else None
            bW = [next(bi) for _ in range(G)]
            bR = [next(bi) for _ in range(G)]
            if cfg.rnn_mode == "gru":
                k = cells[pre + "gates/kernel"]
                assert k.shape == (I_l + H, 2 * H)
                for slot, g in enumerate((0, 1)):      # r then z
                    np.testing.assert_array_equal(k[:, slot * H:(slot + 1) * H], np.concatenate([W[g], R[g]], 1).T)
                np.testing.assert_allclose(cells[pre + "gates/bias"], np.concatenate([bW[0] + bR[0], bW[1] + bR[1]]),
                                           rtol=1e-15)
                np.testing.assert_array_equal(cells[pre + "candidate/input_projection/kernel"], W[2].T)
                np.testing.assert_array_equal(cells[pre + "candidate/input_projection/bias"], bW[2])
                np.testing.assert_array_equal(cells[pre + "candidate/hidden_projection/kernel"], R[2].T)
                np.testing.assert_array_equal(cells[pre + "candidate/hidden_projection/bias"], bR[2])
            else:
                order = TF_LSTM_ORDER if cfg.has_cell_state else (0,)
                k = cells[pre + "kernel"]
                assert k.shape == (I_l + P, G * H)
                for slot, g in enumerate(order):
                    np.testing.assert_array_equal(k[:, slot * H:(slot + 1) * H], np.concatenate([W[g], R[g]], 1).T)
                np.testing.assert_allclose(cells[pre + "bias"], np.concatenate([bW[g] + bR[g] for g in order]),
                                           rtol=1e-15)
                if cfg.num_proj:
                    np.testing.assert_array_equal(cells[pre + "projection/kernel"], Wp.T)
                    assert Wp.T.shape == (H, P)
    # only the sum is kept: the round trip is the identity exactly when bW == bR
    eq = equal_bias_params(cfg, params)
    np.testing.assert_array_equal(from_tf_cells(cfg, to_tf_cells(cfg, eq)), eq)
    back = from_tf_cells(cfg, cells)
    np.testing.assert_allclose(back, eq, rtol=1e-15, atol=1e-15)
    # cells -> params -> cells
    cells2 = to_tf_cells(cfg, back)
    assert sorted(cells2) == sorted(cells)
    for name in cells:
        np.testing.assert_allclose(cells2[name], cells[name], rtol=1e-15, atol=1e-15)


@settings(max_examples=examples(30))
@given(st.sampled_from(["lstm", "gru", "rnn_tanh", "rnn_relu"]), st.integers(1, 2), st.booleans(), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_tf_cells_restore_the_same_network(mode, L, bidirectional, proj, seed):
    """params restored from TF cells (bias split in half) compute the same outputs as the original params:
    only bW+bR matters for every gate whose biases TF sums."""
    cfg = rnn_config(L, 3, 2, mode, "linear_input", "bidirectional" if bidirectional else "unidirectional",
                     2 if (proj and mode == "lstm") else 0)
    case = make_rnn_case(cfg, 4, 3, [4, 1, 0], seed=seed)
    restored = from_tf_cells(cfg, to_tf_cells(cfg, case.params))
    kw = dict(rnn_mode=mode, direction=cfg.direction, num_proj=cfg.num_proj, backend=BACKEND)
    a = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, case.lengths, **kw)
    b = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, restored, case.lengths, **kw)
    for u, v in zip(a[:3], b[:3]):
        np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-13)
    # with bW == bR to begin with, restoring is exact and the outputs are bit-identical
    eq = equal_bias_params(cfg, case.params)
    c = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, eq, case.lengths, **kw)
    d = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, from_tf_cells(cfg, to_tf_cells(cfg, eq)), case.lengths, **kw)
    for u, v in zip(c[:3], d[:3]):
        np.testing.assert_array_equal(u, v)


def test_tf_cells_errors():
    cfg = rnn_config(1, 3, 2, "lstm", num_proj=2)
    cells = to_tf_cells(cfg, random_params(cfg))
    with pytest.raises(ValueError, match="projection/kernel"):
        from_tf_cells(cfg, {k: v for k, v in cells.items() if k != "cell_0/projection/kernel"})
    with pytest.raises(ValueError, match="cell_0/kernel"):
        from_tf_cells(cfg, dict(cells, **{"cell_0/kernel": cells["cell_0/kernel"].T}))
    skip = rnn_config(1, 2, 2, "rnn_relu", "skip_input")
    sk = to_tf_cells(skip, random_params(skip))
    np.testing.assert_array_equal(sk["cell_0/kernel"][:2], np.eye(2))
    with pytest.raises(ValueError, match="identity"):
        from_tf_cells(skip, dict(sk, **{"cell_0/kernel": sk["cell_0/kernel"] + 1}))

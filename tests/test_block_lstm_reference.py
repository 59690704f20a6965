"""BlockLSTM argument checks and NumPy reference (SPEC sections 9, 10, 11). Pure NumPy, no simulator.

What is checked:
- the forward against a literal hand-computed case and against an independent scalar (math-module)
  implementation of the SPEC 9 equations, clip and peephole included;
- the backward against central finite differences of ``sum(h*h_grad) + sum(cs*cs_grad)`` for every
  input, both layouts, with/without peephole, forget_bias != 0, seq_len_max < T, and against a literal
  hand-computed case;
- V1 ('icfo') vs V2 ('ifco'): the same network with the gate blocks permuted;
- zeros past seq_len_max, the clip, empty shapes, float16/float32 vs float64 (SPEC 10 tolerances);
- every bad input of SPEC 11 for BlockLSTM raises ValueError/TypeError whose message starts with the
  argument's name; inputs are never mutated; device arrays are only asked for .shape/.dtype.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from numbarnn.block_lstm_config import (
    GATE_ORDER,
    BlockLSTMCall,
    validate_block_lstm,
    validate_block_lstm_grad,
)
from numbarnn.reference.block_lstm import (
    block_lstm_backward,
    block_lstm_forward,
    gate_slices,
    sigmoid,
)

FORWARD_ARGS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
SAVED = ("i", "cs", "f", "o", "ci", "co", "h")
GRAD_NAMES = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")   # what backward returns grads of


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def make_inputs(rng, T, B, I, C, dtype=np.float64, w_scale=0.6):
    """Random forward inputs; float64 values cast to ``dtype``."""
    arrays = dict(
        x=rng.standard_normal((T, B, I)),                  # [T, B, I]
        cs_prev=rng.standard_normal((B, C)),               # [B, C]
        h_prev=0.8 * rng.uniform(-1, 1, (B, C)),           # [B, C]
        w=w_scale * rng.standard_normal((I + C, 4 * C)),   # [I+C, 4C]
        wci=0.7 * rng.standard_normal(C),                  # [C]
        wcf=0.7 * rng.standard_normal(C),                  # [C]
        wco=0.7 * rng.standard_normal(C),                  # [C]
        b=0.5 * rng.standard_normal(4 * C),                # [4C]
    )
    return {k: v.astype(dtype) for k, v in arrays.items()}


def forward(layout, S, inputs, forget_bias=0.0, cell_clip=0.0, use_peephole=False):
    """Validate, then run the reference forward; returns (call, dict of the seven outputs)."""
    call = validate_block_lstm(layout, S, **inputs, forget_bias=forget_bias, cell_clip=cell_clip,
                               use_peephole=use_peephole)
    outs = block_lstm_forward(call, **inputs)
    return call, dict(zip(SAVED, outs))


def backward(layout, S, inputs, saved, cs_grad, h_grad, use_peephole=False):
    """Validate, then run the reference backward; returns a dict name -> gradient."""
    call = validate_block_lstm_grad(layout, S, **inputs, **saved, cs_grad=cs_grad, h_grad=h_grad,
                                    use_peephole=use_peephole)
    grads = block_lstm_backward(call, **inputs, **saved, cs_grad=cs_grad, h_grad=h_grad)
    return dict(zip(GRAD_NAMES, grads))


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    diff = np.linalg.norm((out - ref).ravel())
    scale = np.linalg.norm(ref.ravel())
    if scale == 0.0:
        return float(diff)
    return float(diff / scale)


def scalar_forward(layout, S, inp, forget_bias, cell_clip, use_peephole):
    """An independent, element-by-element implementation of SPEC 9 with the math module."""
    x, cs_prev, h_prev, w, b = inp["x"], inp["cs_prev"], inp["h_prev"], inp["w"], inp["b"]
    wci, wcf, wco = inp["wci"], inp["wcf"], inp["wco"]
    T, B, I = x.shape
    C = cs_prev.shape[1]
    order = {"icfo": "i c f o", "ifco": "i f c o"}[layout].split()
    col = {gate: order.index(gate) * C for gate in "icfo"}   # first column of each gate block
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731  (inputs here are moderate)
    out = {n: np.zeros((T, B, C)) for n in SAVED}
    for bb in range(B):
        cs_p = [float(v) for v in cs_prev[bb]]
        h_p = [float(v) for v in h_prev[bb]]
        for t in range(S):
            xh = [float(v) for v in x[t, bb]] + h_p
            def pre(gate, c):
                j = col[gate] + c
                return sum(xh[k] * float(w[k, j]) for k in range(I + C)) + float(b[j])
            cs_new, h_new = [], []
            for c in range(C):
                i = sig(pre("i", c) + (cs_p[c] * wci[c] if use_peephole else 0.0))
                ci = math.tanh(pre("c", c))
                f = sig(pre("f", c) + forget_bias + (cs_p[c] * wcf[c] if use_peephole else 0.0))
                cs = ci * i + f * cs_p[c]
                if cell_clip > 0:
                    cs = min(max(cs, -cell_clip), cell_clip)
                co = math.tanh(cs)
                o = sig(pre("o", c) + (cs * wco[c] if use_peephole else 0.0))
                h = o * co
                for name, v in zip(SAVED, (i, cs, f, o, ci, co, h)):
                    out[name][t, bb, c] = v
                cs_new.append(cs)
                h_new.append(h)
            cs_p, h_p = cs_new, h_new
    return out


def v2_to_v1_columns(C):
    """Column indices: w_v1 = w_v2[:, cols] puts V2's (ifco) gate blocks in V1's (icfo) order."""
    v2 = gate_slices("ifco", C)
    return np.concatenate([np.arange(4 * C)[v2[gate]] for gate in GATE_ORDER["icfo"]])


dims = st.tuples(st.integers(0, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------
def test_gate_slices():
    assert gate_slices("icfo", 2) == dict(i=slice(0, 2), ci=slice(2, 4), f=slice(4, 6), o=slice(6, 8))
    assert gate_slices("ifco", 2) == dict(i=slice(0, 2), f=slice(2, 4), ci=slice(4, 6), o=slice(6, 8))
    call = validate_block_lstm("ifco", 1, **make_inputs(np.random.default_rng(0), 1, 1, 1, 3),
                               forget_bias=0.0, cell_clip=0.0, use_peephole=False)
    assert [call.gate_offset(g) for g in ("i", "f", "ci", "o")] == [0, 3, 6, 9]


def test_sigmoid_is_safe_and_right():
    z = np.array([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4])
    with np.errstate(all="raise"):
        s = sigmoid(z)
    expected = [0.0, 1.0 / (1.0 + math.exp(50.0)), 1.0 / (1.0 + math.e), 0.5,
                1.0 / (1.0 + math.exp(-1.0)), 1.0, 1.0]
    np.testing.assert_allclose(s, expected, rtol=1e-14, atol=1e-21)


@pytest.mark.parametrize("layout", ["icfo", "ifco"])
def test_hand_checked_tiny_forward(layout):
    """T=1, B=1, I=1, C=1, w = 0, b = 0: every gate pre-activation is 0 except for forget_bias."""
    inp = dict(x=np.array([[[1.0]]]), cs_prev=np.array([[2.0]]), h_prev=np.array([[0.5]]),
               w=np.zeros((2, 4)), wci=np.zeros(1), wcf=np.zeros(1), wco=np.zeros(1), b=np.zeros(4))
    _, out = forward(layout, 1, inp, forget_bias=1.0, cell_clip=0.0)
    # i = σ(0) = 0.5, ci = tanh(0) = 0, f = σ(1) = 0.7310585786300049, o = σ(0) = 0.5
    # cs = ci*i + f*cs_prev = 2*0.7310585786300049 = 1.4621171572600098
    # co = tanh(1.4621171572600098) = 0.8980630114608957 ; h = o*co = 0.44903150573044787
    expected = dict(i=0.5, ci=0.0, f=0.7310585786300049, o=0.5, cs=1.4621171572600098,
                    co=0.8980630114608957, h=0.44903150573044787)
    for name, value in expected.items():
        np.testing.assert_allclose(out[name], [[[value]]], rtol=1e-14, err_msg=name)
    # the same with the clip on at 1.0: cs = 1, co = tanh(1) = 0.7615941559557649
    _, out = forward(layout, 1, inp, forget_bias=1.0, cell_clip=1.0)
    np.testing.assert_allclose(out["cs"], [[[1.0]]], rtol=1e-15)
    np.testing.assert_allclose(out["co"], [[[0.7615941559557649]]], rtol=1e-14)
    np.testing.assert_allclose(out["h"], [[[0.3807970779778824]]], rtol=1e-14)

    # peephole: wci = 0.5, wcf = -1, wco = 2, forget_bias 0:
    # i = σ(2*0.5) = σ(1) = 0.7310585786300049 ; f = σ(2*-1) = σ(-2) = 0.11920292202211755
    # cs = 0*i + f*2 = 0.2384058440442351 ; o = σ(2*cs) = σ(0.4768116880884702) = 0.6169947192302293
    inp.update(wci=np.array([0.5]), wcf=np.array([-1.0]), wco=np.array([2.0]))
    _, out = forward(layout, 1, inp, use_peephole=True)
    np.testing.assert_allclose(out["i"], [[[0.7310585786300049]]], rtol=1e-14)
    np.testing.assert_allclose(out["f"], [[[0.11920292202211755]]], rtol=1e-14)
    np.testing.assert_allclose(out["cs"], [[[0.2384058440442351]]], rtol=1e-14)
    np.testing.assert_allclose(out["o"], [[[0.6169947192302293]]], rtol=1e-14)
    np.testing.assert_allclose(out["h"], [[[0.6169947192302293 * math.tanh(0.2384058440442351)]]],
                               rtol=1e-14)


@pytest.mark.parametrize("layout", ["icfo", "ifco"])
def test_hand_checked_tiny_gate_placement(layout):
    """One weight per gate block: each output must pick up the right block of the layout."""
    order = GATE_ORDER[layout]
    b = np.zeros(4)
    b[order.index("i")] = 0.1
    b[order.index("ci")] = 0.2
    b[order.index("f")] = 0.3
    b[order.index("o")] = 0.4
    inp = dict(x=np.zeros((1, 1, 1)), cs_prev=np.array([[1.0]]), h_prev=np.zeros((1, 1)),
               w=np.zeros((2, 4)), wci=np.zeros(1), wcf=np.zeros(1), wco=np.zeros(1), b=b)
    _, out = forward(layout, 1, inp)
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    np.testing.assert_allclose(out["i"], [[[sig(0.1)]]], rtol=1e-14)
    np.testing.assert_allclose(out["ci"], [[[math.tanh(0.2)]]], rtol=1e-14)
    np.testing.assert_allclose(out["f"], [[[sig(0.3)]]], rtol=1e-14)
    np.testing.assert_allclose(out["o"], [[[sig(0.4)]]], rtol=1e-14)
    np.testing.assert_allclose(out["cs"], [[[math.tanh(0.2) * sig(0.1) + sig(0.3)]]], rtol=1e-14)


@given(dims=dims, layout=st.sampled_from(["icfo", "ifco"]), peephole=st.booleans(),
       forget_bias=st.sampled_from([0.0, 1.0, -0.6]), cell_clip=st.sampled_from([0.0, -1.0, 0.7, 3.0]),
       s_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
def test_forward_matches_scalar_implementation(dims, layout, peephole, forget_bias, cell_clip, s_frac,
                                               seed):
    T, B, I, C = dims
    S = int(round(s_frac * T))
    inp = make_inputs(np.random.default_rng(seed), T, B, I, C, w_scale=1.2)
    _, out = forward(layout, S, inp, forget_bias, cell_clip, peephole)
    ref = scalar_forward(layout, S, inp, forget_bias, cell_clip, peephole)
    for name in SAVED:
        assert out[name].shape == (T, B, C) and out[name].dtype == np.float64
        np.testing.assert_allclose(out[name], ref[name], rtol=1e-12, atol=1e-14, err_msg=name)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["icfo", "ifco"])
def test_hand_checked_tiny_backward(layout):
    """T=1, B=1, I=1, C=1, w = 0, b = 0, cs_prev = 2, x = 1, h_prev = 0.5, h_grad = 1, cs_grad = 0.

    i = f = o = 0.5, ci = 0, cs = 1, co = tanh(1) =: k = 0.7615941559557649.
    dh = 1 ; do = 0.25*k ; dcs = (1-k²)*0.5 = 0.20998717080701307
    dci = dcs*0.5 ; df = 0.25*dcs*2 = dcs/2 ; di = 0.25*dcs*0 = 0
    cs_prev_grad = dcs*f = dcs/2 ; h_prev_grad = dgates @ w_hᵀ = 0 ; x_grad = 0 (w = 0)
    w_grad = [x, h_prev]ᵀ @ dgates = [dgates, 0.5*dgates] ; b_grad = dgates
    """
    k = math.tanh(1.0)
    dcs = 0.5 * (1 - k * k)
    assert abs(dcs - 0.20998717080701307) < 1e-15
    inp = dict(x=np.array([[[1.0]]]), cs_prev=np.array([[2.0]]), h_prev=np.array([[0.5]]),
               w=np.zeros((2, 4)), wci=np.zeros(1), wcf=np.zeros(1), wco=np.zeros(1), b=np.zeros(4))
    _, saved = forward(layout, 1, inp)
    g = backward(layout, 1, inp, saved, cs_grad=np.zeros((1, 1, 1)), h_grad=np.ones((1, 1, 1)))
    dgates = np.zeros(4)
    order = GATE_ORDER[layout]
    dgates[order.index("i")] = 0.0
    dgates[order.index("f")] = dcs / 2
    dgates[order.index("ci")] = dcs / 2
    dgates[order.index("o")] = 0.25 * k
    np.testing.assert_allclose(g["b"], dgates, rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(g["w"], np.stack([dgates, 0.5 * dgates]), rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(g["cs_prev"], [[dcs / 2]], rtol=1e-14)
    np.testing.assert_array_equal(g["h_prev"], [[0.0]])
    np.testing.assert_array_equal(g["x"], [[[0.0]]])
    for name in ("wci", "wcf", "wco"):
        np.testing.assert_array_equal(g[name], [0.0])
    # a cs_grad adds straight into dcs: cs_prev_grad grows by cs_grad*f = 0.5*0.5
    g2 = backward(layout, 1, inp, saved, cs_grad=np.full((1, 1, 1), 0.5), h_grad=np.ones((1, 1, 1)))
    np.testing.assert_allclose(g2["cs_prev"], [[dcs / 2 + 0.25]], rtol=1e-14)


def _loss(layout, S, inp, forget_bias, cell_clip, peephole, cs_grad, h_grad) -> float:
    _, out = forward(layout, S, inp, forget_bias, cell_clip, peephole)
    return float(np.sum(out["h"] * h_grad) + np.sum(out["cs"] * cs_grad))


@given(dims=dims, layout=st.sampled_from(["icfo", "ifco"]), peephole=st.booleans(),
       forget_bias=st.sampled_from([0.0, 1.0, -0.6]), cell_clip=st.sampled_from([0.0, -1.0, 100.0]),
       s_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
@example(dims=(4, 2, 3, 2), layout="icfo", peephole=True, forget_bias=1.0, cell_clip=100.0, s_frac=0.5,
         seed=1)
@example(dims=(3, 2, 2, 3), layout="ifco", peephole=True, forget_bias=0.0, cell_clip=0.0, s_frac=1.0,
         seed=2)
@example(dims=(3, 2, 2, 3), layout="icfo", peephole=False, forget_bias=-0.6, cell_clip=0.0, s_frac=0.7,
         seed=3)
def test_backward_matches_finite_differences(dims, layout, peephole, forget_bias, cell_clip, s_frac, seed):
    """Central differences of sum(h*h_grad) + sum(cs*cs_grad) for every element of every input.

    No clip triggers (off, or at 100), so TF's clip-ignoring gradient is exact."""
    T, B, I, C = dims
    S = int(round(s_frac * T))
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, T, B, I, C)
    cs_grad = rng.standard_normal((T, B, C))     # [T, B, C], both upstream gradients nonzero
    h_grad = rng.standard_normal((T, B, C))      # [T, B, C]
    _, saved = forward(layout, S, inp, forget_bias, cell_clip, peephole)
    assert np.all(np.abs(saved["cs"]) < 50.0)    # the clip at 100 never triggers
    grads = backward(layout, S, inp, saved, cs_grad, h_grad, peephole)

    eps = 1e-6
    for name in GRAD_NAMES:
        assert grads[name].shape == inp[name].shape and grads[name].dtype == np.float64
        numeric = np.zeros_like(inp[name])
        for idx in np.ndindex(inp[name].shape):
            bumped = {k: v.copy() for k, v in inp.items()}
            bumped[name][idx] += eps
            up = _loss(layout, S, bumped, forget_bias, cell_clip, peephole, cs_grad, h_grad)
            bumped[name][idx] -= 2 * eps
            down = _loss(layout, S, bumped, forget_bias, cell_clip, peephole, cs_grad, h_grad)
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-8, err_msg=name)
        if name in ("wci", "wcf", "wco") and not peephole:
            np.testing.assert_array_equal(grads[name], 0.0)
        if name == "x":
            np.testing.assert_array_equal(grads[name][S:], 0.0)


def test_finite_difference_check_can_fail():
    """Sanity of the harness: a wrong gradient (cs_grad dropped) is caught by the same comparison."""
    rng = np.random.default_rng(7)
    inp = make_inputs(rng, 2, 2, 2, 2)
    cs_grad, h_grad = rng.standard_normal((2, 2, 2)), rng.standard_normal((2, 2, 2))
    _, saved = forward("ifco", 2, inp)
    wrong = backward("ifco", 2, inp, saved, np.zeros_like(cs_grad), h_grad)
    eps = 1e-6
    bumped = {k: v.copy() for k, v in inp.items()}
    bumped["cs_prev"][0, 0] += eps
    up = _loss("ifco", 2, bumped, 0.0, 0.0, False, cs_grad, h_grad)
    bumped["cs_prev"][0, 0] -= 2 * eps
    down = _loss("ifco", 2, bumped, 0.0, 0.0, False, cs_grad, h_grad)
    assert abs((up - down) / (2 * eps) - wrong["cs_prev"][0, 0]) > 1e-3


# ----------------------------------------------------------------------------------------------
# V1 vs V2
# ----------------------------------------------------------------------------------------------
@given(dims=dims, peephole=st.booleans(), forget_bias=st.sampled_from([0.0, 1.0, -0.6]),
       s_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
def test_v1_is_v2_with_gates_permuted(dims, peephole, forget_bias, s_frac, seed):
    T, B, I, C = dims
    S = int(round(s_frac * T))
    rng = np.random.default_rng(seed)
    v2 = make_inputs(rng, T, B, I, C)
    cols = v2_to_v1_columns(C)
    v1 = dict(v2, w=v2["w"][:, cols], b=v2["b"][cols])

    # forget_bias = 0 and the clip off (0 for V2, -1 for V1): identical networks
    _, out2 = forward("ifco", S, v2, 0.0, 0.0, peephole)
    _, out1 = forward("icfo", S, v1, 0.0, -1.0, peephole)
    for name in SAVED:
        np.testing.assert_allclose(out1[name], out2[name], rtol=1e-13, atol=1e-15, err_msg=name)
    # V1's forget_bias is V2 with that much added to the f block of b
    f2 = gate_slices("ifco", C)["f"]
    b2 = v2["b"].copy()
    b2[f2] += forget_bias
    _, out2b = forward("ifco", S, dict(v2, b=b2), 0.0, 0.0, peephole)
    _, out1b = forward("icfo", S, v1, forget_bias, 0.0, peephole)
    for name in SAVED:
        np.testing.assert_allclose(out1b[name], out2b[name], rtol=1e-13, atol=1e-15, err_msg=name)

    cs_grad = rng.standard_normal((T, B, C))
    h_grad = rng.standard_normal((T, B, C))
    g2 = backward("ifco", S, v2, out2, cs_grad, h_grad, peephole)
    g1 = backward("icfo", S, v1, out1, cs_grad, h_grad, peephole)
    np.testing.assert_allclose(g1["w"], g2["w"][:, cols], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1["b"], g2["b"][cols], rtol=1e-12, atol=1e-14)
    for name in ("x", "cs_prev", "h_prev", "wci", "wcf", "wco"):
        np.testing.assert_allclose(g1[name], g2[name], rtol=1e-12, atol=1e-14, err_msg=name)


# ----------------------------------------------------------------------------------------------
# seq_len_max, clip, empty shapes
# ----------------------------------------------------------------------------------------------
@given(layout=st.sampled_from(["icfo", "ifco"]), peephole=st.booleans(), S=st.integers(0, 4),
       seed=st.integers(0, 2**32 - 1))
def test_everything_is_zero_past_seq_len_max(layout, peephole, S, seed):
    T, B, I, C = 4, 2, 3, 2
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, T, B, I, C)
    _, out = forward(layout, S, inp, 1.0, 3.0, peephole)
    for name in SAVED:
        np.testing.assert_array_equal(out[name][S:], 0.0, err_msg=name)
        if S > 0 and name != "ci":  # ci can be ~0 by chance only; the others are strictly nonzero-ish
            assert np.all(out[name][:S] != 0.0), name
    # the steps past seq_len_max are not read: other x there changes nothing
    inp2 = dict(inp, x=inp["x"].copy())
    inp2["x"][S:] = rng.standard_normal((T - S, B, I))
    _, out2 = forward(layout, S, inp2, 1.0, 3.0, peephole)
    for name in SAVED:
        np.testing.assert_array_equal(out2[name], out[name], err_msg=name)

    cs_grad = rng.standard_normal((T, B, C))
    h_grad = rng.standard_normal((T, B, C))
    g = backward(layout, S, inp, out, cs_grad, h_grad, peephole)
    np.testing.assert_array_equal(g["x"][S:], 0.0)
    # upstream gradients past seq_len_max are ignored
    cs_grad2, h_grad2 = cs_grad.copy(), h_grad.copy()
    cs_grad2[S:] = 5.0
    h_grad2[S:] = -3.0
    g2 = backward(layout, S, inp, out, cs_grad2, h_grad2, peephole)
    for name in GRAD_NAMES:
        np.testing.assert_array_equal(g2[name], g[name], err_msg=name)
    if S == 0:
        for name in GRAD_NAMES:
            np.testing.assert_array_equal(g[name], 0.0, err_msg=name)


@pytest.mark.parametrize("layout", ["icfo", "ifco"])
def test_cell_clip_clips_cs(layout):
    T, B, I, C = 3, 2, 2, 3
    inp = make_inputs(np.random.default_rng(11), T, B, I, C)
    order = GATE_ORDER[layout]
    b = np.zeros(4 * C)
    for gate, value in (("i", 4.0), ("ci", 4.0), ("f", 4.0), ("o", 0.0)):
        k = order.index(gate)
        b[k * C:(k + 1) * C] = value
    inp["b"] = b                                # i, ci, f ~ 1: cs grows by ~1 per step
    clip = 1.5
    _, free = forward(layout, T, inp, 0.0, 0.0)
    assert np.max(np.abs(free["cs"])) > 2.0    # without the clip it would exceed it
    _, out = forward(layout, T, inp, 0.0, clip)
    assert np.max(np.abs(out["cs"])) <= clip
    assert np.any(out["cs"] == clip)
    np.testing.assert_allclose(out["co"], np.tanh(out["cs"]), rtol=1e-15)
    np.testing.assert_allclose(out["h"], out["o"] * out["co"], rtol=1e-15)
    # the next step starts from the clipped cs: identical to the scalar implementation
    ref = scalar_forward(layout, T, inp, 0.0, clip, False)
    for name in SAVED:
        np.testing.assert_allclose(out[name], ref[name], rtol=1e-12, atol=1e-14, err_msg=name)
    # cell_clip <= 0 is "off", and a clip that never triggers changes nothing
    for off in (0.0, -1.0, 1e6):
        _, other = forward(layout, T, inp, 0.0, off)
        for name in SAVED:
            np.testing.assert_array_equal(other[name], free[name], err_msg=name)


@pytest.mark.parametrize("T,B,S", [(0, 2, 0), (3, 0, 2), (0, 0, 0), (3, 2, 0)])
@pytest.mark.parametrize("peephole", [False, True])
def test_empty_shapes_and_zero_steps(T, B, S, peephole):
    I, C = 3, 2
    rng = np.random.default_rng(3)
    inp = make_inputs(rng, T, B, I, C)
    call, out = forward("ifco", S, inp, 0.0, 0.0, peephole)
    assert (call.T, call.B, call.I, call.C, call.seq_len_max) == (T, B, I, C, S)
    for name in SAVED:
        assert out[name].shape == (T, B, C)
        np.testing.assert_array_equal(out[name][S:], 0.0)
    g = backward("ifco", S, inp, out, rng.standard_normal((T, B, C)), rng.standard_normal((T, B, C)),
                 peephole)
    for name in GRAD_NAMES:
        assert g[name].shape == inp[name].shape, name
        if S == 0 or B == 0:
            np.testing.assert_array_equal(g[name], 0.0, err_msg=name)


# ----------------------------------------------------------------------------------------------
# dtypes (SPEC 10)
# ----------------------------------------------------------------------------------------------
TOL = {np.float16: (1e-2, 1e-2), np.float32: (1e-5, 1e-4)}   # (outputs, gradients)


@given(dims=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       dtype=st.sampled_from([np.float16, np.float32]), layout=st.sampled_from(["icfo", "ifco"]),
       peephole=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_half_and_single_agree_with_double(dims, dtype, layout, peephole, seed):
    """Results come back in the input dtype, are the float64 computation cast back (bit for bit) and
    agree with the all-float64 pipeline (unrounded inputs) within SPEC 10's tolerances.

    Against that pipeline the tolerances are applied to the seven outputs together and to the eight
    gradients together: a single gradient of a tiny
    problem can be a sum with heavy cancellation (e.g. wci_grad = Σ_b di*cs_p with B = 1..3), whose
    relative accuracy the float16-rounded saved activations limit to a few percent."""
    T, B, I, C = dims
    rng = np.random.default_rng(seed)
    inp64 = make_inputs(rng, T, B, I, C)
    cs_grad = rng.standard_normal((T, B, C))
    h_grad = rng.standard_normal((T, B, C))
    inp = {k: v.astype(dtype) for k, v in inp64.items()}
    up = lambda d: {k: v.astype(np.float64) for k, v in d.items()}  # noqa: E731
    tol_out, tol_grad = TOL[dtype]

    call, out = forward(layout, T, inp, 1.0, 3.0, peephole)
    assert call.dtype == np.dtype(dtype)
    _, out_up = forward(layout, T, up(inp), 1.0, 3.0, peephole)      # same (rounded) inputs, float64
    for name in SAVED:
        assert out[name].dtype == dtype, name
        np.testing.assert_array_equal(out[name], out_up[name].astype(dtype), err_msg=name)
        assert rel_err(out[name], out_up[name]) <= tol_out, name

    g = backward(layout, T, inp, out, cs_grad.astype(dtype), h_grad.astype(dtype), peephole)
    g_up = backward(layout, T, up(inp), up(out), cs_grad.astype(dtype).astype(np.float64),
                    h_grad.astype(dtype).astype(np.float64), peephole)
    for name in GRAD_NAMES:
        assert g[name].dtype == dtype, name
        np.testing.assert_array_equal(g[name], g_up[name].astype(dtype), err_msg=name)

    _, ref = forward(layout, T, inp64, 1.0, 3.0, peephole)            # the all-float64 pipeline
    g_ref = backward(layout, T, inp64, ref, cs_grad, h_grad, peephole)
    flat = lambda d, names: np.concatenate([np.ravel(d[n]).astype(np.float64) for n in names])  # noqa: E731
    assert rel_err(flat(out, SAVED), flat(ref, SAVED)) <= tol_out
    assert rel_err(flat(g, GRAD_NAMES), flat(g_ref, GRAD_NAMES)) <= tol_grad


# ----------------------------------------------------------------------------------------------
# validation (SPEC 11)
# ----------------------------------------------------------------------------------------------
T0, B0, I0, C0 = 3, 2, 5, 4     # all different, so every mismatch is visible


def good_forward_args():
    inp = make_inputs(np.random.default_rng(0), T0, B0, I0, C0)
    return dict(layout="icfo", seq_len_max=2, **inp, forget_bias=1.0, cell_clip=3.0, use_peephole=True)


def good_grad_args():
    inp = make_inputs(np.random.default_rng(0), T0, B0, I0, C0)
    extra = {n: np.zeros((T0, B0, C0)) for n in SAVED + ("cs_grad", "h_grad")}
    return dict(layout="ifco", seq_len_max=3, **inp, **extra, use_peephole=False)


def expect_error(fn, kwargs, exc_type, name):
    with pytest.raises(exc_type) as info:
        fn(**kwargs)
    assert str(info.value).startswith(f"{name}:"), str(info.value)


def _bad_shapes(name, shape):
    """Wrong rank (one more, one fewer axis) and each dimension off by one."""
    yield shape + (1,)
    yield shape[:-1]
    for k in range(len(shape)):
        yield shape[:k] + (shape[k] + 1,) + shape[k + 1:]


FORWARD_SHAPES = dict(x=(T0, B0, I0), cs_prev=(B0, C0), h_prev=(B0, C0), w=(I0 + C0, 4 * C0),
                      wci=(C0,), wcf=(C0,), wco=(C0,), b=(4 * C0,))
# x defines T, B, I and cs_prev defines C: a wrong x / cs_prev dimension is reported by whatever
# disagrees with it first, so those two are only checked for their rank here (and below for B/C).
SHAPE_CASES = [(name, bad) for name, shape in FORWARD_SHAPES.items() for bad in _bad_shapes(name, shape)
               if name not in ("x", "cs_prev") or len(bad) != len(shape)]


def test_validate_returns_the_call():
    call = validate_block_lstm(**good_forward_args())
    assert call == BlockLSTMCall(layout="icfo", seq_len_max=2, T=T0, B=B0, I=I0, C=C0,
                                 dtype=np.dtype(np.float64), forget_bias=1.0, cell_clip=3.0,
                                 use_peephole=True)
    assert isinstance(call.seq_len_max, int) and isinstance(call.forget_bias, float)
    hash(call)
    gcall = validate_block_lstm_grad(**good_grad_args())
    assert gcall == BlockLSTMCall(layout="ifco", seq_len_max=3, T=T0, B=B0, I=I0, C=C0,
                                  dtype=np.dtype(np.float64), forget_bias=0.0, cell_clip=0.0,
                                  use_peephole=False)


@pytest.mark.parametrize("name,shape", SHAPE_CASES)
def test_bad_forward_shape(name, shape):
    args = good_forward_args()
    args[name] = np.zeros(shape)
    expect_error(validate_block_lstm, args, ValueError, name)
    gargs = good_grad_args()
    gargs[name] = np.zeros(shape)
    expect_error(validate_block_lstm_grad, gargs, ValueError, name)


@pytest.mark.parametrize("name,shape", [("cs_prev", (B0 + 1, C0)), ("h_prev", (B0 + 1, C0)),
                                        ("h_prev", (B0, C0 + 1)), ("w", (I0 + C0 - 1, 4 * C0)),
                                        ("b", (4 * C0 - 4,)), ("wci", (4 * C0,))])
def test_mismatch_with_x_or_cs_prev_names_the_argument(name, shape):
    args = good_forward_args()
    args[name] = np.zeros(shape)
    expect_error(validate_block_lstm, args, ValueError, name)


def test_every_input_given_as_111():
    args = good_forward_args()
    for name in FORWARD_ARGS:
        args[name] = np.zeros((1, 1, 1))
    with pytest.raises(ValueError, match="rank"):
        validate_block_lstm(**args)
    gargs = good_grad_args()
    for name in FORWARD_ARGS + SAVED + ("cs_grad", "h_grad"):
        gargs[name] = np.zeros((1, 1, 1))
    with pytest.raises(ValueError, match="rank"):
        validate_block_lstm_grad(**gargs)


@pytest.mark.parametrize("name", SAVED + ("cs_grad", "h_grad"))
@pytest.mark.parametrize("shape", [(T0 + 1, B0, C0), (T0, B0 - 1, C0), (T0, B0, C0 + 1), (T0, B0),
                                   (T0, B0, C0, 1), (B0, C0)])
def test_bad_grad_tensor_shape(name, shape):
    gargs = good_grad_args()
    gargs[name] = np.zeros(shape)
    expect_error(validate_block_lstm_grad, gargs, ValueError, name)


@pytest.mark.parametrize("name", FORWARD_ARGS + SAVED + ("cs_grad", "h_grad"))
def test_bad_dtypes(name):
    gargs = good_grad_args()
    args = good_forward_args()
    for bad in (np.int32, np.complex128, np.bool_):
        gargs[name] = gargs[name].astype(bad)
        expect_error(validate_block_lstm_grad, gargs, TypeError, name)
        if name in args:
            args[name] = args[name].astype(bad)
            expect_error(validate_block_lstm, args, TypeError, name)
    if name != "x":   # mixed float dtypes: the one that differs from x is named
        gargs = good_grad_args()
        gargs[name] = gargs[name].astype(np.float32)
        expect_error(validate_block_lstm_grad, gargs, TypeError, name)
        if name in args:
            args = good_forward_args()
            args[name] = args[name].astype(np.float16)
            expect_error(validate_block_lstm, args, TypeError, name)


@pytest.mark.parametrize("name", FORWARD_ARGS + SAVED + ("cs_grad", "h_grad"))
def test_none_tensor(name):
    gargs = good_grad_args()
    gargs[name] = None
    expect_error(validate_block_lstm_grad, gargs, ValueError, name)


@pytest.mark.parametrize("value,exc", [
    (-1, ValueError), (T0 + 1, ValueError), (np.int64(-2), ValueError), (np.array(T0 + 5), ValueError),
    (np.array([1]), ValueError), ([1], ValueError), (np.array([[1]]), ValueError),
    (1.0, TypeError), (np.float64(1.0), TypeError), (np.array(1.0), TypeError), (True, TypeError),
    ("1", TypeError), (None, TypeError)])
def test_bad_seq_len_max(value, exc):
    args = good_forward_args()
    args["seq_len_max"] = value
    expect_error(validate_block_lstm, args, exc, "seq_len_max")
    gargs = good_grad_args()
    gargs["seq_len_max"] = value
    expect_error(validate_block_lstm_grad, gargs, exc, "seq_len_max")


@pytest.mark.parametrize("value", [0, T0, np.int64(2), np.int32(1), np.uint8(3), np.array(2),
                                   np.array(1, dtype=np.int32)])
def test_good_seq_len_max(value):
    call = validate_block_lstm(**dict(good_forward_args(), seq_len_max=value))
    assert call.seq_len_max == int(value) and type(call.seq_len_max) is int


@pytest.mark.parametrize("name,value,exc", [
    ("layout", "iofc", ValueError), ("layout", "ICFO", ValueError), ("layout", None, ValueError),
    ("forget_bias", float("nan"), ValueError), ("forget_bias", "1", TypeError),
    ("forget_bias", None, TypeError), ("cell_clip", float("nan"), ValueError),
    ("cell_clip", [3.0], TypeError), ("use_peephole", 1, TypeError), ("use_peephole", "yes", TypeError),
    ("use_peephole", None, TypeError)])
def test_bad_attributes(name, value, exc):
    args = good_forward_args()
    args[name] = value
    expect_error(validate_block_lstm, args, exc, name)
    if name in ("layout", "use_peephole"):
        gargs = good_grad_args()
        gargs[name] = value
        expect_error(validate_block_lstm_grad, gargs, exc, name)


class FakeDeviceArray:
    """Has only what a device array shows the validator: a shape, a dtype, the CUDA interface."""

    def __init__(self, shape, dtype, value=None):
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self._value = value

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False), "version": 3}

    def copy_to_host(self):
        return np.array(self._value, dtype=self.dtype)

    def __array__(self, *args, **kwargs):
        raise AssertionError("the validator must not copy a device tensor to the host")


def test_device_arrays_are_only_asked_for_shape_and_dtype():
    args = good_forward_args()
    for name in FORWARD_ARGS:
        args[name] = FakeDeviceArray(args[name].shape, np.float32)
    args["seq_len_max"] = FakeDeviceArray((), np.int64, 2)   # a 0-d device scalar is read
    call = validate_block_lstm(**args)
    assert (call.T, call.B, call.I, call.C, call.seq_len_max, call.dtype) == (T0, B0, I0, C0, 2,
                                                                               np.float32)
    gargs = good_grad_args()
    for name in FORWARD_ARGS + SAVED + ("cs_grad", "h_grad"):
        gargs[name] = FakeDeviceArray(gargs[name].shape, np.float16)
    assert validate_block_lstm_grad(**gargs).dtype == np.float16
    gargs["h_grad"] = FakeDeviceArray((T0, B0, C0 + 1), np.float16)
    expect_error(validate_block_lstm_grad, gargs, ValueError, "h_grad")
    args["seq_len_max"] = FakeDeviceArray((1,), np.int64, [2])
    expect_error(validate_block_lstm, args, ValueError, "seq_len_max")


@pytest.mark.parametrize("layout", ["icfo", "ifco"])
def test_inputs_are_not_mutated(layout):
    rng = np.random.default_rng(5)
    T, B, I, C = 3, 2, 2, 3
    inp = make_inputs(rng, T, B, I, C)
    cs_grad, h_grad = rng.standard_normal((T, B, C)), rng.standard_normal((T, B, C))
    originals = {k: v.copy() for k, v in inp.items()}
    for a in list(inp.values()) + [cs_grad, h_grad]:
        a.flags.writeable = False       # any in-place write would raise
    _, out = forward(layout, 2, inp, 1.0, 0.5, True)
    saved_copy = {k: v.copy() for k, v in out.items()}
    for a in out.values():
        a.flags.writeable = False
    g = backward(layout, 2, inp, out, cs_grad, h_grad, True)
    for k, v in originals.items():
        np.testing.assert_array_equal(inp[k], v, err_msg=k)
    for k, v in saved_copy.items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)
    # results are fresh arrays, never views of the inputs
    for k, v in g.items():
        assert not np.shares_memory(v, inp[k]), k

"""numbarnn.models: the config-only TF-style models (seed 004, tf.contrib.cudnn_rnn.CudnnGRU of the ops module).

Properties, params_size and the canonical conversions against the ops; __call__ exactly equal to
ops.cudnn_rnn_v3 (same backend and attributes, dropout seeds (seed, 0)); a model and a fresh layer with the
same seed agree; bad arguments.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbarnn import layers, ops
from numbarnn.models import CudnnGRU, CudnnLSTM, CudnnRNNRelu, CudnnRNNTanh
from numbarnn.testing import make_rnn_case, rnn_configs

BACKEND = "reference"
CLASSES = {"lstm": CudnnLSTM, "gru": CudnnGRU, "rnn_tanh": CudnnRNNTanh, "rnn_relu": CudnnRNNRelu}
MODES = list(CLASSES)
LAYERS = {"lstm": layers.CudnnLSTM, "gru": layers.CudnnGRU, "rnn_tanh": layers.CudnnRNNTanh,
          "rnn_relu": layers.CudnnRNNRelu}


def make(mode, num_layers=2, num_units=3, input_size=4, **kw):
    kw.setdefault("backend", BACKEND)
    return CLASSES[mode](num_layers, num_units, input_size, **kw)


def call(model, x, h0, c0, params, **kw):
    if model.rnn_mode == "lstm":
        return model(x, h0, c0, params, **kw)
    return model(x, h0, params, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_properties(mode):
    kw = {"num_proj": 2} if mode == "lstm" else {}
    model = make(mode, 2, 3, 4, input_mode="auto_select", direction="bidirectional", dtype="float64", dropout=0.5,
                 seed=9, **kw)
    assert (model.num_layers, model.num_units, model.input_size) == (2, 3, 4)
    assert model.input_mode == "auto_select" and model.config.input_mode == "linear_input"
    assert model.direction == "bidirectional" and model.num_dirs == 2 and model.rnn_mode == mode
    assert model.dtype == np.float64 and model.dropout == 0.5 and model.seed == 9 and model.backend == BACKEND
    if mode == "lstm":
        assert model.num_proj == 2 and make(mode).num_proj is None
    attrs = dict(rnn_mode=mode, direction="bidirectional", **kw)
    assert model.params_size() == ops.cudnn_rnn_params_size(2, 3, 4, **attrs)
    assert model.canonical_weight_shapes == ops.cudnn_rnn_canonical_weight_shapes(2, 3, 4, **attrs)
    assert model.canonical_bias_shapes == ops.cudnn_rnn_canonical_bias_shapes(2, 3, 4, **attrs)
    assert repr(model).startswith(type(model).__name__ + "(")
    default = CLASSES[mode](2, 3, 4)
    assert default.dtype == np.float32 and default.seed == 0 and default.direction == "unidirectional"
    assert default.input_mode == "linear_input" and default.dropout == 0.0 and default.backend is None


@pytest.mark.parametrize("mode", MODES)
def test_skip_input_params_size(mode):
    model = make(mode, 1, 3, 3, input_mode="skip_input")
    assert model.params_size() == ops.cudnn_rnn_params_size(1, 3, 3, mode, input_mode="skip_input")
    assert len(model.canonical_weight_shapes) == (4 if mode == "lstm" else 3 if mode == "gru" else 1)


@pytest.mark.parametrize("mode", MODES)
def test_canonical_conversions_match_ops_and_round_trip(mode):
    rng = np.random.default_rng(0)
    model = make(mode, 2, 3, 4, direction="bidirectional")
    weights = [rng.standard_normal(s).astype(np.float32) for s in model.canonical_weight_shapes]
    biases = [rng.standard_normal(s).astype(np.float32) for s in model.canonical_bias_shapes]
    params = model.canonical_to_params(weights, biases)
    assert params.shape == (model.params_size(),) and params.dtype == np.float32
    np.testing.assert_array_equal(params, ops.cudnn_rnn_canonical_to_params(2, 3, 4, weights, biases, rnn_mode=mode,
                                                                            direction="bidirectional"))
    w2, b2 = model.params_to_canonical(params)
    for a, b in zip(w2 + b2, weights + biases):
        np.testing.assert_array_equal(a, b)
    as64 = model.canonical_to_params([w.astype(np.float64) for w in weights], biases)   # cast to the model dtype
    assert as64.dtype == np.float32
    np.testing.assert_array_equal(as64, params)


@settings(max_examples=20)
@given(cfg=rnn_configs(max_layers=2, max_units=3, max_input=3), T=st.integers(0, 3), B=st.integers(1, 3),
       time_major=st.booleans(), training=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_call_matches_op_exactly(cfg, T, B, time_major, training, seed, data):
    lengths = data.draw(st.none() | st.lists(st.integers(0, T), min_size=B, max_size=B))
    lengths = None if lengths is None else np.asarray(lengths, np.int32)
    case = make_rnn_case(cfg, T, B, lengths, seed=seed, dtype=np.float32, time_major=time_major)
    kw = {"num_proj": cfg.num_proj} if cfg.has_cell_state else {}
    model = make(cfg.rnn_mode, cfg.L, cfg.H, cfg.I, input_mode=cfg.input_mode, direction=cfg.direction,
                 dropout=cfg.dropout, seed=seed, **kw)
    out = call(model, case.x, case.h0, case.c0, case.params, is_training=training, sequence_lengths=lengths,
               time_major=time_major)
    expected = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, lengths, rnn_mode=cfg.rnn_mode,
                                input_mode=cfg.input_mode, direction=cfg.direction, dropout=cfg.dropout, seed=seed,
                                seed2=0, num_proj=cfg.num_proj, is_training=training, time_major=time_major,
                                backend=BACKEND)
    assert len(out) == (3 if cfg.has_cell_state else 2)
    for a, b in zip(out, expected):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_model_agrees_with_a_fresh_layer_of_the_same_seed(mode):
    rng = np.random.default_rng(1)
    layer = LAYERS[mode](3, 3, dropout=0.5, seed=21, backend=BACKEND)
    model = make(mode, 3, 3, 2, dropout=0.5, seed=21)
    x = rng.standard_normal((3, 2, 2)).astype(np.float32)
    y, states = layer(x)                               # first training call: seeds (21, 0)
    zeros = [np.zeros(s, np.float32) for s in layer.state_shape(2)]
    out = call(model, x, zeros[0], zeros[-1], layer.weights[0])
    np.testing.assert_array_equal(out[0], y)
    np.testing.assert_array_equal(out[1], states[0])
    out_inference = call(model, x, zeros[0], zeros[-1], layer.weights[0], is_training=False)
    assert not np.array_equal(out_inference[0], y)     # dropout was active in training


def test_model_is_stateless():
    rng = np.random.default_rng(2)
    model = make("gru", 2, 3, 4, dropout=0.5, seed=3)
    params = rng.standard_normal(model.params_size()).astype(np.float32)
    x = rng.standard_normal((2, 2, 4)).astype(np.float32)
    h0 = np.zeros((2, 2, 3), np.float32)
    first = model(x, h0, params)
    second = model(x, h0, params)                       # same seeds every call: same outputs
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert not hasattr(model, "last_reserve") and not hasattr(model, "backward")


def test_seed_none_draws_a_seed():
    a, b = make("gru", seed=None), make("gru", seed=None)
    assert isinstance(a.seed, int) and a.seed != b.seed


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_units=0), ValueError, "num_units"),
    (dict(input_size=0), ValueError, "input_size"),
    (dict(input_mode="skip"), ValueError, "input_mode"),
    (dict(input_mode="skip_input"), ValueError, "skip_input"),
    (dict(direction="forward"), ValueError, "direction"),
    (dict(dtype="int8"), TypeError, "dtype"),
    (dict(dropout=2.0), ValueError, "dropout"),
    (dict(seed="x"), TypeError, "seed"),
    (dict(backend="tpu"), ValueError, "backend"),
    (dict(num_proj=4), ValueError, "num_proj"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    args = dict(num_layers=1, num_units=3, input_size=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        CudnnLSTM(**args)


@pytest.mark.parametrize("cls", [CudnnGRU, CudnnRNNTanh, CudnnRNNRelu])
def test_num_proj_is_lstm_only(cls):
    with pytest.raises(ValueError, match=r"num_proj: projection is only defined for rnn_mode in \["):
        cls(1, 3, 2, num_proj=2)


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_bad_call_arguments(mode):
    model = make(mode, 2, 3, 4)
    n = model.params_size()
    x = np.zeros((2, 1, 4), np.float32)
    h = np.zeros((2, 1, 3), np.float32)
    c = np.zeros((2, 1, 3), np.float32)
    p = np.zeros(n, np.float32)
    call(model, x, h, c, p)                             # fine
    with pytest.raises(ValueError, match="input_data: expected last dimension input_size=4"):
        call(model, np.zeros((2, 1, 5), np.float32), h, c, p)
    with pytest.raises(ValueError, match="input_data: expected rank 3"):
        call(model, np.zeros((2, 4), np.float32), h, c, p)
    with pytest.raises(ValueError, match="input_h"):
        call(model, x, np.zeros((1, 1, 3), np.float32), c, p)
    with pytest.raises(ValueError, match="input_h"):
        call(model, x, np.zeros((2, 1, 3, 1), np.float32), c, p)
    if mode == "lstm":
        with pytest.raises(ValueError, match="input_c"):
            call(model, x, h, np.zeros((2, 1, 2), np.float32), p)
    with pytest.raises(ValueError, match=f"params: expected length params_size\\(\\) = {n}"):
        call(model, x, h, c, np.zeros(n + 1, np.float32))
    with pytest.raises(TypeError, match="params: expected dtype float32"):
        call(model, x, h, c, np.zeros(n, np.float64))
    with pytest.raises(TypeError, match="is_training"):
        call(model, x, h, c, p, is_training=None)
    with pytest.raises(TypeError, match="time_major"):
        call(model, x, h, c, p, time_major="no")
    with pytest.raises(ValueError, match="sequence_lengths"):
        call(model, x, h, c, p, sequence_lengths=np.array([5], np.int32))
    with pytest.raises(ValueError, match="params"):
        model.params_to_canonical(np.zeros(n - 1, np.float32))
    with pytest.raises(ValueError, match="weights"):
        model.canonical_to_params([], [])


def test_generic_model_of_a_registered_cell():
    """models.CudnnRNN(cell): the states follow the cell (cifg_lstm has c; a CellSpec registers itself), the
    outputs are the op's, and a call with the wrong arguments says which it expected."""
    import numbarnn.contrib.cifg_lstm as cifg
    from numbarnn import ops
    from numbarnn.models import CudnnRNN

    rng = np.random.default_rng(3)
    model = CudnnRNN(cifg.SPEC, num_layers=2, num_units=3, input_size=4, direction="bidirectional",
                     dtype="float64", num_proj=2)
    assert model.rnn_mode == "cifg_lstm" and model.params_size() == ops.cudnn_rnn_params_size(
        2, 3, 4, rnn_mode="cifg_lstm", direction="bidirectional", num_proj=2)
    x, h0, c0 = rng.standard_normal((5, 2, 4)), rng.standard_normal((4, 2, 2)), rng.standard_normal((4, 2, 3))
    params = rng.standard_normal(model.params_size()) * 0.3
    y, hT, cT = model(x, h0, c0, params, is_training=False, sequence_lengths=np.array([5, 2], np.int32))
    want = ops.cudnn_rnn_v3(x, h0, c0, params, np.array([5, 2], np.int32), rnn_mode="cifg_lstm",
                            direction="bidirectional", num_proj=2, is_training=False)
    for got, ref in zip((y, hT, cT), want[:3]):
        np.testing.assert_array_equal(got, ref)
    with pytest.raises(TypeError, match="input_c, params"):
        model(x, h0, params)
    gru = CudnnRNN("gru", 1, 3, 4, dtype="float64")
    y, hT = gru(x, c0[:1], rng.standard_normal(gru.params_size()), is_training=False)     # h0 [1, B, H]
    assert y.shape == (5, 2, 3) and hT.shape == (1, 2, 3)
    with pytest.raises(TypeError, match=r"\(input_data, input_h, params\)"):
        gru(x, c0[:1], c0[:1], rng.standard_normal(gru.params_size()))

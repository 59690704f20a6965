"""numbarnn.layers: the TF-style layers that own their params (seed 003, tf.contrib.cudnn_rnn.CudnnLSTM).

Every property and method; outputs and gradients against the ops they wrap (exact: same backend, same
arguments); a float64 finite-difference check; the documented dropout seeds; save/load in the canonical
format, PyTorch state_dict and TF cells round trips; get_config/from_config; bad arguments.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbarnn import ops
from numbarnn.layers import CudnnGRU, CudnnLSTM, CudnnRNNRelu, CudnnRNNTanh, canonical_names
from numbarnn.testing import directional_check, rnn_configs

BACKEND = "reference"
CLASSES = {"lstm": CudnnLSTM, "gru": CudnnGRU, "rnn_tanh": CudnnRNNTanh, "rnn_relu": CudnnRNNRelu}
MODES = list(CLASSES)
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def make(mode, num_layers=2, num_units=3, **kw):
    kw.setdefault("backend", BACKEND)
    return CLASSES[mode](num_layers, num_units, **kw)


def rand(rng, shape, dtype=np.float32, scale=0.5):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def op_forward(layer, x, state, training, seed2=0, lengths=None, time_major=True, params=None):
    """The op call the layer documents: ops.cudnn_rnn_v3 with seed = layer.seed and seed2 = k."""
    params = layer.weights[0] if params is None else params
    return ops.cudnn_rnn_v3(x, state[0], state[1] if layer.rnn_mode == "lstm" else None, params, lengths,
                            rnn_mode=layer.rnn_mode, input_mode=layer.config.input_mode, direction=layer.direction,
                            dropout=layer.dropout, seed=layer.seed, seed2=seed2,
                            num_proj=layer.config.num_proj, is_training=training, time_major=time_major,
                            backend=BACKEND)


def random_state(layer, rng, B, dtype=np.float32):
    return tuple(rand(rng, s, dtype) for s in layer.state_shape(B))


# ---------------------------------------------------------------------------------------------------
# construction, properties, build
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_properties_before_and_after_build(mode):
    layer = make(mode, 2, 3, direction="bidirectional", dropout=0.25, seed=7, dtype="float64", name="enc")
    assert (layer.num_layers, layer.num_units, layer.input_mode, layer.direction) == \
           (2, 3, "linear_input", "bidirectional")
    assert layer.rnn_mode == mode and layer.num_dirs == 2 and layer.dropout == 0.25 and layer.seed == 7
    assert layer.dtype == np.float64 and layer.name == "enc" and layer.backend == BACKEND
    assert not layer.built and layer.input_size is None and layer.config is None
    assert layer.weights == [] and layer.trainable_weights == [] and layer.get_weights() == []
    assert layer.non_trainable_weights == [] and layer.variables == []
    with pytest.raises(RuntimeError, match="not built"):
        layer.canonical_weight_shapes
    with pytest.raises(RuntimeError, match="not built"):
        layer.canonical_bias_shapes
    with pytest.raises(ValueError, match="not built"):
        layer.count_params()
    for method in ("canonical_weights", "save_canonical", "to_torch_state_dict", "to_tf_cells"):
        with pytest.raises(RuntimeError, match="not built"):
            getattr(layer, method)(*(["/nonexistent.npz"] if method == "save_canonical" else []))

    layer.build([4, 2, 5])
    assert layer.built and layer.input_size == 5 and layer.config.input_size == 5
    (params,) = layer.weights
    assert layer.trainable_weights[0] is params and layer.trainable_variables[0] is params
    n = ops.cudnn_rnn_params_size(2, 3, 5, mode, direction="bidirectional")
    assert params.shape == (n,) and params.dtype == np.float64 and layer.count_params() == n
    assert layer.canonical_weight_shapes == ops.cudnn_rnn_canonical_weight_shapes(2, 3, 5, mode,
                                                                                  direction="bidirectional")
    assert layer.canonical_bias_shapes == ops.cudnn_rnn_canonical_bias_shapes(2, 3, 5, mode,
                                                                              direction="bidirectional")
    assert repr(layer).startswith(type(layer).__name__ + "(")


def test_default_names_and_unidirectional():
    names = [make(m).name for m in MODES]
    assert names == ["cudnn_lstm", "cudnn_gru", "cudnn_rnn_tanh", "cudnn_rnn_relu"]
    layer = make("gru", 1, 2)
    assert layer.num_dirs == 1 and layer.direction == "unidirectional" and layer.dtype == np.float32


def test_lstm_projection_properties_and_shapes():
    layer = make("lstm", 2, 4, num_proj=3, direction="bidirectional")
    assert layer.num_proj == 3
    assert layer.state_shape(5) == ([4, 5, 3], [4, 5, 4])
    layer.build((None, None, 6))
    shapes = layer.canonical_weight_shapes
    assert shapes[:9] == [(4, 6)] * 4 + [(4, 3)] * 4 + [(3, 4)]       # layer 0 fwd: W, R, W_proj
    assert shapes[18:22] == [(4, 6)] * 4                                # layer 1 fwd W: input D*P = 6
    assert make("lstm", 1, 4).num_proj is None and make("lstm", 1, 4, num_proj=0).num_proj is None


@pytest.mark.parametrize("mode", MODES)
def test_state_shape_and_compute_output_shape(mode):
    layer = make(mode, 3, 4, direction="bidirectional")
    expected = ([6, 2, 4], [6, 2, 4]) if mode == "lstm" else ([6, 2, 4],)
    assert layer.state_shape(2) == expected
    assert layer.compute_output_shape([7, 2, 5]) == [7, 2, 8]


def test_skip_and_auto_select_build():
    layer = make("gru", 1, 3, input_mode="auto_select")
    layer.build([2, 2, 3])
    assert layer.input_mode == "auto_select" and layer.config.input_mode == "skip_input"
    assert layer.canonical_weight_shapes == [(3, 3)] * 3                # R only: skip_input has no layer-0 W
    other = make("gru", 1, 3, input_mode="auto_select")
    other.build([2, 2, 4])
    assert other.config.input_mode == "linear_input"
    with pytest.raises(ValueError, match="skip_input"):
        make("gru", 1, 3, input_mode="skip_input").build([2, 2, 4])


def test_build_arguments_and_rebuild():
    layer = make("rnn_tanh", 1, 2)
    for bad in ([2, 2, None], [], None, 5):
        with pytest.raises(ValueError, match="input_shape"):
            layer.build(bad)
    with pytest.raises(ValueError, match="input_shape"):
        layer.build([2, 2, 0])
    layer.build([3])                       # any shape whose last dim is I
    before = layer.get_weights()[0]
    layer.build([9, 9, 3])                 # same I: keeps the weights
    np.testing.assert_array_equal(layer.weights[0], before)
    with pytest.raises(ValueError, match="built for input size I=3"):
        layer.build([2, 2, 4])


# ---------------------------------------------------------------------------------------------------
# initialisation
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_default_initialisation_is_seeded_glorot_with_zero_biases(mode):
    a, b, c = make(mode, seed=3), make(mode, seed=3), make(mode, seed=4)
    for layer in (a, b, c):
        layer.build([1, 1, 5])
    np.testing.assert_array_equal(a.weights[0], b.weights[0])
    assert not np.array_equal(a.weights[0], c.weights[0])
    weights, biases = a.canonical_weights()
    assert all(np.all(bias == 0) for bias in biases)
    for w in weights:
        limit = np.sqrt(6.0 / (w.shape[0] + w.shape[1]))
        assert np.all(np.abs(w) <= limit) and np.std(w) > 0.1 * limit
    d, e = make(mode, seed=None), make(mode, seed=None)          # nondeterministic
    d.build([1, 1, 5])
    e.build([1, 1, 5])
    assert d.seed != e.seed and not np.array_equal(d.weights[0], e.weights[0])


def test_custom_initializers_called_per_canonical_tensor():
    calls = []

    def kernel(shape, dtype):
        calls.append(("k", shape, np.dtype(dtype)))
        return np.full(shape, 0.5)

    def bias(shape, dtype):
        calls.append(("b", shape, np.dtype(dtype)))
        return np.arange(shape[0], dtype=dtype)

    layer = make("gru", 1, 2, kernel_initializer=kernel, bias_initializer=bias, dtype=np.float64)
    layer.build([1, 1, 3])
    assert [c[1] for c in calls if c[0] == "k"] == layer.canonical_weight_shapes
    assert [c[1] for c in calls if c[0] == "b"] == layer.canonical_bias_shapes
    assert all(c[2] == np.float64 for c in calls)
    weights, biases = layer.canonical_weights()
    assert all(np.all(w == 0.5) for w in weights)
    assert all(np.array_equal(b, [0.0, 1.0]) for b in biases)

    bad = make("gru", 1, 2, kernel_initializer=lambda shape, dtype: np.zeros((1, 1)))
    with pytest.raises(ValueError, match="kernel_initializer"):
        bad.build([1, 1, 3])


# ---------------------------------------------------------------------------------------------------
# forward against the op
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("time_major", [True, False])
def test_call_matches_op(mode, time_major):
    rng = np.random.default_rng(0)
    kw = {"num_proj": 2} if mode == "lstm" else {}
    layer = make(mode, 2, 3, direction="bidirectional", **kw)
    T, B = 3, 2
    x = rand(rng, (T, B, 4) if time_major else (B, T, 4))
    y, states = layer(x, time_major=time_major, training=False)     # builds, zero state
    assert layer.built and layer.input_size == 4
    assert isinstance(states, tuple) and len(states) == (2 if mode == "lstm" else 1)
    zero = tuple(np.zeros(s if time_major else [s[1], s[0], s[2]], np.float32) for s in layer.state_shape(B))
    ey, eh, ec, _, _ = op_forward(layer, x, zero + (None,), False, time_major=time_major)
    np.testing.assert_array_equal(y, ey)
    np.testing.assert_array_equal(states[0], eh)
    if mode == "lstm":
        np.testing.assert_array_equal(states[1], ec)

    state = random_state(layer, rng, B)
    if not time_major:
        state = tuple(np.ascontiguousarray(s.swapaxes(0, 1)) for s in state)
    lengths = np.array([3, 1], np.int32)
    y, states = layer(x, initial_state=state, sequence_lengths=lengths, time_major=time_major, training=False)
    ey, eh, ec, _, _ = op_forward(layer, x, state + (None,), False, lengths=lengths, time_major=time_major)
    np.testing.assert_array_equal(y, ey)
    np.testing.assert_array_equal(states[0], eh)
    assert y.shape == ((T, B, 2 * layer.config.P) if time_major else (B, T, 2 * layer.config.P))


def test_float16_negative_seed_and_empty_batch():
    layer = make("lstm", 1, 2, seed=-5, dtype="float16")
    y, (h, c) = layer(np.ones((2, 0, 3), np.float16))
    assert y.shape == (2, 0, 2) and h.shape == c.shape == (1, 0, 2) and y.dtype == np.float16
    x = np.ones((2, 1, 3), np.float16)
    y, _ = layer(x)
    dx, (dh0, dc0) = layer.backward(np.ones_like(y))
    assert dx.dtype == dh0.dtype == layer.params_grad.dtype == layer.weights[0].dtype == np.float16
    twin = make("lstm", 1, 2, seed=-5, dtype="float16")
    twin.build(x.shape)
    np.testing.assert_array_equal(twin.weights[0], layer.weights[0])


def test_initial_state_may_be_a_list_and_weights_are_live():
    rng = np.random.default_rng(1)
    layer = make("lstm", 1, 2)
    x = rand(rng, (2, 1, 3))
    state = list(random_state(layer, rng, 1))
    y1, _ = layer(x, state, training=False)
    layer.weights[0][...] *= 2                  # the live buffer, as a TF variable
    y2, _ = layer(x, state, training=False)
    assert not np.allclose(y1, y2)


# ---------------------------------------------------------------------------------------------------
# dropout seeds and backward
# ---------------------------------------------------------------------------------------------------

def test_dropout_seeds_follow_the_documented_rule():
    rng = np.random.default_rng(2)
    layer, twin = make("gru", 3, 3, dropout=0.5, seed=11), make("gru", 3, 3, dropout=0.5, seed=11)
    x = rand(rng, (3, 2, 3))
    assert layer.next_dropout_seeds == (11, 0)
    outs = []
    for k in range(3):
        assert layer.next_dropout_seeds == (11, k)
        y, (h,) = layer(x)
        ey, eh, _, _, _ = op_forward(layer, x, (np.zeros((3, 2, 3), np.float32), None), True, seed2=k)
        np.testing.assert_array_equal(y, ey)
        np.testing.assert_array_equal(h, eh)
        np.testing.assert_array_equal(twin(x)[0], y)     # same seed, same calls -> same outputs
        outs.append(y)
    assert not np.array_equal(outs[0], outs[1])        # masks change from one training call to the next
    layer(x, training=False)
    assert layer.next_dropout_seeds == (11, 3)         # inference does not advance k


@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_op(mode):
    rng = np.random.default_rng(3)
    kw = {"num_proj": 2} if mode == "lstm" else {}
    layer = make(mode, 2, 3, direction="bidirectional", dropout=0.3, seed=5, **kw)
    x = rand(rng, (3, 2, 4))
    layer(x)                                            # k = 0, then differentiate the k = 1 call
    state = random_state(layer, rng, 2)
    lengths = np.array([2, 3], np.int32)
    y, states = layer(x, state, sequence_lengths=lengths)
    dy = rand(rng, y.shape)
    dstates = tuple(rand(rng, s.shape) for s in states)
    params_at_call = layer.get_weights()[0]
    layer.weights[0][...] += 1.0                        # an update between forward and backward is harmless
    dx, dstate0 = layer.backward(dy, dstates)

    fwd = op_forward(layer, x, state + (None,), True, seed2=1, lengths=lengths, params=params_at_call)
    np.testing.assert_array_equal(y, fwd[0])
    lstm = mode == "lstm"
    ex, eh, ec, ep = ops.cudnn_rnn_backprop_v3(
        x, state[0], state[1] if lstm else None, params_at_call, lengths, fwd[0], fwd[1], fwd[2] if lstm else None,
        dy, dstates[0], dstates[1] if lstm else None, fwd[3], fwd[4], rnn_mode=mode, direction="bidirectional",
        dropout=0.3, seed=5, seed2=1, num_proj=layer.config.num_proj, backend=BACKEND)
    np.testing.assert_array_equal(dx, ex)
    np.testing.assert_array_equal(dstate0[0], eh)
    assert len(dstate0) == (2 if lstm else 1)
    if lstm:
        np.testing.assert_array_equal(dstate0[1], ec)
    np.testing.assert_array_equal(layer.params_grad, ep)
    assert layer.params_grad.shape == layer.weights[0].shape

    dx0, _ = layer.backward(dy)                         # state_grads=None: zeros
    _, _, _, ep0 = ops.cudnn_rnn_backprop_v3(
        x, state[0], state[1] if lstm else None, params_at_call, lengths, fwd[0], fwd[1], fwd[2] if lstm else None,
        dy, np.zeros_like(dstates[0]), np.zeros_like(dstates[1]) if lstm else None, fwd[3], fwd[4], rnn_mode=mode,
        direction="bidirectional", dropout=0.3, seed=5, seed2=1, num_proj=layer.config.num_proj, backend=BACKEND)
    np.testing.assert_array_equal(layer.params_grad, ep0)


@pytest.mark.parametrize("mode", MODES)
def test_backward_finite_differences_float64(mode):
    rng = np.random.default_rng(4)
    layer = make(mode, 2, 2, direction="bidirectional", dtype="float64", seed=1)
    x = rand(rng, (3, 2, 3), np.float64)
    state = random_state(layer, rng, 2, np.float64)
    y, states = layer(x, state)
    dy = rand(rng, y.shape, np.float64)
    dstates = tuple(rand(rng, s.shape, np.float64) for s in states)
    dx, dstate0 = layer.backward(dy, dstates)
    dparams = layer.params_grad.copy()
    params = layer.get_weights()[0]

    def loss(x=x, state=state, params=params):
        layer.set_weights([params])
        out, outs = layer(x, state, training=False)
        return float(np.vdot(out, dy) + sum(np.vdot(a, b) for a, b in zip(outs, dstates)))

    errs = [directional_check(lambda v: loss(x=v), x, dx, rng),
            directional_check(lambda v: loss(params=v), params, dparams, rng)]
    for k in range(len(state)):
        errs.append(directional_check(lambda v: loss(state=state[:k] + (v,) + state[k + 1:]), state[k],
                                      dstate0[k], rng))
    assert max(errs) < 1e-6, errs


def test_backward_needs_a_training_call():
    rng = np.random.default_rng(5)
    layer = make("lstm", 1, 2)
    with pytest.raises(RuntimeError, match="training=True"):
        layer.backward(np.zeros((1, 1, 2), np.float32))
    x = rand(rng, (2, 1, 3))
    y, _ = layer(x)
    layer.backward(np.ones_like(y))                     # fine
    layer(x, training=False)                            # the most recent call is inference now
    with pytest.raises(RuntimeError, match="training=True"):
        layer.backward(np.ones_like(y))
    y, _ = layer(x)
    with pytest.raises(ValueError, match="state_grads"):
        layer.backward(np.ones_like(y), (np.zeros((1, 1, 2), np.float32),))      # LSTM needs (dh, dc)
    with pytest.raises(ValueError, match="state_grads"):
        layer.backward(np.ones_like(y), np.zeros((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="output_backprop"):
        layer.backward(np.ones((5, 1, 2), np.float32))


# ---------------------------------------------------------------------------------------------------
# weights: get/set, canonical, save/load, PyTorch, TF
# ---------------------------------------------------------------------------------------------------

def test_get_and_set_weights():
    layer = make("rnn_relu", 1, 2, seed=0)
    with pytest.raises(ValueError, match="expected a list of 0 array"):
        layer.set_weights([np.zeros(3)])
    layer.build([1, 1, 3])
    (w,) = layer.get_weights()
    w[...] = 0                                          # a copy
    assert np.any(layer.weights[0] != 0)
    live = layer.weights[0]
    new = np.arange(layer.count_params(), dtype=np.float64)
    layer.set_weights([new])
    assert layer.weights[0] is live and live.dtype == np.float32
    np.testing.assert_array_equal(live, new.astype(np.float32))
    with pytest.raises(ValueError, match="expected a list of 1 array"):
        layer.set_weights([new, new])
    with pytest.raises(ValueError, match="expected a list of 1 array"):
        layer.set_weights([])
    with pytest.raises(ValueError, match=r"weights\[0\]"):
        layer.set_weights([new[:-1]])
    with pytest.raises(ValueError, match="expected a list"):
        layer.set_weights(new)


@pytest.mark.parametrize("mode", MODES)
def test_canonical_weights_match_ops_and_set_canonical(mode):
    layer = make(mode, 2, 3, direction="bidirectional", seed=2)
    layer.build([1, 1, 4])
    weights, biases = layer.canonical_weights()
    ew, eb = ops.cudnn_rnn_params_to_canonical(2, 3, 4, layer.weights[0], rnn_mode=mode, direction="bidirectional")
    for a, b in zip(weights + biases, ew + eb):
        np.testing.assert_array_equal(a, b)
    assert [w.shape for w in weights] == layer.canonical_weight_shapes
    other = make(mode, 2, 3, direction="bidirectional", seed=9)
    other.build([1, 1, 4])
    other.set_canonical_weights(weights, biases)
    np.testing.assert_array_equal(other.weights[0], layer.weights[0])


def test_canonical_names():
    layer = make("lstm", 2, 3, direction="bidirectional", num_proj=2)
    layer.build([1, 1, 4])
    w_names, b_names = canonical_names(layer.config)
    assert w_names[:9] == ["layer0/fwd/W_i", "layer0/fwd/W_f", "layer0/fwd/W_g", "layer0/fwd/W_o",
                           "layer0/fwd/R_i", "layer0/fwd/R_f", "layer0/fwd/R_g", "layer0/fwd/R_o", "layer0/fwd/W_proj"]
    assert "layer1/rev/W_proj" in w_names and len(w_names) == len(set(w_names)) == 36
    assert b_names[:8] == [f"layer0/fwd/{k}_{g}" for k in ("bW", "bR") for g in "ifgo"]
    assert "layer1/rev/bR_o" in b_names and len(b_names) == 32
    gru = make("gru", 1, 3, input_mode="skip_input")
    gru.build([1, 1, 3])
    w_names, b_names = canonical_names(gru.config)
    assert w_names == ["layer0/fwd/R_r", "layer0/fwd/R_z", "layer0/fwd/R_n"]
    assert b_names == [f"layer0/fwd/{k}_{g}" for k in ("bW", "bR") for g in "rzn"]
    rnn = make("rnn_tanh", 1, 2)
    rnn.build([1, 1, 2])
    assert canonical_names(rnn.config)[0] == ["layer0/fwd/W_h", "layer0/fwd/R_h"]


@pytest.mark.parametrize("mode", MODES)
def test_save_load_round_trip_identical_outputs(mode, tmp_path):
    rng = np.random.default_rng(6)
    kw = {"direction": "bidirectional", **({"num_proj": 2} if mode == "lstm" else {})}
    layer = make(mode, 2, 3, seed=1, **kw)
    x = rand(rng, (3, 2, 4))
    y, states = layer(x, training=False)
    path = tmp_path / "ckpt"                           # no .npz suffix: written to exactly this path
    assert layer.save_canonical(path) == path and path.exists()
    with np.load(path) as data:
        config = json.loads(str(data["__config__"]))
        assert config["rnn_mode"] == mode and config["input_size"] == 4 and config["num_layers"] == 2
        w_names, b_names = canonical_names(layer.config)
        assert set(data.files) == set(w_names + b_names) | {"__config__"}
        np.testing.assert_array_equal(data[w_names[0]], layer.canonical_weights()[0][0])

    fresh = make(mode, 2, 3, seed=99, **kw)            # unbuilt: load builds it
    fresh.load_canonical(path)
    assert fresh.built and fresh.input_size == 4
    np.testing.assert_array_equal(fresh.weights[0], layer.weights[0])
    y2, states2 = fresh(x, training=False)
    np.testing.assert_array_equal(y2, y)
    for a, b in zip(states2, states):
        np.testing.assert_array_equal(a, b)

    built = make(mode, 2, 3, seed=98, **kw)
    built.build([1, 1, 4])
    live = built.weights[0]
    built.load_canonical(path)
    assert built.weights[0] is live
    np.testing.assert_array_equal(live, layer.weights[0])

    wide = make(mode, 2, 3, seed=1, dtype="float64", **kw)    # cast to the loading layer's dtype
    wide.load_canonical(path)
    np.testing.assert_array_equal(wide.weights[0], layer.weights[0].astype(np.float64))


def test_load_canonical_mismatch_names_the_difference(tmp_path):
    path = tmp_path / "lstm.npz"
    layer = make("lstm", 2, 3, seed=1)
    layer.build([1, 1, 4])
    layer.save_canonical(path)
    cases = [(make("gru", 2, 3), "rnn_mode"), (make("lstm", 1, 3), "num_layers"), (make("lstm", 2, 4), "num_units"),
             (make("lstm", 2, 3, direction="bidirectional"), "direction"),
             (make("lstm", 2, 3, num_proj=2), "num_proj")]
    for other, key in cases:
        with pytest.raises(ValueError, match=f"saved {key}="):
            other.load_canonical(path)
    built = make("lstm", 2, 3)
    built.build([1, 1, 5])
    with pytest.raises(ValueError, match="saved input_size=4"):
        built.load_canonical(path)
    with pytest.raises(ValueError, match="skip_input"):
        make("lstm", 2, 3, input_mode="skip_input").load_canonical(path)
    square = make("lstm", 2, 3, seed=1)
    square.build([1, 1, 3])
    square.save_canonical(tmp_path / "square.npz")
    with pytest.raises(ValueError, match="saved input_mode='linear_input'"):
        built = make("lstm", 2, 3, input_mode="auto_select")   # resolves to skip_input for I == H
        built.load_canonical(tmp_path / "square.npz")
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    with pytest.raises(ValueError, match="not a numbarnn canonical checkpoint"):
        make("lstm", 2, 3).load_canonical(tmp_path / "plain.npz")


@pytest.mark.parametrize("mode", MODES)
def test_torch_state_dict_round_trip(mode):
    kw = {"num_proj": 2} if mode == "lstm" else {}
    layer = make(mode, 2, 3, direction="bidirectional", seed=3, **kw)
    layer.build([1, 1, 4])
    # make the biases nonzero so that they round-trip too
    weights, biases = layer.canonical_weights()
    layer.set_canonical_weights(weights, [b + k for k, b in enumerate(biases)])
    sd = layer.to_torch_state_dict()
    G, H = GATES[mode], 3
    assert sd["weight_ih_l0"].shape == (G * H, 4) and sd["bias_hh_l1_reverse"].shape == (G * H,)
    assert ("weight_hr_l0" in sd) == (mode == "lstm")
    fresh = make(mode, 2, 3, direction="bidirectional", **kw)      # unbuilt: input size from weight_ih_l0
    fresh.load_torch_state_dict(sd)
    assert fresh.input_size == 4
    np.testing.assert_array_equal(fresh.weights[0], layer.weights[0])
    again = fresh.to_torch_state_dict()
    assert again.keys() == sd.keys() and all(np.array_equal(again[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="weight_ih_l0"):
        make(mode, 2, 3).load_torch_state_dict({})


@pytest.mark.parametrize("mode", MODES)
def test_tf_cells_round_trip(mode):
    rng = np.random.default_rng(7)
    kw = {"num_proj": 2} if mode == "lstm" else {}
    layer = make(mode, 2, 3, direction="bidirectional", seed=4, dtype="float64", **kw)
    layer.build([1, 1, 4])
    weights, biases = layer.canonical_weights()
    layer.set_canonical_weights(weights, [rand(rng, b.shape, np.float64) for b in biases])
    cells = layer.to_tf_cells()
    fresh = make(mode, 2, 3, direction="bidirectional", dtype="float64", **kw)   # unbuilt: I from cell_0's kernel
    fresh.load_tf_cells(cells)
    assert fresh.input_size == 4
    again = fresh.to_tf_cells()
    assert again.keys() == cells.keys() and all(np.array_equal(again[k], cells[k]) for k in cells)
    x = rand(rng, (3, 2, 4), np.float64)
    y, states = layer(x, training=False)
    y2, states2 = fresh(x, training=False)             # only bW+bR is kept: same network up to rounding
    np.testing.assert_allclose(y2, y, rtol=1e-12, atol=1e-12)
    for a, b in zip(states2, states):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="cell_0"):
        make(mode, 2, 3, direction="bidirectional", **kw).load_tf_cells({})


# ---------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_get_config_from_config_round_trip(mode):
    init = (lambda shape, dtype: np.ones(shape, dtype))
    kw = dict(input_mode="auto_select", direction="bidirectional", dropout=0.5, seed=12, dtype=np.float64,
              kernel_initializer=init, name="mine", backend=BACKEND)
    if mode == "lstm":
        kw["num_proj"] = 2
    layer = CLASSES[mode](3, 4, **kw)
    config = layer.get_config()
    expected = dict(num_layers=3, num_units=4, input_mode="auto_select", direction="bidirectional", dropout=0.5,
                    seed=12, dtype="float64", kernel_initializer=init, bias_initializer=None, name="mine",
                    backend=BACKEND, **({"num_proj": 2} if mode == "lstm" else {}))
    assert config == expected
    clone = type(layer).from_config(config)
    assert type(clone) is type(layer) and clone.get_config() == config
    json.dumps({k: v for k, v in config.items() if "initializer" not in k})   # the rest is serialisable
    x = np.ones((2, 1, 5))
    np.testing.assert_array_equal(clone(x, training=False)[0], layer(x, training=False)[0])
    with pytest.raises(ValueError, match="config"):
        type(layer).from_config([("num_layers", 1)])


# ---------------------------------------------------------------------------------------------------
# property test: any configuration, layer == op (forward, backward) and a save/load round trip
# ---------------------------------------------------------------------------------------------------

@settings(max_examples=15)
@given(cfg=rnn_configs(max_layers=2, max_units=3, max_input=3), T=st.integers(1, 3), B=st.integers(1, 3),
       seed=st.integers(0, 2**32))
def test_any_configuration_matches_ops(cfg, T, B, seed, tmp_path_factory):
    rng = np.random.default_rng(seed)
    kw = {"num_proj": cfg.num_proj} if cfg.has_cell_state else {}
    layer = make(cfg.rnn_mode, cfg.L, cfg.H, input_mode=cfg.input_mode, direction=cfg.direction,
                 dropout=cfg.dropout, seed=seed, dtype="float64", **kw)
    x = rand(rng, (T, B, cfg.I), np.float64)
    y, states = layer(x)
    fwd = op_forward(layer, x, tuple(np.zeros(s) for s in layer.state_shape(B)) + (None,), True, seed2=0)
    np.testing.assert_array_equal(y, fwd[0])
    dy = rand(rng, y.shape, np.float64)
    dx, _ = layer.backward(dy)
    zeros = [np.zeros(s) for s in layer.state_shape(B)]
    ex, _, _, ep = ops.cudnn_rnn_backprop_v3(
        x, zeros[0], zeros[1] if cfg.has_cell_state else None, layer.weights[0], None, fwd[0], fwd[1],
        fwd[2] if cfg.has_cell_state else None, dy, zeros[0], zeros[1] if cfg.has_cell_state else None, fwd[3], fwd[4],
        rnn_mode=cfg.rnn_mode, input_mode=cfg.input_mode, direction=cfg.direction, dropout=cfg.dropout,
        seed=seed, seed2=0, num_proj=cfg.num_proj, backend=BACKEND)
    np.testing.assert_array_equal(dx, ex)
    np.testing.assert_array_equal(layer.params_grad, ep)

    path = tmp_path_factory.mktemp("ckpt") / "layer.npz"
    layer.save_canonical(path)
    restored = type(layer).from_config(layer.get_config())
    restored.load_canonical(path)
    np.testing.assert_array_equal(restored.weights[0], layer.weights[0])
    np.testing.assert_array_equal(restored(x, training=False)[0], layer(x, training=False)[0])


# ---------------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_units=-1), ValueError, "num_units"),
    (dict(num_units=2.5), TypeError, "num_units"),
    (dict(input_mode="linear"), ValueError, "input_mode"),
    (dict(direction="both"), ValueError, "direction"),
    (dict(dropout=1.5), ValueError, "dropout"),
    (dict(dropout=-0.1), ValueError, "dropout"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(dtype="int32"), TypeError, "dtype"),
    (dict(dtype="nonsense"), TypeError, "dtype"),
    (dict(kernel_initializer=3), TypeError, "kernel_initializer"),
    (dict(bias_initializer="zeros"), TypeError, "bias_initializer"),
    (dict(name=5), TypeError, "name"),
    (dict(backend="gpu"), ValueError, "backend"),
    (dict(num_proj=5), ValueError, "num_proj"),
    (dict(num_proj=-1), ValueError, "num_proj"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    args = dict(num_layers=1, num_units=3)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        CudnnLSTM(**args)


@pytest.mark.parametrize("cls", [CudnnGRU, CudnnRNNTanh, CudnnRNNRelu])
def test_num_proj_only_for_lstm(cls):
    with pytest.raises(ValueError, match=r"num_proj: projection is only defined for rnn_mode in \["):
        cls(1, 2, num_proj=1)
    assert "num_proj" not in cls(1, 2, num_proj=None).get_config()


def test_bad_call_arguments():
    rng = np.random.default_rng(8)
    layer = make("lstm", 1, 2)
    with pytest.raises(TypeError, match="inputs: expected dtype float32"):
        layer(np.zeros((2, 1, 3)))                      # float64 into a float32 layer
    assert not layer.built                              # a rejected first call does not build
    with pytest.raises(TypeError, match="training"):
        layer(np.zeros((2, 1, 3), np.float32), training=1)
    assert not layer.built
    with pytest.raises(ValueError, match="inputs: expected rank 3"):
        layer(np.zeros((2, 3), np.float32))
    x = rand(rng, (2, 1, 3))
    layer(x, training=False)
    with pytest.raises(ValueError, match="inputs: expected last dimension I=3"):
        layer(rand(rng, (2, 1, 4)))
    with pytest.raises(ValueError, match="initial_state"):
        layer(x, initial_state=np.zeros((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="initial_state"):
        layer(x, initial_state=(np.zeros((1, 1, 2), np.float32),))
    with pytest.raises(ValueError, match="input_h"):
        layer(x, initial_state=(np.zeros((2, 1, 2), np.float32), np.zeros((1, 1, 2), np.float32)))
    with pytest.raises(TypeError, match="training"):
        layer(x, training="yes")
    with pytest.raises(TypeError, match="time_major"):
        layer(x, time_major=1)
    with pytest.raises(ValueError, match="sequence_lengths"):
        layer(x, sequence_lengths=np.array([3], np.int32))
    with pytest.raises(ValueError, match="batch_size"):
        layer.state_shape(-1)

"""TF-style layers (`tf.contrib.cudnn_rnn.CudnnLSTM` & co.): thin classes over `numbarnn.ops` that own their
parameters.

A layer holds one opaque params buffer (a 1-D NumPy array in the SPEC 4.2 layout), created by `build` from
the input size, and runs `ops.cudnn_rnn_v3` on it::

    from numbarnn.layers import CudnnLSTM
    lstm = CudnnLSTM(num_layers=2, num_units=8, direction="bidirectional", dropout=0.2, seed=1)
    y, (h, c) = lstm(x)                            # x [T, B, I]; builds on the first call, zero initial state
    dx, (dh0, dc0) = lstm.backward(dy)             # gradients of the last training call; also lstm.params_grad
    lstm.save_canonical("ckpt.npz")                # canonical tensors, independent of the opaque layout

Choices (documented here, where users read them):

* Initialisation.  `kernel_initializer(shape, dtype)` / `bias_initializer(shape, dtype)` are called once per
  canonical weight / bias (SPEC 4.3 order and shapes).  Defaults: Glorot-uniform weights, U(-a, a) with
  a = sqrt(6 / (fan_in + fan_out)) for a matrix ``[fan_out, fan_in]``, drawn from
  ``numpy.random.default_rng(seed mod 2**64)`` in canonical order; zero biases.  ``seed=None`` draws a
  random seed once, at construction (so weights and dropout masks are not reproducible).  A layer-normalised
  cell's normalisation vectors (SPEC 13) start as haste's: gains 1, the state's bias 0 (unless
  kernel_initializer is given: then it draws them too).
* Dropout seeds.  The op's dropout mask is a pure function of (seed, seed2) (SPEC 6), so a layer derives
  them per call: its k-th training call (k = 0, 1, 2, ...) runs the op with ``seed = layer seed`` and
  ``seed2 = k``.  Masks therefore change from one training step to the next (as cuDNN's stateful dropout
  does), yet are reproducible: two layers with the same seed called the same way give the same outputs, and
  the k-th call can be replayed with `ops.cudnn_rnn_v3(..., seed=layer.seed, seed2=k)`.  `next_dropout_seeds`
  tells the pair the next training call will use.  Inference calls do not advance k.
  ``numbarnn.models`` passes ``(seed, 0)``: a model and a fresh layer with the same seed agree.
* Backward.  `backward` differentiates the most recent call, which must be a training call; it uses the
  params as they were at that call (a copy is kept), so weights updated in between do not corrupt it.
* Canonical save format (`save_canonical`): an ``.npz`` written to exactly the given path, one array per
  canonical tensor named ``layer{l}/{fwd|rev}/{W|R|bW|bR}_{gate}`` (gates i, f, g, o for LSTM, r, z, n for
  GRU, h for the plain RNNs) and ``layer{l}/{fwd|rev}/W_proj``, plus ``__config__`` (JSON). skip_input's
  absent layer-0 W matrices are not stored.  Loading checks the configuration and casts to the layer dtype.

Why one file: it is one class (`_CudnnRNN`, the TF layer API: build, call, backward, canonical
save/load, config) whose methods share the layer's private state, plus five one-screen subclasses; split, a
reader would chase that state across files.
"""
from __future__ import annotations

import json
import re

import numpy as np

from . import ops
from . import params as _params
from .backends import BACKENDS
from .cells import CellSpec, get_cell, register
from .config import RNNConfig, rnn_config
from .validation import (ArgumentTypeError, SUPPORTED_DTYPES, as_array, check_choice,
                         check_int, check_rank, check_shape, shape_of)

__all__ = ["CudnnLSTM", "CudnnGRU", "CudnnRNNTanh", "CudnnRNNRelu", "canonical_names"]

SAVE_FORMAT = "numbarnn-canonical-v1"
CONFIG_KEY = "__config__"
#: configuration entries a saved file must share with the layer that loads it (in the order they are checked)
_SAVED_CONFIG_KEYS = ("rnn_mode", "num_layers", "num_units", "input_size", "input_mode", "direction", "num_proj")


def canonical_names(cfg: RNNConfig) -> tuple[list[str], list[str]]:
    """Names of the canonical tensors, (weight names, bias names), in SPEC 4.3 order.

    ``layer0/fwd/W_i``, ``layer0/fwd/R_f``, ``layer0/rev/bW_g``, ``layer1/fwd/W_proj``: one per region of
    `params.param_regions`.
    """
    def name(r):
        way = "fwd" if r.direction == 0 else "rev"
        gate = "" if r.gate < 0 else "_" + cfg.gate_names[r.gate]
        return f"layer{r.layer}/{way}/{r.kind}{gate}"

    regions = _params.param_regions(cfg)
    return [name(r) for r in regions if not r.is_bias], [name(r) for r in regions if r.is_bias]


def _check_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ArgumentTypeError(f"dtype: expected float16, float32 or float64, got {dtype!r}") from exc
    if dt not in SUPPORTED_DTYPES:
        raise ArgumentTypeError(f"dtype: expected float16, float32 or float64, got {dt}")
    return dt


def _snake_case(name: str) -> str:
    """As TF names layers: CudnnLSTM -> cudnn_lstm, CudnnRNNTanh -> cudnn_rnn_tanh."""
    name = re.sub(r"(.)([A-Z][a-z0-9]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def _glorot_uniform(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """U(-a, a), a = sqrt(6 / (fan_in + fan_out)) for a matrix [fan_out, fan_in] (a cell vector [H]: fan H, H);
    float64."""
    fan_out, fan_in = shape if len(shape) == 2 else (shape[0], shape[0])
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape)


class _CudnnRNN:
    """Base of the four layers; subclasses fix `_rnn_mode`."""

    _rnn_mode: str = ""
    _num_states: int = 1       # (h,) or (h, c)

    def __init__(self, num_layers, num_units, input_mode="linear_input", direction="unidirectional", dropout=0.0,
                 seed=None, dtype="float32", kernel_initializer=None, bias_initializer=None, name=None,
                 backend=None, *, num_proj=None):
        # rnn_config validates every attribute; input_size = num_units is a stand-in until build
        num_units_ok = check_int("num_units", num_units, minimum=1)
        rnn_config(num_layers, num_units_ok, num_units_ok, self._rnn_mode, input_mode, direction,
                   0 if num_proj is None else num_proj, dropout)
        self._num_layers = int(num_layers)
        self._num_units = int(num_units)
        self._input_mode = input_mode
        self._direction = direction
        self._dropout = float(dropout)
        self._num_proj = None if num_proj is None else int(num_proj)
        self._seed = None if seed is None else check_int("seed", seed)
        # the seed in use: the given one, or one random draw (seed=None)
        self._seed_value = self._seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        self._dtype = _check_dtype(dtype)
        for arg, init in (("kernel_initializer", kernel_initializer), ("bias_initializer", bias_initializer)):
            if init is not None and not callable(init):
                raise ArgumentTypeError(f"{arg}: expected None or a callable (shape, dtype) -> array, got {init!r}")
        self._kernel_initializer = kernel_initializer
        self._bias_initializer = bias_initializer
        if name is not None and not isinstance(name, str):
            raise ArgumentTypeError(f"name: expected a string or None, got {name!r}")
        self._name = name if name is not None else _snake_case(type(self).__name__)
        self._backend = None if backend is None else check_choice("backend", backend, tuple(BACKENDS))
        self._config: RNNConfig | None = None     # set by build (needs the input size)
        self._params: np.ndarray | None = None    # [params_size] opaque buffer
        self._train_calls = 0                     # k of the next training call (dropout seed2)
        self._saved = None                        # what backward needs from the last call (training only)
        self.params_grad: np.ndarray | None = None

    # ---------------------------------------------------------------------------------------------------
    # properties (as tf.contrib.cudnn_rnn layers)
    # ---------------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_units(self) -> int:
        return self._num_units

    @property
    def input_mode(self) -> str:
        """'linear_input', 'skip_input' or 'auto_select', as given (see `config.input_mode` for the resolved one)."""
        return self._input_mode

    @property
    def direction(self) -> str:
        return self._direction

    @property
    def rnn_mode(self) -> str:
        """'lstm', 'gru', 'rnn_tanh', 'rnn_relu' or a registered cell's name."""
        return self._rnn_mode

    @property
    def num_dirs(self) -> int:
        return 2 if self._direction == "bidirectional" else 1

    @property
    def dropout(self) -> float:
        return self._dropout

    @property
    def seed(self) -> int:
        """The seed in use (a random draw when the layer was created with seed=None)."""
        return self._seed_value

    @property
    def next_dropout_seeds(self) -> tuple[int, int]:
        """(seed, seed2) the next training call passes to the op: (layer seed, number of training calls so far)."""
        return self._seed_value, self._train_calls

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def name(self) -> str:
        return self._name

    @property
    def backend(self):
        return self._backend

    @property
    def built(self) -> bool:
        return self._params is not None

    @property
    def input_size(self):
        """I, or None until built."""
        return None if self._config is None else self._config.input_size

    @property
    def config(self) -> RNNConfig | None:
        """The resolved `RNNConfig` (auto_select resolved), or None until built."""
        return self._config

    @property
    def canonical_weight_shapes(self) -> list[tuple]:
        """Shapes of the canonical weights (SPEC 4.3 order; skip_input and projection included)."""
        return _params.canonical_weight_shapes(self._require_built("canonical_weight_shapes"))

    @property
    def canonical_bias_shapes(self) -> list[tuple]:
        return _params.canonical_bias_shapes(self._require_built("canonical_bias_shapes"))

    @property
    def trainable_weights(self) -> list:
        """[params] (the live buffer) once built, else []."""
        return [] if self._params is None else [self._params]

    @property
    def weights(self) -> list:
        return self.trainable_weights

    variables = trainable_variables = weights

    @property
    def non_trainable_weights(self) -> list:
        return []

    non_trainable_variables = non_trainable_weights

    def __repr__(self) -> str:
        size = "" if self._config is None else f", input_size={self.input_size}"
        return (f"{type(self).__name__}(num_layers={self._num_layers}, num_units={self._num_units}{size}, "
                f"direction={self._direction!r}, name={self._name!r})")

    # ---------------------------------------------------------------------------------------------------
    # build and initialisation
    # ---------------------------------------------------------------------------------------------------
    def _require_built(self, what: str, exc=RuntimeError) -> RNNConfig:
        if self._config is None:
            raise exc(f"{type(self).__name__}.{what}: the layer is not built yet (its input size is unknown); "
                      f"call build(input_shape) or the layer on an input first")
        return self._config

    def _make_config(self, input_size: int) -> RNNConfig:
        return rnn_config(self._num_layers, self._num_units, input_size, self._rnn_mode, self._input_mode,
                          self._direction, self._num_proj or 0, self._dropout, 0, 0)

    def build(self, input_shape) -> None:
        """Create the params buffer for inputs of shape `input_shape` ([T, B, I] or any shape ending in I).

        A second build with the same input size keeps the weights; another input size is an error.
        """
        try:
            dims = tuple(input_shape)
        except TypeError:
            raise ValueError(f"input_shape: expected a shape such as [T, B, I], got {input_shape!r}") from None
        if len(dims) == 0 or dims[-1] is None:
            raise ValueError(f"input_shape: expected a known last dimension (the input size I), got {input_shape!r}")
        input_size = check_int("input_shape[-1] (input size I)", dims[-1], minimum=1)
        if self._config is not None:
            if input_size != self._config.input_size:
                raise ValueError(f"input_shape: the layer is built for input size I={self._config.input_size}, "
                                 f"got I={input_size}")
            return
        cfg = self._make_config(input_size)
        weights = self._init_tensors(cfg, _params.canonical_weight_shapes(cfg), self._kernel_initializer,
                                     "kernel_initializer", glorot=True)
        biases = self._init_tensors(cfg, _params.canonical_bias_shapes(cfg), self._bias_initializer,
                                    "bias_initializer", glorot=False)
        self._params = _params.canonical_to_params(cfg, weights, biases, dtype=self._dtype)
        if self._kernel_initializer is None:                 # layer norm: gains 1, the state's bias 0 (haste's)
            for r in _params.param_regions(cfg):
                if r.kind == "N":
                    self._params[r.offset:r.offset + r.size] = 0.0 if "bias" in r.describe(cfg) else 1.0
        self._config = cfg

    def _init_tensors(self, cfg, shapes, initializer, arg, glorot):
        rng = np.random.default_rng(self._seed_value % 2**64)
        out = []
        for shape in shapes:
            if initializer is not None:
                value = np.asarray(initializer(tuple(shape), self._dtype))
                check_shape(f"{arg}{tuple(shape)} result", value, tuple(shape), "")
            elif glorot:
                value = _glorot_uniform(rng, tuple(shape))
            else:
                value = np.zeros(shape)
            out.append(np.asarray(value, dtype=self._dtype))
        return out

    def count_params(self) -> int:
        """Number of scalars in the params buffer (= ops.cudnn_rnn_params_size); ValueError before build."""
        return _params.params_size(self._require_built("count_params", ValueError))

    def state_shape(self, batch_size):
        """([L*D, B, P], [L*D, B, H]) for LSTM, ([L*D, B, H],) otherwise (lists, time-major)."""
        B = check_int("batch_size", batch_size, minimum=0)
        LD, H = self._num_layers * self.num_dirs, self._num_units
        P = self._num_proj or H
        if self._num_states == 2:
            return [LD, B, P], [LD, B, H]
        return ([LD, B, H],)

    def compute_output_shape(self, input_shape):
        """[T, B, D*P] for input [T, B, I] (any leading dims are kept)."""
        dims = list(input_shape)
        return dims[:-1] + [self.num_dirs * (self._num_proj or self._num_units)]

    # ---------------------------------------------------------------------------------------------------
    # forward / backward
    # ---------------------------------------------------------------------------------------------------
    def __call__(self, inputs, initial_state=None, training=True, sequence_lengths=None, time_major=True):
        """Build on the first call, then `call`."""
        x = as_array("inputs", inputs)
        if not self.built:   # reject a bad first call before building
            self._check_flags(training, time_major)
            check_rank("inputs", x, 3, "[T, B, I]" if time_major else "[B, T, I]")
            self._check_input_dtype(x)
            self.build(shape_of(x))
        return self.call(x, initial_state, training, sequence_lengths, time_major)

    apply = __call__

    @staticmethod
    def _check_flags(training, time_major) -> tuple[bool, bool]:
        if not isinstance(training, (bool, np.bool_)):
            raise ArgumentTypeError(f"training: expected a bool, got {training!r}")
        if not isinstance(time_major, (bool, np.bool_)):
            raise ArgumentTypeError(f"time_major: expected a bool, got {time_major!r}")
        return bool(training), bool(time_major)

    def _check_input_dtype(self, x) -> None:
        if np.dtype(x.dtype) != self._dtype:
            raise ArgumentTypeError(f"inputs: expected dtype {self._dtype} (the layer's dtype), got {np.dtype(x.dtype)}")

    def _zero_state(self, B: int, time_major: bool):
        shapes = self.state_shape(B)
        if not time_major:
            shapes = tuple([s[1], s[0], s[2]] for s in shapes)
        return tuple(np.zeros(s, dtype=self._dtype) for s in shapes)

    def _check_state(self, arg: str, state):
        if not isinstance(state, (tuple, list)):
            raise ValueError(f"{arg}: expected a tuple of {self._num_states} array(s) "
                             f"({'(h, c)' if self._num_states == 2 else '(h,)'}), got {type(state).__name__}")
        if len(state) != self._num_states:
            raise ValueError(f"{arg}: expected a tuple of {self._num_states} array(s) "
                             f"({'(h, c)' if self._num_states == 2 else '(h,)'}), got {len(state)}")
        return tuple(state)

    def call(self, inputs, initial_state=None, training=True, sequence_lengths=None, time_major=True):
        """Run the network: -> (output, output_states).

        inputs [T, B, I] (time_major=False: [B, T, I]); initial_state a tuple (h, c) for LSTM, (h,) otherwise,
        shaped as `state_shape` (batch-major: first two axes swapped), zeros when None.  output
        [T, B, D*P]; output_states a tuple like initial_state.  training=True keeps what `backward` needs.
        """
        cfg = self._require_built("call")
        training, time_major = self._check_flags(training, time_major)
        x = as_array("inputs", inputs)
        check_rank("inputs", x, 3, "[T, B, I]" if time_major else "[B, T, I]")
        if shape_of(x)[2] != cfg.input_size:
            raise ValueError(f"inputs: expected last dimension I={cfg.input_size} (the layer is built for it), "
                             f"got shape {shape_of(x)}")
        self._check_input_dtype(x)
        B = shape_of(x)[1] if time_major else shape_of(x)[0]
        state = self._zero_state(B, time_major) if initial_state is None else \
            self._check_state("initial_state", initial_state)
        h0, c0 = state[0], (state[1] if self._num_states == 2 else None)
        seed, seed2 = self.next_dropout_seeds
        params = self._params.copy() if training else self._params
        y, hT, cT, reserve, host_reserved = ops.cudnn_rnn_v3(
            x, h0, c0, params, sequence_lengths, rnn_mode=self._rnn_mode, input_mode=cfg.input_mode,
            direction=self._direction, dropout=self._dropout, seed=seed, seed2=seed2, num_proj=cfg.num_proj,
            is_training=training, time_major=time_major, backend=self._backend)
        if training:
            self._train_calls += 1
            self._saved = dict(x=x, h0=h0, c0=c0, params=params, lengths=sequence_lengths, y=y, hT=hT, cT=cT,
                               reserve=reserve, host_reserved=host_reserved, seed=seed, seed2=seed2,
                               time_major=time_major)
        else:
            self._saved = None
        return y, ((hT, cT) if self._num_states == 2 else (hT,))

    def backward(self, output_grad, state_grads=None):
        """Gradients of the most recent call (a training call): -> (input_grad, initial_state_grads).

        output_grad is shaped like the output; state_grads a tuple like output_states (zeros when None).
        initial_state_grads is a tuple like output_states; `self.params_grad` receives the gradient of the
        params buffer (same shape, opaque layout).  Runs `ops.cudnn_rnn_backprop_v3` on the saved reserve.
        """
        if self._saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward: no training call to differentiate; call the layer "
                               f"with training=True first (backward applies to the most recent call, which must "
                               f"be a training call)")
        s = self._saved
        if state_grads is None:
            dh = np.zeros(shape_of(s["hT"]), dtype=self._dtype)
            dc = np.zeros(shape_of(s["cT"]), dtype=self._dtype) if self._num_states == 2 else None
        else:
            grads = self._check_state("state_grads", state_grads)
            dh, dc = grads[0], (grads[1] if self._num_states == 2 else None)
        cfg = self._config
        dx, dh0, dc0, dparams = ops.cudnn_rnn_backprop_v3(
            s["x"], s["h0"], s["c0"], s["params"], s["lengths"], s["y"], s["hT"],
            s["cT"] if self._num_states == 2 else None, output_grad, dh, dc, s["reserve"], s["host_reserved"],
            rnn_mode=self._rnn_mode, input_mode=cfg.input_mode, direction=self._direction, dropout=self._dropout,
            seed=s["seed"], seed2=s["seed2"], num_proj=cfg.num_proj, time_major=s["time_major"],
            backend=self._backend)
        self.params_grad = dparams
        return dx, ((dh0, dc0) if self._num_states == 2 else (dh0,))

    # ---------------------------------------------------------------------------------------------------
    # weights: opaque buffer
    # ---------------------------------------------------------------------------------------------------
    def get_weights(self) -> list:
        """[a copy of params] once built, else []."""
        return [] if self._params is None else [self._params.copy()]

    def set_weights(self, weights) -> None:
        """Set params from a list of one array shaped (params_size,); written into the live buffer (cast to dtype)."""
        if not isinstance(weights, (list, tuple)):
            raise ValueError(f"weights: expected a list of arrays (as get_weights returns), "
                             f"got {type(weights).__name__}")
        expected = len(self.trainable_weights)
        if len(weights) != expected:
            why = "" if self.built else " (the layer is not built yet)"
            raise ValueError(f"weights: expected a list of {expected} array(s){why}, got {len(weights)}")
        if not weights:
            return
        value = np.asarray(weights[0])
        check_shape("weights[0]", value, self._params.shape, "(params_size,)")
        self._params[...] = value.astype(self._dtype)

    # ---------------------------------------------------------------------------------------------------
    # weights: canonical, PyTorch and TF formats (independent of the opaque layout)
    # ---------------------------------------------------------------------------------------------------
    def canonical_weights(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(weights, biases) in canonical order and shapes (SPEC 4.3), fresh arrays."""
        return _params.params_to_canonical(self._require_built("canonical_weights"), self._params)

    def set_canonical_weights(self, weights, biases) -> None:
        """Inverse of `canonical_weights` (cast to the layer dtype)."""
        cfg = self._require_built("set_canonical_weights")
        self._params[...] = _params.canonical_to_params(cfg, list(weights), list(biases), dtype=self._dtype)

    def _saved_config(self, cfg: RNNConfig) -> dict:
        return {"format": SAVE_FORMAT, "rnn_mode": cfg.rnn_mode, "num_layers": cfg.L, "num_units": cfg.H,
                "input_size": cfg.I, "input_mode": cfg.input_mode, "direction": cfg.direction,
                "num_proj": cfg.num_proj, "dtype": str(self._dtype)}

    def save_canonical(self, path) -> str:
        """Write the canonical tensors and the configuration to an .npz at exactly `path`; returns path."""
        cfg = self._require_built("save_canonical")
        weights, biases = self.canonical_weights()
        w_names, b_names = canonical_names(cfg)
        arrays = dict(zip(w_names + b_names, weights + biases))
        arrays[CONFIG_KEY] = np.array(json.dumps(self._saved_config(cfg), sort_keys=True))
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return path

    def load_canonical(self, path) -> None:
        """Restore weights saved by `save_canonical` (by any layer with the same configuration).

        An unbuilt layer is built with the saved input size.  A different rnn_mode, num_layers, num_units,
        input_size, (resolved) input_mode, direction or num_proj is a ValueError naming it; values are cast
        to this layer's dtype.
        """
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        if CONFIG_KEY not in arrays:
            raise ValueError(f"{path}: not a numbarnn canonical checkpoint (no {CONFIG_KEY} entry)")
        saved = json.loads(str(arrays.pop(CONFIG_KEY)[()]))
        if saved.get("format") != SAVE_FORMAT:
            raise ValueError(f"{path}: expected format {SAVE_FORMAT!r}, got {saved.get('format')!r}")
        input_size = saved.get("input_size")
        if self._config is not None and input_size != self._config.input_size:
            raise ValueError(f"{path}: saved input_size={input_size!r} but this layer has "
                             f"input_size={self._config.input_size!r}")
        if self._config is not None:
            cfg = self._config
        else:
            try:
                cfg = self._make_config(input_size)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}: the saved configuration does not fit this layer: {exc}") from None
        mine = self._saved_config(cfg)
        for key in _SAVED_CONFIG_KEYS:
            if saved.get(key) != mine[key]:
                raise ValueError(f"{path}: saved {key}={saved.get(key)!r} but this layer has {key}={mine[key]!r}")
        w_names, b_names = canonical_names(cfg)
        missing = [n for n in w_names + b_names if n not in arrays]
        extra = sorted(set(arrays) - set(w_names + b_names))
        if missing or extra:
            raise ValueError(f"{path}: canonical tensors do not match the configuration (missing {missing}, "
                             f"unexpected {extra})")
        weights = [arrays[n] for n in w_names]
        biases = [arrays[n] for n in b_names]
        new = _params.canonical_to_params(cfg, weights, biases, dtype=self._dtype)
        if self._params is None:
            self._config, self._params = cfg, new
        else:
            self._params[...] = new

    def to_torch_state_dict(self) -> dict:
        """{name: NumPy array} named as torch.nn.LSTM/GRU/RNN's state_dict (`torch.from_numpy` each to load)."""
        return _params.to_torch_state_dict(self._require_built("to_torch_state_dict"), self._params)

    def load_torch_state_dict(self, state_dict) -> None:
        """Load a torch.nn.LSTM/GRU/RNN state_dict (tensors or arrays); an unbuilt layer is built from weight_ih_l0."""
        if self._config is None:
            if "weight_ih_l0" not in state_dict:
                raise ValueError("state_dict: missing weight_ih_l0 (needed to infer the input size)")
            w = state_dict["weight_ih_l0"]
            self._build_quietly(int(w.shape[-1]))
        self._params[...] = _params.from_torch_state_dict(self._config, state_dict, dtype=self._dtype)

    def to_tf_cells(self) -> dict:
        """{name: NumPy array} of TF CudnnCompatible cell variables (see `numbarnn.params.to_tf_cells`)."""
        return _params.to_tf_cells(self._require_built("to_tf_cells"), self._params)

    def load_tf_cells(self, cells) -> None:
        """Load TF CudnnCompatible cell variables; an unbuilt layer is built from cell_0's kernel.

        TF keeps one summed bias where cuDNN has two: it is split half to bW, half to bR.
        """
        if self._config is None:
            pre = "cell_0/" + ("" if self.num_dirs == 1 else "fw/")
            key = pre + ("gates/kernel" if self._rnn_mode == "gru" else "kernel")
            if key not in cells:
                raise ValueError(f"cells: missing {key!r} (needed to infer the input size)")
            rows = int(np.shape(cells[key])[0])
            width = self._num_units if self._rnn_mode == "gru" else (self._num_proj or self._num_units)
            if rows - width < 1:
                raise ValueError(f"cells[{key!r}]: expected [I+{width}, ...] rows with I >= 1, got {rows}")
            self._build_quietly(rows - width)
        self._params[...] = _params.from_tf_cells(self._config, cells, dtype=self._dtype)

    def _build_quietly(self, input_size: int) -> None:
        """Build for `input_size` with zero params (they are about to be overwritten)."""
        cfg = self._make_config(input_size)
        self._config, self._params = cfg, np.zeros(_params.params_size(cfg), dtype=self._dtype)

    # ---------------------------------------------------------------------------------------------------
    # config
    # ---------------------------------------------------------------------------------------------------
    def get_config(self) -> dict:
        """The constructor arguments (weights excluded): `type(layer).from_config(layer.get_config())` rebuilds it."""
        config = {"num_layers": self._num_layers, "num_units": self._num_units, "input_mode": self._input_mode,
                  "direction": self._direction, "dropout": self._dropout, "seed": self._seed,
                  "dtype": str(self._dtype), "kernel_initializer": self._kernel_initializer,
                  "bias_initializer": self._bias_initializer, "name": self._name, "backend": self._backend}
        if self._num_states == 2:
            config["num_proj"] = self._num_proj
        return config

    @classmethod
    def from_config(cls, config: dict):
        if not isinstance(config, dict):
            raise ValueError(f"config: expected a dict (as get_config returns), got {type(config).__name__}")
        return cls(**config)


class CudnnRNN(_CudnnRNN):
    """A layer of any registered cell: ``CudnnRNN("peephole_lstm", num_layers, num_units, ...)``.

    `cell` is an rnn_mode name or a `numbarnn.cells.CellSpec` (registered if it is not yet).  States are (h, c)
    for cells with a cell state, (h,) otherwise; `num_proj` is accepted for cells that allow a projection.
    The four cuDNN layers below are this layer with the cell fixed.
    """

    def __init__(self, cell, num_layers, num_units, input_mode="linear_input", direction="unidirectional",
                 dropout=0.0, seed=None, dtype="float32", kernel_initializer=None, bias_initializer=None, name=None,
                 backend=None, num_proj=None):
        if isinstance(cell, CellSpec):
            register(cell)
            cell = cell.name
        spec = get_cell(cell)
        self._rnn_mode = spec.name
        self._num_states = 2 if spec.cell_state else 1
        super().__init__(num_layers, num_units, input_mode, direction, dropout, seed, dtype, kernel_initializer,
                         bias_initializer, name, backend, num_proj=num_proj)

    @property
    def num_proj(self):
        """P, or None without projection."""
        return self._num_proj or None

    def get_config(self) -> dict:
        return {"cell": self._rnn_mode, **super().get_config(), "num_proj": self._num_proj}


class CudnnLSTM(_CudnnRNN):
    """cuDNN LSTM layer (gates i, f, g, o; optional projection `num_proj`, 0 < num_proj <= num_units).

    __call__(inputs, initial_state=None, training=True, sequence_lengths=None, time_major=True)
    -> (output [T, B, D*P], (h [L*D, B, P], c [L*D, B, H])).
    """

    _rnn_mode = "lstm"
    _num_states = 2

    def __init__(self, num_layers, num_units, input_mode="linear_input", direction="unidirectional", dropout=0.0,
                 seed=None, dtype="float32", kernel_initializer=None, bias_initializer=None, name=None,
                 backend=None, num_proj=None):
        super().__init__(num_layers, num_units, input_mode, direction, dropout, seed, dtype, kernel_initializer,
                         bias_initializer, name, backend, num_proj=num_proj)

    @property
    def num_proj(self):
        """P, or None without projection (num_proj=0 is the same as None)."""
        return self._num_proj or None


class CudnnGRU(_CudnnRNN):
    """cuDNN GRU layer (gates r, z, n; reset after the recurrent matmul). Output states: (h,)."""

    _rnn_mode = "gru"


class CudnnRNNTanh(_CudnnRNN):
    """cuDNN RNN layer with tanh activation. Output states: (h,)."""

    _rnn_mode = "rnn_tanh"


class CudnnRNNRelu(_CudnnRNN):
    """cuDNN RNN layer with ReLU activation. Output states: (h,)."""

    _rnn_mode = "rnn_relu"

"""TF-style config-only models (`tf.contrib.cudnn_rnn.CudnnGRU` of the ops module & co.).

A model is a validated configuration, nothing more: it owns no parameters and keeps no state between calls.
The user creates the opaque params buffer (`params_size()`, `canonical_to_params`) and passes it in::

    from numbarnn.models import CudnnLSTM
    model = CudnnLSTM(num_layers=1, num_units=4, input_size=3)
    params = model.canonical_to_params(weights, biases)        # or any buffer of model.params_size()
    output, output_h, output_c = model(x, h0, c0, params, is_training=False)

`__call__` is `ops.cudnn_rnn_v3` with the model's attributes (dropout seeds: ``seed=seed, seed2=0``, the same
as the first training call of a `numbarnn.layers` layer with that seed), returning only the outputs.  Training
needs the reserve space that the op returns: use `ops.cudnn_rnn_v3` + `ops.cudnn_rnn_backprop_v3` directly,
or a `numbarnn.layers` layer, which keeps it and offers `backward`.
"""
from __future__ import annotations

import numpy as np

from . import ops
from . import params as _params
from .backends import BACKENDS
from .cells import CellSpec, get_cell, register
from .config import RNNConfig, rnn_config
from .validation import (ArgumentTypeError, SUPPORTED_DTYPES, as_array, check_choice,
                         check_int, check_rank, check_shape, shape_of)

__all__ = ["CudnnRNN", "CudnnLSTM", "CudnnGRU", "CudnnRNNTanh", "CudnnRNNRelu"]


def _check_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ArgumentTypeError(f"dtype: expected float16, float32 or float64, got {dtype!r}") from exc
    if dt not in SUPPORTED_DTYPES:
        raise ArgumentTypeError(f"dtype: expected float16, float32 or float64, got {dt}")
    return dt


class _CudnnRNNModel:
    """Base of the four models; subclasses fix `_rnn_mode`."""

    _rnn_mode: str = ""

    def __init__(self, num_layers, num_units, input_size, input_mode="linear_input", direction="unidirectional",
                 dtype="float32", dropout=0.0, seed=0, backend=None, *, num_proj=None):
        if seed is None:   # TF: no op seed -> a random one; drawn once here so the model stays a pure config
            seed = int(np.random.SeedSequence().entropy % 2**63)
        self._given_input_mode = input_mode
        self._config = rnn_config(num_layers, num_units, input_size, self._rnn_mode, input_mode, direction,
                                  0 if num_proj is None else num_proj, dropout, check_int("seed", seed), 0)
        self._dtype = _check_dtype(dtype)
        self._backend = None if backend is None else check_choice("backend", backend, tuple(BACKENDS))

    # properties --------------------------------------------------------------------------------------------
    @property
    def config(self) -> RNNConfig:
        """The validated `RNNConfig` (auto_select resolved)."""
        return self._config

    @property
    def num_layers(self) -> int:
        return self._config.L

    @property
    def num_units(self) -> int:
        return self._config.H

    @property
    def input_size(self) -> int:
        return self._config.I

    @property
    def input_mode(self) -> str:
        """As given ('auto_select' included); `config.input_mode` is the resolved one."""
        return self._given_input_mode

    @property
    def direction(self) -> str:
        return self._config.direction

    @property
    def rnn_mode(self) -> str:
        return self._rnn_mode

    @property
    def num_dirs(self) -> int:
        return self._config.D

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def dropout(self) -> float:
        return self._config.dropout

    @property
    def seed(self) -> int:
        return self._config.seed

    @property
    def backend(self):
        return self._backend

    @property
    def canonical_weight_shapes(self) -> list[tuple]:
        return _params.canonical_weight_shapes(self._config)

    @property
    def canonical_bias_shapes(self) -> list[tuple]:
        return _params.canonical_bias_shapes(self._config)

    def __repr__(self) -> str:
        c = self._config
        return (f"{type(self).__name__}(num_layers={c.L}, num_units={c.H}, input_size={c.I}, "
                f"direction={c.direction!r}, dtype={self._dtype})")

    # parameters --------------------------------------------------------------------------------------------
    def params_size(self) -> int:
        """Length of the opaque params buffer (SPEC 4.2)."""
        return _params.params_size(self._config)

    def canonical_to_params(self, weights, biases) -> np.ndarray:
        """Canonical lists (SPEC 4.3 order and shapes) -> a fresh opaque params buffer in the model's dtype."""
        return _params.canonical_to_params(self._config, list(weights), list(biases), dtype=self._dtype)

    def params_to_canonical(self, params) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Opaque params buffer -> (weights, biases), fresh arrays in canonical order."""
        self._check_params(params)
        return _params.params_to_canonical(self._config, params)

    # forward -----------------------------------------------------------------------------------------------
    def _check_params(self, params):
        p = as_array("params", params)
        check_rank("params", p, 1, "(a 1-D opaque buffer)")
        n = self.params_size()
        if shape_of(p)[0] != n:
            raise ValueError(f"params: expected length params_size() = {n} for this model, got {shape_of(p)[0]}")
        if np.dtype(p.dtype) != self._dtype:
            raise ArgumentTypeError(f"params: expected dtype {self._dtype} (the model's dtype), got {np.dtype(p.dtype)}")
        return p

    def _run(self, input_data, input_h, input_c, params, is_training, sequence_lengths, time_major):
        c = self._config
        if not isinstance(time_major, (bool, np.bool_)):
            raise ArgumentTypeError(f"time_major: expected a bool, got {time_major!r}")
        x = as_array("input_data", input_data)
        check_rank("input_data", x, 3, "[T, B, I]" if time_major else "[B, T, I]")
        if shape_of(x)[2] != c.I:
            raise ValueError(f"input_data: expected last dimension input_size={c.I}, got shape {shape_of(x)}")
        B = shape_of(x)[1] if time_major else shape_of(x)[0]
        LD = c.L * c.D
        legend = "[L*D, B, {}]" if time_major else "[B, L*D, {}]"
        h_shape = (LD, B, c.P) if time_major else (B, LD, c.P)
        check_shape("input_h", as_array("input_h", input_h), h_shape, legend.format("P" if c.has_proj else "H"))
        if c.has_cell_state:
            c_shape = (LD, B, c.H) if time_major else (B, LD, c.H)
            check_shape("input_c", as_array("input_c", input_c), c_shape, legend.format("H"))
        self._check_params(params)
        return ops.cudnn_rnn_v3(input_data, input_h, input_c, params, sequence_lengths, rnn_mode=c.rnn_mode,
                                input_mode=c.input_mode, direction=c.direction, dropout=c.dropout, seed=c.seed,
                                seed2=c.seed2, num_proj=c.num_proj, is_training=is_training, time_major=time_major,
                                backend=self._backend)


class CudnnRNN(_CudnnRNNModel):
    """The model of any registered cell: ``CudnnRNN("cifg_lstm", num_layers, num_units, input_size, ...)``.

    `cell` is an rnn_mode name or a `numbarnn.cells.CellSpec` (registered if it is not yet).  The call takes
    the cell's states like the fixed models: ``model(x, h0, c0, params)`` -> (output, output_h, output_c) for a
    cell with a cell state, ``model(x, h0, params)`` -> (output, output_h) otherwise.  The four cuDNN models
    below are this model with the cell fixed.
    """

    def __init__(self, cell, num_layers, num_units, input_size, input_mode="linear_input",
                 direction="unidirectional", dtype="float32", dropout=0.0, seed=0, backend=None, num_proj=None):
        if isinstance(cell, CellSpec):
            register(cell)
            cell = cell.name
        self._cell = get_cell(cell)
        self._rnn_mode = self._cell.name
        super().__init__(num_layers, num_units, input_size, input_mode, direction, dtype, dropout, seed, backend,
                         num_proj=num_proj)

    def __call__(self, input_data, input_h, *states_and_params, is_training=True, sequence_lengths=None,
                 time_major=True):
        names = ("input_c", "params") if self._cell.cell_state else ("params",)
        if len(states_and_params) != len(names):
            raise TypeError(f"{type(self).__name__}({self._rnn_mode!r})(input_data, input_h, {', '.join(names)}): "
                            f"expected {len(names) + 2} positional arguments, got {len(states_and_params) + 2}")
        args = dict(zip(names, states_and_params))
        y, hT, cT, _, _ = self._run(input_data, input_h, args.get("input_c"), args["params"], is_training,
                                    sequence_lengths, time_major)
        return (y, hT, cT) if self._cell.cell_state else (y, hT)


class CudnnLSTM(_CudnnRNNModel):
    """cuDNN LSTM model (config only): __call__(input_data, input_h, input_c, params, ...) -> (output, h, c)."""

    _rnn_mode = "lstm"

    def __init__(self, num_layers, num_units, input_size, input_mode="linear_input", direction="unidirectional",
                 dtype="float32", dropout=0.0, seed=0, backend=None, num_proj=None):
        super().__init__(num_layers, num_units, input_size, input_mode, direction, dtype, dropout, seed, backend,
                         num_proj=num_proj)

    @property
    def num_proj(self):
        """P, or None without projection."""
        return self._config.num_proj or None

    def __call__(self, input_data, input_h, input_c, params, is_training=True, sequence_lengths=None,
                 time_major=True):
        """-> (output [T, B, D*P], output_h [L*D, B, P], output_c [L*D, B, H]) (batch-major when not time_major)."""
        y, hT, cT, _, _ = self._run(input_data, input_h, input_c, params, is_training, sequence_lengths, time_major)
        return y, hT, cT


class _CudnnRNNNoC(_CudnnRNNModel):
    """Models without a cell state c: __call__(input_data, input_h, params, ...) -> (output, output_h)."""

    def __call__(self, input_data, input_h, params, is_training=True, sequence_lengths=None, time_major=True):
        """-> (output [T, B, D*H], output_h [L*D, B, H]) (batch-major when not time_major)."""
        y, hT, _, _, _ = self._run(input_data, input_h, None, params, is_training, sequence_lengths, time_major)
        return y, hT


class CudnnGRU(_CudnnRNNNoC):
    """cuDNN GRU model (config only)."""

    _rnn_mode = "gru"


class CudnnRNNTanh(_CudnnRNNNoC):
    """cuDNN RNN-tanh model (config only)."""

    _rnn_mode = "rnn_tanh"


class CudnnRNNRelu(_CudnnRNNNoC):
    """cuDNN RNN-relu model (config only)."""

    _rnn_mode = "rnn_relu"

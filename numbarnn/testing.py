"""Public test helpers: random RNN cases, hypothesis strategies, and finite-difference gradient checks.

Use them on numbarnn's ops or on your own cell variants::

    from numbarnn.testing import rnn_cases, make_rnn_case, check_rnn_gradients
    @given(rnn_cases())
    def test_mine(case):
        report = check_rnn_gradients(case)        # {name: relative error}
        assert max(report.values()) < 1e-6

A case is drawn config first, then lengths, then arrays, so hypothesis shrinks towards small configs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from . import ops
from .config import RNNConfig, rnn_config
from .params import params_size

try:  # hypothesis is a test dependency, not a runtime one
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None


@dataclass
class RNNCase:
    """Everything one cudnn_rnn_v3 / backprop call needs, as NumPy arrays in `dtype`."""

    cfg: RNNConfig
    T: int
    B: int
    lengths: np.ndarray | None     # [B] int32, or None (all T)
    x: np.ndarray                  # [T, B, I] (or [B, T, I] when not time_major)
    h0: np.ndarray                 # [L*D, B, P] (or [B, L*D, P])
    c0: np.ndarray | None          # [L*D, B, H] (or [B, L*D, H]); None for non-LSTM
    params: np.ndarray             # [params_size]
    dy: np.ndarray                 # upstream gradient of output
    dhT: np.ndarray                # upstream gradient of output_h
    dcT: np.ndarray | None         # upstream gradient of output_c (LSTM)
    time_major: bool = True
    is_training: bool = True
    dtype: np.dtype = field(default=np.dtype(np.float64))

    @property
    def attrs(self) -> dict:
        c = self.cfg
        return dict(rnn_mode=c.rnn_mode, input_mode=c.input_mode, direction=c.direction, dropout=c.dropout,
                    seed=c.seed, seed2=c.seed2, num_proj=c.num_proj, time_major=self.time_major)

    def astype(self, dtype) -> "RNNCase":
        cast = (lambda a: None if a is None else a.astype(dtype))
        return replace(self, x=cast(self.x), h0=cast(self.h0), c0=cast(self.c0), params=cast(self.params),
                       dy=cast(self.dy), dhT=cast(self.dhT), dcT=cast(self.dcT), dtype=np.dtype(dtype))


def make_rnn_case(cfg: RNNConfig, T: int, B: int, lengths=None, seed: int = 0, dtype=np.float64,
                  time_major: bool = True, is_training: bool = True, scale: float = 0.5) -> RNNCase:
    """Random inputs, params and upstream gradients (all nonzero) for `cfg`."""
    rng = np.random.default_rng(seed)
    L, D, H, P, I = cfg.L, cfg.D, cfg.H, cfg.P, cfg.I

    def rand(*shape):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    def layout(shape_tm):  # time-major shape -> the call's layout
        return shape_tm if time_major else (shape_tm[1], shape_tm[0]) + tuple(shape_tm[2:])

    lstm = cfg.is_lstm
    lens = None if lengths is None else np.asarray(lengths, dtype=np.int32)
    return RNNCase(cfg, T, B, lens, rand(*layout((T, B, I))), rand(*layout((L * D, B, P))),
                   rand(*layout((L * D, B, H))) if lstm else None, rand(params_size(cfg)),
                   rand(*layout((T, B, D * P))), rand(*layout((L * D, B, P))),
                   rand(*layout((L * D, B, H))) if lstm else None, time_major, is_training, np.dtype(dtype))


def run_forward(case: RNNCase, backend=None, **overrides):
    kw = dict(x=case.x, h0=case.h0, c0=case.c0, params=case.params)
    kw.update(overrides)
    return ops.cudnn_rnn_v3(kw["x"], kw["h0"], kw["c0"], kw["params"], case.lengths, is_training=case.is_training,
                            backend=backend, **case.attrs)


def run_backward(case: RNNCase, forward_outputs, backend=None):
    y, hT, cT, reserve, host_reserved = forward_outputs
    return ops.cudnn_rnn_backprop_v3(case.x, case.h0, case.c0, case.params, case.lengths, y, hT, cT, case.dy,
                                     case.dhT, case.dcT, reserve, host_reserved, backend=backend, **case.attrs)


def rnn_loss(case: RNNCase, backend=None, **overrides) -> float:
    """The scalar whose gradient backprop computes: <y, dy> + <hT, dhT> (+ <cT, dcT>)."""
    y, hT, cT, _, _ = run_forward(case, backend, **overrides)
    loss = np.vdot(np.asarray(y, np.float64), case.dy) + np.vdot(np.asarray(hT, np.float64), case.dhT)
    if case.cfg.is_lstm:
        loss += np.vdot(np.asarray(cT, np.float64), case.dcT)
    return float(loss)


def directional_check(loss, x: np.ndarray, grad: np.ndarray, rng, eps: float = 1e-6, directions: int = 2) -> float:
    """Central finite differences of `loss` along random directions v ~ N(0, I), against <grad, v>.

    Returns the max over directions of |fd - <grad, v>| / max(|fd|, |<grad, v>|, ‖grad‖): 0 is perfect.  The
    ‖grad‖ floor is the typical size of <grad, v> (its standard deviation): without it, a direction that happens
    to be nearly orthogonal to grad would turn finite-difference noise into a large "relative" error.
    """
    if x.size == 0:
        return 0.0
    worst = 0.0
    scale = float(np.linalg.norm(grad))
    for _ in range(directions):
        v = rng.standard_normal(x.shape)
        fd = (loss(x + eps * v) - loss(x - eps * v)) / (2 * eps)
        an = float(np.vdot(grad, v))
        denom = max(abs(fd), abs(an), scale, 1e-8)
        worst = max(worst, abs(fd - an) / denom)
    return worst


def check_rnn_gradients(case: RNNCase, backend=None, eps: float = 1e-6, seed: int = 0) -> dict:
    """Finite-difference check (float64) of every backprop output: {name: relative error}."""
    assert case.dtype == np.float64, "finite differences need float64"
    fwd = run_forward(case, backend)
    dx, dh0, dc0, dparams = run_backward(case, fwd, backend)
    rng = np.random.default_rng(seed)
    report = {
        "input_backprop": directional_check(lambda v: rnn_loss(case, backend, x=v), case.x, dx, rng, eps),
        "input_h_backprop": directional_check(lambda v: rnn_loss(case, backend, h0=v), case.h0, dh0, rng, eps),
        "params_backprop": directional_check(lambda v: rnn_loss(case, backend, params=v), case.params, dparams,
                                             rng, eps),
    }
    if case.cfg.is_lstm:
        report["input_c_backprop"] = directional_check(lambda v: rnn_loss(case, backend, c0=v), case.c0, dc0,
                                                       rng, eps)
    return report


def relative_error(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are empty or zero)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    nb = np.linalg.norm(b)
    na = np.linalg.norm(a - b)
    return float(na / nb) if nb > 0 else float(na)


#: SPEC 10 tolerances for ‖out − ref‖/‖ref‖ against the float64 reference: (outputs, gradients)
TOLERANCES = {np.dtype(np.float64): (1e-10, 1e-10), np.dtype(np.float32): (1e-5, 1e-4),
              np.dtype(np.float16): (1e-2, 1e-2)}


# ---------------------------------------------------------------------------------------------------
# hypothesis strategies
# ---------------------------------------------------------------------------------------------------

def ragged_lengths(T: int, B: int):
    """Lengths in [0, T] with the ragged shapes that break drivers: sorted, unsorted, zeros, all-T.

    Free draws alone are rarely ragged (hypothesis favours equal small values), so half of the non-None draws
    are a permutation of a spread from T down to 0 (B=6, T=7: 7, 5, 4, 2, 1, 0) or of a list holding T, 0 and
    duplicates.
    """
    free = st.lists(st.integers(0, T), min_size=B, max_size=B)
    spread = [T * (B - 1 - k) // max(B - 1, 1) for k in range(B)]                        # T, ..., 0
    with_ends = st.lists(st.integers(0, T), min_size=B, max_size=B).map(
        lambda v: [T] + v[1:-1] + [0] if B > 1 else v)                                      # T, ..., 0, repeats
    ragged = st.one_of(st.permutations(spread), with_ends.flatmap(st.permutations))
    return st.one_of(st.none(), free, ragged).map(lambda v: None if v is None else np.asarray(v, dtype=np.int32))


def rnn_configs(modes=("lstm", "gru", "rnn_tanh", "rnn_relu"), max_layers: int = 2, max_units: int = 4,
                max_input: int = 4, dropout: bool = True):
    """RNNConfig with odd sizes, both directions, projection (LSTM), skip/linear input, dropout."""
    @st.composite
    def build(draw):
        mode = draw(st.sampled_from(modes))
        L = draw(st.integers(1, max_layers))
        H = draw(st.integers(1, max_units))
        input_mode = draw(st.sampled_from(["linear_input", "skip_input", "auto_select"]))
        I = H if input_mode == "skip_input" else draw(st.integers(1, max_input))  # noqa: E741
        direction = draw(st.sampled_from(["unidirectional", "bidirectional"]))
        num_proj = draw(st.integers(0, H)) if mode == "lstm" else 0
        p = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])) if dropout and L > 1 else 0.0
        seed, seed2 = draw(st.integers(-2**40, 2**40)), draw(st.integers(0, 2**33))
        return rnn_config(L, H, I, mode, input_mode, direction, num_proj, p, seed, seed2)
    return build()


def rnn_cases(configs=None, max_T: int = 4, max_B: int = 4, dtype=np.float64, time_major=None):
    """RNNCase: config, then T, B and ragged lengths, then the arrays (from a drawn seed)."""
    configs = configs if configs is not None else rnn_configs()

    @st.composite
    def build(draw):
        cfg = draw(configs)
        T = draw(st.integers(1, max_T))
        B = draw(st.integers(1, max_B))
        lengths = draw(ragged_lengths(T, B))
        tm = draw(st.booleans()) if time_major is None else time_major
        seed = draw(st.integers(0, 2**31 - 1))
        return make_rnn_case(cfg, T, B, lengths, seed=seed, dtype=dtype, time_major=tm)
    return build()

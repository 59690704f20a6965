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
from .cells import CellSpec, get_cell, register
from .config import RNNConfig, rnn_config
from .params import params_size
from .verify import TOLERANCES, relative_error, rnn_named  # noqa: F401 (TOLERANCES: public here too)

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
                    seed=c.seed, seed2=c.seed2, num_proj=c.num_proj, time_major=self.time_major,
                    **({"zoneout": c.zoneout} if c.zoneout else {}))

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

    lstm = cfg.has_cell_state
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
    if case.cfg.has_cell_state:
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
    if case.cfg.has_cell_state:
        report["input_c_backprop"] = directional_check(lambda v: rnn_loss(case, backend, c0=v), case.c0, dc0,
                                                       rng, eps)
    return report


def run_named(case: RNNCase, backend=None) -> dict:
    """{name: NumPy array} of one forward + backward of `case` on `backend` (numbarnn.verify's names)."""
    fwd = run_forward(case, backend)
    return rnn_named(fwd, run_backward(case, fwd, backend), case.cfg.has_cell_state)


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
    """RNNConfig with odd sizes, both directions, projection (cells that allow one), skip/linear input, dropout.

    modes: rnn_mode names, built-in or registered (numbarnn.cells.register); a CellSpec is accepted too.
    """
    modes = tuple(m.name if hasattr(m, "name") else m for m in ([modes] if isinstance(modes, str) else modes))
    for m in modes:
        get_cell(m)                 # unknown names fail here, with the registry's message

    @st.composite
    def build(draw):
        mode = draw(st.sampled_from(modes))
        L = draw(st.integers(1, max_layers))
        H = draw(st.integers(1, max_units))
        input_mode = draw(st.sampled_from(["linear_input", "skip_input", "auto_select"]))
        I = H if input_mode == "skip_input" else draw(st.integers(1, max_input))  # noqa: E741
        direction = draw(st.sampled_from(["unidirectional", "bidirectional"]))
        num_proj = draw(st.integers(0, H)) if get_cell(mode).projection else 0
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


# ---------------------------------------------------------------------------------------------------
# a user cell's oracle: finite differences (numbarnn.cells.register'ed cells have no hand-written reference)
# ---------------------------------------------------------------------------------------------------

@dataclass
class CellReport:
    """What `check_cell` found: worst relative errors and, on failure, the (shrunk) failing example."""

    cell: str
    pointwise: float = 0.0                          # pointwise backward vs central FD of the pointwise forward
    network: dict = field(default_factory=dict)     # backend -> worst FD error of the whole network's backprop
    examples: int = 0
    failing: str | None = None
    tolerance: float = 0.0

    @property
    def worst(self) -> float:
        return max([self.pointwise, *self.network.values()])

    @property
    def ok(self) -> bool:
        return self.failing is None and self.worst <= self.tolerance

    def __str__(self) -> str:
        nets = ", ".join(f"{b} {e:.1e}" for b, e in self.network.items()) or "not run"
        text = (f"cell {self.cell!r}: pointwise backward {self.pointwise:.1e}, network {nets} "
                f"({self.examples} examples, tolerance {self.tolerance:.0e})")
        return text + (f"\nfailing example: {self.failing}" if self.failing else "")


def pointwise_gradient_error(cell, wx, rh, v, h, c, dm, dc, eps: float = 1e-6) -> float:
    """max |analytic - FD| / max |gradient| of the loss dm*m + dc*c' over every input of the pointwise step.

    Analytic: cell.backward from cell.forward's saved values; FD: central differences of cell.forward.  At a kink
    (relu at 0, which hypothesis draws: it mixes in the constants of the loaded modules) the analytic derivative is
    one of the one-sided ones, so each input's error is the least against the central and the one-sided differences.
    """
    G, S, V = cell.G, cell.S, cell.V
    dc = dc if cell.cell_state else 0.0

    def loss(x):
        saved = np.zeros(S)
        m, c_new = cell.forward(x[:G], x[G:2 * G], x[2 * G:2 * G + V], x[-2], x[-1], saved)
        return dm * m + (dc * c_new if cell.cell_state else 0.0)

    x = np.concatenate([wx, rh, v, [h, c]]).astype(np.float64)
    saved = np.zeros(S)
    _, c_new = cell.forward(x[:G], x[G:2 * G], x[2 * G:2 * G + V], x[-2], x[-1], saved)
    dwx, drh, dv = np.zeros(G), np.zeros(G), np.zeros(V)
    dh, dc_prev = cell.backward(dm, dc, saved, x[2 * G:2 * G + V], x[-2], x[-1], c_new, dwx, drh, dv)
    analytic = np.concatenate([dwx, np.where(cell.split_mask, drh, dwx), dv,
                               [dh, dc_prev if cell.cell_state else 0.0]])
    fd, miss = np.zeros_like(x), np.zeros_like(x)
    at = loss(x)
    for k in range(x.size):
        e = np.zeros_like(x)
        e[k] = eps
        up, down = loss(x + e), loss(x - e)
        fd[k] = (up - down) / (2 * eps)
        miss[k] = min(abs(analytic[k] - fd[k]), abs(analytic[k] - (up - at) / eps),
                      abs(analytic[k] - (at - down) / eps))
    scale = max(np.max(np.abs(analytic)), np.max(np.abs(fd)), 1e-12)
    error = float(np.max(miss) / scale)
    if cell.modulated:
        error = max(error, _modulation_gradient_error(cell, x[:G], x[G:2 * G], x[2 * G:2 * G + V], x[-2], dm, saved,
                                                      eps))
    if "c" in cell.layer_norm:
        error = max(error, _output_gradient_error(cell, x[:G], x[G:2 * G], x[2 * G:2 * G + V], x[-2], x[-1], dm, dc,
                                                  eps))
    return error


def _output_gradient_error(cell, wx, rh, v, h, c, dm, dc, eps: float) -> float:
    """max |analytic - FD| / max |gradient| of the loss dm*output(n) + dc*c' over wx, rh and n (a cell with a
    normalised state: `output_backward` plus `backward` with dm = 0, against central differences of `forward`
    and `output`; n is an independent input, as the framework's LN makes it)."""
    G, S = cell.G, cell.S
    x = np.concatenate([wx, rh, [c * 0.7 + 0.1]])               # n: any value

    def loss(x):
        saved = np.zeros(S)
        _, c_new = cell.forward(x[:G], x[G:2 * G], v, h, c, saved)
        return dm * cell.output(x[-1], saved, v) + dc * c_new

    saved = np.zeros(S)
    _, c_new = cell.forward(x[:G], x[G:2 * G], v, h, c, saved)
    dwx, drh, dwx2, drh2, dv = np.zeros(G), np.zeros(G), np.zeros(G), np.zeros(G), np.zeros(cell.V)
    dn = cell.output_backward(dm, x[-1], saved, v, dwx, drh)
    cell.backward(0.0, dc, saved, v, h, c, c_new, dwx2, drh2, dv)
    analytic = np.concatenate([dwx + dwx2, np.where(cell.split_mask, drh + drh2, dwx + dwx2), [dn]])
    fd = np.zeros_like(x)
    for k in range(x.size):
        e = np.zeros_like(x)
        e[k] = eps
        fd[k] = (loss(x + e) - loss(x - e)) / (2 * eps)
    scale = max(np.max(np.abs(analytic)), np.max(np.abs(fd)), 1e-12)
    return float(np.max(np.abs(analytic - fd)) / scale)


def _modulation_gradient_error(cell, wx, rh, v, h, dmod, saved, eps: float) -> float:
    """max |analytic - FD| / max |gradient| of the loss dmod*m over the unmodulated gates' wx, rh (a modulated
    cell: `modulation_backward` against central differences of `modulation`; the modulated gates' rh are 0)."""
    G = cell.G
    keep = np.array([not m for m in cell.modulated_mask] * 2, dtype=np.float64)   # [2G] wx, rh of free gates
    x = np.concatenate([wx, rh]) * keep

    def loss(x):
        return dmod * cell.modulation(x[:G], x[G:], v, h)

    dwx, drh = np.zeros(G), np.zeros(G)
    cell.modulation_backward(dmod, cell.modulation(x[:G], x[G:], v, h), saved, v, h, dwx, drh)
    analytic = np.concatenate([dwx, np.where(cell.split_mask, drh, dwx)]) * keep
    fd = np.zeros_like(x)
    for k in np.flatnonzero(keep):
        e = np.zeros_like(x)
        e[k] = eps
        fd[k] = (loss(x + e) - loss(x - e)) / (2 * eps)
    scale = max(np.max(np.abs(analytic)), np.max(np.abs(fd)), 1e-12)
    return float(np.max(np.abs(analytic - fd)) / scale)


def check_cell(cell, backends=("reference",), max_examples: int = 25, network_examples: int | None = None,
               tolerance: float = 1e-5, raise_on_failure: bool = True) -> CellReport:
    """Gradient checks of a (user) cell: its oracle is finite differences.

    1. the pointwise backward against central differences of the pointwise forward, at `max_examples` inputs;
    2. the whole network built from the cell (ragged lengths with zeros, both directions, up to two layers,
       dropout, projection where allowed, skip/linear input, both layouts) through ops.cudnn_rnn_backprop_v3
       against finite differences of ops.cudnn_rnn_v3, on each of `backends`.
    The examples are drawn by hypothesis when it is installed (the `test` extra: a failure is shrunk to a
    small example), else from a seeded NumPy generator over the same ranges (the same checks, no shrinking).
    cell: a CellSpec (registered if need be) or a registered name.  Returns a CellReport; with
    raise_on_failure an AssertionError carrying the report (and the failing example) instead.
    """
    if isinstance(cell, CellSpec):
        register(cell)
    else:
        cell = get_cell(cell)
    report = CellReport(cell.name, tolerance=tolerance)
    last = {}
    n_network = network_examples or max(2, max_examples // 3)

    def pointwise(ab, v, h, c, dm, dc):
        last["example"] = f"pointwise wx={ab[:cell.G]} rh={ab[cell.G:]} v={v} h={h} c={c} dm={dm} dc={dc}"
        report.examples += 1
        err = pointwise_gradient_error(cell, np.array(ab[:cell.G]), np.array(ab[cell.G:]), np.array(v), h, c,
                                       dm, dc)
        report.pointwise = max(report.pointwise, err)
        assert err <= tolerance, f"pointwise gradient error {err:.2e}"

    def network(backend, case):
        last["example"] = (f"network backend={backend} {case.cfg} T={case.T} B={case.B} lengths="
                           f"{None if case.lengths is None else case.lengths.tolist()} "
                           f"time_major={case.time_major}")
        report.examples += 1
        err = max(check_rnn_gradients(case, backend).values())
        report.network[backend] = max(report.network.get(backend, 0.0), err)
        assert err <= tolerance, f"network gradient error {err:.2e} on {backend}"

    run = _hypothesis_examples if st is not None else _numpy_examples
    try:
        run(cell, pointwise, network, backends, max_examples, n_network)
    except AssertionError:
        report.failing = last.get("example")
        if raise_on_failure:
            raise AssertionError(str(report)) from None
    return report


def _hypothesis_examples(cell, pointwise, network, backends, max_examples: int, n_network: int) -> None:
    """check_cell's examples drawn (and a failure shrunk) by hypothesis."""
    import hypothesis  # lazy: hypothesis is optional
    from hypothesis import given, settings  # lazy: hypothesis is optional
    from hypothesis import strategies as hst  # lazy: hypothesis is optional

    quiet = settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
    floats = (lambda lo, hi: hst.floats(lo, hi, allow_nan=False, allow_infinity=False))
    quiet(given(hst.lists(floats(-3, 3), min_size=2 * cell.G, max_size=2 * cell.G),
                hst.lists(floats(-1, 1), min_size=cell.V, max_size=cell.V),
                floats(-2, 2), floats(-2, 2), floats(-1, 1), floats(-1, 1))(pointwise))()
    for backend in backends:
        cases = rnn_cases(rnn_configs(modes=(cell.name,), max_layers=2, max_units=3, max_input=3), max_T=3, max_B=3)
        settings(quiet, max_examples=n_network)(given(cases)(lambda case: network(backend, case)))()


def _numpy_examples(cell, pointwise, network, backends, max_examples: int, n_network: int, seed: int = 0) -> None:
    """check_cell's examples without hypothesis: the ranges of `_hypothesis_examples` from a seeded generator,
    the network cases cycling through the shapes that break drivers (1 or 2 layers, both directions, both
    layouts, lengths None / a spread from T down to 0 / free draws)."""
    rng = np.random.default_rng(seed)
    for _ in range(max_examples):
        pointwise(list(rng.uniform(-3, 3, 2 * cell.G)), list(rng.uniform(-1, 1, cell.V)), *rng.uniform(-2, 2, 2),
                  *rng.uniform(-1, 1, 2))
    for backend in backends:
        for k in range(n_network):
            L, H = 1 + (k // 2) % 2, int(rng.integers(1, 4))
            input_mode = ("linear_input", "skip_input", "auto_select")[int(rng.integers(0, 3))]
            I = H if input_mode == "skip_input" else int(rng.integers(1, 4))  # noqa: E741
            num_proj = int(rng.integers(0, H + 1)) if cell.projection else 0
            dropout = float(rng.choice([0.0, 0.3, 1.0])) if L > 1 else 0.0
            cfg = rnn_config(L, H, I, cell.name, input_mode, ("unidirectional", "bidirectional")[k % 2], num_proj,
                             dropout, int(rng.integers(-2**40, 2**40)), int(rng.integers(0, 2**33)))
            T, B = int(rng.integers(1, 4)), int(rng.integers(1, 4))
            spread = [T * (B - 1 - b) // max(B - 1, 1) for b in range(B)]           # T, ..., 0
            lengths = (None, rng.permutation(spread), rng.integers(0, T + 1, B))[k % 3]
            lengths = None if lengths is None else np.asarray(lengths, dtype=np.int32)
            network(backend, make_rnn_case(cfg, T, B, lengths, seed=int(rng.integers(0, 2**31 - 1)),
                                           time_major=k % 3 != 1))

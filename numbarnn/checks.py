"""`numbarnn check`'s harness: one configuration (Spec), the default sweep, and the checks themselves.

    check_spec(spec, backends)  ->  CheckResult with one numbarnn.verify.Comparison per (output, backend):
        reference   float64 directional finite differences of its gradients (FD_TOLERANCE)
        other       every named output and gradient against the float64 reference on the same
                    (dtype-rounded) inputs, SPEC 10 tolerances (numbarnn.verify.TOLERANCES)
        torch       torch.nn itself (an independent implementation) in float64 against the reference

The names, tolerances and the comparison are numbarnn.verify's, shared with `numbarnn bench` and the tests.
numba is imported only inside the checks (the CLI decides between GPU and simulator first).
"""
from __future__ import annotations

import importlib
import importlib.util
import time
from dataclasses import dataclass, field, replace

import numpy as np

from . import ops
from .backends import BACKENDS as OP_BACKENDS
from .config import RNNCall, rnn_config
from .verify import (BLOCK_GRADIENTS, BLOCK_OUTPUTS, FD_TOLERANCE, PEEPHOLE_GRADIENTS, Comparison, compare, host,
                     rnn_named, tolerances, worst)

CUDA_BACKEND_MODULE = "numbarnn.kernels.backend"

DIRECTIONS = ("unidirectional", "bidirectional")
INPUT_MODES = ("linear_input", "skip_input", "auto_select")
DTYPES = ("float16", "float32", "float64")
#: what `numbarnn check --backends` accepts: numbarnn's backends, and torch (torch.nn as an independent oracle)
BACKEND_NAMES = (*OP_BACKENDS, "torch")

# ---------------------------------------------------------------------------------------------------
# GPU or simulator: decided before numba is imported
# ---------------------------------------------------------------------------------------------------

def load_cuda_backend():
    """(module, None) or (None, reason) for numbarnn.kernels.backend (the kernels may not exist yet)."""
    try:
        return importlib.import_module(CUDA_BACKEND_MODULE), None
    except Exception as exc:  # missing module, or one being written: report, do not crash
        return None, f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------------------
# one configuration to check / explain
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """One configuration of `check` / `explain` (cuDNN RNN op, or BlockLSTM when blocklstm=True)."""

    mode: str = "lstm"
    layers: int = 1                 # L
    units: int = 3                  # H (C for BlockLSTM)
    input_size: int | None = None   # I (None: H for skip_input, else 2)
    direction: str = "unidirectional"
    input_mode: str = "linear_input"
    proj: int = 0                   # num_proj (P), 0 = none
    batch: int = 2                  # B
    time: int = 3                   # T
    lengths: tuple | None = None    # sequence_lengths [B], None = all T
    dtype: str = "float32"
    dropout: float = 0.0
    seed: int = 0                   # op attributes seed / seed2 (dropout)
    seed2: int = 0
    data_seed: int = 0              # random inputs, params and upstream gradients
    batch_major: bool = False       # time_major=False
    blocklstm: bool = False
    peephole: bool = False
    v1: bool = False                # BlockLSTM (V1, layout icfo) instead of BlockLSTMV2 (ifco)
    cell_clip: float | None = None  # None: the op's default (V1 3.0, V2 0.0 = off)
    forget_bias: float = 1.0        # V1 only
    seq_len_max: int | None = None  # BlockLSTM; None = T
    zoneout: float = 0.0            # haste's zoneout of h (SPEC 6.1), 0 = none

    @property
    def I(self) -> int:  # noqa: E743 - the SPEC's letter
        if self.input_size is not None:
            return self.input_size
        return self.units if self.input_mode == "skip_input" else 2

    @property
    def clip(self) -> float:
        return (3.0 if self.v1 else 0.0) if self.cell_clip is None else self.cell_clip

    @property
    def slm(self) -> int:
        return self.time if self.seq_len_max is None else self.seq_len_max

    def label(self) -> str:
        if self.blocklstm:
            parts = ["BlockLSTM" if self.v1 else "BlockLSTMV2", f"C={self.units}", f"I={self.I}",
                     f"T={self.time}", f"B={self.batch}"]
            if self.peephole:
                parts.append("peephole")
            if self.slm != self.time:
                parts.append(f"seq_len_max={self.slm}")
            if self.clip > 0:
                parts.append(f"cell_clip={self.clip:g}")
            if self.v1:
                parts.append(f"forget_bias={self.forget_bias:g}")
            return " ".join(parts + [self.dtype])
        parts = [self.mode, f"L={self.layers}", f"H={self.units}", f"I={self.I}", f"T={self.time}",
                 f"B={self.batch}"]
        if self.direction == "bidirectional":
            parts.append("bidirectional")
        if self.input_mode != "linear_input":
            parts.append(self.input_mode)
        if self.proj:
            parts.append(f"proj={self.proj}")
        if self.lengths is not None:
            parts.append("lengths=" + ",".join(str(v) for v in self.lengths))
        if self.batch_major:
            parts.append("batch-major")
        if self.dropout:
            parts.append(f"dropout={self.dropout:g}")
        if self.zoneout:
            parts.append(f"zoneout={self.zoneout:g}")
        return " ".join(parts + [self.dtype])

    def rnn_config(self):
        return rnn_config(self.layers, self.units, self.I, self.mode, self.input_mode, self.direction, self.proj,
                          self.dropout, self.seed, self.seed2, zoneout=self.zoneout)

    def rnn_call(self, is_training: bool = True):
        lengths = self.lengths if self.lengths is not None else (self.time,) * self.batch
        return RNNCall(self.rnn_config(), self.time, self.batch, np.dtype(self.dtype), not self.batch_major,
                       is_training, tuple(lengths))


#: the configurations of `numbarnn check` without config flags: every mode, bidirectional, projection,
#: skip input, ragged lengths with 0, batch-major, dropout, float32 and float64, BlockLSTM V1/V2 with peephole
SWEEP = (
    Spec(mode="lstm", layers=1, units=3, input_size=2, time=3, batch=2, dtype="float64"),
    Spec(mode="gru", layers=2, units=3, input_size=2, direction="bidirectional", time=3, batch=3,
         lengths=(3, 1, 2), dtype="float32"),
    Spec(mode="rnn_tanh", layers=1, units=3, input_mode="skip_input", time=3, batch=2, dtype="float64"),
    Spec(mode="rnn_relu", layers=2, units=2, input_size=3, time=3, batch=2, batch_major=True, dtype="float32"),
    Spec(mode="lstm", layers=2, units=4, input_size=3, proj=2, direction="bidirectional", time=3, batch=2,
         dtype="float32"),
    Spec(mode="lstm", layers=1, units=3, input_size=2, direction="bidirectional", time=4, batch=4,
         lengths=(4, 2, 0, 1), dtype="float64"),
    Spec(mode="gru", layers=2, units=3, input_size=3, input_mode="auto_select", time=3, batch=2, dropout=0.5,
         seed=7, seed2=11, dtype="float64"),
    Spec(mode="lstm", layers=2, units=3, input_size=2, direction="bidirectional", time=3, batch=2, dropout=0.3,
         seed=3, seed2=5, batch_major=True, lengths=(3, 1), dtype="float32"),
    Spec(mode="rnn_tanh", layers=2, units=4, input_size=2, direction="bidirectional", time=4, batch=3,
         lengths=(2, 4, 0), dtype="float32"),
    Spec(blocklstm=True, v1=True, peephole=True, units=3, input_size=2, time=3, batch=2, dtype="float64"),
    Spec(blocklstm=True, v1=False, peephole=True, units=3, input_size=2, time=4, batch=2, seq_len_max=3,
         dtype="float32"),
    Spec(blocklstm=True, v1=False, units=4, input_size=3, time=3, batch=3, cell_clip=0.5, dtype="float64"),
)


# ---------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------

@dataclass
class CheckResult:
    """The comparisons of one configuration (numbarnn.verify.Comparison rows) and what the backends reported."""

    spec: Spec
    rows: list = field(default_factory=list)
    launches: dict = field(default_factory=dict)   # backend -> {"forward": n, "backward": n}
    skipped: list = field(default_factory=list)    # "backend: why" for backends that cannot run this config
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def worst(self, backend: str) -> Comparison | None:
        """The row of `backend` furthest from its tolerance (a failure first)."""
        return worst([r for r in self.rows if r.backend == backend])


# ---------------------------------------------------------------------------------------------------
# check: cuDNN RNN ops
# ---------------------------------------------------------------------------------------------------

def launch_info(be_module, phase: str):
    """(total, detail) of the backend's last `phase` call from its `last_launch_count()`, or None.

    Accepts an int, an object with `total` (and optionally `per_step`, `steps`, `by_kernel`), or a dict of
    those keyed by "forward" / "backward".
    """
    if be_module is None or not hasattr(be_module, "last_launch_count"):
        return None
    try:
        raw = be_module.last_launch_count()
    except Exception as exc:
        return None, f"last_launch_count() failed: {_exc(exc)}"
    if isinstance(raw, dict):
        raw = raw.get(phase)
    if raw is None:
        return None
    if isinstance(raw, int):
        return raw, str(raw)
    total = getattr(raw, "total", None)
    if not isinstance(total, int):
        return None, str(raw)
    parts = [str(total)]
    if getattr(raw, "steps", 0):
        parts.append(f"({getattr(raw, 'per_step', '?')} per step x {raw.steps} steps")
        parts[-1] += ")" if not getattr(raw, "by_kernel", None) else ";"
    by_kernel = getattr(raw, "by_kernel", None)
    if by_kernel:
        text = ", ".join(f"{k} {v}" for k, v in by_kernel.items())
        parts.append(text + ")" if len(parts) > 1 else f"({text})")
    return total, " ".join(parts)


def _run_rnn(case, backend: str, be_module=None):
    """{name: NumPy array} of forward and backward on `backend`, plus the launch counts when exposed."""
    from .testing import run_backward, run_forward  # lazy: testing imports hypothesis
    launches = {}
    fwd = run_forward(case, backend)
    info = launch_info(be_module, "forward")
    if info is not None:
        launches["forward"] = info
    grads = run_backward(case, fwd, backend)
    info = launch_info(be_module, "backward")
    if info is not None:
        launches["backward"] = info
    return rnn_named(fwd, grads, case.cfg.has_cell_state), launches


def check_rnn(spec: Spec, backends, tolerance=None, cuda_module=None) -> CheckResult:
    from .testing import check_rnn_gradients, make_rnn_case  # lazy: testing imports hypothesis
    result = CheckResult(spec)
    cfg = spec.rnn_config()
    lengths = None if spec.lengths is None else np.asarray(spec.lengths, dtype=np.int32)
    case64 = make_rnn_case(cfg, spec.time, spec.batch, lengths, seed=spec.data_seed, dtype=np.float64,
                           time_major=not spec.batch_major)
    fd_tol = FD_TOLERANCE if tolerance is None else tolerance
    if "reference" in backends:        # finite differences of the reference, in float64
        try:
            for name, err in check_rnn_gradients(case64, backend="reference", seed=spec.data_seed).items():
                result.rows.append(Comparison(f"{name} (FD)", "reference", err, fd_tol))
        except Exception as exc:
            result.rows.append(Comparison("finite differences", "reference", None, fd_tol, _exc(exc)))
    # the float64 reference of exactly the inputs the backends see (rounded to the dtype first)
    case = case64.astype(spec.dtype)
    if "torch" in backends:
        _check_against_torch_nn(result, case64, tolerance)
    compare_to = [b for b in backends if b not in ("torch",) and (b != "reference" or
                                                                   np.dtype(spec.dtype) != np.float64)]
    if not compare_to:
        return result
    ref, _ = _run_rnn(case.astype(np.float64), "reference")
    _compare_backends(result, compare_to, lambda backend, module: _run_rnn(case, backend, module), ref,
                      tolerances(spec.dtype, tolerance), cuda_module)
    return result


def _compare_backends(result: CheckResult, backends, run, ref: dict, tols, cuda_module) -> None:
    """run(backend, launch-count module) -> (named outputs, launches) of each backend, compared with `ref`."""
    for backend in backends:
        try:
            got, launches = run(backend, cuda_module if backend == "cuda" else None)
        except Exception as exc:
            result.rows.append(Comparison("forward/backward", backend, None, tols[0], _exc(exc)))
            continue
        if launches:
            result.launches[backend] = launches
        result.rows += compare(got, ref, backend, tols=tols)


def _check_against_torch_nn(result: CheckResult, case64, tolerance) -> None:
    """torch.nn.LSTM/GRU/RNN (an independent implementation) against the float64 reference, same inputs."""
    from .torch import torch_nn_outputs, torch_nn_supports  # lazy: torch is optional
    why = torch_nn_supports(case64)
    if why:
        result.skipped.append(f"torch: {why}")
        return
    tol, _ = tolerances(np.float64, tolerance)
    try:
        got = torch_nn_outputs(case64)
    except Exception as exc:
        result.rows.append(Comparison("forward/backward", "torch", None, tol, _exc(exc)))
        return
    ref, _ = _run_rnn(case64, "reference")
    result.rows += compare(got, {k: v for k, v in ref.items() if k in got}, "torch", tols=(tol, tol))


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _exc(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 160 else text[:157] + "..."


# ---------------------------------------------------------------------------------------------------
# check: BlockLSTM ops
# ---------------------------------------------------------------------------------------------------

def _block_inputs(spec: Spec, dtype):
    """x, cs_prev, h_prev, w, wci, wcf, wco, b and the upstream cs_grad, h_grad (float64, then cast)."""
    rng = np.random.default_rng(spec.data_seed)
    T, B, I, C = spec.time, spec.batch, spec.I, spec.units

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(dtype)

    inputs = dict(x=rand(T, B, I), cs_prev=rand(B, C), h_prev=rand(B, C), w=rand(I + C, 4 * C), wci=rand(C),
                  wcf=rand(C), wco=rand(C), b=rand(4 * C))
    upstream = dict(cs_grad=rand(T, B, C), h_grad=rand(T, B, C))
    return inputs, upstream


_BLOCK_ARGS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")


def _run_block(spec: Spec, inputs: dict, upstream: dict, backend: str, be_module=None):
    args = [inputs[k] for k in _BLOCK_ARGS]
    launches = {}
    if spec.v1:
        fwd = ops.block_lstm(spec.slm, *args, forget_bias=spec.forget_bias, cell_clip=spec.clip,
                             use_peephole=spec.peephole, backend=backend)
    else:
        fwd = ops.block_lstm_v2(spec.slm, *args, cell_clip=spec.clip, use_peephole=spec.peephole,
                                backend=backend)
    info = launch_info(be_module, "forward")
    if info is not None:
        launches["forward"] = info
    grad_op = ops.block_lstm_grad if spec.v1 else ops.block_lstm_grad_v2
    bwd = grad_op(spec.slm, *args, *fwd, upstream["cs_grad"], upstream["h_grad"], use_peephole=spec.peephole,
                  backend=backend)
    info = launch_info(be_module, "backward")
    if info is not None:
        launches["backward"] = info
    named = dict(zip(BLOCK_OUTPUTS, fwd))
    named.update(zip(BLOCK_GRADIENTS, bwd))
    if not spec.peephole:   # the peephole gradients are not defined without peepholes
        for k in PEEPHOLE_GRADIENTS:
            named.pop(k)
    return {k: host(v) for k, v in named.items()}, launches


def _block_fd_rows(spec: Spec, result: CheckResult, tolerance):
    """Directional finite differences of <cs, cs_grad> + <h, h_grad> for the reference, in float64."""
    from .testing import directional_check  # lazy: testing imports hypothesis
    inputs, upstream = _block_inputs(spec, np.float64)
    got, _ = _run_block(spec, inputs, upstream, "reference")
    fd_tol = FD_TOLERANCE if tolerance is None else tolerance
    note = ""
    if spec.clip > 0 and np.max(np.abs(got["cs"]), initial=0.0) >= spec.clip:
        # TF's gradient ignores the clip, so finite differences through an active clip disagree by design:
        # check the gradient of the same cell without the clip instead
        spec = replace(spec, cell_clip=0.0)
        got, _ = _run_block(spec, inputs, upstream, "reference")
        note = "cell_clip active: checked with cell_clip=0 (the gradient ignores the clip)"

    def loss(name):
        def f(v):
            out, _ = _run_block(spec, {**inputs, name: v}, upstream, "reference")
            return float(np.vdot(out["cs"], upstream["cs_grad"]) + np.vdot(out["h"], upstream["h_grad"]))
        return f

    rng = np.random.default_rng(spec.data_seed)
    for arg in _BLOCK_ARGS:
        if arg in ("wci", "wcf", "wco") and not spec.peephole:
            continue
        err = directional_check(loss(arg), inputs[arg], got[f"{arg}_grad"], rng)
        result.rows.append(Comparison(f"{arg}_grad (FD)", "reference", err, fd_tol, note))


def check_block(spec: Spec, backends, tolerance=None, cuda_module=None) -> CheckResult:
    result = CheckResult(spec)
    if "reference" in backends:
        try:
            _block_fd_rows(spec, result, tolerance)
        except Exception as exc:
            result.rows.append(Comparison("finite differences", "reference", None,
                                   FD_TOLERANCE if tolerance is None else tolerance, _exc(exc)))
    inputs, upstream = _block_inputs(spec, np.float64)
    inputs = {k: v.astype(spec.dtype) for k, v in inputs.items()}
    upstream = {k: v.astype(spec.dtype) for k, v in upstream.items()}
    if "torch" in backends:
        result.skipped.append("torch: torch.nn has no BlockLSTM")
    compare_to = [b for b in backends if b != "torch" and (b != "reference" or np.dtype(spec.dtype) != np.float64)]
    if not compare_to:
        return result
    ref, _ = _run_block(spec, {k: v.astype(np.float64) for k, v in inputs.items()},
                        {k: v.astype(np.float64) for k, v in upstream.items()}, "reference")
    _compare_backends(result, compare_to, lambda backend, module: _run_block(spec, inputs, upstream, backend, module),
                      ref, tolerances(spec.dtype, tolerance), cuda_module)
    return result


def check_spec(spec: Spec, backends, tolerance=None, cuda_module=None) -> CheckResult:
    start = time.perf_counter()
    run = check_block if spec.blocklstm else check_rnn
    try:
        result = run(spec, backends, tolerance, cuda_module)
    except Exception as exc:   # e.g. the float64 reference itself failed: a failed check, not a crash
        result = CheckResult(spec, [Comparison("check", "reference", None, FD_TOLERANCE, _exc(exc))])
    result.seconds = time.perf_counter() - start
    return result



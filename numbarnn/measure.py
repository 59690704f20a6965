"""What `numbarnn bench` measures: one adapter per backend, validation before timing, the timing itself.

An adapter turns an RNN case into three closures, so that every backend is timed the same way:

    forward, backward, named = adapter.calls(case)
    forward() -> forward outputs; backward(forward outputs) -> gradients (the timed work)
    named(forward outputs, gradients) -> {name: NumPy array} (validation only; numbarnn.verify's names)

    reference   numbarnn's NumPy reference, NumPy arrays in and out
    cpu         numbarnn's numba CPU backend, NumPy arrays in and out
    torch       torch.nn.LSTM / GRU / RNN on the CPU: what a user without a GPU would pick instead
    cuda        numbarnn's numba.cuda kernels, device arrays in and out (nothing through the host)
    cudnn       cuDNN through torch.nn on cuda, TF32 off

`measure_all` validates each backend against the float64 reference at T = CHECK_T (numbarnn.verify: SPEC 10
tolerances), then times the ones that passed: `warmup` untimed calls, then the median of `reps`.  The
validation call is each backend's first for a cell in the process: its time, JIT compilation included, is
reported separately as the cold time.  numba and torch are imported only inside the adapters.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from . import backends, ops, settings
from . import device as _device
from .config import rnn_config
from .params import from_torch_state_dict
from .settings import SIM_VAR
from .verify import compare, host, rnn_named, tolerances, worst

CHECK_T = 2                      # time steps of the validation slice
BACKENDS = ("reference", "cpu", "torch", "cuda", "cudnn")   # the order of the rows
BASELINES = ("cudnn", "torch", "reference")                 # ratios are against the first of these in the run
MUST_HAVE = ("output", "output_h", "input_backprop", "params_backprop")


def make_case(mode: str, H: int, B: int, T: int, I: int, dtype, seed: int = 0, num_proj: int = 0):  # noqa: E741
    """A one-layer, unidirectional, linear-input case (full lengths), scaled like torch's default init."""
    from .testing import make_rnn_case  # lazy: testing imports hypothesis

    cfg = rnn_config(1, H, I, mode, input_mode="linear_input", num_proj=num_proj)
    return make_rnn_case(cfg, T, B, None, seed=seed, dtype=dtype, scale=1.0 / math.sqrt(max(H, I)))


# --------------------------------------------------------------------------------------------------
# adapters
# --------------------------------------------------------------------------------------------------

class OpsAdapter:
    """numbarnn's ops on NumPy arrays, with backend=`op_backend`."""

    name = op_backend = "reference"

    def __init__(self, name: str = "reference"):
        self.name = self.op_backend = name

    def sync(self) -> None:
        pass

    def put(self, a):
        return None if a is None else np.ascontiguousarray(a)

    def calls(self, case):
        x, h0, c0, params, dy, dhT, dcT = (self.put(a) for a in (case.x, case.h0, case.c0, case.params, case.dy,
                                                                  case.dhT, case.dcT))
        attrs, be = case.attrs, self.op_backend

        def forward():
            return ops.cudnn_rnn_v3(x, h0, c0, params, None, is_training=True, backend=be, **attrs)

        def backward(fwd):
            y, hT, cT, reserve, host_reserved = fwd
            return ops.cudnn_rnn_backprop_v3(x, h0, c0, params, None, y, hT, cT, dy, dhT, dcT, reserve,
                                             host_reserved, backend=be, **attrs)

        def named(fwd, grads):
            return rnn_named(fwd, grads, case.cfg.has_cell_state)

        return forward, backward, named

    def start(self) -> None:
        """Called once before this backend's first call of the run (stop: after its last)."""

    def stop(self) -> None:
        pass

    def extra(self) -> dict:
        return {}


class CudaAdapter(OpsAdapter):
    """numbarnn's numba.cuda kernels (backend="cuda") on device arrays; `version`: pin the step kernels
    (NUMBARNN_STEP_VERSION around every call, the row is named "cuda v<version>"), None: the driver's choice."""

    def __init__(self, version: int | None = None):
        super().__init__("cuda")
        self.version = version
        if version is not None:
            self.name = f"cuda v{version}"

    def calls(self, case):
        forward, backward, named = super().calls(case)
        if self.version is None:
            return forward, backward, named
        from .kernels.driver import pinned_step_version  # lazy: the kernels import numba.cuda

        def pinned(fn):
            def call(*args):
                with pinned_step_version(self.version):
                    return fn(*args)
            return call

        return pinned(forward), pinned(backward), named

    def sync(self) -> None:
        from numba import cuda  # lazy: numba.cuda after the simulator switch
        cuda.synchronize()

    def put(self, a):
        from numba import cuda  # lazy: numba.cuda after the simulator switch
        return None if a is None else cuda.to_device(np.ascontiguousarray(a))

    def extra(self) -> dict:
        """Kernel launches of the last forward / backward call."""
        try:
            from .kernels import driver  # lazy: the kernels import numba.cuda
            last = driver.last_launch_count()
            return {"launches_fwd": last["forward"].total, "launches_bwd": last["backward"].total,
                    "why": last["forward"].note}
        except Exception:   # pragma: no cover - informative only
            return {}


class TorchNNAdapter:
    """torch.nn.LSTM / GRU / RNN in training mode on `device` ("cuda": cuDNN; "cpu": torch's own kernels).

    On cuda TF32 is switched off for cuDNN's RNNs during the run (torch allows it by default on Ampere and
    later): float32 means float32, as in numbarnn, so that the SPEC 10 tolerances apply and the timings compare
    like with like.  On the CPU torch uses as many threads as numba (numba.get_num_threads()): same machine,
    same thread count.
    """

    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        self._restore = None

    def start(self) -> None:
        import torch  # lazy: torch is optional
        if self.device == "cpu":
            import numba  # lazy: numba after the simulator switch
            old = torch.get_num_threads()
            torch.set_num_threads(numba.get_num_threads())
            self._restore = lambda: torch.set_num_threads(old)
            return
        rnn = getattr(torch.backends.cudnn, "rnn", None)
        if rnn is not None and hasattr(rnn, "fp32_precision"):     # torch >= 2.9: the new API only (no mixing)
            old = rnn.fp32_precision
            rnn.fp32_precision = "ieee"
            self._restore = lambda: setattr(rnn, "fp32_precision", old)
        else:
            old = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            self._restore = lambda: setattr(torch.backends.cudnn, "allow_tf32", old)

    def stop(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def sync(self) -> None:
        import torch  # lazy: torch is optional
        if self.device == "cuda":
            torch.cuda.synchronize()

    def calls(self, case):
        import torch  # lazy: torch is optional

        from .torch import torch_nn_module  # lazy: torch is optional

        cfg = case.cfg
        tdt = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}[str(case.dtype)]
        module = torch_nn_module(cfg, case.params, tdt).to(device=self.device).train()

        def tensor(a, grad=False):
            return None if a is None else torch.tensor(np.asarray(a), device=self.device, dtype=tdt,
                                                       requires_grad=grad)

        x, h0, c0 = tensor(case.x, True), tensor(case.h0, True), tensor(case.c0, True)    # [T,B,I] [1,B,H] [1,B,H]
        dy, dhT, dcT = tensor(case.dy), tensor(case.dhT), tensor(case.dcT)
        lstm = cfg.has_cell_state
        names = [n for n, _ in module.named_parameters()]
        inputs = [x, h0] + ([c0] if lstm else []) + [p for _, p in module.named_parameters()]

        def forward():
            return module(x, (h0, c0) if lstm else h0)

        def backward(fwd):
            y, state_T = fwd
            outs, grads = ([y, state_T[0], state_T[1]], [dy, dhT, dcT]) if lstm else ([y, state_T], [dy, dhT])
            return torch.autograd.grad(outs, inputs, grads)

        def named(fwd, grads):
            y, state_T = fwd
            hT, cT = state_T if lstm else (state_T, None)
            k = 3 if lstm else 2
            params = from_torch_state_dict(cfg, {n: host(g).astype(np.float64) for n, g in zip(names, grads[k:])},
                                           dtype=np.float64)
            out = {"output": host(y), "output_h": host(hT), "output_c": host(cT), "input_backprop": host(grads[0]),
                   "input_h_backprop": host(grads[1]), "input_c_backprop": host(grads[2]) if lstm else None,
                   "params_backprop": params}
            return {n: a for n, a in out.items() if a is not None}

        return forward, backward, named

    def extra(self) -> dict:
        return {}


#: where the cudnn adapter runs ("cpu" only to test the cudnn path without a GPU)
TORCH_CUDA_DEVICE = "cuda"

#: backend name -> a new adapter
ADAPTERS = {"reference": lambda: OpsAdapter("reference"),
            "cpu": lambda: OpsAdapter("cpu"),
            "torch": lambda: TorchNNAdapter("torch", "cpu"),
            "cuda": CudaAdapter,
            "cudnn": lambda: TorchNNAdapter("cudnn", TORCH_CUDA_DEVICE)}


def make_adapter(name: str):
    return ADAPTERS[name]()


# --------------------------------------------------------------------------------------------------
# what is available (numba and torch imported only here, after use_simulator_unless_gpu)
# --------------------------------------------------------------------------------------------------

def cpu_status() -> tuple[bool, str]:
    if "cpu" not in backends.BACKENDS:
        return False, "numbarnn has no cpu backend in this version"
    import numba  # lazy: numba after the simulator switch

    from .cpu import microkernel, tuning  # lazy: the cpu backend imports numba
    shapes = ", ".join(f"{name} {V}x{NR}" + (f" (wide {V}x{NRW})" if NRW != NR else "")
                       for name, G in (("LSTM", 4), ("GRU", 3), ("RNN", 1))
                       for V, NR, NRW in [microkernel.tile_shape(G) + (microkernel.wide_rows(G),)])
    how = "measured here" if tuning.enabled() else "static rule, NUMBARNN_CPU_TUNE=0"
    return True, (f"numbarnn.cpu (numba {numba.__version__}, {numba.get_num_threads()} threads) on "
                  f"{tuning.cpu_model()}, {8 * microkernel.simd_bytes()}-bit vectors; tile shapes V x NR ({how}): {shapes}")


def cuda_status(allow_simulator: bool) -> tuple[bool, bool, str]:
    """-> (usable, in the simulator, description) of the cuda backend."""
    if settings.simulator():
        if allow_simulator:
            return True, True, "numba's CUDA simulator (--simulator)"
        return False, True, (f"needs a real GPU (numba's CUDA simulator is active: no GPU found, or {SIM_VAR}=1), "
                             "or --simulator to run it in the simulator (validates; its timings mean nothing)")
    try:
        from numba import cuda  # lazy: numba.cuda after the simulator switch
        if not cuda.is_available():
            return False, False, "needs a real GPU (numba finds no CUDA driver/device), or --simulator"
        name = cuda.get_current_device().name
        return True, False, name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:
        return False, False, f"numba.cuda is not usable ({type(exc).__name__}: {exc})"


def torch_status(device: str) -> tuple[bool, str]:
    """-> (usable, description) of torch.nn on `device`; torch is not imported for cuda when there is no GPU."""
    if device == "cuda" and not _device.real_gpu_present():
        return False, "needs torch with CUDA on a GPU (no GPU found)"
    try:
        import torch  # lazy: torch is optional
    except Exception as exc:
        return False, f"torch does not import ({type(exc).__name__}: {exc})"
    if device != "cuda":
        return True, f"torch.nn {torch.__version__} on the CPU ({torch.get_num_threads()} threads by default)"
    try:
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} has no usable CUDA"
        if not (torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled):
            return False, f"torch {torch.__version__} has no usable cuDNN"
        return True, (f"cuDNN {torch.backends.cudnn.version()} via torch {torch.__version__}, TF32 off, on "
                      f"{torch.cuda.get_device_name()}")
    except Exception as exc:   # pragma: no cover - broken installs
        return False, f"torch's CUDA is not usable ({type(exc).__name__}: {exc})"


# --------------------------------------------------------------------------------------------------
# validation and timing
# --------------------------------------------------------------------------------------------------

@dataclass
class Check:
    error: float            # ‖out − ref‖/‖ref‖ of the output worst relative to its tolerance
    output: str             # the output it belongs to
    tolerance: float
    ok: bool
    message: str = ""


@dataclass
class Row:
    mode: str
    dtype: str
    H: int
    B: int
    T: int
    I: int  # noqa: E741
    backend: str
    check: Check | None = None
    cold_ms: float | None = None      # the validation call when it was the first of this backend and cell in
    #                                   the process (T = CHECK_T): numba's JIT compilation included
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    baseline: str = ""
    fwd_ratio: float | None = None
    fwdbwd_ratio: float | None = None
    extra: dict = field(default_factory=dict)
    note: str = ""
    P: int = 0                        # num_proj (0: none)

    @property
    def shape(self) -> str:
        return shape_label((self.H, self.B, self.T))

    @property
    def timed(self) -> bool:
        return self.fwd_ms is not None and self.fwdbwd_ms is not None


def shape_label(shape) -> str:
    return "x".join(str(v) for v in shape)


def reference_outputs(case) -> dict:
    """The float64 reference of `case` on the same (dtype-rounded) inputs."""
    from .testing import run_named  # lazy: testing imports hypothesis
    return run_named(case.astype(np.float64), "reference")


def named_outputs(adapter, case) -> dict:
    """One forward + backward of `adapter` on `case`: {name: NumPy array}."""
    forward, backward, named = adapter.calls(case)
    fwd = forward()
    grads = backward(fwd)
    adapter.sync()
    return named(fwd, grads)


def validate(adapter, case, ref: dict) -> Check:
    """Every named output `adapter` has vs the float64 reference `ref`, SPEC 10 tolerances of case.dtype."""
    tol_out, _ = tolerances(case.dtype)
    try:
        got = named_outputs(adapter, case)
    except Exception as exc:
        return Check(math.inf, "-", tol_out, False, f"{type(exc).__name__}: {exc}")
    missing = [n for n in MUST_HAVE if n not in got]
    if missing:
        return Check(math.inf, missing[0], tol_out, False, f"no {', '.join(missing)} returned")
    rows = compare(got, {n: v for n, v in ref.items() if n in got}, adapter.name, case.dtype)
    bad = [r for r in rows if not r.ok]
    if bad:
        w = worst(bad)
        return Check(math.inf if w.error is None else w.error, w.name, w.tolerance, False,
                     "; ".join(f"{r.name} rel. error {r.error:.2e} > {r.tolerance:.0e}" if r.error is not None
                               else f"{r.name}: {r.note}" for r in bad))
    # shown: the worst of what a user reads (outputs and gradients); the opaque reserve_space is validated too,
    # but only shown when it fails (its error is the dtype's rounding of bounded activations, the same every row)
    w = worst([r for r in rows if r.name != "reserve_space"] or rows)
    return Check(w.error, w.name, w.tolerance, True)


def median_ms(fn, sync, reps: int, warmup: int) -> float:
    """Median wall time in ms of fn() over `reps` calls after `warmup` untimed ones, synchronised around each."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median ms of fn() over `reps` calls, synchronised with the GPU when numba.cuda runs on one.

    `warmup` untimed calls first keep kernel compilation out of the numbers; in the CUDA simulator there is
    nothing to synchronise and no warm-up (its timings only say that it is slow).
    """
    from numba import config, cuda  # lazy: numba.cuda after the simulator switch
    if config.ENABLE_CUDASIM:
        return median_ms(fn, lambda: None, reps, 0)
    return median_ms(fn, cuda.synchronize, reps, warmup)


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    """Microseconds per fn() for host-side costs of a few us, where one call is too short to time alone: the
    median over `rounds` of the mean of `calls` calls, after min(calls, 100) untimed ones."""
    for _ in range(min(calls, 100)):
        fn()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls)
    return 1e6 * statistics.median(means)


def time_backend(adapter, case, reps: int, warmup: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of `adapter` on `case`."""
    forward, backward, _ = adapter.calls(case)
    fwd_ms = median_ms(forward, adapter.sync, reps, warmup)
    fwdbwd_ms = median_ms(lambda: backward(forward()), adapter.sync, reps, warmup)
    return fwd_ms, fwdbwd_ms


def add_ratios(rows: list[Row]) -> None:
    """ratio = time / time of the baseline (first of BASELINES timed for the same mode and shape)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.mode, r.H, r.B, r.T), []).append(r)
    for group in groups.values():
        timed = {r.backend: r for r in group if r.timed}
        base = next((timed[b] for b in BASELINES if b in timed), None)
        if base is None:
            continue
        for r in group:
            r.baseline = base.backend
            if r.timed:
                r.fwd_ratio = r.fwd_ms / base.fwd_ms if base.fwd_ms > 0 else None
                r.fwdbwd_ratio = r.fwdbwd_ms / base.fwdbwd_ms if base.fwdbwd_ms > 0 else None


def measure_all(modes, dtype: str, shapes, adapters: dict, reps: int, warmup: int, log=print, num_proj: int = 0
                ) -> tuple[list[Row], bool]:
    """Validate, then time, every adapter for every (mode, shape); an LSTM projection of num_proj outputs when
    it is > 0. -> (rows, anything failed)."""
    rows: list[Row] = []
    failed = False
    seen = set()                # (adapter, mode) pairs that have run: their next call is warm
    for mode in modes:
        for H, B, T in shapes:
            I = H
            label = f"{mode} {shape_label((H, B, T))}"
            small = make_case(mode, H, B, CHECK_T, I, np.float64, seed=H + B, num_proj=num_proj).astype(dtype)
            ref = reference_outputs(small)
            case = None
            for name, adapter in adapters.items():
                row = Row(mode, dtype, H, B, T, I, name, P=num_proj)
                rows.append(row)
                t0 = time.perf_counter()
                row.check = validate(adapter, small, ref)
                if (name, mode) not in seen:          # the first call of this backend and cell in the process
                    row.cold_ms = (time.perf_counter() - t0) * 1e3
                    seen.add((name, mode))
                if not row.check.ok:
                    failed = True
                    row.note = row.check.message
                    log(f"  {label:<18} {name:<9} validation FAILED: {row.check.message}; not timed")
                    continue
                case = case if case is not None else make_case(mode, H, B, T, I, dtype, seed=1, num_proj=num_proj)
                try:
                    row.fwd_ms, row.fwdbwd_ms = time_backend(adapter, case, reps, warmup)
                except Exception as exc:
                    failed = True
                    row.fwd_ms = row.fwdbwd_ms = None
                    row.note = f"timing failed: {type(exc).__name__}: {exc}"
                    log(f"  {label:<18} {name:<9} {row.note}")
                    continue
                row.extra = adapter.extra()
                row.note = row.extra.get("why", "") or row.note      # e.g. why v3 ran, or why v2 ran instead
                log(f"  {label:<18} {name:<9} error vs float64 reference {row.check.error:.1e} "
                    f"({row.check.output}) ok; fwd {row.fwd_ms:.3f} ms, fwd+bwd {row.fwdbwd_ms:.3f} ms")
    add_ratios(rows)
    return rows, failed

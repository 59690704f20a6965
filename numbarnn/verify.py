"""What "agrees with the reference" means, written once: output names, SPEC 10 tolerances, the comparison.

Everything that compares a backend with the float64 reference uses this module: `numbarnn check`
(numbarnn/checks.py), `numbarnn bench`'s validation before timing (numbarnn/measure.py), the tests and the
tutorials.

    TOLERANCES[dtype] = (outputs, gradients)      ‖out − ref‖/‖ref‖ allowed against the float64 reference
    RNN_OUTPUTS, RNN_GRADIENTS                    the names of CudnnRNNV3's outputs and CudnnRNNBackpropV3's
    BLOCK_OUTPUTS, BLOCK_GRADIENTS                the names of BlockLSTM's outputs and BlockLSTMGrad's
    rnn_named(forward, gradients, cell_state)     {name: NumPy array} of one forward + backward
    compare(got, ref, backend, dtype)             one Comparison per name of `ref`

No numba import here (the CLI decides between GPU and simulator before numba is imported).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .reserve import reserve_contents

#: SPEC 10: ‖out − ref‖/‖ref‖ against the float64 reference, as (forward outputs, gradients)
TOLERANCES = {np.dtype(np.float64): (1e-12, 1e-12),
              np.dtype(np.float32): (1e-5, 1e-4),
              np.dtype(np.float16): (1e-2, 1e-2)}

#: relative error allowed between the reference's analytic gradient and a float64 directional finite
#: difference (central, eps = 1e-6: truncation and cancellation leave ~1e-8 .. 1e-7)
FD_TOLERANCE = 1e-5

RNN_OUTPUTS = ("output", "output_h", "output_c", "reserve_space")
RNN_GRADIENTS = ("input_backprop", "input_h_backprop", "input_c_backprop", "params_backprop")
#: the names that exist only for cells with a cell state (SPEC 3: empty placeholders otherwise)
CELL_STATE_NAMES = ("output_c", "input_c_backprop")
BLOCK_OUTPUTS = ("i", "cs", "f", "o", "ci", "co", "h")
BLOCK_GRADIENTS = ("x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad",
                   "b_grad")
PEEPHOLE_GRADIENTS = ("wci_grad", "wcf_grad", "wco_grad")
OUTPUT_NAMES = RNN_OUTPUTS + BLOCK_OUTPUTS          # forward outputs: the first tolerance; the rest: the second


def tolerances(dtype, override: float | None = None) -> tuple[float, float]:
    """(outputs, gradients) tolerance of `dtype`; `override` replaces both."""
    if override is not None:
        return override, override
    return TOLERANCES[np.dtype(dtype)]


def host(a):
    """NumPy array of a NumPy / numba device / torch / __cuda_array_interface__ array; None stays None."""
    if a is None or isinstance(a, np.ndarray):
        return a
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    if hasattr(a, "__cuda_array_interface__"):
        from numba import cuda  # lazy: numba.cuda after the simulator switch
        return cuda.as_cuda_array(a).copy_to_host()
    return np.asarray(a)


def relative_error(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (‖a − b‖ when b is zero; 0 when both are empty)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    nb = np.linalg.norm(b)
    na = np.linalg.norm(a - b)
    return float(na / nb) if nb > 0 else float(na)


def rnn_named(forward, gradients, cell_state: bool) -> dict:
    """{name: NumPy array} of cudnn_rnn_v3's outputs and cudnn_rnn_backprop_v3's gradients.

    The reserve is compared without its per-call nonce (`reserve_contents`); the cell-state names are left out
    for cells without a cell state.  `gradients` may be None (forward only).
    """
    y, hT, cT, reserve = forward[:4]
    named = dict(zip(RNN_OUTPUTS, (y, hT, cT, reserve_contents(host(reserve)))))
    if gradients is not None:
        named.update(zip(RNN_GRADIENTS, gradients))
    if not cell_state:
        for name in CELL_STATE_NAMES:
            named.pop(name, None)
    return {k: host(v) for k, v in named.items()}


@dataclass
class Comparison:
    """One named output of one backend against the reference."""

    name: str
    backend: str
    error: float | None     # ‖out − ref‖/‖ref‖; None when it could not be computed (see note)
    tolerance: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error is not None and self.error <= self.tolerance     # NaN is not <= anything

    @property
    def ratio(self) -> float:
        """error / tolerance (inf for a missing or NaN error): the larger, the worse."""
        if self.error is None or math.isnan(self.error):
            return math.inf
        return self.error / max(self.tolerance, 1e-300)


def compare(got: dict, ref: dict, backend: str, dtype=None, override: float | None = None,
            tols: tuple[float, float] | None = None) -> list[Comparison]:
    """One Comparison per name of `ref`: forward outputs against the first tolerance, gradients the second."""
    tol_out, tol_grad = tols if tols is not None else tolerances(dtype, override)
    rows = []
    for name, want in ref.items():
        tol = tol_out if name in OUTPUT_NAMES else tol_grad
        if name not in got or got[name] is None:
            rows.append(Comparison(name, backend, None, tol, "missing"))
            continue
        try:
            rows.append(Comparison(name, backend, relative_error(got[name], want), tol))
        except ValueError as exc:
            rows.append(Comparison(name, backend, None, tol, f"{name}: {exc}"))
    return rows


def worst(rows: list[Comparison]) -> Comparison | None:
    """The comparison furthest from its tolerance (a failure first)."""
    return max(rows, key=lambda r: r.ratio, default=None)

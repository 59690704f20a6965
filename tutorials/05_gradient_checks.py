"""Tutorial 05: gradient checks with hypothesis, on a cell variant of your own.

    python tutorials/05_gradient_checks.py            # full run
    python tutorials/05_gradient_checks.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
A hand-written backward pass is the easiest place to hide a bug: it runs, the loss even goes down,
and the gradient is a little wrong.  Two tools catch it:

  * finite differences: for a scalar loss L and a random direction v,
        (L(p + eps*v) - L(p - eps*v)) / (2 eps)  ==  <dL/dp, v>   up to O(eps²)
    (numbarnn.testing.directional_check; float64, so eps = 1e-6 leaves ~1e-9 of noise);
  * hypothesis: instead of the one shape you thought of, draw many (odd sizes, T = 1, B = 1, and the
    ragged lengths that break drivers: a length 0, unsorted lengths) and shrink a failure to the
    smallest example that still fails.

The variant here is the CIFG LSTM ("coupled input and forget gate", Greff et al. 2017, "LSTM: A
Search Space Odyssey"), cuDNN style with two biases per gate:

    f = σ(W_f x + bW_f + R_f h + bR_f)      gate order f, g, o (G = 3)
    g = tanh(W_g x + bW_g + R_g h + bR_g)
    o = σ(W_o x + bW_o + R_o h + bR_o)
    c' = f*c + (1-f)*g ;  h' = o*tanh(c')  # the input gate is i = 1 - f

run over a sequence with ragged lengths as SPEC section 5 says (rows past their length keep their
state and output 0).  The script checks it against numbarnn's own LSTM (with i-gate weights = -f-gate
weights, σ(-a) = 1 - σ(a) makes the two cells equal), runs a hypothesis gradient check on it, shows
the same check catching a planted bug, runs numbarnn.testing's own strategies on the library ops,
and times the checks.  Letters: T time, B batch, I input size, H units.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from numbarnn.device import use_simulator_unless_gpu  # imports no numba

# numba reads NUMBA_ENABLE_CUDASIM once, at import: without a GPU, choose the simulator before importing it.
use_simulator_unless_gpu()

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.config import rnn_config  # noqa: E402
from numbarnn.reference.activations import dsigmoid, dtanh, sigmoid, tanh  # noqa: E402
from numbarnn.testing import (TOLERANCES, check_rnn_gradients, directional_check, make_rnn_case,  # noqa: E402
                              ragged_lengths, relative_error, rnn_cases, rnn_configs, run_backward, run_forward)
from numbarnn.measure import timed_ms  # noqa: E402

SIM = bool(numba_config.ENABLE_CUDASIM)


def device_name() -> str:
    if SIM:
        return "numba CUDA simulator (no GPU: one Python thread per CUDA thread, timings are not GPU timings)"
    name = cuda.get_current_device().name
    return "GPU " + (name.decode() if isinstance(name, bytes) else str(name))


# ---------------------------------------------------------------------------------------------------
# 1. The CIFG cell and its sequence driver, forward and backward
# ---------------------------------------------------------------------------------------------------
F_, G_, O_ = 0, 1, 2          # gate offsets in units of H


@dataclass
class CifgCase:
    """One call: inputs, parameters and upstream gradients (float64)."""

    x: np.ndarray        # [T, B, I]
    h0: np.ndarray       # [B, H]
    c0: np.ndarray       # [B, H]
    W: np.ndarray        # [3H, I]
    R: np.ndarray        # [3H, H]
    bW: np.ndarray       # [3H]
    bR: np.ndarray       # [3H]
    lens: np.ndarray     # [B] int32
    dy: np.ndarray       # [T, B, H]  upstream gradients: loss = <y, dy> + <hT, dhT> + <cT, dcT>
    dhT: np.ndarray      # [B, H]
    dcT: np.ndarray      # [B, H]

    ARRAYS = ("x", "h0", "c0", "W", "R", "bW", "bR")


def make_cifg_case(T, B, I, H, lens, seed, scale=0.6) -> CifgCase:
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.standard_normal(shape) * scale   # noqa: E731
    lens = np.full(B, T, np.int32) if lens is None else np.asarray(lens, np.int32)
    return CifgCase(r(T, B, I), r(B, H), r(B, H), r(3 * H, I), r(3 * H, H), r(3 * H), r(3 * H), lens,
                    r(T, B, H), r(B, H), r(B, H))


def cifg_forward(k: CifgCase, x=None, h0=None, c0=None, W=None, R=None, bW=None, bR=None):
    """-> y [T, B, H], hT [B, H], cT [B, H], saved {acts [T, B, 3H], c [T, B, H]}.  Keyword overrides
    (x=..., W=...) let the finite differences perturb one array."""
    x, h0, c0 = (k.x if x is None else x), (k.h0 if h0 is None else h0), (k.c0 if c0 is None else c0)
    W, R = (k.W if W is None else W), (k.R if R is None else R)
    bW, bR = (k.bW if bW is None else bW), (k.bR if bR is None else bR)
    T, B, _ = x.shape
    H = h0.shape[1]
    gx = x @ W.T + bW                                     # [T, B, 3H] all steps at once
    h, c = h0.copy(), c0.copy()                           # [B, H]
    y = np.zeros((T, B, H))
    saved = {"acts": np.zeros((T, B, 3 * H)), "c": np.zeros((T, B, H))}
    for t in range(T):
        b = np.flatnonzero(t < k.lens)                    # active rows; the others keep their state
        a = gx[t, b] + h[b] @ R.T + bR                    # [n, 3H]
        f = sigmoid(a[:, F_ * H:(F_ + 1) * H])
        g = tanh(a[:, G_ * H:(G_ + 1) * H])
        o = sigmoid(a[:, O_ * H:(O_ + 1) * H])
        c[b] = f * c[b] + (1.0 - f) * g
        h[b] = o * tanh(c[b])
        y[t, b] = h[b]
        saved["acts"][t, b] = np.concatenate([f, g, o], axis=1)
        saved["c"][t, b] = c[b]
    return y, h, c, saved


def cifg_backward(k: CifgCase, y, saved, coupled_df=True):
    """Backprop through time from the saved activations -> {name: gradient} for every array of the case.

    coupled_df=False plants the classic bug: df = dc*c_prev as in a plain LSTM, forgetting that the
    input gate (1-f) also depends on f (the right term is dc*(c_prev - g))."""
    T, B, _ = k.x.shape
    H = k.h0.shape[1]
    dh, dc = k.dhT.copy(), k.dcT.copy()                   # [B, H] arriving from the future
    da_all = np.zeros((T, B, 3 * H))                      # [T, B, 3H] pre-activation gradients
    h_prev_all = np.zeros((T, B, H))                      # [T, B, H] h entering each step
    for t in reversed(range(T)):
        b = np.flatnonzero(t < k.lens)
        if b.size == 0:
            continue
        f, g, o = (saved["acts"][t, b, q * H:(q + 1) * H] for q in (F_, G_, O_))
        c_new = saved["c"][t, b]
        c_prev = k.c0[b] if t == 0 else saved["c"][t - 1, b]   # a row active at t was active at t-1
        h_prev = k.h0[b] if t == 0 else y[t - 1, b]
        dh_t = dh[b] + k.dy[t, b]
        tc = tanh(c_new)
        do = dh_t * tc
        dcell = dc[b] + dh_t * o * dtanh(tc)
        df = dcell * (c_prev - g) if coupled_df else dcell * c_prev
        dg = dcell * (1.0 - f)
        da = np.concatenate([df * dsigmoid(f), dg * dtanh(g), do * dsigmoid(o)], axis=1)   # [n, 3H]
        da_all[t, b] = da
        h_prev_all[t, b] = h_prev
        dh[b] = da @ k.R
        dc[b] = dcell * f
    gx2, x2 = da_all.reshape(-1, 3 * H), k.x.reshape(-1, k.x.shape[2])
    return {"x": da_all @ k.W, "h0": dh, "c0": dc, "W": gx2.T @ x2, "R": gx2.T @ h_prev_all.reshape(-1, H),
            "bW": gx2.sum(axis=0), "bR": gx2.sum(axis=0)}


def cifg_loss(k: CifgCase, **override) -> float:
    y, hT, cT, _ = cifg_forward(k, **override)
    return float(np.vdot(y, k.dy) + np.vdot(hT, k.dhT) + np.vdot(cT, k.dcT))


def check_cifg_gradients(k: CifgCase, coupled_df=True, seed=0) -> dict:
    """{array name: worst relative error along 2 random directions} (numbarnn.testing.directional_check)."""
    y, _, _, saved = cifg_forward(k)
    grads = cifg_backward(k, y, saved, coupled_df)
    rng = np.random.default_rng(seed)
    return {name: directional_check(lambda v, n=name: cifg_loss(k, **{n: v}), getattr(k, name), grads[name], rng)
            for name in CifgCase.ARRAYS}


# ---------------------------------------------------------------------------------------------------
# 2. The CIFG cell is an LSTM with i-gate parameters = -(f-gate parameters)
# ---------------------------------------------------------------------------------------------------

def check_against_numbarnn_lstm():
    T, B, I, H = 4, 3, 2, 3
    k = make_cifg_case(T, B, I, H, [4, 0, 2], seed=1)
    f, g, o = (slice(q * H, (q + 1) * H) for q in (F_, G_, O_))
    # numbarnn's canonical lists (SPEC 4.3): W_i, W_f, W_g, W_o, R_i, R_f, R_g, R_o; bW_i.., bR_i..
    weights = [-k.W[f], k.W[f], k.W[g], k.W[o], -k.R[f], k.R[f], k.R[g], k.R[o]]
    biases = [-k.bW[f], k.bW[f], k.bW[g], k.bW[o], -k.bR[f], k.bR[f], k.bR[g], k.bR[o]]
    params = ops.cudnn_rnn_canonical_to_params(1, H, I, weights, biases, rnn_mode="lstm")
    y_ref, hT_ref, cT_ref, _, _ = ops.cudnn_rnn_v3(k.x, k.h0[None], k.c0[None], params, k.lens, rnn_mode="lstm",
                                                   is_training=False, backend="reference")
    y, hT, cT, _ = cifg_forward(k)
    for name, a, ref in (("output", y, y_ref), ("output_h", hT, hT_ref[0]), ("output_c", cT, cT_ref[0])):
        err = relative_error(a, ref)
        assert err < 1e-14, f"CIFG vs numbarnn LSTM {name}: relative error {err:.1e}"
    print(f"  CIFG forward == ops.cudnn_rnn_v3 LSTM with W_i = -W_f, R_i = -R_f, b_i = -b_f (lengths "
          f"{k.lens.tolist()}; outputs, final h and c to 1e-14)")


# ---------------------------------------------------------------------------------------------------
# 3. hypothesis, run from inside the script
# ---------------------------------------------------------------------------------------------------

@st.composite
def cifg_cases(draw, max_T=4, max_B=4, max_I=3, max_H=3):
    """Sizes first, then ragged lengths (numbarnn.testing.ragged_lengths), then the data seed: hypothesis
    shrinks towards T = B = I = H = 1 and full lengths."""
    T, B = draw(st.integers(1, max_T)), draw(st.integers(1, max_B))
    I, H = draw(st.integers(1, max_I)), draw(st.integers(1, max_H))  # noqa: E741
    lens = draw(ragged_lengths(T, B))
    return make_cifg_case(T, B, I, H, lens, seed=draw(st.integers(0, 2**31 - 1)))


def hypothesis_settings(max_examples: int):
    # derandomize: the same examples on every run (CI); database=None: nothing written to .hypothesis/
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=False,
                    report_multiple_bugs=False)


def make_cifg_property(max_examples: int, coupled_df: bool, seen: list):
    @hypothesis_settings(max_examples)
    @given(cifg_cases())
    def cifg_gradients_match_finite_differences(case):
        report = check_cifg_gradients(case, coupled_df)
        seen.append(case)
        worst = max(report, key=report.get)
        assert report[worst] < 1e-6, (f"d{worst}: relative error {report[worst]:.1e} (T, B, I, H = "
                                      f"{case.x.shape[0]}, {case.x.shape[1]}, {case.x.shape[2]}, "
                                      f"{case.h0.shape[1]}; lengths {case.lens.tolist()})")
    return cifg_gradients_match_finite_differences


def run_cifg_property(max_examples: int):
    seen = []
    make_cifg_property(max_examples, True, seen)()          # hypothesis runs it; a failure raises
    shapes = {(k.x.shape[0], k.x.shape[1], k.x.shape[2], k.h0.shape[1]) for k in seen}
    zero_len = sum(bool((k.lens == 0).any()) for k in seen)
    assert len(seen) >= max_examples // 2 and len(shapes) > 1
    print(f"  hypothesis: {len(seen)} CIFG cases ({len(shapes)} distinct (T, B, I, H), {zero_len} with a "
          f"length-0 row): every gradient matches central differences to < 1e-6")


def run_planted_bug(max_examples: int):
    """The same property with df = dc*c_prev (plain-LSTM habit): hypothesis must fail it and shrink it."""
    seen = []
    try:
        make_cifg_property(max_examples, False, seen)()
    except AssertionError as failure:
        message = str(failure).splitlines()[0]
        print(f"  planted bug (df without the coupled input gate): hypothesis fails it after {len(seen)} "
              f"example(s) including shrinking; the minimal failure:\n    {message}")
        assert "relative error" in message, message
        return
    raise AssertionError("the planted bug went unnoticed: the gradient check is too weak")


def run_library_property(max_examples: int):
    """numbarnn.testing's strategies on the library ops (reference backend: finite differences are cheap)."""
    count = []

    @hypothesis_settings(max_examples)
    @given(rnn_cases(configs=rnn_configs(max_layers=2, max_units=3, max_input=3), max_T=3, max_B=3))
    def reference_gradients_match_finite_differences(case):
        report = check_rnn_gradients(case, backend="reference")
        count.append(case.cfg.rnn_mode)
        assert max(report.values()) < 1e-6, report

    reference_gradients_match_finite_differences()
    print(f"  numbarnn.testing.rnn_cases + check_rnn_gradients: {len(count)} library cases "
          f"({', '.join(sorted(set(count)))}; layers, directions, projection, dropout, ragged lengths) pass")


def check_cuda_gradients():
    """The kernels are checked against the (finite-difference-checked) reference, not by finite differences:
    every finite-difference evaluation would be a whole forward pass in the simulator."""
    cfg = rnn_config(1, 2, 2, "gru", direction="bidirectional")
    case = make_rnn_case(cfg, T=3, B=2, lengths=[3, 0], seed=7)
    ref = run_backward(case, run_forward(case, "reference"), "reference")
    out = run_backward(case, run_forward(case, "cuda"), "cuda")
    tol = TOLERANCES[np.dtype(np.float64)][1]
    names = ("input_backprop", "input_h_backprop", "input_c_backprop", "params_backprop")
    for name, a, r in zip(names, out, ref):
        assert relative_error(a, r) < tol, f"cuda {name}: relative error {relative_error(a, r):.1e}"
    print(f"  cuda backend (bidirectional GRU, lengths [3, 0]): all four gradients equal the reference's "
          f"(tolerance {tol:.0e})")


# ---------------------------------------------------------------------------------------------------
# 4. Benchmark
# ---------------------------------------------------------------------------------------------------

def benchmark(quick: bool):
    reps = 1 if quick else 3
    k = make_cifg_case(4, 3, 3, 3, [4, 2, 0], seed=2)
    cfg = rnn_config(1, 3, 3, "lstm")
    case = make_rnn_case(cfg, T=4, B=3, lengths=[4, 2, 0], seed=2)
    print(f"  T=4 B=3 I=3 H=3 float64, median of {reps}")
    ms = timed_ms(lambda: check_cifg_gradients(k), reps)
    print(f"    {'CIFG: finite-difference check of 7 arrays':<52} {ms:9.2f} ms   [NumPy (host)]")
    print(f"    {'LSTM op: check_rnn_gradients (finite differences)':<52} "
          f"{timed_ms(lambda: check_rnn_gradients(case, backend='reference'), reps):9.2f} ms   [backend=reference]")
    for backend in ("reference", "cuda"):
        ms = timed_ms(lambda: run_backward(case, run_forward(case, backend), backend), reps)
        where = "NumPy, float64 inside" if backend == "reference" else device_name()
        print(f"    {'LSTM op: one forward + backward':<52} {ms:9.2f} ms   [backend={backend}: {where}]")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer hypothesis examples (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    print(f"running on: {device_name()}")
    print("1-2. the CIFG cell against numbarnn's LSTM")
    check_against_numbarnn_lstm()
    print("3. gradient checks with hypothesis")
    run_cifg_property(10 if quick else 60)
    run_planted_bug(10 if quick else 60)
    run_library_property(5 if quick else 30)
    check_cuda_gradients()
    print("4. benchmark")
    benchmark(quick)
    print("tutorial 05: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

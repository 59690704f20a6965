"""Tutorial 01: the LSTM and GRU cells in NumPy.

    python tutorials/01_cell_math.py            # full run
    python tutorials/01_cell_math.py --quick    # what CI runs (also: NUMBARNN_QUICK=1)

Motivation
----------
Every kernel in numbarnn is the twin of a few lines of NumPy.  Before any CUDA, this tutorial writes
the two cells cuDNN implements (SPEC section 2) from their equations, makes the sigmoid safe from
overflow, and derives the backward pass from the activations the forward pass saved, checking every
gradient against central finite differences.  cuDNN's flavour has two biases per gate (bW with the
input matrix W, bR with the recurrent matrix R) and, for the GRU, applies the reset gate AFTER the
recurrent matmul:

    lstm: i = σ(W_i x + bW_i + R_i h + bR_i)   (gate order i, f, g, o)
          f = σ(...), g = tanh(...), o = σ(...)
          c' = f*c + i*g ;  h' = o*tanh(c')
    gru:  r = σ(W_r x + bW_r + R_r h + bR_r) ;  z = σ(...)        (gate order r, z, n)
          n = tanh(W_n x + bW_n + r*(R_n h + bR_n))
          h' = (1-z)*n + z*h

Letters: B batch rows, I input size, H units, G gates (4 LSTM, 3 GRU).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from numbarnn.device import use_simulator_unless_gpu  # imports no numba

# numba reads NUMBA_ENABLE_CUDASIM once, at import: without a GPU, choose the simulator before importing it.
use_simulator_unless_gpu()

import numpy as np  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.reference import gru as ref_gru  # noqa: E402
from numbarnn.reference import lstm as ref_lstm  # noqa: E402
from numbarnn.testing import relative_error  # noqa: E402
from numbarnn.measure import timed_ms  # noqa: E402


# ---------------------------------------------------------------------------------------------------
# 1. A sigmoid that cannot overflow
# ---------------------------------------------------------------------------------------------------
# The textbook 1/(1+exp(-x)) computes exp(1000) = inf for x = -1000 (an overflow; the result 0 is
# right only by luck), and in float16 exp overflows already at x < -11.1.  Two safe forms:
#   * 0.5*tanh(0.5x) + 0.5   -- one transcendental, branch-free: what numbarnn uses (GPU-friendly);
#   * the two-branch expit   -- exp of a non-positive number only: best relative accuracy for tiny σ.

def sigmoid_naive(x):
    return 1.0 / (1.0 + np.exp(-x))


def sigmoid_tanh(x):
    half = x.dtype.type(0.5)          # a typed constant keeps float16/float32 in their own type
    return half * np.tanh(half * x) + half


def sigmoid_two_branch(x):
    e = np.exp(-np.abs(x))            # in (0, 1]: never overflows
    one = x.dtype.type(1)
    return np.where(x >= 0, one / (one + e), e / (one + e))


def dsigmoid_from_saved(s):
    """dσ/dx = σ(1-σ), from the saved output s: no need to keep the pre-activation."""
    return s * (1.0 - s)


def dtanh_from_saved(t):
    """dtanh/dx = 1-t², from the saved output t."""
    return 1.0 - t * t


# ---------------------------------------------------------------------------------------------------
# 2. The cells, forward and backward
# ---------------------------------------------------------------------------------------------------
sigmoid = sigmoid_tanh


def split(a, G):
    """[B, G*H] -> G arrays [B, H] (gate order as in cuDNN)."""
    return np.split(a, G, axis=1)


def lstm_forward(x, h, c, W, R, bW, bR):
    """x [B, I], h [B, H], c [B, H], W [4H, I], R [4H, H], bW, bR [4H]
    -> h' [B, H], c' [B, H], saved = (i, f, g, o, c') each [B, H]."""
    a = x @ W.T + bW + h @ R.T + bR                  # [B, 4H] pre-activations, gate order i, f, g, o
    a_i, a_f, a_g, a_o = split(a, 4)
    i, f, g, o = sigmoid(a_i), sigmoid(a_f), np.tanh(a_g), sigmoid(a_o)
    c_new = f * c + i * g                           # [B, H]
    h_new = o * np.tanh(c_new)                      # [B, H]
    return h_new, c_new, (i, f, g, o, c_new)


def lstm_backward(dh_new, dc_new, x, h, c, W, R, saved):
    """Gradients of a loss given dL/dh' [B, H] and dL/dc' [B, H] (what flows in from the next step)
    -> dict of dL/d(x, h, c, W, R, bW, bR) and da [B, 4H] (pre-activation gradients)."""
    i, f, g, o, c_new = saved
    tc = np.tanh(c_new)                             # recomputed: cheaper than saving it
    do = dh_new * tc
    dc = dc_new + dh_new * o * dtanh_from_saved(tc)   # total gradient reaching c'
    di, dg, df = dc * g, dc * i, dc * c
    da = np.concatenate([di * dsigmoid_from_saved(i), df * dsigmoid_from_saved(f),
                         dg * dtanh_from_saved(g), do * dsigmoid_from_saved(o)], axis=1)   # [B, 4H]
    return {"x": da @ W, "h": da @ R, "c": dc * f, "W": da.T @ x, "R": da.T @ h,
            "bW": da.sum(axis=0), "bR": da.sum(axis=0), "da": da}


def gru_forward(x, h, W, R, bW, bR):
    """x [B, I], h [B, H], W [3H, I], R [3H, H], bW, bR [3H] -> h' [B, H], saved = (r, z, n, hn)."""
    gx = x @ W.T + bW                               # [B, 3H]
    gh = h @ R.T + bR                               # [B, 3H] the reset gate multiplies gh_n, bias included
    gx_r, gx_z, gx_n = split(gx, 3)
    gh_r, gh_z, hn = split(gh, 3)
    r, z = sigmoid(gx_r + gh_r), sigmoid(gx_z + gh_z)
    n = np.tanh(gx_n + r * hn)
    h_new = (1.0 - z) * n + z * h
    return h_new, (r, z, n, hn)


def gru_backward(dh_new, x, h, W, R, saved):
    """-> dict of dL/d(x, h, W, R, bW, bR), plus dgx, dgh [B, 3H] (the W and R side differ for a GRU)."""
    r, z, n, hn = saved
    dn = dh_new * (1.0 - z) * dtanh_from_saved(n)   # through n's tanh
    dz = dh_new * (h - n) * dsigmoid_from_saved(z)
    dr = dn * hn * dsigmoid_from_saved(r)
    dgx = np.concatenate([dr, dz, dn], axis=1)       # [B, 3H]
    dgh = np.concatenate([dr, dz, dn * r], axis=1)   # [B, 3H] the reset gate scales the R_n side
    return {"x": dgx @ W, "h": dgh @ R + dh_new * z, "W": dgx.T @ x, "R": dgh.T @ h,
            "bW": dgx.sum(axis=0), "bR": dgh.sum(axis=0), "dgx": dgx, "dgh": dgh}


# ---------------------------------------------------------------------------------------------------
# 3. Finite differences
# ---------------------------------------------------------------------------------------------------

def numeric_gradient(loss, arrays: dict, name: str, eps: float = 1e-6):
    """Central differences (float64) of loss() w.r.t. every element of arrays[name], perturbed in place."""
    a = arrays[name]
    grad = np.zeros_like(a)
    for k in np.ndindex(a.shape):
        keep = a[k]
        a[k] = keep + eps
        up = loss()
        a[k] = keep - eps
        down = loss()
        a[k] = keep
        grad[k] = (up - down) / (2 * eps)
    return grad


def random_cell(rng, B, I, H, G, scale=0.7):
    shapes = {"x": (B, I), "h": (B, H), "c": (B, H), "W": (G * H, I), "R": (G * H, H), "bW": (G * H,),
              "bR": (G * H,)}
    return {k: rng.standard_normal(s) * scale for k, s in shapes.items()}


def check_sigmoid():
    x = np.linspace(-30.0, 30.0, 1001)
    for f in (sigmoid_tanh, sigmoid_two_branch):
        err = np.max(np.abs(f(x) - sigmoid_naive(x)))
        assert err < 1e-15, (f.__name__, err)
    extreme = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    with np.errstate(over="raise"):
        try:
            sigmoid_naive(extreme)
            raise AssertionError("the naive sigmoid was expected to overflow at x = -1000")
        except FloatingPointError:
            pass
        for f in (sigmoid_tanh, sigmoid_two_branch):          # no overflow, exact limits
            s = f(extreme)
            assert s[0] == 0.0 and s[-1] == 1.0 and s[2] == 0.5, (f.__name__, s)
    # float16: the naive form overflows at x = -12 (exp(12) > 65504); the safe ones do not
    x16 = np.array([-12.0, -8.0, 8.0, 12.0], dtype=np.float16)
    with np.errstate(over="raise"):
        try:
            sigmoid_naive(x16)
            raise AssertionError("float16: the naive sigmoid was expected to overflow at x = -12")
        except FloatingPointError:
            pass
        for f in (sigmoid_tanh, sigmoid_two_branch):
            s = f(x16)
            assert s.dtype == np.float16
            assert np.max(np.abs(s.astype(np.float64) - sigmoid_naive(x16.astype(np.float64)))) < 1e-3
    # relative precision of tiny values: the tanh form rounds σ(-40) = 4e-18 to 0, expit keeps it
    tiny = sigmoid_two_branch(np.array([-40.0]))[0]
    assert abs(tiny - np.exp(-40.0)) / np.exp(-40.0) < 1e-12
    print(f"  sigmoid: tanh form and two-branch expit match 1/(1+e^-x) to 1e-15 on [-30, 30], no overflow at "
          f"±1000 (float64) or ±12 (float16); σ(-40): tanh form {sigmoid_tanh(np.array([-40.0]))[0]:.1e}, "
          f"expit {tiny:.3e} (absolute error < 1e-16 either way)")


def check_lstm(rng):
    B, I, H = 2, 3, 2
    v = random_cell(rng, B, I, H, 4)
    u_h, u_c = rng.standard_normal((B, H)), rng.standard_normal((B, H))   # loss = <h', u_h> + <c', u_c>

    def loss():
        h_new, c_new, _ = lstm_forward(v["x"], v["h"], v["c"], v["W"], v["R"], v["bW"], v["bR"])
        return float(np.vdot(h_new, u_h) + np.vdot(c_new, u_c))

    h_new, c_new, saved = lstm_forward(v["x"], v["h"], v["c"], v["W"], v["R"], v["bW"], v["bR"])
    grads = lstm_backward(u_h, u_c, v["x"], v["h"], v["c"], v["W"], v["R"], saved)
    worst = 0.0
    for name in ("x", "h", "c", "W", "R", "bW", "bR"):
        err = relative_error(grads[name], numeric_gradient(loss, v, name))
        assert err < 1e-8, f"LSTM d{name}: relative error {err:.2e} against finite differences"
        worst = max(worst, err)
    # the same cell as numbarnn's reference (which takes gx = W x + bW and gh = R h + bR)
    gx, gh = v["x"] @ v["W"].T + v["bW"], v["h"] @ v["R"].T + v["bR"]
    m_ref, c_ref, acts = ref_lstm.forward(gx, gh, v["h"], v["c"])
    assert relative_error(h_new, m_ref) < 1e-15 and relative_error(c_new, c_ref) < 1e-15
    dgx, _, _, dc_prev = ref_lstm.backward(u_h, u_c, acts, v["h"], v["c"], c_ref)
    assert relative_error(grads["da"], dgx) < 1e-14 and relative_error(grads["c"], dc_prev) < 1e-14
    print(f"  LSTM: 7 gradients match central differences (worst relative error {worst:.1e}); "
          f"forward and backward equal numbarnn.reference.lstm")


def check_gru(rng):
    B, I, H = 2, 3, 2
    v = random_cell(rng, B, I, H, 3)
    u = rng.standard_normal((B, H))

    def loss():
        return float(np.vdot(gru_forward(v["x"], v["h"], v["W"], v["R"], v["bW"], v["bR"])[0], u))

    h_new, saved = gru_forward(v["x"], v["h"], v["W"], v["R"], v["bW"], v["bR"])
    grads = gru_backward(u, v["x"], v["h"], v["W"], v["R"], saved)
    worst = 0.0
    for name in ("x", "h", "W", "R", "bW", "bR"):
        err = relative_error(grads[name], numeric_gradient(loss, v, name))
        assert err < 1e-8, f"GRU d{name}: relative error {err:.2e} against finite differences"
        worst = max(worst, err)
    gx, gh = v["x"] @ v["W"].T + v["bW"], v["h"] @ v["R"].T + v["bR"]
    h_ref, _, acts = ref_gru.forward(gx, gh, v["h"])
    assert relative_error(h_new, h_ref) < 1e-15
    dgx, dgh, direct, _ = ref_gru.backward(u, None, acts, v["h"])
    assert relative_error(grads["dgx"], dgx) < 1e-14 and relative_error(grads["dgh"], dgh) < 1e-14
    assert relative_error(grads["h"], dgh @ v["R"] + direct) < 1e-14
    # the reset gate really acts after the matmul: r*(R_n h + bR_n) differs from R_n (r*h) + bR_n
    H3 = slice(2 * H, 3 * H)
    r = saved[0]
    before = np.tanh(gx[:, H3] + (r * v["h"]) @ v["R"][H3].T + v["bR"][H3])
    assert np.max(np.abs(before - saved[2])) > 1e-6, "reset-before-matmul should give another cell"
    print(f"  GRU: 6 gradients match central differences (worst relative error {worst:.1e}); equal to "
          f"numbarnn.reference.gru; reset-before-matmul (the original GRU paper) gives a different n")


# ---------------------------------------------------------------------------------------------------
# 4. Benchmark
# ---------------------------------------------------------------------------------------------------

def device_name() -> str:
    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        return "numba CUDA simulator (no GPU: one Python thread per CUDA thread, timings are not GPU timings)"
    name = cuda.get_current_device().name
    return "GPU " + (name.decode() if isinstance(name, bytes) else str(name))


def benchmark(quick: bool, rng):
    from numba import config
    reps = 1 if quick else 5
    n = 100_000 if quick else 2_000_000
    x = rng.standard_normal(n)
    print(f"  backend: NumPy (host), {n} elements, median of {reps + 2}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for f in (sigmoid_naive, sigmoid_tanh, sigmoid_two_branch):
            print(f"    {f.__name__:<20} {timed_ms(lambda: f(x), reps + 2):8.3f} ms")
    # one whole cuDNN-style LSTM layer: the float64 NumPy reference against the numba.cuda kernels
    T, B, I, H = (4, 2, 3, 3) if config.ENABLE_CUDASIM else (50, 64, 256, 256)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    h0 = np.zeros((1, B, H), np.float32)
    c0 = np.zeros((1, B, H), np.float32)
    params = (rng.standard_normal(ops.cudnn_rnn_params_size(1, H, I)) * 0.1).astype(np.float32)
    out = {}
    print(f"  one LSTM layer forward, T={T} B={B} I={I} H={H} float32 (NumPy in, NumPy out), median of {reps}:")
    for backend in ("reference", "cuda"):
        def run():
            out[backend] = ops.cudnn_rnn_v3(x, h0, c0, params, is_training=False, backend=backend)[0]
        ms = timed_ms(run, reps)
        where = "NumPy, float64 inside" if backend == "reference" else device_name()
        print(f"    backend={backend:<9} {ms:9.2f} ms   [{where}]")
    err = relative_error(out["cuda"], out["reference"])
    assert err < 1e-5, f"cuda vs reference: relative error {err:.1e}"
    print(f"    agreement: relative error {err:.1e} (float32 tolerance 1e-5)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    rng = np.random.default_rng(1)
    print("1. numerically safe sigmoid")
    check_sigmoid()
    print("2-3. cells and their backward from saved activations, checked by finite differences")
    check_lstm(rng)
    check_gru(rng)
    print("4. benchmark")
    benchmark(quick, rng)
    print("tutorial 01: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

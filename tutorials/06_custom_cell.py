"""Tutorial 06: your own cell in one short file: a coupled input-forget gate LSTM (CIFG).

Motivation.  cuDNN and torch.nn have four fixed cells; a new cell in plain PyTorch runs as a Python loop of
small ops, and in haste it means C++.  In numbarnn a cell is data: a `CellSpec` naming its gates, what it
saves for backward, whether it carries a cell state, and two plain scalar Python functions (one hidden unit,
one step).  Everything around them (the input GEMM over all steps, the fused recurrent product, ragged
lengths, both directions, layers, dropout, projection, the reserve, the params layout, layers, torch modules,
`numbarnn check`) is derived from the spec, and the same two functions are compiled into the CUDA kernels.

The CIFG LSTM (Greff et al., "LSTM: A Search Space Odyssey") couples the forget gate to the input gate,
f = 1 - i, so it has 3 gates instead of 4:

    i = σ(wx_i + rh_i)     g = tanh(wx_g + rh_g)     o = σ(wx_o + rh_o)
    c' = (1-i)*c + i*g     m = o*tanh(c')

where wx = W x + bW and rh = R h + bR per gate.  Steps:
  1. write the spec (below; numbarnn/contrib/cifg_lstm.py is the same cell as a module);
  2. check its gradients: `numbarnn.testing.check_cell` (hypothesis + finite differences: a user cell has no
     hand-written oracle, so finite differences are the oracle);
  3. run it as an op, on the reference backend and on the CUDA kernels (the simulator without a GPU), and
     compare; 4. look at the kernel numbarnn generated for it; 5. time it;
  6. a cell whose recurrent weight is a vector, not a matrix (IndRNN: `recurrence="diagonal"`);
  7. a cell that modulates the state before a recurrent product (the minimal gated unit: `modulated`);
  8. a cell that layer-normalises its rows (haste's LayerNormGRU: `layer_norm`).

Run: python tutorials/06_custom_cell.py [--quick]
"""
from __future__ import annotations

import os
import sys

if os.environ.get("NUMBARNN_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")     # no GPU: the kernels run in numba's simulator

import numpy as np  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.cells import CellSpec, dsigmoid, dtanh, one_minus, register, sigmoid, tanh  # noqa: E402

QUICK = "--quick" in sys.argv or os.environ.get("NUMBARNN_QUICK") == "1"

# ---------------------------------------------------------------------------------------------------
# 1. The cell: two scalar functions and a description
# ---------------------------------------------------------------------------------------------------
I, G, O = 0, 1, 2          # named gate offsets: the order of the gates in the params (W_i, W_g, W_o, ...)


def cifg_forward(wx, rh, v, h, c, saved):
    """One unit, one step.  wx[k], rh[k]: the input and recurrent sides of gate k; c: previous cell state.
    Save what backward needs; return the unit's output m and the new cell state c'."""
    i = sigmoid(wx[I] + rh[I])
    g = tanh(wx[G] + rh[G])
    o = sigmoid(wx[O] + rh[O])
    c_new = c + i * (g - c)                 # (1-i)*c + i*g, without a float literal (GPU: stays in float32)
    saved[I] = i
    saved[G] = g
    saved[O] = o
    return o * tanh(c_new), c_new


def cifg_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    """dm = dL/dm, dc = dL/dc' from the next step.  Write dL/d(pre-activation) of each gate into dwx (the
    recurrent side gets the same gradient: each gate saw wx + rh); return (dL/dh bypassing R, dL/dc)."""
    i, g, o = saved[I], saved[G], saved[O]
    tc = tanh(c_new)
    dcell = dc + dm * o * dtanh(tc)         # c' reaches the loss through m and through the next step
    dwx[I] = dcell * (g - c) * dsigmoid(i)  # dc'/di = g - c  (the coupling: f = 1 - i)
    dwx[G] = dcell * i * dtanh(g)
    dwx[O] = dm * tc * dsigmoid(o)
    return 0.0, dcell * one_minus(i)        # h only enters through R h; dc'/dc = 1 - i


CIFG = register(CellSpec(name="cifg_tutorial", gates=("i", "g", "o"), saved=("i", "g", "o"),
                         forward=cifg_forward, backward=cifg_backward, cell_state=True, projection=True,
                         equations=__doc__))


def step1_spec():
    print(f"  registered {CIFG.name!r}: G={CIFG.G} gates {CIFG.gates}, saves {CIFG.saved}, cell state "
          f"{CIFG.cell_state}, projection allowed {CIFG.projection}")
    n4 = ops.cudnn_rnn_params_size(1, 8, 8, "lstm")
    n3 = ops.cudnn_rnn_params_size(1, 8, 8, CIFG.name)
    assert n3 * 4 == n4 * 3, (n3, n4)
    print(f"  params of one layer, H = I = 8: {n3} (an LSTM has {n4}: one gate fewer, 3/4 of the weights)")


# ---------------------------------------------------------------------------------------------------
# 2. Gradient checks: finite differences are the oracle of a new cell
# ---------------------------------------------------------------------------------------------------

def step2_check():
    from numbarnn.testing import check_cell
    report = check_cell(CIFG, max_examples=10 if QUICK else 50)
    print(f"  {report}")
    assert report.ok
    # a wrong derivative is caught, with the (shrunk) example that shows it
    def wrong(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
        dh, dc_prev = cifg_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv)
        dcell = dc + dm * saved[O] * dtanh(tanh(c_new))
        dwx[I] = dcell * saved[G] * dsigmoid(saved[I])   # a classic slip: the uncoupled LSTM's dc'/di = g
        return dh, dc_prev
    bad = CellSpec(name="cifg_wrong", gates=CIFG.gates, saved=CIFG.saved, forward=cifg_forward, backward=wrong,
                   cell_state=True)
    caught = check_cell(bad, max_examples=10, raise_on_failure=False)
    assert not caught.ok
    print(f"  the same check on a backward with dc'/di = g instead of g - c: worst error {caught.worst:.2f}, "
          f"failing example:\n    {caught.failing}")


# ---------------------------------------------------------------------------------------------------
# 3. The cell as an op: reference vs the CUDA kernels (the same two functions compiled into them)
# ---------------------------------------------------------------------------------------------------

def step3_ops():
    from numbarnn.config import rnn_config
    from numbarnn.testing import make_rnn_case, relative_error, run_backward, run_forward
    from numbarnn.verify import TOLERANCES
    cfg = rnn_config(2, 3, 4, CIFG.name, "linear_input", "bidirectional", num_proj=2, dropout=0.3, seed=1)
    case = make_rnn_case(cfg, 4, 3, lengths=[4, 0, 2], seed=0)
    ref, gpu = run_forward(case, "reference"), run_forward(case, "cuda")
    worst = max(relative_error(b, a) for a, b in zip(ref[:3], gpu[:3]))
    worst = max([worst] + [relative_error(b, a) for a, b in zip(run_backward(case, ref, "reference"),
                                                                run_backward(case, gpu, "cuda"))])
    assert worst <= TOLERANCES[np.dtype(np.float64)][1], worst      # SPEC 10, float64
    print(f"  2 layers, bidirectional, projection P=2, dropout 0.3, lengths [4, 0, 2]: cuda kernels equal the "
          f"reference built from the spec (outputs and every gradient) to {worst:.1e}")


# ---------------------------------------------------------------------------------------------------
# 4. The kernel numbarnn made for it
# ---------------------------------------------------------------------------------------------------

def step4_kernel():
    from numbarnn.kernels import cell_steps
    src = cell_steps.make_forward_step(CIFG, "float32", False).source
    print("  its forward step kernel: the cell's exact argument list, calling the template body "
          "(numbarnn/kernels/cell_steps.py) with cifg_forward compiled in:")
    for line in src.rstrip().splitlines():
        print("  |" + line)


# ---------------------------------------------------------------------------------------------------
# 5. Time it (reference backend on this machine; the kernels when a GPU is present)
# ---------------------------------------------------------------------------------------------------

def step5_time():
    from numbarnn.measure import timed_ms
    T, B, H = (10, 4, 16) if QUICK else (50, 16, 64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, H)).astype(np.float32)
    h0 = np.zeros((1, B, H), np.float32)
    for mode in ("lstm", CIFG.name):
        params = (rng.standard_normal(ops.cudnn_rnn_params_size(1, H, H, mode)) * 0.1).astype(np.float32)
        ms = timed_ms(lambda: ops.cudnn_rnn_v3(x, h0, h0, params, rnn_mode=mode, is_training=False,
                                               backend="reference"), reps=3)
        print(f"  reference forward, T={T} B={B} H={H}, {mode:>13}: {ms:8.2f} ms (median of 3)")
    print("  (a registered cell runs on the reference backend as plain Python per unit: it is the oracle, "
          "not the fast path; the kernels are)")


# ---------------------------------------------------------------------------------------------------
# 6. A diagonal recurrence: IndRNN, h' = tanh(W x + bW + u ⊙ h + bR), u a vector [H]
# ---------------------------------------------------------------------------------------------------

def indrnn_forward(wx, rh, v, h, c, saved):
    """The same contract: rh[0] arrives computed, here as u[j]*h[j] + bR[j] (the framework's elementwise product)."""
    saved[0] = tanh(wx[0] + rh[0])
    return saved[0], c


def indrnn_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    """dL/d(pre-activation); the framework turns it into du += d*h and dh += d*u (no R to multiply by)."""
    dwx[0] = dm * dtanh(saved[0])
    return 0.0, dc


IND = register(CellSpec(name="indrnn_tutorial", gates=("a",), saved=("h",), forward=indrnn_forward,
                        backward=indrnn_backward, recurrence="diagonal"))


def step6_diagonal():
    """One more field, `recurrence="diagonal"`: the params hold a vector u [H] where other cells hold R [H, H]
    (numbarnn/contrib/indrnn.py ships haste's IndRNN and the paper's ReLU variant the same way)."""
    from numbarnn.config import rnn_config
    from numbarnn.params import param_regions
    from numbarnn.testing import check_cell, make_rnn_case, relative_error, run_backward, run_forward
    cfg = rnn_config(1, 8, 8, IND.name)
    shapes = {r.kind: r.shape for r in param_regions(cfg)}
    print(f"  params of one layer, H = I = 8: {ops.cudnn_rnn_params_size(1, 8, 8, IND.name)} "
          f"(W {shapes['W']}, u {shapes['R']} in R's slot, bW, bR); an rnn_tanh has "
          f"{ops.cudnn_rnn_params_size(1, 8, 8, 'rnn_tanh')}")
    report = check_cell(IND, backends=("reference", "cpu"), max_examples=8 if QUICK else 25,
                        network_examples=2 if QUICK else 6)
    print(f"  {report}")
    assert report.ok
    cfg = rnn_config(2, 3, 2, IND.name, direction="bidirectional")
    case = make_rnn_case(cfg, 4, 3, lengths=[4, 0, 2], seed=0)
    ref, gpu = run_forward(case, "reference"), run_forward(case, "cuda")
    worst = max(relative_error(b, a) for a, b in zip(ref[:2] + run_backward(case, ref, "reference")[:2],
                                                     gpu[:2] + run_backward(case, gpu, "cuda")[:2]))
    assert worst < 1e-12, worst
    from numbarnn.kernels import driver
    print(f"  cuda kernels equal the reference to {worst:.1e}; step kernels: "
          f"{driver.last_launch_count()['backward'].note or 'v1 (the simulator default)'}")


# ---------------------------------------------------------------------------------------------------
# 7. A modulated state: the MGU, n = tanh(W_n x + bW_n + R_n (f ⊙ h) + bR_n), f a gate of the same step
# ---------------------------------------------------------------------------------------------------

F, N = 0, 1                      # the MGU's gates


def mgu_forward(wx, rh, v, h, c, saved):
    """The same contract; rh[N] arrives as R_n (f ⊙ h) + bR_n: the framework made the second product."""
    f = sigmoid(wx[F] + rh[F])
    n = tanh(wx[N] + rh[N])
    saved[F] = f
    saved[N] = n
    return h + f * (n - h), c


def mgu_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    """Through h' only; f's part through m ⊙ h is modulation_backward's."""
    f, n = saved[F], saved[N]
    dwx[F] = dm * (n - h) * dsigmoid(f)
    dwx[N] = dm * f * dtanh(n)
    return dm * one_minus(f), dc


def mgu_modulation(wx, rh, v, h):
    """m of unit j, from the unmodulated gates only (rh[N] is 0 when this runs): here m = f."""
    return sigmoid(wx[F] + rh[F])


def mgu_modulation_backward(dmod, mod, saved, v, h, dwx, drh):
    """dmod = dL/dm (the framework's: (R_n^T drh_n)_j * h_j); into f's pre-activation (added to backward's)."""
    dwx[F] = dmod * dsigmoid(mod)


MGU = register(CellSpec(name="mgu_tutorial", gates=("f", "n"), saved=("f", "n"), forward=mgu_forward,
                        backward=mgu_backward, modulated=("n",), modulation=mgu_modulation,
                        modulation_backward=mgu_modulation_backward))


def step7_modulated():
    """Three more fields: `modulated` names the gates whose recurrent input is R_g (m ⊙ h), `modulation` computes
    m per unit, `modulation_backward` takes dL/dm back (numbarnn/contrib/mgu.py and gru_v1.py, the classic GRU,
    ship the same way).  A step now makes two recurrent products; the params are those of any 2-gate cell."""
    from numbarnn.config import rnn_config
    from numbarnn.kernels import driver
    from numbarnn.testing import check_cell, make_rnn_case, relative_error, run_backward, run_forward
    report = check_cell(MGU, backends=("reference", "cpu"), max_examples=8 if QUICK else 25,
                        network_examples=2 if QUICK else 6)
    print(f"  {report}")
    assert report.ok
    cfg = rnn_config(2, 3, 2, MGU.name, direction="bidirectional")
    case = make_rnn_case(cfg, 4, 3, lengths=[4, 0, 2], seed=0)
    ref, gpu = run_forward(case, "reference"), run_forward(case, "cuda")
    worst = max(relative_error(b, a) for a, b in zip(ref[:2] + run_backward(case, ref, "reference")[:2],
                                                     gpu[:2] + run_backward(case, gpu, "cuda")[:2]))
    assert worst < 1e-12, worst
    launches = driver.last_launch_count()
    print(f"  cuda kernels equal the reference to {worst:.1e}; per step: forward "
          f"{', '.join(k for k in launches['forward'].by_kernel if 'modulat' in k)}; backward "
          f"{', '.join(k for k in launches['backward'].by_kernel if k.endswith(('step', 'backward')))}")


# ---------------------------------------------------------------------------------------------------
# 8. Layer normalisation across the row: haste's LayerNormGRU, rh = LN(R h) γ_r + bR
# ---------------------------------------------------------------------------------------------------

Z, R_, G_, HG = 0, 1, 2, 3       # the GRU's gates z, r, g (haste's order) and the saved rh_g


def lngru_forward(wx, rh, v, h, c, saved):
    """The cuDNN-style GRU, gates in haste's order; wx and rh arrive layer-normalised (the framework's rows)."""
    z = sigmoid(wx[Z] + rh[Z])
    r = sigmoid(wx[R_] + rh[R_])
    g = tanh(wx[G_] + r * rh[G_])
    saved[Z] = z
    saved[R_] = r
    saved[G_] = g
    saved[HG] = rh[G_]
    return g + z * (h - g), c


def lngru_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    """dL/d(wx), dL/d(rh) per unit; the framework takes them back through the rows' layer norms."""
    z, r, g, hg = saved[Z], saved[R_], saved[G_], saved[HG]
    dg = (dm - dm * z) * dtanh(g)
    dwx[Z] = dm * (h - g) * dsigmoid(z)
    dwx[R_] = dg * hg * dsigmoid(r)
    dwx[G_] = dg
    drh[G_] = dg * r
    return dm * z, dc


LNGRU = register(CellSpec(name="lngru_tutorial", gates=("z", "r", "g"), saved=("z", "r", "g", "hg"),
                          forward=lngru_forward, backward=lngru_backward, split_recurrent=("g",),
                          layer_norm=("wx", "rh")))


def step8_layer_norm():
    """One more field, `layer_norm=("wx", "rh")`: each batch row's W x and R h are normalised across all G*H
    values before the pointwise functions see them (a per-row reduction inside the step, which the framework does:
    the cell's functions are an ordinary GRU's).  The gains γ_x, γ_r [G*H] are per-layer vectors at the end of the
    params; with "c" the cell state is normalised too (numbarnn/contrib/layer_norm_lstm.py: `output` makes h' from
    the normalised state).  numbarnn/contrib/layer_norm_gru.py is this cell; numbarnn.torch.LayerNormGRU is haste's
    module on it."""
    from numbarnn.config import rnn_config
    from numbarnn.kernels import driver
    from numbarnn.params import param_regions
    from numbarnn.testing import check_cell, make_rnn_case, relative_error, run_backward, run_forward
    cfg = rnn_config(1, 4, 3, LNGRU.name)
    gains = [r.describe(cfg) for r in param_regions(cfg) if r.kind == "N"]
    print(f"  params of one layer, H = 4, I = 3: {ops.cudnn_rnn_params_size(1, 4, 3, LNGRU.name)} "
          f"(a GRU's {ops.cudnn_rnn_params_size(1, 4, 3, 'gru')} + {len(gains)} gain vectors: {gains[0]}, ...)")
    report = check_cell(LNGRU, backends=("reference", "cpu"), max_examples=8 if QUICK else 25,
                        network_examples=2 if QUICK else 6)
    print(f"  {report}")
    assert report.ok
    cfg = rnn_config(2, 3, 2, LNGRU.name, direction="bidirectional")
    case = make_rnn_case(cfg, 4, 3, lengths=[4, 0, 2], seed=0)
    ref, gpu = run_forward(case, "reference"), run_forward(case, "cuda")
    worst = max(relative_error(b, a) for a, b in zip(ref[:2] + run_backward(case, ref, "reference")[:2],
                                                     gpu[:2] + run_backward(case, gpu, "cuda")[:2]))
    assert worst < 1e-12, worst
    launches = driver.last_launch_count()
    print(f"  cuda kernels equal the reference to {worst:.1e}; a block per row: forward "
          f"{', '.join(k for k in launches['forward'].by_kernel if 'layer_norm' in k)}; backward "
          f"{', '.join(k for k in launches['backward'].by_kernel if 'layer_norm' in k)}")


def main():
    for title, step in (("1. the cell as data", step1_spec), ("2. gradient checks", step2_check),
                        ("3. as an op, on every backend", step3_ops), ("4. the generated kernel", step4_kernel),
                        ("5. timing", step5_time), ("6. a diagonal recurrence (IndRNN)", step6_diagonal),
                        ("7. a modulated state (MGU)", step7_modulated),
                        ("8. layer normalisation (haste's LayerNormGRU)", step8_layer_norm)):
        print(title)
        step()
    print("tutorial 06: all checks passed")


if __name__ == "__main__":
    main()

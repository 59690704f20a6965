"""Modulated cells (CellSpec.modulated): the classic GRU (gru_v1) and the MGU, whose candidate's recurrent input is
R_n (m ⊙ h), m from another gate of the same step, on every backend.

The oracle is twofold: finite differences (`check_cell`), and an independent implementation in plain PyTorch
operations written from the published equations (Cho et al. 2014's GRU as Keras GRU(reset_after=False) computes it;
Zhou et al. 2016's MGU), looping row by row over each sequence's own length, differentiated by autograd.
"""
import json
import os

import numpy as np
import pytest

import numbarnn
import numbarnn.contrib.gru_v1 as gru_v1
import numbarnn.contrib.mgu as mgu
from numbarnn import cli
from numbarnn.cells import CellSpec, dsigmoid, sigmoid
from numbarnn.config import RNNCall, params_size, rnn_config
from numbarnn.kernels import common
from numbarnn.params import param_regions
from numbarnn.reserve import reserve_entries
from numbarnn.testing import check_cell, make_rnn_case, relative_error, run_forward
from conftest import (assert_agrees_with_the_reference, assert_agrees_with_torch_network,
                      assert_cpu_agrees_in_lower_precision, assert_fused_forward_equals_the_blas_loop,
                      assert_layer_runs_like_the_reference, assert_v1_fallback, planned_and_launched)

BACKENDS = ("reference", "cpu", "cuda")
CELLS = ("gru_v1", "mgu")


# ----------------------------------------------------------------------------------------------
# the description
# ----------------------------------------------------------------------------------------------

def test_the_shipped_cells_modulate_their_candidate():
    assert gru_v1.SPEC.modulated == ("n",) and gru_v1.SPEC.modulated_mask == (False, False, True)
    assert mgu.SPEC.modulated == ("n",) and mgu.SPEC.gates == ("f", "n")
    assert numbarnn.cells.get_cell("gru").modulated == ()


def _spec(**kw):
    return CellSpec(**{**dict(name="bad_mod", gates=("f", "n"), saved=("f", "n"), forward=mgu.forward,
                              backward=mgu.backward, modulated=("n",), modulation=mgu.modulation,
                              modulation_backward=mgu.modulation_backward), **kw})


@pytest.mark.parametrize("kw, error, message", [
    (dict(modulated=("x",)), ValueError, r"CellSpec\.modulated: \['x'\] are not gates of 'bad_mod'"),
    (dict(modulated=("n", "n")), ValueError, r"CellSpec\.modulated: names must be distinct"),
    (dict(modulated=("f", "n")), ValueError, r"CellSpec\.modulated: at least one gate must stay unmodulated"),
    (dict(modulated="n"), TypeError, r"CellSpec\.modulated: expected a tuple of non-empty names"),
    (dict(recurrence="diagonal"), ValueError, r"CellSpec\.modulated: .* needs recurrence='matrix'"),
    (dict(cell_state=True, projection=True), ValueError, r"CellSpec\.modulated: a modulated cell cannot have a "
                                                         r"projection"),
    (dict(modulation=None), TypeError, r"CellSpec\.modulation: a cell with modulated gates \('n',\) needs"),
    (dict(modulation_backward=None), TypeError, r"CellSpec\.modulation_backward: a cell with modulated gates"),
    (dict(modulation=lambda wx, rh, v: 0.0), TypeError, r"CellSpec\.modulation: expected a function of 4 "
                                                        r"positional arguments \(wx, rh, v, h\)"),
    (dict(modulation_backward=sigmoid), TypeError, r"CellSpec\.modulation_backward: expected a function of 7"),
    (dict(modulated=()), ValueError, r"CellSpec\.modulated: modulation / modulation_backward are given but no "
                                     r"gate is modulated"),
])
def test_bad_descriptions_name_the_field(kw, error, message):
    with pytest.raises(error, match=message):
        _spec(**kw)


def test_a_spec_that_differs_only_in_what_it_modulates_is_a_different_cell():
    numbarnn.cells.register(_spec(name="mod_or_not", gates=("f", "g", "n"), saved=("f", "n")))
    numbarnn.cells.register(_spec(name="mod_or_not", gates=("f", "g", "n"), saved=("f", "n")))   # equal: fine
    with pytest.raises(ValueError, match="a different cell named 'mod_or_not'"):
        numbarnn.cells.register(_spec(name="mod_or_not", gates=("f", "g", "n"), saved=("f", "n"), modulated=("g",)))


def test_num_proj_is_refused_for_a_modulated_cell():
    with pytest.raises(ValueError, match="num_proj"):
        rnn_config(1, 3, 2, "gru_v1", num_proj=2)


def test_params_are_the_grus_and_the_reserve_saves_m():
    cfg, gru = rnn_config(2, 4, 3, "gru_v1", direction="bidirectional"), rnn_config(2, 4, 3, "gru",
                                                                                      direction="bidirectional")
    assert params_size(cfg) == params_size(gru)
    assert [r.shape for r in param_regions(cfg)] == [r.shape for r in param_regions(gru)]
    call = RNNCall(cfg, 5, 2, np.dtype(np.float64), True, True, (5, 3))
    entries = {e.name: e.shape for e in reserve_entries(call)}
    assert entries["mod0"] == entries["mod1"] == (2, 5, 2, 4)
    assert "mod0" not in {e.name for e in reserve_entries(RNNCall(gru, 5, 2, np.dtype(np.float64), True, True,
                                                                  (5, 3)))}


def test_explain_shows_the_modulation_and_the_step_kernel_fallback(capsys):
    assert cli.main(["explain", "--cells", "numbarnn.contrib.mgu", "--mode", "mgu", "--units", "3",
                     "--input-size", "2", "--time", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "modulated state: gates n take rh_g = R_g (m ⊙ h) + bR_g" in out and "mod0" in out
    assert "step kernels: v1: 'mgu' modulates the state before a recurrent product" in out
    assert "mgu_modulate " in out and "mgu_modulated_step" in out and "mgu_modulate_backward" in out
    assert "2 per step per layer" in out                 # forward: modulate + modulated_step


# ----------------------------------------------------------------------------------------------
# finite differences on every backend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
def test_check_cell(cell, backend):
    report = check_cell(cell, backends=(backend,), max_examples=12, network_examples=6)
    assert report.ok, str(report)


def _wrong_modulation_backward(dmod, mod, saved, v, h, dwx, drh):
    dwx[0] = dmod * mod                      # not σ'(f): the check must catch it


@pytest.mark.parametrize("where", ["modulation_backward", "backward"])
def test_check_cell_catches_a_wrong_gradient_through_m(where):
    """A cell whose gradient through m is wrong fails check_cell (the oracle can fail)."""
    def wrong_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
        out = mgu.backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv)
        dwx[1] *= 1.5
        return out
    fns = (dict(modulation_backward=_wrong_modulation_backward) if where == "modulation_backward"
           else dict(backward=wrong_backward))
    spec = CellSpec(**{**dict(name=f"mgu_wrong_{where}", gates=("f", "n"), saved=("f", "n"), forward=mgu.forward,
                              backward=mgu.backward, modulated=("n",), modulation=mgu.modulation,
                              modulation_backward=mgu.modulation_backward), **fns})
    report = check_cell(spec, backends=("reference",), max_examples=5, network_examples=2, raise_on_failure=False)
    assert not report.ok and report.pointwise > 1e-3


def test_check_cli_loads_the_cell_from_its_module_and_its_path():
    assert cli.main(["check", "--cells", "numbarnn.contrib.gru_v1", "--mode", "gru_v1", "--layers", "2",
                     "--direction", "bidirectional", "--units", "3", "--input-size", "2", "--time", "3",
                     "--batch", "3"]) == 0
    assert cli.main(["check", "--cells", os.path.abspath(mgu.__file__), "--mode", "mgu", "--units", "3",
                     "--input-size", "2", "--time", "3", "--batch", "2"]) == 0


# ----------------------------------------------------------------------------------------------
# an independent implementation in plain torch operations (published equations)
# ----------------------------------------------------------------------------------------------

def classic_gru_step(torch, W, R, bW, bR, x, h):
    """Cho et al. 2014 / Keras GRU(reset_after=False): the reset gate scales h before R_n."""
    r = torch.sigmoid(W[0] @ x + bW[0] + R[0] @ h + bR[0])
    z = torch.sigmoid(W[1] @ x + bW[1] + R[1] @ h + bR[1])
    n = torch.tanh(W[2] @ x + bW[2] + R[2] @ (r * h) + bR[2])
    return (1 - z) * n + z * h


def mgu_step(torch, W, R, bW, bR, x, h):
    """Zhou et al. 2016: f = σ(W_f x + U_f h + b_f), n = tanh(W_n x + U_n (f ⊙ h) + b_n), h' = (1-f) h + f n."""
    f = torch.sigmoid(W[0] @ x + bW[0] + R[0] @ h + bR[0])
    n = torch.tanh(W[1] @ x + bW[1] + R[1] @ (f * h) + bR[1])
    return (1 - f) * h + f * n


STEPS = {"gru_v1": (classic_gru_step, 3), "mgu": (mgu_step, 2)}


def torch_network(torch, step, x, h0, layers, lengths, L, D):
    """x [T, B, I], h0 [L*D, B, H]; layers[p] = (W, R, bW, bR), each a list over gates; lengths: B ints.  Per row b
    and pseudo-layer p, over the row's own length (the reverse direction reads it backwards)
    -> (y [T, B, D*H] with zeros past each length, hT [L*D, B, H])."""
    T, B = x.shape[0], x.shape[1]
    H = h0.shape[2]
    hT = []
    x_l = x
    for layer in range(L):
        outs = []
        for d in range(D):
            p = layer * D + d
            rows, finals = [], []
            for b in range(B):
                n = lengths[b]
                h = h0[p, b]
                ys = [None] * T
                for t in (range(n) if d == 0 else range(n - 1, -1, -1)):
                    h = step(torch, *layers[p], x_l[t, b], h)
                    ys[t] = h
                rows.append(torch.stack([v if v is not None else torch.zeros(H, dtype=x.dtype) for v in ys]))
                finals.append(h)
            outs.append(torch.stack(rows, dim=1))           # [T, B, H]
            hT.append(torch.stack(finals))                  # [B, H]
        x_l = torch.cat(outs, dim=2)                        # [T, B, D*H]
    return x_l, torch.stack(hT)


@pytest.mark.parametrize("time_major", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
def test_agrees_with_plain_torch_to_1e10(cell, backend, time_major):
    pytest.importorskip("torch", reason="the independent implementation is written in torch")
    step, G = STEPS[cell]

    def network(torch, x, h0, tw, tb, lengths, L, D):     # per p: W_0.., R_0.. ; bW_0.., bR_0..
        layers = [(tw[2 * G * p:2 * G * p + G], tw[2 * G * p + G:2 * G * (p + 1)], tb[2 * G * p:2 * G * p + G],
                   tb[2 * G * p + G:2 * G * (p + 1)]) for p in range(L * D)]
        return torch_network(torch, step, x, h0, layers, lengths, L, D)
    assert_agrees_with_torch_network(cell, backend, time_major, network)


def test_gru_v1_differs_from_the_builtin_gru_only_where_r_applies():
    """The same params and inputs: a different output (r before R_n, not after), equal with R_n = 0 and bR_n = 0
    (then r ⊙ (R_n h + bR_n) = R_n (r ⊙ h) + bR_n = 0)."""
    cfg_v1, cfg = rnn_config(1, 3, 2, "gru_v1"), rnn_config(1, 3, 2, "gru")
    case = make_rnn_case(cfg, 4, 2, seed=1)
    v1 = make_rnn_case(cfg_v1, 4, 2, seed=1)
    assert np.array_equal(case.params, v1.params)
    want, got = run_forward(case, "reference")[0], run_forward(v1, "reference")[0]
    assert relative_error(got, want) > 1e-3
    lp = numbarnn.params.unpack(cfg, case.params)[0]
    lp.R[6:9] = 0.0
    lp.bR[6:9] = 0.0
    assert relative_error(run_forward(v1, "reference", params=case.params)[0],
                          run_forward(case, "reference")[0]) < 1e-14


#: Keras' outputs for `_keras_case`, computed by tf.keras.layers.GRU(reset_after=False) in float64 (written by
#: `_keras_outputs` with TensorFlow installed: `python tests/test_modulated_cells.py`); read where it is not
KERAS_STORED = os.path.join(os.path.dirname(__file__), "stored", "keras_gru_reset_before.json")


def _keras_case():
    """x [B, T, I], kernel [I, 3H], recurrent_kernel [H, 3H], bias [3H] (Keras' layout: column blocks z, r, h),
    float64, from a fixed seed."""
    H, I, T, B = 3, 2, 4, 2
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, T, I)), rng.standard_normal((I, 3 * H)), rng.standard_normal((H, 3 * H)),
            rng.standard_normal(3 * H))


def _keras_outputs(tf, x, kernel, recurrent, bias):
    """(y [B, T, H], h [B, H]) of tf.keras.layers.GRU(reset_after=False) in float64 with these weights."""
    B, T, I = x.shape
    layer = tf.keras.layers.GRU(recurrent.shape[0], reset_after=False, return_sequences=True, return_state=True,
                                dtype="float64")
    layer.build((B, T, I))
    layer.set_weights([kernel, recurrent, bias])
    y, h = layer(tf.constant(x))
    return y.numpy(), h.numpy()


def test_agrees_with_keras_gru_reset_before():
    """tf.keras.layers.GRU(reset_after=False), in float64, to 1e-10: kernel [I, 3H] and recurrent_kernel [H, 3H] in
    gate order z, r, h, one bias (bW here, bR = 0).  With TensorFlow installed Keras computes its outputs here
    (and they must equal the stored ones); without it, the stored outputs it computed are compared."""
    x, kernel, recurrent, bias = _keras_case()
    with open(KERAS_STORED) as f:
        stored = json.load(f)
    y_tf, h_tf = np.array(stored["y"]), np.array(stored["h"])
    try:
        import tensorflow as tf
    except ImportError:
        tf = None
    if tf is not None:
        y_live, h_live = _keras_outputs(tf, x, kernel, recurrent, bias)
        assert relative_error(y_live, y_tf) < 1e-12 and relative_error(h_live, h_tf) < 1e-12
    B, T, I = x.shape
    H = recurrent.shape[0]
    cfg = rnn_config(1, H, I, "gru_v1")
    gate = {"r": 1, "z": 0, "n": 2}                             # keras' column blocks z, r, h
    weights = [kernel[:, gate[g] * H:(gate[g] + 1) * H].T for g in "rzn"] + \
              [recurrent[:, gate[g] * H:(gate[g] + 1) * H].T for g in "rzn"]
    biases = [bias[gate[g] * H:(gate[g] + 1) * H] for g in "rzn"] + [np.zeros(H)] * 3
    params = numbarnn.params.canonical_to_params(cfg, weights, biases)
    for backend in BACKENDS:
        y, h, *_ = numbarnn.ops.cudnn_rnn_v3(x, np.zeros((B, 1, H)), None, params, rnn_mode="gru_v1",
                                             time_major=False, is_training=False, backend=backend)
        assert relative_error(np.asarray(y), y_tf) < 1e-10, backend
        assert relative_error(np.asarray(h)[:, 0], h_tf) < 1e-10, backend


# ----------------------------------------------------------------------------------------------
# cpu in float32 / float16, and the layer
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float16, 1e-2)])
@pytest.mark.parametrize("cell", CELLS)
def test_cpu_lower_precision_agrees_with_the_reference(cell, dtype, tol):
    assert_cpu_agrees_in_lower_precision(cell, dtype, tol)


def test_cpu_inference_and_the_layer():
    """numbarnn.CudnnRNN(cell, ...) runs on the cpu backend like the reference, training and inference alike."""
    assert_layer_runs_like_the_reference(mgu.SPEC)


@pytest.mark.parametrize("cell", CELLS)
def test_cpu_fused_forward_agrees_with_the_blas_loop_and_the_reference(monkeypatch, cell):
    """cpu/modulated_fused.py's fused forward against the BLAS loop (NUMBARNN_CPU_FUSED=0) and the reference."""
    from numbarnn.cpu import modulated_fused
    assert_fused_forward_equals_the_blas_loop(monkeypatch, cell, modulated_fused)


# ----------------------------------------------------------------------------------------------
# cuda: several blocks with a partial last block, the launch plan, the v1 fallback
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not common.SIMULATOR, reason="simulator launch sizes (several blocks of a few threads)")
@pytest.mark.parametrize("cell", CELLS)
def test_cuda_several_blocks_with_a_partial_last_block(cell):
    cfg = rnn_config(2, 11, 5, cell, direction="bidirectional", dropout=0.4, seed=3, seed2=9)
    case = make_rnn_case(cfg, 3, 3, [3, 0, 2], seed=5)
    plan, log, got_f, got_b = planned_and_launched(case)      # the plan lists exactly the launches made
    for name in (f"{cell}_modulate", f"{cell}_modulated_step", f"{cell}_modulate_backward",
                 f"{cell}_recurrent_backward"):
        row = next(r for r in plan if r["kernel"] == name)
        assert row["grid"][0] > 1 and 11 % row["block"] != 0   # several blocks, the last one partial
        assert row["launches"] == 3
    for name in ("modulate", "modulated_step", "modulate_backward", "recurrent_backward"):
        assert log["forward" if "backward" not in name else "backward"].by_kernel[name] == 2 * 3
    assert_agrees_with_the_reference(case, got_f, got_b)


@pytest.mark.parametrize("version", [2, 3])
def test_cuda_step_versions_2_and_3_fall_back_to_v1_with_a_note(version):
    assert_v1_fallback("gru_v1", version, "'gru_v1' modulates the state before a recurrent product (R_g (m ⊙ h)); the v2/v3 step kernels make one product per step")


def test_the_kernel_report_lists_the_modulated_kernels():
    from numbarnn.kernels import modulated
    names = {(name, dt) for name, dt, *_ in modulated.kernel_specs()}
    for cell in CELLS:
        for kernel in modulated.KERNELS:
            assert (f"{cell}_{kernel}", "float32") in names
    from numbarnn.kernels import cell_steps, step_v2
    assert ("mgu_forward_step", "float32") not in {(n, d) for n, d, *_ in cell_steps.kernel_specs()}
    assert ("mgu_backward_step", "float32") in {(n, d) for n, d, *_ in cell_steps.kernel_specs()}
    assert not [n for n, *_ in step_v2.kernel_specs() if n.startswith(("mgu", "gru_v1"))]


# ----------------------------------------------------------------------------------------------
# numbarnn.torch
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", CELLS)
def test_numbarnn_torch_module_of_a_modulated_cell(cell):
    """numbarnn.torch.RNNBase(cell, ...): torch.nn.GRU's weight shapes (G*H rows), outputs equal the reference op's,
    gradients pass torch's gradcheck and gradgradcheck (the double backward recomputes in torch operations)."""
    torch = pytest.importorskip("torch", reason="numbarnn.torch needs torch")
    import numbarnn.torch as nt
    from numbarnn import ops
    from numbarnn.params import from_torch_state_dict
    G = STEPS[cell][1]
    torch.manual_seed(0)
    m = nt.RNNBase(cell, 3, 5, num_layers=2, bidirectional=True, dtype=torch.float64)
    assert tuple(m.weight_hh_l0.shape) == (G * 5, 5) and tuple(m.weight_ih_l1_reverse.shape) == (G * 5, 10)
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    y, h = m(x)
    cfg = rnn_config(2, 5, 3, cell, direction="bidirectional")
    p = from_torch_state_dict(cfg, {k: v.detach().numpy() for k, v in m.state_dict().items()})
    want, want_h, *_ = ops.cudnn_rnn_v3(x.detach().numpy(), np.zeros((4, 2, 5)), None, p, rnn_mode=cell,
                                        direction="bidirectional", is_training=False, backend="reference")
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(h.detach().numpy(), want_h, rtol=0, atol=1e-12)
    small = nt.RNNBase(cell, 2, 3, dtype=torch.float64, bidirectional=True)
    xs = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)

    def f(x, r):
        return torch.func.functional_call(small, {"weight_hh_l0": r}, (x,))[0]
    inputs = (xs, small.weight_hh_l0.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_the_spec_functions_match_dsigmoid_of_m():
    """modulation_backward of both cells is dL/dm * σ'(m) into the modulating gate's pre-activation."""
    for spec, k in ((gru_v1.SPEC, 0), (mgu.SPEC, 0)):
        wx, rh = np.array([0.3, -0.2, 0.1][:spec.G]), np.array([-1.1, 0.4, 0.0][:spec.G])
        m = spec.modulation(wx, rh, np.zeros(0), 0.5)
        assert m == sigmoid(wx[k] + rh[k])
        dwx, drh = np.zeros(spec.G), np.zeros(spec.G)
        spec.modulation_backward(2.0, m, np.zeros(spec.S), np.zeros(0), 0.5, dwx, drh)
        assert dwx[k] == 2.0 * dsigmoid(m) and not dwx[k + 1:].any()


if __name__ == "__main__":                     # (re)write the stored Keras outputs: needs TensorFlow
    import tensorflow

    y, h = _keras_outputs(tensorflow, *_keras_case())
    with open(KERAS_STORED, "w") as f:
        json.dump({"made_by": f"tensorflow {tensorflow.__version__}, keras {tensorflow.keras.__version__}",
                   "y": y.tolist(), "h": h.tolist()}, f, indent=1)
        f.write("\n")
    print("wrote", KERAS_STORED)

"""IndRNN (numbarnn.contrib.indrnn): a cell with a diagonal recurrence, rh_g = u_g ⊙ h + bR_g, on every backend.

The oracle is twofold: finite differences (`check_cell`), and an independent implementation in plain PyTorch
operations written from the published equations (haste's IndRNN: h' = tanh(W x + u ⊙ h + b); the paper's ReLU
variant), looping row by row over each sequence's own length, differentiated by autograd.
"""
import os

import numpy as np
import pytest

import numbarnn
import numbarnn.contrib.indrnn as indrnn
from numbarnn import cli
from numbarnn.cells import CellSpec, relu, tanh
from numbarnn.config import params_size, rnn_config
from numbarnn.kernels import common
from numbarnn.params import (canonical_weight_shapes, from_torch_state_dict, param_regions, params_to_canonical,
                             to_torch_state_dict, unpack)
from numbarnn.testing import check_cell, make_rnn_case
from conftest import (assert_agrees_with_the_reference, assert_agrees_with_torch_network,
                      assert_cpu_agrees_in_lower_precision, assert_layer_runs_like_the_reference, assert_v1_fallback,
                      planned_and_launched)

BACKENDS = ("reference", "cpu", "cuda")
CELLS = ("indrnn", "indrnn_relu")


# ----------------------------------------------------------------------------------------------
# the description
# ----------------------------------------------------------------------------------------------

def test_the_shipped_cells_declare_a_diagonal_recurrence():
    assert indrnn.SPEC.diagonal and indrnn.SPEC.recurrence == "diagonal" and not indrnn.SPEC.projection
    assert indrnn.RELU_SPEC.diagonal
    assert not numbarnn.cells.get_cell("lstm").diagonal and numbarnn.cells.get_cell("lstm").recurrence == "matrix"


def _spec(**kw):
    return CellSpec(**{**dict(name="bad_diag", gates=("a",), saved=("h",), forward=indrnn.forward,
                              backward=indrnn.backward), **kw})


def test_unknown_recurrence_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"CellSpec\.recurrence: expected one of \('matrix', 'diagonal'\), "
                                         r"got 'diag'"):
        _spec(recurrence="diag")


def test_diagonal_recurrence_with_a_projection_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"CellSpec\.recurrence: a diagonal recurrence .* cannot have a projection"):
        _spec(recurrence="diagonal", cell_state=True, projection=True)


def test_num_proj_is_refused_for_a_diagonal_cell():
    with pytest.raises(ValueError, match="num_proj"):
        rnn_config(1, 3, 2, "indrnn", num_proj=2)


def test_a_spec_that_differs_only_in_its_recurrence_is_a_different_cell():
    numbarnn.cells.register(_spec(name="diag_or_not"))
    with pytest.raises(ValueError, match="a different cell named 'diag_or_not'"):
        numbarnn.cells.register(_spec(name="diag_or_not", recurrence="diagonal"))


# ----------------------------------------------------------------------------------------------
# parameters: vectors u_g [H] in the R slots
# ----------------------------------------------------------------------------------------------

def test_params_hold_a_vector_per_gate_where_others_hold_R():
    cfg = rnn_config(2, 4, 3, "indrnn", direction="bidirectional")
    H, I, D = 4, 3, 2
    assert params_size(cfg) == D * (H * I + H) + D * (H * D * H + H) + 2 * D * 2 * H
    regions = param_regions(cfg)
    assert sum(r.size for r in regions) == params_size(cfg)
    R = [r for r in regions if r.kind == "R"]
    assert len(R) == 4 and all(r.shape == (H,) and r.linear_id == 1 for r in R)
    assert "diagonal" in R[0].describe(cfg)
    assert canonical_weight_shapes(cfg) == [(H, I), (H,), (H, I), (H,), (H, D * H), (H,), (H, D * H), (H,)]
    params = np.arange(params_size(cfg), dtype=np.float64)
    lp = unpack(cfg, params)[1]
    assert lp.R.shape == (H,) and lp.W.shape == (H, I)
    weights, biases = params_to_canonical(cfg, params)
    assert np.array_equal(weights[3], lp.R)
    sd = to_torch_state_dict(cfg, params)
    assert sd["weight_hh_l0_reverse"].shape == (H,)
    assert np.array_equal(from_torch_state_dict(cfg, sd), params)
    sd["weight_hh_l1"] = np.zeros((H, H))
    with pytest.raises(ValueError, match=r"weight_hh_l1.*\[G\*H\] \(a diagonal recurrence"):
        from_torch_state_dict(cfg, sd)


def test_explain_shows_the_vectors_and_the_step_kernel_fallback(capsys):
    assert cli.main(["explain", "--cells", "numbarnn.contrib.indrnn", "--mode", "indrnn", "--units", "3",
                     "--input-size", "2", "--time", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "layer 0 fwd R gate a (diagonal: u, rh = u ⊙ h)" in out and "| [3]    |" in out
    assert "diagonal recurrence: each R_g slot holds a vector u_g [H]" in out
    assert "step kernels: v1: 'indrnn' has a diagonal recurrence" in out      # the GPU plan's v3 falls back
    assert "indrnn_forward_step " in out and "diagonal_gradient" in out and "dR = dgh^T" not in out


# ----------------------------------------------------------------------------------------------
# finite differences on every backend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
def test_check_cell(cell, backend):
    report = check_cell(cell, backends=(backend,), max_examples=12, network_examples=6)
    assert report.ok, str(report)


def test_check_cli_loads_the_cell_from_its_path():
    path = os.path.abspath(indrnn.__file__)           # a second import of the same file: an equal spec again
    assert cli.main(["check", "--cells", path, "--mode", "indrnn", "--layers", "2", "--direction", "bidirectional",
                     "--units", "3", "--input-size", "2", "--time", "3", "--batch", "3"]) == 0


# ----------------------------------------------------------------------------------------------
# an independent implementation in plain torch operations (published equations)
# ----------------------------------------------------------------------------------------------

def torch_indrnn(act, x, h0, layers, lengths, L, D):
    import torch
    """x [T, B, I], h0 [L*D, B, H]; layers[p] = (W [H, I_l], u [H], bW [H], bR [H]); lengths: B ints.
    Per row b and pseudo-layer p, over the row's own length (the reverse direction reads it backwards):
        h_t = act(W x_t + bW + u ⊙ h_{t-1} + bR)
    -> (y [T, B, D*H] with zeros past each length, hT [L*D, B, H])."""
    T, B = x.shape[0], x.shape[1]
    H = h0.shape[2]
    hT = []
    x_l = x
    for layer in range(L):
        outs = []
        for d in range(D):
            p = layer * D + d
            W, u, bW, bR = layers[p]
            rows, finals = [], []
            for b in range(B):
                n = lengths[b]
                times = range(n) if d == 0 else range(n - 1, -1, -1)
                h = h0[p, b]
                ys = [None] * T
                for t in times:
                    h = act(W @ x_l[t, b] + bW + u * h + bR)
                    ys[t] = h
                rows.append(torch.stack([v if v is not None else torch.zeros(H, dtype=x.dtype) for v in ys]))
                finals.append(h)
            outs.append(torch.stack(rows, dim=1))           # [T, B, H]
            hT.append(torch.stack(finals))                  # [B, H]
        x_l = torch.cat(outs, dim=2)                        # [T, B, D*H]
    return x_l, torch.stack(hT)


ACT = {"indrnn": "tanh", "indrnn_relu": "relu"}       # torch's functions of these names


@pytest.mark.parametrize("time_major", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
def test_agrees_with_plain_torch_to_1e10(cell, backend, time_major):
    pytest.importorskip("torch")

    def network(torch, x, h0, tw, tb, lengths, L, D):     # per p: W, u ; bW, bR
        layers = [(tw[2 * p], tw[2 * p + 1], tb[2 * p], tb[2 * p + 1]) for p in range(L * D)]
        return torch_indrnn(getattr(torch, ACT[cell]), x, h0, layers, lengths, L, D)
    assert_agrees_with_torch_network(cell, backend, time_major, network)


def test_the_spec_functions_match_the_published_activations():
    """The cells' pointwise forward is haste's tanh (and the paper's relu) of wx + rh."""
    for spec, act in ((indrnn.SPEC, tanh), (indrnn.RELU_SPEC, relu)):
        saved = np.zeros(1)
        m, _ = spec.forward(np.array([0.3]), np.array([-1.1]), np.zeros(0), 0.5, 0.0, saved)
        assert m == act(0.3 - 1.1) == saved[0]


# ----------------------------------------------------------------------------------------------
# cuda: several blocks with a partial last one, the launch plan, the v1 fallback
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not common.SIMULATOR, reason="simulator launch sizes (several blocks of a few threads)")
def test_cuda_several_blocks_with_a_partial_last_block():
    cfg = rnn_config(2, 19, 5, "indrnn_relu", direction="bidirectional", dropout=0.4, seed=3, seed2=9)
    case = make_rnn_case(cfg, 4, 3, [4, 0, 2], seed=5)
    plan, log, got_f, got_b = planned_and_launched(case)      # the plan lists exactly the launches made
    step = next(r for r in plan if r["kernel"] == "indrnn_relu_forward_step")
    assert step["grid"][0] > 1 and 19 % step["block"] != 0     # several blocks, the last one partial
    grad = next(r for r in plan if r["kernel"] == "diagonal_gradient")
    assert grad["grid"][0] > 1 and 19 % grad["block"] != 0
    assert log["backward"].by_kernel["recurrent_backward"] == 2 * 4 and "gemm" in log["backward"].by_kernel
    assert_agrees_with_the_reference(case, got_f, got_b)


@pytest.mark.parametrize("version", [2, 3])
def test_cuda_step_versions_2_and_3_fall_back_to_v1_with_a_note(version):
    assert_v1_fallback("indrnn", version, "'indrnn' has a diagonal recurrence (u_g ⊙ h); the v2/v3 step kernels tile a product by a matrix R")


# ----------------------------------------------------------------------------------------------
# cpu in float32 / float16, inference, and the layer
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float16, 1e-2)])
def test_cpu_lower_precision_agrees_with_the_reference(dtype, tol):
    assert_cpu_agrees_in_lower_precision("indrnn", dtype, tol)


def test_layer_of_the_cell():
    """numbarnn.CudnnRNN(cell, ...) builds params with a vector u per R slot and runs like the reference."""
    layer = assert_layer_runs_like_the_reference(indrnn.SPEC)
    assert [w.shape for w in layer.canonical_weights()[0]][:2] == [(4, 2), (4,)]


def test_numbarnn_torch_module_of_a_diagonal_cell():
    """numbarnn.torch.RNNBase("indrnn", ...): weight_hh is the stacked u_g [G*H] (torch's state_dict and the
    params converters agree), outputs equal the reference op's, gradients pass torch's gradcheck."""
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    from numbarnn import ops
    from numbarnn.config import rnn_config
    from numbarnn.params import from_torch_state_dict
    torch.manual_seed(0)
    m = nt.RNNBase("indrnn", 3, 5, num_layers=2, bidirectional=True, dtype=torch.float64)
    assert tuple(m.weight_hh_l0.shape) == (5,) and tuple(m.weight_hh_l1_reverse.shape) == (5,)
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    y, h = m(x)
    cfg = rnn_config(2, 5, 3, "indrnn", direction="bidirectional")
    p = from_torch_state_dict(cfg, {k: v.detach().numpy() for k, v in m.state_dict().items()})
    want, want_h, *_ = ops.cudnn_rnn_v3(x.detach().numpy(), np.zeros((4, 2, 5)), None, p, rnn_mode="indrnn",
                                        direction="bidirectional", is_training=False, backend="reference")
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(h.detach().numpy(), want_h, rtol=0, atol=1e-12)
    small = nt.RNNBase("indrnn", 2, 3, dtype=torch.float64)
    xs = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, u: torch.func.functional_call(small, {"weight_hh_l0": u}, (x,))[0],
                                    (xs, small.weight_hh_l0.detach().clone().requires_grad_()))

"""Layer-normalised cells (CellSpec.layer_norm, SPEC 13): haste's LayerNormLSTM and LayerNormGRU, whose rows of W x
and R h (and the LSTM's cell state) are layer-normalised inside the step.

The oracle is twofold: finite differences (`check_cell`), and an independent implementation in plain PyTorch
operations written from haste's published equations (its LayerNormLSTMScript / LayerNormGRUScript: F.layer_norm of
the whole row, gains gamma[0], gamma[1], gamma_h, beta_h), looping row by row over each sequence's own length,
differentiated by autograd.
"""

import numpy as np
import pytest

import numbarnn
import numbarnn.contrib.layer_norm_gru as ln_gru
import numbarnn.contrib.layer_norm_lstm as ln_lstm
from numbarnn.cells import CellSpec
from numbarnn.config import RNNCall, params_size, rnn_config
from numbarnn.params import param_regions, params_to_canonical
from numbarnn.reserve import reserve_contents, reserve_entries, reserve_views
from numbarnn.testing import check_cell, make_rnn_case, relative_error, run_backward, run_forward
from numbarnn.kernels import common
from conftest import (assert_agrees_with_the_reference, assert_cpu_agrees_in_lower_precision,
                      assert_fused_forward_equals_the_blas_loop, assert_layer_runs_like_the_reference,
                      assert_v1_fallback, planned_and_launched)

CELLS = ("layer_norm_lstm", "layer_norm_gru")
BACKENDS = ("reference", "cpu", "cuda")


# ----------------------------------------------------------------------------------------------
# the description
# ----------------------------------------------------------------------------------------------

def test_the_shipped_cells_normalise_what_haste_normalises():
    assert ln_lstm.SPEC.layer_norm == ("wx", "rh", "c") and ln_lstm.SPEC.gates == ("i", "g", "f", "o")
    assert ln_gru.SPEC.layer_norm == ("wx", "rh") and ln_gru.SPEC.gates == ("z", "r", "g")
    assert ln_lstm.SPEC.norm_groups == (("ln_wx_gain", 4), ("ln_rh_gain", 4), ("ln_c_gain", 1), ("ln_c_bias", 1))
    assert numbarnn.cells.get_cell("lstm").layer_norm == () and numbarnn.cells.get_cell("lstm").NV == 0


def _spec(**kw):
    return CellSpec(**{**dict(name="bad_ln", gates=("i", "g", "f", "o"), saved=("i", "g", "f", "o"),
                              forward=ln_lstm.forward, backward=ln_lstm.backward, cell_state=True,
                              layer_norm=("wx", "rh", "c"), output=ln_lstm.output,
                              output_backward=ln_lstm.output_backward), **kw})


@pytest.mark.parametrize("kw, error, message", [
    (dict(layer_norm=("x",)), ValueError, r"CellSpec\.layer_norm: \['x'\] cannot be normalised"),
    (dict(layer_norm=("wx", "wx")), ValueError, r"CellSpec\.layer_norm: names must be distinct"),
    (dict(layer_norm="wx"), TypeError, r"CellSpec\.layer_norm: expected a tuple of non-empty names"),
    (dict(cell_state=False), ValueError, r"CellSpec\.layer_norm: 'c' normalises the cell state, but the cell has "
                                         r"none"),
    (dict(output=None), TypeError, r"CellSpec\.output: a cell with a normalised state .* needs"),
    (dict(output_backward=None), TypeError, r"CellSpec\.output_backward: a cell with a normalised state"),
    (dict(output=lambda n, saved: 0.0), TypeError, r"CellSpec\.output: expected a function of 3 positional "
                                                   r"arguments \(n, saved, v\)"),
    (dict(layer_norm=("wx",)), ValueError, r"CellSpec\.output: output / output_backward are given but the cell "
                                           r"state is not normalised"),
    (dict(recurrence="diagonal"), ValueError, r"CellSpec\.layer_norm: a layer-normalised cell needs "
                                              r"recurrence='matrix'"),
    (dict(projection=True), ValueError, r"CellSpec\.layer_norm: a layer-normalised cell cannot have a projection"),
])
def test_bad_descriptions_name_the_field(kw, error, message):
    with pytest.raises(error, match=message):
        _spec(**kw)


def test_a_spec_that_differs_only_in_what_it_normalises_is_a_different_cell():
    from numbarnn.cells.spec import _same
    assert _same(_spec(), _spec())
    assert not _same(_spec(), _spec(layer_norm=("rh", "c")))


def test_params_end_with_the_normalisation_vectors_and_the_reserve_saves_the_statistics():
    cfg = rnn_config(2, 3, 2, "layer_norm_lstm", direction="bidirectional")
    plain = rnn_config(2, 3, 2, "lstm", direction="bidirectional")
    assert params_size(cfg) == params_size(plain) + 4 * 10 * 3
    tail = [r for r in param_regions(cfg) if r.kind == "N"]
    assert len(tail) == 40 and tail[0].offset == params_size(plain) and tail[-1].offset + 3 == params_size(cfg)
    assert tail[0].describe(cfg) == "layer 0 fwd N ln_wx_gain i" and tail[9].describe(cfg) == "layer 0 fwd N ln_c_bias"
    names = {e.name: e.shape for e in reserve_entries(RNNCall(cfg, 4, 5, None, True))}
    assert names["lnstat1"] == (2, 4, 5, 6) and names["rh0"] == (2, 4, 5, 12)
    gru = {e.name: e.shape for e in reserve_entries(RNNCall(rnn_config(1, 3, 2, "layer_norm_gru"), 4, 5, None,
                                                            True))}
    assert gru["lnstat0"] == (1, 4, 5, 4) and "c0" not in gru


def test_num_proj_is_refused_for_a_layer_normalised_cell():
    with pytest.raises(ValueError, match="num_proj: projection is only defined for rnn_mode in"):
        rnn_config(1, 4, 3, "layer_norm_lstm", num_proj=2)


# ----------------------------------------------------------------------------------------------
# gradients: finite differences
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell", CELLS)
def test_check_cell(cell, backend):
    report = check_cell(cell, backends=(backend,), max_examples=8, network_examples=2 if backend == "cuda" else 4)
    assert report.ok and report.network[backend] < 1e-5


def test_the_pointwise_check_catches_a_wrong_gradient_through_the_normalised_state():
    def output_backward(dm, n, saved, v, dwx, drh):
        dwx[3] = dm * ln_lstm.tanh(n) * ln_lstm.dsigmoid(saved[3])
        return dm * saved[3]                               # forgets tanh's derivative
    from numbarnn.testing import pointwise_gradient_error
    args = (np.array([0.3, -0.2, 0.5, 0.1]), np.array([0.2, 0.4, -0.3, 0.6]), np.zeros(0), 0.3, -0.4, 0.7, 0.2)
    assert pointwise_gradient_error(ln_lstm.SPEC, *args) < 1e-8
    assert pointwise_gradient_error(_spec(name="bad_ln_output", output_backward=output_backward), *args) > 1e-3


# ----------------------------------------------------------------------------------------------
# haste's equations in plain torch
# ----------------------------------------------------------------------------------------------

def _haste_layers(torch, cell, tw, tb, L, D, H):
    """Per pseudo-layer haste's parameters from the canonical lists (W_0.., R_0.. per p; then every p's
    normalisation vectors; biases bW_0.., bR_0.. per p): kernel [I_l, G*H], recurrent_kernel [H, G*H], bias,
    recurrent_bias [G*H], gamma [2, G*H], gamma_h, beta_h [H]."""
    G, NV, n0 = cell.G, cell.NV, 2 * cell.G * L * D
    out = []
    for p in range(L * D):
        w, b = tw[2 * G * p:2 * G * (p + 1)], tb[2 * G * p:2 * G * (p + 1)]
        norm = tw[n0 + NV * p:n0 + NV * (p + 1)]
        out.append(dict(kernel=torch.cat(w[:G]).T, recurrent_kernel=torch.cat(w[G:]).T, bias=torch.cat(b[:G]),
                        recurrent_bias=torch.cat(b[G:]), gamma=torch.stack([torch.cat(norm[:G]),
                                                                             torch.cat(norm[G:2 * G])]),
                        gamma_h=norm[2 * G] if NV > 2 * G else None, beta_h=norm[2 * G + 1] if NV > 2 * G else None))
    return out


def _haste_lstm(torch, x, h, c, q):
    """haste's LayerNormLSTMScript over one sequence x [n, I] (bias = bias + recurrent_bias: haste has one)."""
    F = torch.nn.functional
    H = q["recurrent_kernel"].shape[0]
    Wx = F.layer_norm(x @ q["kernel"], (4 * H,), weight=q["gamma"][0])
    hs = []
    for t in range(x.shape[0]):
        v = F.layer_norm(h @ q["recurrent_kernel"], (4 * H,), weight=q["gamma"][1]) + Wx[t] + q["bias"] + \
            q["recurrent_bias"]
        i, g, f, o = torch.chunk(v, 4, 0)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(F.layer_norm(c, (H,), weight=q["gamma_h"], bias=q["beta_h"]))
        hs.append(h)
    return hs, h, c


def _haste_gru(torch, x, h, c, q):
    """haste's LayerNormGRUScript over one sequence x [n, I]."""
    F = torch.nn.functional
    H = q["recurrent_kernel"].shape[0]
    Wx = F.layer_norm(x @ q["kernel"], (3 * H,), weight=q["gamma"][0]) + q["bias"]
    hs = []
    for t in range(x.shape[0]):
        Rh = F.layer_norm(h @ q["recurrent_kernel"], (3 * H,), weight=q["gamma"][1]) + q["recurrent_bias"]
        vx, vh = torch.chunk(Wx[t], 3, 0), torch.chunk(Rh, 3, 0)
        z = torch.sigmoid(vx[0] + vh[0])
        r = torch.sigmoid(vx[1] + vh[1])
        g = torch.tanh(vx[2] + r * vh[2])
        h = z * h + (1 - z) * g
        hs.append(h)
    return hs, h, c


def _torch_network(torch, cell, x, h0, c0, tw, tb, lengths, L, D):
    """y [T, B, D*H], hT, cT [L*D, B, H] (time-major), row by row over each sequence's own length."""
    T, B, _ = x.shape
    H = h0.shape[-1]
    layers = _haste_layers(torch, cell, tw, tb, L, D, H)
    run = _haste_lstm if cell.cell_state else _haste_gru
    ys, hT, cT = [], [[None] * B for _ in range(L * D)], [[None] * B for _ in range(L * D)]
    for b, n in enumerate(lengths):
        seq = x[:n, b]                                        # [n, I]
        for layer in range(L):
            outs = []
            for d in range(D):
                p = layer * D + d
                c = c0[p, b] if c0 is not None else None
                src = seq if d == 0 else torch.flip(seq, [0])
                hs, hT[p][b], cT[p][b] = run(torch, src, h0[p, b], c, layers[p])
                out = torch.stack(hs) if hs else seq.new_zeros((0, H))
                outs.append(out if d == 0 else torch.flip(out, [0]))
            seq = torch.cat(outs, dim=1)                      # [n, D*H]
        ys.append(torch.cat([seq, seq.new_zeros((T - n, D * H))]))
    y = torch.stack(ys, dim=1)
    stack = (lambda rows: torch.stack([torch.stack(r) for r in rows]))
    return y, stack(hT), (stack(cT) if c0 is not None else None)


@pytest.mark.parametrize("backend, time_major", [("reference", True), ("reference", False), ("cpu", True),
                                                 ("cpu", False), ("cuda", True)])
@pytest.mark.parametrize("cell", CELLS)
def test_agrees_with_haste_in_plain_torch_to_1e10(cell, backend, time_major):
    """2 layers, bidirectional, lengths with 0, either layout (cuda: time-major; the layout is the op's, shared by
    every backend): outputs, final states and every gradient."""
    torch = pytest.importorskip("torch", reason="the independent implementation is written in torch")
    spec = numbarnn.cells.get_cell(cell)
    L, D, H, I, T, B = 2, 2, 3, 2, 4, 3
    lengths = [4, 0, 2]
    cfg = rnn_config(L, H, I, cell, direction="bidirectional")
    case = make_rnn_case(cfg, T, B, lengths, seed=3, time_major=time_major)
    for r in param_regions(cfg):                              # gains near 1, as trained ones are
        if r.kind == "N":
            case.params[r.offset:r.offset + r.size] += 1.0 if "gain" in r.describe(cfg) else 0.0
    tm = (lambda a: a) if time_major else (lambda a: np.swapaxes(a, 0, 1))
    fwd = run_forward(case, backend)
    dx, dh0, dc0, dparams = run_backward(case, fwd, backend)

    x = torch.tensor(tm(case.x), requires_grad=True)
    h0 = torch.tensor(tm(case.h0), requires_grad=True)
    c0 = torch.tensor(tm(case.c0), requires_grad=True) if spec.cell_state else None
    weights, biases = params_to_canonical(cfg, case.params)
    tw = [torch.tensor(w, requires_grad=True) for w in weights]
    tb = [torch.tensor(b, requires_grad=True) for b in biases]
    y, hT, cT = _torch_network(torch, spec, x, h0, c0, tw, tb, lengths, L, D)
    loss = (y * torch.tensor(tm(case.dy))).sum() + (hT * torch.tensor(tm(case.dhT))).sum()
    if spec.cell_state:
        loss = loss + (cT * torch.tensor(tm(case.dcT))).sum()
    loss.backward()

    assert relative_error(tm(np.asarray(fwd[0])), y.detach().numpy()) < 1e-10
    assert relative_error(tm(np.asarray(fwd[1])), hT.detach().numpy()) < 1e-10
    assert relative_error(tm(np.asarray(dx)), x.grad.numpy()) < 1e-10
    assert relative_error(tm(np.asarray(dh0)), h0.grad.numpy()) < 1e-10
    if spec.cell_state:
        assert relative_error(tm(np.asarray(fwd[2])), cT.detach().numpy()) < 1e-10
        assert relative_error(tm(np.asarray(dc0)), c0.grad.numpy()) < 1e-10
    dw, db = params_to_canonical(cfg, np.asarray(dparams))
    for got, want in zip(dw + db, tw + tb):
        assert relative_error(got, want.grad.numpy()) < 1e-10


# ----------------------------------------------------------------------------------------------
# cpu: lower precision, the layer
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float16, 1e-2)])
@pytest.mark.parametrize("cell", CELLS)
def test_cpu_lower_precision_agrees_with_the_reference(cell, dtype, tol):
    assert_cpu_agrees_in_lower_precision(cell, dtype, tol)


def test_cpu_inference_and_the_layer():
    """numbarnn.CudnnRNN(cell, ...) runs on the cpu backend like the reference (2 layers, bidirectional, lengths
    with 0; the LSTM's state is (h, c))."""
    assert_layer_runs_like_the_reference(ln_gru.SPEC)
    x = np.random.default_rng(0).standard_normal((5, 3, 2))
    lengths = np.array([5, 0, 3], np.int32)
    outs = {}
    for backend in ("cpu", "reference"):
        layer = numbarnn.CudnnRNN(ln_lstm.SPEC, 2, 4, direction="bidirectional", dtype="float64", seed=1,
                                  backend=backend)
        y, (h, c) = layer(x, sequence_lengths=lengths)
        assert y.shape == (5, 3, 8) and h.shape == c.shape == (4, 3, 4)
        cfg = layer._config
        for r in param_regions(cfg):                          # haste's init: gains 1, the state's bias 0
            if r.kind == "N":
                assert np.all(np.asarray(layer.trainable_weights[0])[r.offset:r.offset + r.size] ==
                              (0.0 if "bias" in r.describe(cfg) else 1.0))
        outs[backend] = (np.asarray(y), np.asarray(h), np.asarray(c))
    for got, want in zip(outs["cpu"], outs["reference"]):
        assert relative_error(got, want) < 1e-12


def test_cpu_one_unit_and_skip_input():
    """H = 1 (a row of c' has no spread: n = β_c) and skip_input (W x = x per gate) agree with the reference.
    At H = 1, dh0 (~5e-5, four orders below the other gradients) is what cancellation leaves, so the order of the
    CPU's sums moves it: 6e-13 relative on an AMD Zen 4, 4e-12 on the CPU of an H100 machine; hence 1e-11 there."""
    gru = rnn_config(2, 3, 3, "layer_norm_gru", input_mode="skip_input", direction="bidirectional")
    for cfg, tol in ((rnn_config(1, 1, 2, "layer_norm_lstm"), 1e-11), (gru, 1e-12)):
        case = make_rnn_case(cfg, 3, 2, [3, 1], seed=2)
        got_f = run_forward(case, "cpu")
        assert_agrees_with_the_reference(case, got_f, run_backward(case, got_f, "cpu"), tol)


# ----------------------------------------------------------------------------------------------
# cuda: a block per row, several blocks with a partial last stride, the launch plan, the v1 fallback
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not common.SIMULATOR, reason="simulator launch sizes (blocks of a few threads)")
@pytest.mark.parametrize("cell", CELLS)
def test_cuda_several_blocks_with_a_partial_last_stride(cell):
    """H = 5 on blocks of 4 threads: every row takes several strides, the last one partial (c' 5 values; the GRU's
    G*H = 15); grids of B*D step blocks and T*B*D row blocks; dropout between the layers; the plan lists exactly
    the launches made."""
    from numbarnn.kernels.layer_norm import BLOCK_SIM
    cfg = rnn_config(2, 5, 3, cell, direction="bidirectional", dropout=0.4, seed=3, seed2=9)
    case = make_rnn_case(cfg, 3, 3, [3, 0, 2], seed=5)
    plan, log, got_f, got_b = planned_and_launched(case)
    assert BLOCK_SIM == 4 and 5 % BLOCK_SIM and (cfg.G == 4 or (cfg.G * 5) % BLOCK_SIM)
    for name, grid, launches in ((f"{cell}_layer_norm_step", (3, 2), 3),
                                 (f"{cell}_layer_norm_backward_step", (3, 2), 3),
                                 ("layer_norm_rows (W x)", (9, 2), 1), ("layer_norm_rows_backward (W x)", (9, 2), 1)):
        rows = [r for r in plan if r["kernel"] == name]
        assert len(rows) == 2 and all(r["grid"] == grid and r["block"] == BLOCK_SIM and r["launches"] == launches
                                      for r in rows), (name, rows)
    assert log["forward"].by_kernel["layer_norm_step"] == 2 * 3
    assert log["backward"].by_kernel["layer_norm_backward_step"] == 2 * 3
    assert_agrees_with_the_reference(case, got_f, got_b)


@pytest.mark.parametrize("cell", CELLS)
def test_one_reserve_layout_on_every_backend_with_the_raw_products(monkeypatch, cell):
    """The reserve (SPEC 7, 13: lnstat and the raw W x and R h of each step, 0 where no step runs) is one layout:
    cpu (fused and BLAS loops) and cuda write the reference's to 1e-12; the reference's backward on their reserve and
    theirs on the reference's give the reference's gradients; and the backward reads W x from it (a changed wx_l
    changes every backend's gradients, where the recomputed W x would not)."""
    cfg = rnn_config(2, 5, 3, cell, direction="bidirectional", dropout=0.4, seed=3, seed2=9)
    case = make_rnn_case(cfg, 3, 3, [3, 0, 2], seed=5)
    ref = run_forward(case, "reference")
    want = run_backward(case, ref, "reference")
    entries = reserve_views(RNNCall(cfg, 3, 3, [3, 0, 2], True), ref[3])
    assert entries["wx1"].shape == (2, 3, 3, cfg.G * 5) and not entries["wx1"][:, :, 1].any()   # (length 0)
    assert entries["wx0"][1, 1, 2].any() and not entries["wx0"][:, 2, 2].any()                  # (length 2)
    tampered = list(ref)
    tampered[3] = ref[3].copy()
    reserve_views(RNNCall(cfg, 3, 3, [3, 0, 2], True), tampered[3])["wx0"][0, 1, 0] += 1.0
    for backend, fused_loops in (("cpu", "1"), ("cpu", "0"), ("cuda", "1")):
        monkeypatch.setenv("NUMBARNN_CPU_FUSED", fused_loops)
        got = run_forward(case, backend)
        assert relative_error(reserve_contents(got[3]), reserve_contents(ref[3])) < 1e-12
        for grads in (run_backward(case, got, "reference"), run_backward(case, ref, backend)):
            for a, b in zip(grads, want):
                assert (b is None) == (a is None) and (b is None or relative_error(a, b) < 1e-12)
        assert relative_error(run_backward(case, tampered, backend)[3], want[3]) > 1e-6


@pytest.mark.parametrize("version", [2, 3])
def test_cuda_step_versions_2_and_3_fall_back_to_v1_with_a_note(version):
    assert_v1_fallback("layer_norm_lstm", version, "'layer_norm_lstm' layer-normalises its rows (wx, rh, c): a "
                                                   "reduction across the row inside the step; the v2/v3 step kernels "
                                                   "have none")


def test_explain_shows_the_normalisation_and_the_step_kernel_fallback(capsys):
    from numbarnn import cli
    assert cli.main(["explain", "--cells", "numbarnn.contrib.layer_norm_gru", "--mode", "layer_norm_gru", "--units",
                     "3", "--input-size", "2", "--time", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "layer normalisation across each row of wx, rh" in out and "ln_wx_gain z" in out and "lnstat0" in out
    assert "step kernels: v1: 'layer_norm_gru' layer-normalises its rows (wx, rh)" in out
    assert "layer_norm_gru_layer_norm_step" in out and "layer_norm_rows (W x)" in out


def test_the_kernel_report_lists_the_layer_norm_kernels():
    from numbarnn.kernels import cell_steps, layer_norm, step_v2
    names = {(name, dt) for name, dt, *_ in layer_norm.kernel_specs()}
    for cell in CELLS:
        for kernel in ("layer_norm_step", "layer_norm_backward_step", "layer_norm_rows", "layer_norm_rows_backward"):
            assert (f"{cell}_{kernel}", "float32") in names
    assert not [n for n, *_ in cell_steps.kernel_specs() if n.startswith("layer_norm")]
    assert not [n for n, *_ in step_v2.kernel_specs() if n.startswith("layer_norm")]



# ----------------------------------------------------------------------------------------------
# numbarnn.torch: haste's modules
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls_name", ["LayerNormLSTM", "LayerNormGRU"])
def test_numbarnn_torch_modules_take_hastes_names_and_compute_hastes_equations(cls_name):
    """haste's parameter names, shapes and init; outputs and final states equal haste's equations in plain torch
    (ragged lengths with 0, batch_first); gradients pass torch's gradcheck."""
    torch = pytest.importorskip("torch", reason="numbarnn.torch needs torch")
    import numbarnn.torch as nt
    torch.manual_seed(0)
    cls = getattr(nt, cls_name)
    m = cls(3, 4, batch_first=True, dtype=torch.float64)
    G = 4 if cls_name == "LayerNormLSTM" else 3
    shapes = {k: tuple(v.shape) for k, v in m.named_parameters()}
    want = {"kernel": (3, 4 * G), "recurrent_kernel": (4, 4 * G), "bias": (4 * G,), "gamma": (2, 4 * G)}
    want.update({"gamma_h": (4,), "beta_h": (4,)} if G == 4 else {"recurrent_bias": (4 * G,)})
    assert shapes == want
    bias = m.bias.detach()
    assert torch.all(m.gamma.detach() == 1) and (G == 3 or float(bias[8]) == 1.0 and float(bias[0]) == 0.0)
    with torch.no_grad():                                     # away from the init: gains, biases not trivial
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(3, 5, 3, dtype=torch.float64)             # [B, T, I]
    lengths = torch.tensor([5, 0, 2])
    y, state = m(x, lengths=lengths)
    q = dict(m.named_parameters())
    q.setdefault("recurrent_bias", torch.zeros(4 * G, dtype=torch.float64))
    q.setdefault("gamma_h", None)
    q.setdefault("beta_h", None)
    run = _haste_lstm if G == 4 else _haste_gru
    for b, n in enumerate(lengths.tolist()):
        h, c = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        hs, h, c = run(torch, x[b, :n], h, c if G == 4 else None, q)
        if n:
            torch.testing.assert_close(y[b, :n], torch.stack(hs), rtol=0, atol=1e-12)
        assert torch.all(y[b, n:] == 0)
        h_n = state[0] if G == 4 else state
        torch.testing.assert_close(h_n[0, b], h, rtol=0, atol=1e-12)
        if G == 4:
            torch.testing.assert_close(state[1][0, b], c, rtol=0, atol=1e-12)

    small = cls(2, 2, dtype=torch.float64)
    xs = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)

    def f(x, gamma, R):
        return torch.func.functional_call(small, {"gamma": gamma, "recurrent_kernel": R}, (x,))[0]
    inputs = (xs, small.gamma.detach().clone().requires_grad_(),
              small.recurrent_kernel.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(f, inputs)


def test_numbarnn_torch_modules_refuse_bad_arguments():
    """(zoneout and return_state_sequence: tests/test_layer_norm_modules.py)"""
    torch = pytest.importorskip("torch", reason="numbarnn.torch needs torch")
    import numbarnn.torch as nt
    with pytest.raises(ValueError, match="LayerNormGRU: dropout must be in"):
        nt.LayerNormGRU(2, 3, dropout=2.0)
    m = nt.LayerNormGRU(2, 3)
    with pytest.raises(ValueError, match="lengths must be 2 values in"):
        m(torch.zeros(4, 2, 2), lengths=[5, 1])


def test_check_cli_runs_a_layer_normalised_cell_on_every_backend(capsys):
    from numbarnn import cli
    assert cli.main(["check", "--cells", "numbarnn.contrib.layer_norm_gru", "--mode", "layer_norm_gru", "--units", "3",
                     "--input-size", "2", "--time", "3", "--batch", "2", "--backends", "reference,cpu,cuda"]) == 0
    out = capsys.readouterr().out
    assert "params_backprop       | cuda" in out and out.rstrip().splitlines()[-1].startswith("ok")


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("training", [True, False])
def test_zoneout_on_a_layer_normalised_cell(backend, training):
    """Zoneout (SPEC 6.1) composes with the row normalisations on every backend: 2 layers, bidirectional,
    lengths with 0, in training (masks, backward too) and inference (the expectation), to 1e-12 in float64."""
    for mode in ("layer_norm_lstm", "layer_norm_gru"):
        cfg = rnn_config(2, 3, 2, mode, direction="bidirectional", zoneout=0.4, seed=3, seed2=5)
        case = make_rnn_case(cfg, 4, 3, lengths=[4, 0, 2], seed=2, is_training=training)
        got = run_forward(case, backend)
        if training:
            assert_agrees_with_the_reference(case, got, run_backward(case, got, backend))
        else:
            want = run_forward(case, "reference")
            for a, b in zip(got[:3], want[:3]):
                assert relative_error(a, b) < 1e-12
        plain = run_forward(make_rnn_case(rnn_config(2, 3, 2, mode, direction="bidirectional"), 4, 3,
                                          lengths=[4, 0, 2], seed=2, is_training=training), backend)
        assert relative_error(got[0], plain[0]) > 1e-3                  # zoneout changed the outputs



@pytest.mark.parametrize("cell", CELLS)
def test_cpu_fused_forward_agrees_with_the_blas_loop_and_the_reference(monkeypatch, cell):
    """cpu/layer_norm_fused.py's fused forward against the BLAS loop (NUMBARNN_CPU_FUSED=0) and the reference."""
    from numbarnn.cpu import layer_norm_fused
    assert_fused_forward_equals_the_blas_loop(monkeypatch, cell, layer_norm_fused)


@pytest.mark.parametrize("cell", CELLS)
def test_cpu_fused_backward_agrees_with_the_blas_loop_and_the_reference(monkeypatch, cell):
    """cpu/layer_norm_fused.py's backward time loop, in one row group and in 3 (on the call's threads, every
    layer's), and its weight-gradient products in slices on two threads, give the BLAS loop's gradients
    (NUMBARNN_CPU_FUSED=0) to 1e-12 and the reference's: H = 9 (a partial column tile), B = 7 with lengths 0 (a
    partial row tile, rows ending at different steps; groups with no rows), 2 layers, bidirectional."""
    import numba

    from numbarnn.cpu import fused, layer_norm, layer_norm_fused, threads
    case = make_rnn_case(rnn_config(2, 9, 5, cell, direction="bidirectional"), 4, 7, [4, 0, 2, 4, 1, 3, 0], seed=4)
    out = run_forward(case, "cpu")
    ran, loop = [], layer_norm_fused.backward_loop
    monkeypatch.setattr(layer_norm_fused, "backward_loop", lambda *a: ran.append(a[2]) or loop(*a))
    monkeypatch.setenv("NUMBARNN_CPU_FUSED", "0")           # the BLAS loops
    want = run_backward(case, out, "cpu")
    assert ran == []
    monkeypatch.setenv("NUMBARNN_CPU_FUSED", "1")
    monkeypatch.setattr(threads, "SPLIT_MIN_MACS", 0)
    for groups in (1, 3):
        monkeypatch.setattr(fused, "row_groups", lambda *a, n=groups: n)
        old = numba.get_num_threads()
        numba.set_num_threads(2)
        try:
            got = run_backward(case, out, "cpu")
        finally:
            numba.set_num_threads(old)
        for a, b in zip(got, want):
            assert relative_error(a, b) < 1e-12
        assert_agrees_with_the_reference(case, out, got)
    assert ran == [False] * 4 + [True] * 4               # per pseudo-layer: every layer's loop in groups
    # the row groups run the one group function, each on one of the call's threads
    row_step = layer_norm.backward_loop(case.cfg.cell, "float64")
    assert loop(case.cfg.cell, "float64", True, row_step).group is \
        layer_norm_fused.backward_group(case.cfg.cell, "float64", row_step)

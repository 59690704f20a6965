"""numbarnn.torch.LayerNormLSTM / LayerNormGRU beyond the plain call: the layer-normalised network as torch operations
(numbarnn.torch_network: second derivatives, eval-mode zoneout's gradient), haste's zoneout, and haste's
return_state_sequence.

The oracles: the NumPy reference (numbarnn/reference/layer_norm.py, hand-written) for torch_network, and an
independent implementation in plain torch written from haste's LayerNormLSTMScript / LayerNormGRUScript (zoneout
included: ``(h_new - h_prev) * mask + h_prev`` in training, ``p*h_prev + (1-p)*h_new`` in eval mode), looping row by
row over each sequence's own length, differentiated by autograd.
"""
import numpy as np
import pytest

from conftest import assert_zoneout_masks_drawn_per_call
from numbarnn.config import rnn_config
from numbarnn.params import param_regions
from numbarnn.reference.philox import zoneout_update_mask
from numbarnn.testing import make_rnn_case, relative_error, run_backward, run_forward

torch = pytest.importorskip("torch", reason="numbarnn.torch needs torch")
import numbarnn.contrib.layer_norm_gru  # noqa: E402,F401  (registers the cells)
import numbarnn.contrib.layer_norm_lstm  # noqa: E402,F401
import numbarnn.torch as nt  # noqa: E402
from numbarnn.torch_ops import _network_function  # noqa: E402
from numbarnn.torch_tensors import _layout  # noqa: E402

F64 = torch.float64
CLASSES = ("LayerNormLSTM", "LayerNormGRU")


# ----------------------------------------------------------------------------------------------
# torch_network: the layer-normalised network as torch operations
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", ["layer_norm_lstm", "layer_norm_gru"])
def test_torch_network_agrees_with_the_reference_to_1e10(cell):
    """The differentiable path's network (torch_ops._network_function: what create_graph and eval-mode zoneout's
    gradient run) against the reference: 2 layers, bidirectional, lengths with 0; without zoneout, with its
    training masks (forward and every gradient) and with its expectation (forward)."""
    L, H, I, T, B, lengths = 2, 3, 2, 4, 3, [4, 0, 2]
    lstm = cell == "layer_norm_lstm"
    layout = _layout(cell, L, H, I, True, 0, True)
    for zoneout, training in ((0.0, True), (0.4, True), (0.4, False)):
        cfg = rnn_config(L, H, I, cell, direction="bidirectional", zoneout=zoneout, seed=3, seed2=5)
        case = make_rnn_case(cfg, T, B, lengths, seed=3, is_training=training)
        for r in param_regions(cfg):             # gains near 1, as trained ones are
            if r.kind == "N" and "gain" in r.describe(cfg):
                case.params[r.offset:r.offset + r.size] += 1.0
        want = run_forward(case, "reference")
        params = torch.tensor(np.asarray(case.params))                                       # [N]
        weights = [params[o:o + int(np.prod(shape))].reshape(shape).clone().requires_grad_()
                   for o, shape in layout.spans]
        net = (cell, L, H, I, True, 0, True, 0.0, training, "", zoneout)
        fn = _network_function(net, lengths, torch.tensor([3, 5]))
        x, h0 = torch.tensor(case.x, requires_grad=True), torch.tensor(case.h0, requires_grad=True)   # [T, B, I]
        c0 = [torch.tensor(case.c0, requires_grad=True)] if lstm else []                              # [L*D, B, H]
        y, hT, cT = fn(x, h0, *c0, *weights)
        for got, ref in zip((y, hT, cT) if lstm else (y, hT), want):
            assert relative_error(got.detach().numpy(), ref) < 1e-10
        if not training:
            continue
        dx, dh0, dc0, dparams = run_backward(case, want, "reference")
        loss = (y * torch.tensor(case.dy)).sum() + (hT * torch.tensor(case.dhT)).sum()
        if lstm:
            loss = loss + (cT * torch.tensor(case.dcT)).sum()
        loss.backward()
        assert relative_error(x.grad.numpy(), dx) < 1e-10 and relative_error(h0.grad.numpy(), dh0) < 1e-10
        if lstm:
            assert relative_error(c0[0].grad.numpy(), dc0) < 1e-10
        dparams = np.asarray(dparams)
        for w, (o, shape) in zip(weights, layout.spans):
            assert relative_error(w.grad.numpy(), dparams[o:o + int(np.prod(shape))].reshape(shape)) < 1e-10


def _module(cls_name, *args, **kw):
    torch.manual_seed(0)
    module = getattr(nt, cls_name)(*args, dtype=F64, **kw)
    with torch.no_grad():                                     # away from the init: gains, biases not trivial
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


@pytest.mark.parametrize("cls_name", CLASSES)
def test_second_derivatives(cls_name):
    """create_graph=True: gradgradcheck through the module (ragged lengths with a 0, zoneout in training with a
    fixed mask), and the differentiable path's first-order gradient equals the kernels' for the same call."""
    module = _module(cls_name, 2, 2, zoneout=0.3)
    x = torch.randn(2, 2, 2, dtype=F64, requires_grad=True)              # [T, B, I]

    def f(x, gamma):
        torch.manual_seed(1)                                  # the same Philox keys at every call
        return torch.func.functional_call(module, {"gamma": gamma}, (x,), {"lengths": [2, 0]})[0]

    gamma = module.gamma.detach().clone().requires_grad_()
    assert torch.autograd.gradgradcheck(f, (x, gamma), fast_mode=True)
    (kernels,) = torch.autograd.grad((f(x, gamma) ** 2).sum(), gamma)
    (graph,) = torch.autograd.grad((f(x, gamma) ** 2).sum(), gamma, create_graph=True)
    assert graph.requires_grad
    torch.testing.assert_close(graph, kernels, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# haste's script in plain torch (zoneout, the state after every step)
# ----------------------------------------------------------------------------------------------

def _haste_script(module, x, h0, c0, lengths, mask):
    """haste's LayerNormLSTMScript / LayerNormGRUScript on `module`'s parameters, row by row over each row's length:
    x [T, B, I], h0, c0 [B, H] (c0 None: the GRU), mask [T, B, H] (zoneout's in training) -> (y [T, B, H], 0 past
    a length; hs, cs [T, B, H]: the state after each step, held past the length)."""
    F = torch.nn.functional
    q, p, training = dict(module.named_parameters()), module.zoneout, module.training
    T, B, H = x.shape[0], x.shape[1], module.hidden_size
    lstm = c0 is not None
    ys, hss, css = [], [], []
    for b in range(B):
        h, c = h0[b], (c0[b] if lstm else None)
        y_b, h_b, c_b = [], [], []
        for t in range(T):
            if t < lengths[b]:
                if lstm:
                    v = F.layer_norm(h @ q["recurrent_kernel"], (4 * H,), weight=q["gamma"][1]) + \
                        F.layer_norm(x[t, b] @ q["kernel"], (4 * H,), weight=q["gamma"][0]) + q["bias"]
                    i, g, f, o = torch.chunk(v, 4, 0)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h_new = torch.sigmoid(o) * torch.tanh(F.layer_norm(c, (H,), weight=q["gamma_h"],
                                                                       bias=q["beta_h"]))
                else:
                    vx = torch.chunk(F.layer_norm(x[t, b] @ q["kernel"], (3 * H,), weight=q["gamma"][0]) +
                                     q["bias"], 3, 0)
                    vh = torch.chunk(F.layer_norm(h @ q["recurrent_kernel"], (3 * H,), weight=q["gamma"][1]) +
                                     q["recurrent_bias"], 3, 0)
                    z, r = torch.sigmoid(vx[0] + vh[0]), torch.sigmoid(vx[1] + vh[1])
                    g = torch.tanh(vx[2] + r * vh[2])
                    h_new = z * h + (1 - z) * g
                if p:
                    h_new = (h_new - h) * mask[t, b] + h if training else p * h + (1 - p) * h_new
                h = h_new
                y_b.append(h)
            else:
                y_b.append(torch.zeros_like(h))
            h_b.append(h)
            c_b.append(c)
        ys.append(torch.stack(y_b))
        hss.append(torch.stack(h_b))
        css.append(torch.stack(c_b) if lstm else None)
    return torch.stack(ys, 1), torch.stack(hss, 1), (torch.stack(css, 1) if lstm else None)


def _zoneout_mask(seed, module, T, B):
    """The mask [T, B, H] of the module's next training call after torch.manual_seed(seed) (its Philox keys are
    the first draw of torch's generator)."""
    torch.manual_seed(seed)
    keys = torch.randint(0, 2 ** 32, (2,), dtype=torch.int64).tolist()
    return torch.as_tensor(zoneout_update_mask(keys[0], keys[1], 0, T, B, module.hidden_size, module.zoneout),
                           dtype=F64)


def _leaves(module, B):
    """x [T=4, B, I], h0, c0 [1, B, H] as leaves needing a gradient."""
    x = torch.randn(4, B, module.input_size, dtype=F64, requires_grad=True)
    h0, c0 = (torch.randn(1, B, module.hidden_size, dtype=F64, requires_grad=True) for _ in range(2))
    return x, h0, c0


def _assert_matches_haste(module, lengths, sequence: bool):
    """Outputs, states and the gradients of one loss over all of them (every parameter, x, h0, c0) equal haste's
    script with the call's own mask, to 1e-10."""
    lstm = isinstance(module, nt.LayerNormLSTM)
    B = len(lengths)
    x, h0, c0 = _leaves(module, B)
    mask = _zoneout_mask(7, module, x.shape[0], B)
    torch.manual_seed(7)
    y, state = module(x, (h0, c0) if lstm else h0, lengths=torch.tensor(lengths))
    h, c = state if lstm else (state, None)
    y_w, hs_w, cs_w = _haste_script(module, x, h0[0], c0[0] if lstm else None, lengths, mask)
    if sequence:                                              # (1, T, B, H): every step's state
        h_w, c_w = hs_w[None], (cs_w[None] if lstm else None)
    else:                                                     # (1, B, H): the final state
        h_w, c_w = hs_w[-1][None], (cs_w[-1][None] if lstm else None)
    got, want = [y, h] + ([c] if lstm else []), [y_w, h_w] + ([c_w] if lstm else [])
    weights = [torch.randn_like(w) for w in want]
    grads = []
    for outs in (got, want):
        assert all(a.shape == b.shape for a, b in zip(outs, want))
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        grads.append(torch.autograd.grad(loss, [x, h0, c0, *module.parameters()] if lstm else
                                         [x, h0, *module.parameters()]))
    for a, b in zip(got, want):
        assert relative_error(a.detach().numpy(), b.detach().numpy()) < 1e-10
    for a, b in zip(*grads):
        assert relative_error(a.numpy(), b.numpy()) < 1e-10


# ----------------------------------------------------------------------------------------------
# zoneout
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls_name", CLASSES)
def test_zoneout_agrees_with_hastes_script_to_1e10(cls_name, training):
    """Training: haste's script with the call's Philox mask; eval: the expectation (its gradient through
    torch_network).  Ragged lengths with a 0, outputs, final states and every gradient."""
    module = _module(cls_name, 2, 3, zoneout=0.4).train(training)
    _assert_matches_haste(module, [4, 0, 2], sequence=False)


@pytest.mark.parametrize("cls_name", CLASSES)
def test_zoneout_masks_are_drawn_per_call_and_eval_is_the_expectation(cls_name):
    module, plain = _module(cls_name, 2, 3, zoneout=0.5), _module(cls_name, 2, 3)
    assert repr(module) == f"{cls_name}(2, 3, zoneout=0.5)" and repr(plain) == f"{cls_name}(2, 3)"
    x = torch.randn(4, 2, 2, dtype=F64)
    assert_zoneout_masks_drawn_per_call(module, plain, x)
    module.eval()
    one = x[:1]
    assert torch.allclose(module(one)[0], 0.5 * plain.eval()(one)[0], rtol=0, atol=1e-15)   # h0 = 0: (1-p) h_new


@pytest.mark.parametrize("cls_name", CLASSES)
def test_zoneout_gradcheck_in_training_and_eval(cls_name):
    module = _module(cls_name, 2, 2, zoneout=0.4)
    x = torch.randn(3, 2, 2, dtype=F64, requires_grad=True)

    def run(x, *weights):
        torch.manual_seed(1)                                  # the same Philox keys at every call: a fixed mask
        return torch.func.functional_call(module, dict(zip(names, weights)), (x,), {"lengths": [3, 1]})[0]

    names = [n for n, _ in module.named_parameters()]
    weights = [w.detach().clone().requires_grad_() for w in module.parameters()]
    for training in (True, False):
        module.train(training)
        assert torch.autograd.gradcheck(run, (x, *weights), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("bad, error, match", [
    (1.0, ValueError, r"LayerNormLSTM: zoneout: expected a probability in \[0, 1\), got 1.0"),
    (-0.1, ValueError, r"LayerNormLSTM: zoneout: expected a probability"),
    ("0.1", TypeError, r"LayerNormLSTM: zoneout: expected a float"),
    (True, TypeError, r"LayerNormLSTM: zoneout: expected a float")])
def test_bad_zoneout_is_refused_naming_the_argument(bad, error, match):
    with pytest.raises(error, match=match):
        nt.LayerNormLSTM(2, 3, zoneout=bad)


# ----------------------------------------------------------------------------------------------
# return_state_sequence
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zoneout", [0.0, 0.4])
@pytest.mark.parametrize("cls_name", CLASSES)
def test_state_sequence_agrees_with_hastes_script_to_1e10(cls_name, zoneout):
    """haste's (1, T, B, H) states after every step (the initial one not included), held past a row's length;
    gradients from every returned state (the LSTM's c sequence too), zoneout's training masks the call's own."""
    module = _module(cls_name, 2, 3, zoneout=zoneout, return_state_sequence=True)
    _assert_matches_haste(module, [4, 0, 2], sequence=True)


@pytest.mark.parametrize("cls_name", CLASSES)
def test_state_sequence_shapes_batch_first_and_gradcheck(cls_name):
    """batch_first gives (1, B, T, H); the last step's state is the final state of the plain call; gradcheck of
    every returned state through ragged lengths with a 0."""
    lstm = cls_name == "LayerNormLSTM"
    module = _module(cls_name, 2, 2, batch_first=True, return_state_sequence=True)
    plain = _module(cls_name, 2, 2, batch_first=True)
    x = torch.randn(2, 3, 2, dtype=F64, requires_grad=True)              # [B, T, I]
    lengths = [3, 0]
    y, state = module(x, lengths=lengths)
    _, final = plain(x, lengths=lengths)
    for seq, last in zip(state if lstm else (state,), final if lstm else (final,)):
        assert seq.shape == (1, 2, 3, 2)
        torch.testing.assert_close(seq[:, :, -1], last, rtol=0, atol=1e-14)
    assert torch.equal(state[0][0, 1] if lstm else state[0, 1], torch.zeros(3, 2, dtype=F64))   # len 0: h0

    def run(x, kernel):
        out, st = torch.func.functional_call(module, {"kernel": kernel}, (x,), {"lengths": lengths})
        return (out, *st) if lstm else (out, st)

    assert torch.autograd.gradcheck(run, (x, module.kernel.detach().clone().requires_grad_()), fast_mode=True)


def test_return_state_sequence_must_be_a_bool():
    with pytest.raises(TypeError, match="LayerNormGRU: return_state_sequence must be a bool"):
        nt.LayerNormGRU(2, 3, return_state_sequence="yes")



def test_state_sequence_under_torch_compile():
    """The LSTM's state sequence (torch_network, NumPy masks and lengths) runs eagerly inside a compiled module."""
    module = _module("LayerNormLSTM", 2, 3, zoneout=0.3, return_state_sequence=True)
    compiled = torch.compile(module, backend="eager")
    x = torch.randn(4, 2, 2, dtype=F64)
    outs = []
    for run in (compiled, module):
        torch.manual_seed(1)
        outs.append(run(x, lengths=[4, 1]))
    for a, b in zip((outs[0][0], *outs[0][1]), (outs[1][0], *outs[1][1])):
        assert torch.equal(a, b)

"""numbarnn.torch.LayerNormLSTM / LayerNormGRU beyond the plain call: the layer-normalised network as torch operations
(numbarnn.torch_network: second derivatives, eval-mode zoneout's gradient).

The oracle: the NumPy reference (numbarnn/reference/layer_norm.py, hand-written).
"""
import numpy as np
import pytest

from numbarnn.config import rnn_config
from numbarnn.params import param_regions
from numbarnn.reference.philox import zoneout_update_mask
from numbarnn.testing import make_rnn_case, relative_error, run_backward, run_forward

torch = pytest.importorskip("torch", reason="numbarnn.torch needs torch")
import numbarnn.contrib.layer_norm_gru  # noqa: E402,F401  (registers the cells)
import numbarnn.contrib.layer_norm_lstm  # noqa: E402,F401
from numbarnn.torch_ops import _network_function  # noqa: E402
from numbarnn.torch_tensors import _layout  # noqa: E402

F64 = torch.float64


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

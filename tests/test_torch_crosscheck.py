"""Cross-check against PyTorch (optional: skipped when torch is not importable).

torch.nn.LSTM (with and without proj_size), GRU, RNN(tanh) and RNN(relu), 1-2 layers, uni- and bidirectional,
in float64, on ragged batches packed with pack_padded_sequence(enforce_sorted=False) (PyTorch's reversal
within each length is SPEC 5's), and on full-length batches in either layout. Compared: output (padded
positions 0), h_n, c_n, and the gradients of <y, dy> + <h_n, dh> (+ <c_n, dc>) with respect to the input,
h0, c0 and every parameter (mapped with numbarnn.params.to_torch_state_dict / from_torch_state_dict).
PyTorch rejects length-0 sequences, so lengths here are >= 1. numbarnn runs on backend="reference".
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.config import rnn_config  # noqa: E402
from numbarnn.params import from_torch_state_dict, to_torch_state_dict  # noqa: E402
from numbarnn.testing import make_rnn_case  # noqa: E402

BACKEND = "reference"
TOL = dict(rtol=1e-9, atol=1e-11)

MODULES = {
    "lstm": (lambda **kw: torch.nn.LSTM(**kw)),
    "gru": (lambda **kw: torch.nn.GRU(**kw)),
    "rnn_tanh": (lambda **kw: torch.nn.RNN(nonlinearity="tanh", **kw)),
    "rnn_relu": (lambda **kw: torch.nn.RNN(nonlinearity="relu", **kw)),
}


def torch_module(cfg, params, batch_first=False):
    """A float64 torch RNN module holding numbarnn's params (state_dict loaded strictly: every name matches)."""
    kw = dict(input_size=cfg.I, hidden_size=cfg.H, num_layers=cfg.L, bias=True, batch_first=batch_first,
              dropout=0.0, bidirectional=cfg.D == 2)
    if cfg.num_proj:
        kw["proj_size"] = cfg.num_proj
    module = MODULES[cfg.rnn_mode](**kw).double()
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in to_torch_state_dict(cfg, params).items()}
    module.load_state_dict(state, strict=True)
    return module


def run_torch(case, packed=True):
    """-> (y, h_n, c_n or None, dx, dh0, dc0 or None, dparams in numbarnn's opaque layout), all NumPy."""
    cfg = case.cfg
    batch_first = not case.time_major
    module = torch_module(cfg, case.params, batch_first)
    x = torch.tensor(case.x, dtype=torch.float64, requires_grad=True)
    # torch states are [L*D, B, *] in both layouts; numbarnn's batch-major states are [B, L*D, *]
    h0_np = case.h0 if case.time_major else np.swapaxes(case.h0, 0, 1)
    h0 = torch.tensor(np.ascontiguousarray(h0_np), dtype=torch.float64, requires_grad=True)
    c0 = None
    if cfg.is_lstm:
        c0_np = case.c0 if case.time_major else np.swapaxes(case.c0, 0, 1)
        c0 = torch.tensor(np.ascontiguousarray(c0_np), dtype=torch.float64, requires_grad=True)
    state = (h0, c0) if cfg.is_lstm else h0
    if packed:
        lengths = torch.as_tensor(np.asarray(case.lengths, np.int64))
        seq = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
        out, final = module(seq, state)
        y, _ = pad_packed_sequence(out, batch_first=batch_first, total_length=case.T)
    else:
        y, final = module(x, state)
    hn, cn = final if cfg.is_lstm else (final, None)
    dhT = case.dhT if case.time_major else np.swapaxes(case.dhT, 0, 1)
    loss = (y * torch.from_numpy(np.ascontiguousarray(case.dy))).sum() + \
        (hn * torch.from_numpy(np.ascontiguousarray(dhT))).sum()
    if cfg.is_lstm:
        dcT = case.dcT if case.time_major else np.swapaxes(case.dcT, 0, 1)
        loss = loss + (cn * torch.from_numpy(np.ascontiguousarray(dcT))).sum()
    loss.backward()
    grads = {name: p.grad.detach().numpy().copy() for name, p in module.named_parameters()}
    assert all(g is not None for g in grads.values())

    def back(a):   # torch's [L*D, B, *] states -> numbarnn's layout
        a = a.detach().numpy()
        return a if case.time_major else np.swapaxes(a, 0, 1)

    return (y.detach().numpy(), back(hn), back(cn) if cfg.is_lstm else None, x.grad.numpy(), back(h0.grad),
            back(c0.grad) if cfg.is_lstm else None, from_torch_state_dict(cfg, grads, dtype=np.float64))


def run_numbarnn(case):
    attrs = dict(rnn_mode=case.cfg.rnn_mode, input_mode=case.cfg.input_mode, direction=case.cfg.direction,
                 num_proj=case.cfg.num_proj, time_major=case.time_major, backend=BACKEND)
    y, hT, cT, reserve, host_reserved = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, case.lengths,
                                                         **attrs)
    dx, dh0, dc0, dparams = ops.cudnn_rnn_backprop_v3(case.x, case.h0, case.c0, case.params, case.lengths, y, hT,
                                                      cT, case.dy, case.dhT, case.dcT, reserve, host_reserved,
                                                      **attrs)
    return y, hT, cT if case.cfg.is_lstm else None, dx, dh0, dc0 if case.cfg.is_lstm else None, dparams


def compare(case, packed=True):
    names = ("output", "output_h", "output_c", "input_backprop", "input_h_backprop", "input_c_backprop",
             "params_backprop")
    ours = run_numbarnn(case)
    theirs = run_torch(case, packed)
    for name, a, b in zip(names, ours, theirs):
        if a is None:
            assert b is None, name
            continue
        assert a.shape == b.shape, (name, a.shape, b.shape)
        np.testing.assert_allclose(a, b, err_msg=name, **TOL)


CONFIGS = [
    ("lstm", 0), ("lstm", 2), ("gru", 0), ("rnn_tanh", 0), ("rnn_relu", 0),
]


@pytest.mark.parametrize("mode, num_proj", CONFIGS)
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("lengths", [[5, 3, 3, 1, 2], [1, 1, 5, 4, 2]])
def test_packed_ragged_against_torch(mode, num_proj, direction, L, lengths):
    cfg = rnn_config(L, 3, 2, mode, "linear_input", direction, num_proj)
    case = make_rnn_case(cfg, 5, len(lengths), lengths, seed=L * 10 + len(direction), scale=0.6)
    compare(case, packed=True)


@pytest.mark.parametrize("mode, num_proj", CONFIGS)
@pytest.mark.parametrize("time_major", [True, False])
def test_full_length_against_torch(mode, num_proj, time_major):
    """No sequence_lengths (all T), 2 bidirectional layers, either layout (torch's batch_first)."""
    cfg = rnn_config(2, 3, 4, mode, "linear_input", "bidirectional", num_proj)
    case = make_rnn_case(cfg, 4, 3, None, seed=5, time_major=time_major)
    compare(case, packed=False)


def test_packed_batch_first_against_torch():
    cfg = rnn_config(2, 4, 3, "lstm", "linear_input", "bidirectional", 3)
    case = make_rnn_case(cfg, 6, 4, [6, 2, 4, 1], seed=9, time_major=False)
    compare(case, packed=True)

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

from dataclasses import replace  # noqa: E402

from numbarnn import ops  # noqa: E402
from numbarnn.config import rnn_config  # noqa: E402
from numbarnn.testing import make_rnn_case  # noqa: E402
from numbarnn.torch import torch_nn_outputs, torch_nn_supports  # noqa: E402

BACKEND = "reference"
TOL = dict(rtol=1e-9, atol=1e-11)

def run_numbarnn(case):
    attrs = dict(rnn_mode=case.cfg.rnn_mode, input_mode=case.cfg.input_mode, direction=case.cfg.direction,
                 num_proj=case.cfg.num_proj, time_major=case.time_major, backend=BACKEND)
    y, hT, cT, reserve, host_reserved = ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, case.lengths,
                                                         **attrs)
    dx, dh0, dc0, dparams = ops.cudnn_rnn_backprop_v3(case.x, case.h0, case.c0, case.params, case.lengths, y, hT,
                                                      cT, case.dy, case.dhT, case.dcT, reserve, host_reserved,
                                                      **attrs)
    return y, hT, cT if case.cfg.has_cell_state else None, dx, dh0, dc0 if case.cfg.has_cell_state else None, dparams


def compare(case, packed=True):
    names = ("output", "output_h", "output_c", "input_backprop", "input_h_backprop", "input_c_backprop",
             "params_backprop")
    ours = dict(zip(names, run_numbarnn(case)))
    theirs = torch_nn_outputs(case if packed else replace(case, lengths=None))
    assert {k for k, v in ours.items() if v is not None} == set(theirs)
    for name, b in theirs.items():
        assert ours[name].shape == b.shape, (name, ours[name].shape, b.shape)
        np.testing.assert_allclose(ours[name], b, err_msg=name, **TOL)


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


def test_torch_nn_oracle_refuses_what_torch_cannot_express():
    skip = make_rnn_case(rnn_config(1, 3, 3, "gru", "skip_input"), 3, 2, None)
    zero = make_rnn_case(rnn_config(1, 3, 2, "gru"), 3, 2, [3, 0])
    drop = make_rnn_case(rnn_config(2, 3, 2, "lstm", dropout=0.5), 3, 2, None)
    for case in (skip, zero, drop):
        assert torch_nn_supports(case)
        with pytest.raises(ValueError, match="case: "):
            torch_nn_outputs(case)

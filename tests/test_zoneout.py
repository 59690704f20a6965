"""Zoneout (haste's definition, SPEC 6.1): the network option `zoneout=p` on every backend.

The oracles: finite differences of the whole network in training (fixed seed, so a fixed mask), and an
independent implementation in plain PyTorch operations written from haste's published equations
(`h' = (h_new - h_prev) * mask + h_prev` in training, `p*h_prev + (1-p)*h_new` at inference), looping row by
row over each sequence's own length with the mask read from the reference's reserve, differentiated by autograd.
"""
from dataclasses import replace

import numpy as np
import pytest

from conftest import assert_zoneout_masks_drawn_per_call
from numbarnn import ops
from numbarnn.config import RNNCall, rnn_config
from numbarnn.params import params_to_canonical
from numbarnn.reference.philox import dropout_keep_mask, zoneout_update_mask
from numbarnn.reserve import reserve_contents, reserve_views
from numbarnn.testing import check_rnn_gradients, make_rnn_case, run_backward, run_forward
from numbarnn.verify import relative_error

L, H, I, T, B = 2, 3, 2, 4, 3
LENGTHS = [4, 0, 2]


def _case(mode="lstm", zoneout=0.3, seed=5, seed2=1, time_major=True, is_training=True, lengths=LENGTHS, dropout=0.0,
          num_proj=0, direction="bidirectional", dtype=np.float64):
    cfg = rnn_config(L, H, I, mode, direction=direction, seed=seed, seed2=seed2, zoneout=zoneout, dropout=dropout,
                     num_proj=num_proj)
    return make_rnn_case(cfg, T, B, lengths, seed=3, time_major=time_major, is_training=is_training, dtype=dtype)


def _masks(case, reserve):
    """The reserve's zoneout masks, zmask_l [D, T, B, P] per layer (reference layout, time-major)."""
    lengths = tuple(int(n) for n in case.lengths) if case.lengths is not None else (case.T,) * case.B
    call = RNNCall(case.cfg, case.T, case.B, np.dtype(case.dtype), case.time_major, True, lengths)
    views = reserve_views(call, np.asarray(reserve))
    return [views[f"zmask{layer}"] for layer in range(case.cfg.L)]


# ----------------------------------------------------------------------------------------------
# the mask
# ----------------------------------------------------------------------------------------------

def test_the_mask_is_a_philox_stream_of_its_own():
    update = zoneout_update_mask(7, 3, 1, 5, 4, 6, 0.5)                  # [T, B, P]
    assert update.shape == (5, 4, 6) and update.dtype == bool
    assert np.array_equal(update, zoneout_update_mask(7, 3, 1, 5, 4, 6, 0.5))   # a pure function
    assert not np.array_equal(update, zoneout_update_mask(8, 3, 1, 5, 4, 6, 0.5))
    assert not np.array_equal(update, zoneout_update_mask(7, 3, 2, 5, 4, 6, 0.5))
    # dropout's flags at the same element index differ (counter word 2: 1 here, 0 there)
    keep = dropout_keep_mask(7, 3, 1, 5, 4, 6, 0.5)
    assert not np.array_equal(update, keep)
    assert zoneout_update_mask(7, 3, 0, 3, 2, 2, 0.0).all()
    big = zoneout_update_mask(1, 0, 0, 50, 20, 20, 0.25)
    assert abs(big.mean() - 0.75) < 0.02


@pytest.mark.parametrize("bad, error, match", [
    (1.0, ValueError, r"zoneout: expected a probability in \[0, 1\), got 1.0"),
    (-0.1, ValueError, r"zoneout: expected a probability in \[0, 1\)"),
    (float("nan"), ValueError, "zoneout"),
    ("0.1", TypeError, "zoneout: expected a float in \\[0, 1\\), got str"),
    (True, TypeError, "zoneout: expected a float"),
    (None, TypeError, "zoneout"),
])
def test_bad_zoneout_is_refused_naming_the_argument(bad, error, match):
    with pytest.raises(error, match=match):
        rnn_config(1, 3, 2, "lstm", zoneout=bad)
    case = _case(zoneout=0.0)
    with pytest.raises(error, match=match):
        ops.cudnn_rnn_v3(case.x, case.h0, case.c0, case.params, case.lengths, backend="reference",
                         **{**case.attrs, "zoneout": bad})


def test_backprop_refuses_a_reserve_of_another_zoneout():
    case = _case(mode="gru")
    fwd = run_forward(case, "reference")
    args = (case.x, case.h0, case.c0, case.params, case.lengths, *fwd[:3], case.dy, case.dhT, case.dcT, *fwd[3:])
    attrs = {**case.attrs}
    for zoneout in (0.0, 0.5):
        with pytest.raises(ValueError, match="zoneout"):
            ops.cudnn_rnn_backprop_v3(*args, backend="reference", **{**attrs, "zoneout": zoneout})


# ----------------------------------------------------------------------------------------------
# the reference backend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["lstm", "gru", "rnn_tanh"])
def test_finite_differences_of_the_network_in_training(mode):
    report = check_rnn_gradients(_case(mode), "reference")
    assert max(report.values()) < 1e-7, report


def test_finite_differences_with_a_projection_and_dropout():
    report = check_rnn_gradients(_case("lstm", num_proj=2, dropout=0.4, time_major=False), "reference")
    assert max(report.values()) < 1e-7, report


def test_the_masks_are_a_pure_function_of_the_seed_and_recorded():
    case = _case("lstm")
    a, b = run_forward(case, "reference"), run_forward(case, "reference")
    for x, y in zip(a[:3], b[:3]):
        assert np.array_equal(x, y)
    masks = _masks(case, a[3])
    lens = np.asarray(LENGTHS)
    for layer, zmask in enumerate(masks):
        for d in range(2):
            want = zoneout_update_mask(5, 1, layer * 2 + d, T, B, H, 0.3)       # [T, B, P]
            valid = np.arange(T)[:, None] < lens[None, :]                       # [T, B]
            assert np.array_equal(zmask[d], np.where(valid[:, :, None], want, False).astype(np.float64))
    assert 0 < np.mean([m[:, :, 0].mean() for m in masks]) < 1
    other = run_forward(_case("lstm", seed2=2), "reference")
    assert not np.array_equal(other[0], a[0])


@pytest.mark.parametrize("mode", ["lstm", "gru"])
@pytest.mark.parametrize("is_training", [True, False])
def test_zoneout_0_is_no_zoneout_bit_for_bit(mode, is_training):
    zero = _case(mode, zoneout=0.0, is_training=is_training)
    plain = replace(zero, cfg=rnn_config(L, H, I, mode, direction="bidirectional", seed=5, seed2=1))
    got, want = run_forward(zero, "reference"), run_forward(plain, "reference")
    for a, b in zip(got[:3] + (reserve_contents(got[3]),), want[:3] + (reserve_contents(want[3]),)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if is_training:
        for a, b in zip(run_backward(zero, got, "reference"), run_backward(plain, want, "reference")):
            assert a is None or a.tobytes() == b.tobytes()


def test_inference_is_the_expectation():
    """One layer, one step: h' = p*h0 + (1-p)*h_new exactly as haste's inference, and the mean of many
    training masks tends to it (the expectation of h' over the mask)."""
    p = 0.3
    cfg = rnn_config(1, 4, 2, "gru", zoneout=p)
    case = make_rnn_case(cfg, 1, 2, seed=2, is_training=False)
    plain = make_rnn_case(rnn_config(1, 4, 2, "gru"), 1, 2, seed=2, is_training=False)
    y = run_forward(case, "reference")[0]
    h_new = run_forward(plain, "reference")[0]
    assert np.allclose(y[0], p * case.h0[0] + (1 - p) * h_new[0], rtol=0, atol=1e-15)
    mean = np.mean([run_forward(make_rnn_case(rnn_config(1, 4, 2, "gru", zoneout=p, seed2=k), 1, 2, seed=2),
                                "reference")[0] for k in range(300)], axis=0)
    assert np.abs(mean - y).max() < 0.05


def test_batch_major_equals_time_major():
    tm = _case("lstm")
    swap = (lambda a: np.ascontiguousarray(np.swapaxes(a, 0, 1)))
    bm = replace(tm, time_major=False, x=swap(tm.x), h0=swap(tm.h0), c0=swap(tm.c0), dy=swap(tm.dy),
                 dhT=swap(tm.dhT), dcT=swap(tm.dcT))
    f_tm, f_bm = run_forward(tm, "reference"), run_forward(bm, "reference")
    assert np.array_equal(f_tm[0], np.swapaxes(f_bm[0], 0, 1))
    assert np.array_equal(f_tm[1], np.swapaxes(f_bm[1], 0, 1))
    assert np.array_equal(reserve_contents(f_tm[3]), reserve_contents(f_bm[3]))
    for g_tm, g_bm in zip(run_backward(tm, f_tm, "reference"), run_backward(bm, f_bm, "reference")):
        assert np.array_equal(g_tm, g_bm if g_bm.ndim == 1 else np.swapaxes(g_bm, 0, 1))


# ----------------------------------------------------------------------------------------------
# an independent implementation in plain torch operations (haste's equations)
# ----------------------------------------------------------------------------------------------

def _torch_cell(torch, mode, x, h, c, W, R, bW, bR):
    """One cuDNN cell step of one row (SPEC 2) in torch operations: -> (h_new, c_new)."""
    gx = [w @ x + b for w, b in zip(W, bW)]
    gh = [r @ h + b for r, b in zip(R, bR)]
    if mode == "lstm":
        i, f = torch.sigmoid(gx[0] + gh[0]), torch.sigmoid(gx[1] + gh[1])
        g, o = torch.tanh(gx[2] + gh[2]), torch.sigmoid(gx[3] + gh[3])
        c = f * c + i * g
        return o * torch.tanh(c), c
    r, z = torch.sigmoid(gx[0] + gh[0]), torch.sigmoid(gx[1] + gh[1])
    n = torch.tanh(gx[2] + r * gh[2])
    return (1 - z) * n + z * h, c


def _torch_network(torch, mode, case, masks, training):
    """haste's zoneout around a cuDNN-layout network (2 layers, bidirectional, ragged), row by row."""
    G = 4 if mode == "lstm" else 3
    D, p_zone = case.cfg.D, case.cfg.zoneout
    tm = (lambda a: a) if case.time_major else (lambda a: np.swapaxes(a, 0, 1))
    x = torch.tensor(tm(case.x), requires_grad=True)
    h0 = torch.tensor(tm(case.h0), requires_grad=True)
    c0 = torch.tensor(tm(case.c0), requires_grad=True) if mode == "lstm" else None
    weights, biases = params_to_canonical(case.cfg, case.params)
    tw = [torch.tensor(w, requires_grad=True) for w in weights]
    tb = [torch.tensor(b, requires_grad=True) for b in biases]
    layer_in = x
    hT, cT = [None] * (L * D), [None] * (L * D)
    for layer in range(L):
        outs = []
        for d in range(D):
            p = layer * D + d
            W, R = tw[p * 2 * G:p * 2 * G + G], tw[p * 2 * G + G:(p + 1) * 2 * G]
            bW, bR = tb[p * 2 * G:p * 2 * G + G], tb[p * 2 * G + G:(p + 1) * 2 * G]
            rows_y, rows_h, rows_c = [], [], []
            for b in range(B):
                n = LENGTHS[b]
                h, c = h0[p, b], (c0[p, b] if c0 is not None else None)
                ys = [None] * T
                for s in range(n):
                    t = s if d == 0 else n - 1 - s
                    h_new, c = _torch_cell(torch, mode, layer_in[t, b], h, c, W, R, bW, bR)
                    if training:
                        mask = torch.tensor(masks[layer][d, t, b])
                        h = (h_new - h) * mask + h
                    else:
                        h = p_zone * h + (1 - p_zone) * h_new
                    ys[t] = h
                zero = torch.zeros(H, dtype=torch.float64)
                rows_y.append(torch.stack([v if v is not None else zero for v in ys]))
                rows_h.append(h)
                rows_c.append(c)
            outs.append(torch.stack(rows_y, dim=1))                   # [T, B, H]
            hT[p] = torch.stack(rows_h)
            cT[p] = torch.stack(rows_c) if c0 is not None else None
        layer_in = torch.cat(outs, dim=2)                             # [T, B, D*H]
    leaves = [x, h0] + ([c0] if c0 is not None else []) + tw + tb
    return layer_in, torch.stack(hT), (torch.stack(cT) if c0 is not None else None), leaves


@pytest.mark.parametrize("mode, time_major", [("lstm", True), ("gru", False)])
@pytest.mark.parametrize("training", [True, False])
def test_agrees_with_plain_torch_to_1e10(mode, time_major, training):
    torch = pytest.importorskip("torch")
    case = _case(mode, time_major=time_major, is_training=training)
    tm = (lambda a: a) if time_major else (lambda a: np.swapaxes(a, 0, 1))
    fwd = run_forward(case, "reference")
    masks = _masks(case, fwd[3]) if training else None
    y, hT, cT, leaves = _torch_network(torch, mode, case, masks, training)
    assert relative_error(tm(np.asarray(fwd[0])), y.detach().numpy()) < 1e-10
    assert relative_error(tm(np.asarray(fwd[1])), hT.detach().numpy()) < 1e-10
    if cT is not None:
        assert relative_error(tm(np.asarray(fwd[2])), cT.detach().numpy()) < 1e-10
    if not training:
        return
    loss = (y * torch.tensor(tm(case.dy))).sum() + (hT * torch.tensor(tm(case.dhT))).sum()
    if cT is not None:
        loss = loss + (cT * torch.tensor(tm(case.dcT))).sum()
    loss.backward()
    dx, dh0, dc0, dparams = run_backward(case, fwd, "reference")
    got = [tm(dx), tm(dh0)] + ([tm(dc0)] if cT is not None else [])
    dw, db = params_to_canonical(case.cfg, np.asarray(dparams))
    for g, leaf in zip(got + dw + db, leaves):
        assert relative_error(np.asarray(g), leaf.grad.numpy()) < 1e-10


# ----------------------------------------------------------------------------------------------
# the cpu backend
# ----------------------------------------------------------------------------------------------

def test_cpu_masks_are_the_reference_masks_bit_for_bit():
    from numbarnn.cpu.zoneout import update_mask
    # (a pseudo-layer's elements start and end anywhere in a Philox counter's 4 words: n = pl*T*B*P + ...)
    for args in ((5, 1, 0, 4, 3, 3, 0.3), (-2, 2**40, 3, 2, 5, 7, 0.9), (0, 0, 1, 3, 1, 2, 0.0),
                 (7, 3, 5, 3, 5, 7, 0.5), (1, 2, 3, 1, 1, 1, 0.5), (4, 4, 2, 1, 1, 5, 0.5)):
        assert np.array_equal(update_mask(*args).astype(bool), zoneout_update_mask(*args)), args


@pytest.fixture
def fused_only(monkeypatch):
    """The cpu backend's BLAS loops fail if called: zoneout runs in the fused loops (cpu/fused.py), forward and
    backward (`cells.pick` picks the BLAS loops' step functions, forward and backward)."""
    from numbarnn.cpu import cells, network

    def fail(*args, **kwargs):
        raise AssertionError("the BLAS loop ran")

    monkeypatch.setattr(network, "blas_forward", fail)
    monkeypatch.setattr(cells, "pick", fail)


@pytest.mark.parametrize("mode, kw", [
    ("lstm", {}), ("gru", dict(time_major=False)), ("rnn_tanh", dict(dropout=0.5)),
    ("lstm", dict(num_proj=2, direction="unidirectional")), ("lstm", dict(num_proj=2)),
    ("gru", dict(is_training=False)), ("lstm", dict(is_training=False, num_proj=2)),
    ("rnn_tanh", dict(is_training=False)),
])
def test_cpu_agrees_with_the_reference(fused_only, mode, kw):
    """2 layers (bidirectional unless said), lengths [4, 0, 2], float64: forward, backward, and each backward on
    the other backend's reserve, to 1e-12; the fused loops only (the fixture)."""
    from conftest import compare_cpu
    compare_cpu(_case(mode, **kw))


@pytest.mark.parametrize("mode, kw", [("gru", {}), ("lstm", dict(num_proj=2))])
def test_cpu_fused_and_blas_loops_agree_and_read_each_others_reserve(monkeypatch, mode, kw):
    """The fused loops (zoneout inside them) and the BLAS loops (zoneout.py's steps around them): the same masks
    bit for bit, outputs and gradients to rounding, and either backward on either forward's reserve."""
    case = _case(mode, **kw)
    fused_f = run_forward(case, "cpu")
    monkeypatch.setenv("NUMBARNN_CPU_FUSED", "0")           # the BLAS loops
    blas_f = run_forward(case, "cpu")
    blas_b = [run_backward(case, f, "cpu") for f in (fused_f, blas_f)]
    monkeypatch.setenv("NUMBARNN_CPU_FUSED", "1")
    fused_b = [run_backward(case, f, "cpu") for f in (fused_f, blas_f)]
    for got, want in zip(_masks(case, fused_f[3]), _masks(case, blas_f[3])):
        assert np.array_equal(got, want) and got.any() and not got.all()
    for got, want in zip(fused_f[:3], blas_f[:3]):
        assert relative_error(got, want) < 1e-14
    for grads in blas_b[1:] + fused_b:
        for got, want in zip(grads, blas_b[0]):
            assert relative_error(got, want) < 1e-14


def test_cpu_float32_agrees_with_the_reference():
    case = _case("lstm", dtype=np.float32)
    want_f, got_f = run_forward(case, "reference"), run_forward(case, "cpu")
    for got, want in zip(got_f[:3], want_f[:3]):
        assert relative_error(got, want) < 1e-5
    for got, want in zip(run_backward(case, got_f, "cpu"), run_backward(case, want_f, "reference")):
        assert relative_error(got, want) < 1e-4


# ----------------------------------------------------------------------------------------------
# the cuda backend (simulator: blocks of P-1 threads, so P = 3 runs two blocks, the last one partial)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, kw", [
    ("gru", dict(time_major=False, dropout=0.5)), ("lstm", dict(num_proj=2)), ("rnn_tanh", dict(is_training=False)),
])
def test_cuda_agrees_with_the_reference(mode, kw):
    from conftest import compare_backends
    case = _case(mode, **kw)
    fwd_cuda, _, _, _ = compare_backends(case)
    if case.is_training:                                      # the masks bit for bit
        for got, want in zip(_masks(case, fwd_cuda[3].copy_to_host() if hasattr(fwd_cuda[3], "copy_to_host")
                                    else fwd_cuda[3]), _masks(case, run_forward(case, "reference")[3])):
            assert np.array_equal(got, want)


@pytest.mark.parametrize("version", [2, 3])
def test_cuda_step_versions_2_and_3_fall_back_to_v1_with_a_note(version):
    from numbarnn import settings
    from numbarnn.kernels import driver
    from conftest import assert_agrees_with_the_reference
    case = _case("gru", zoneout=0.25, direction="unidirectional")
    with settings.override(step_version=version):
        got_f = run_forward(case, "cuda")
        got_b = run_backward(case, got_f, "cuda")
        log = driver.last_launch_count()
    for phase in ("forward", "backward"):
        assert log[phase].step_version == 1
        assert log[phase].note == (f"v1: zoneout=0.25 mixes h_prev into each step's h' (kernels/zoneout.py, launched "
                                   f"between v1's step kernels); the v2/v3 step kernels have no such hook, so v1 "
                                   f"runs instead of v{version}")
        assert log[phase].by_kernel.get("zoneout_forward_step" if phase == "forward" else "zoneout_split_step")
    assert_agrees_with_the_reference(case, got_f, got_b)


def test_cuda_launch_plan_lists_the_zoneout_kernels():
    from conftest import planned_and_launched
    plan, log, _, _ = planned_and_launched(_case("lstm", direction="unidirectional"))
    kernels = {r["kernel"] for r in plan}
    assert {"zoneout_forward_step", "zoneout_split_step", "zoneout_carry_step", "fill (zoneout_no_dy = 0)"} <= kernels


def test_explain_shows_the_masks_the_kernels_and_the_step_kernel_fallback(capsys):
    from numbarnn import cli
    assert cli.main(["explain", "--mode", "gru", "--zoneout", "0.2", "--units", "3", "--time", "2"]) == 0
    out = capsys.readouterr().out
    assert "gru L=1 H=3 I=2 T=2 B=2 zoneout=0.2" in out and "zmask0" in out
    assert "zoneout_forward_step" in out and "zoneout_split_step" in out and "zoneout_carry_step" in out
    assert "step kernels: v1: zoneout=0.2 mixes h_prev into each step's h'" in out    # the GPU plan's v3 falls back


def test_check_cli_runs_a_zoneout_network(capsys):
    from numbarnn import cli
    assert cli.main(["check", "--mode", "lstm", "--zoneout", "0.3", "--lengths", "2,0", "--dtype", "float64",
                     "--backends", "reference,cpu"]) == 0
    assert "zoneout=0.3" in capsys.readouterr().out


def test_zoneout_kernels_compile_for_sm_80_without_the_simulator():
    import os
    import subprocess
    import sys
    code = ("from numba import cuda\n"
            "from numbarnn.kernels import zoneout\n"
            "for name, dt, fn, sig, block in zoneout.kernel_specs():\n"
            "    if dt == 'float32' or name == 'zoneout_forward_step':\n"
            "        cuda.compile_ptx(fn, sig, cc=(8, 0))\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# numbarnn.torch: zoneout= on the modules (haste's argument name)
# ----------------------------------------------------------------------------------------------

def _module(cls_name, zoneout, **kw):
    torch = pytest.importorskip("torch")
    import numbarnn.torch as nt
    torch.manual_seed(0)
    if cls_name == "indrnn":
        import numbarnn.contrib.indrnn  # noqa: F401  (registers the cell)
        return nt.RNNBase("indrnn", 2, 3, dtype=torch.float64, zoneout=zoneout, **kw)
    return getattr(nt, cls_name)(2, 3, dtype=torch.float64, zoneout=zoneout, **kw)


@pytest.mark.parametrize("cls_name, kw", [("LSTM", dict(bidirectional=True)), ("GRU", dict(num_layers=2)),
                                          ("indrnn", {})])
def test_torch_module_gradcheck_in_training_and_eval(cls_name, kw):
    torch = pytest.importorskip("torch")
    module = _module(cls_name, 0.4, **kw)
    x = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)

    def run(x, *weights):
        torch.manual_seed(1)                          # the same Philox keys at every call: a fixed mask
        return module(x)[0]

    weights = [w for w in module.parameters()]
    for training in (True, False):
        module.train(training)
        assert torch.autograd.gradcheck(run, (x, *weights), eps=1e-6, atol=1e-7, fast_mode=True)


def test_torch_module_masks_and_expectation():
    torch = pytest.importorskip("torch")
    module, plain = _module("GRU", 0.5), _module("GRU", 0.0)
    assert "zoneout=0.5" in repr(module) and "zoneout" not in repr(plain)
    x = torch.randn(4, 2, 2, dtype=torch.float64)
    assert_zoneout_masks_drawn_per_call(module, plain, x)
    module.eval()
    plain.eval()
    one = x[:1]
    h_new = plain(one)[0]
    assert torch.allclose(module(one)[0], 0.5 * h_new, rtol=0, atol=1e-15)   # h0 = 0: p*0 + (1-p)*h_new


@pytest.mark.parametrize("bad, error", [(1.0, ValueError), (-0.5, ValueError), ("0.1", TypeError)])
def test_torch_module_refuses_bad_zoneout(bad, error):
    pytest.importorskip("torch")
    with pytest.raises(error, match="zoneout"):
        _module("LSTM", bad)

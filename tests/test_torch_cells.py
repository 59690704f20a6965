"""numbarnn.torch_cells: RNNCell, LSTMCell and GRUCell as drop-ins for torch.nn's (outputs, gradients, init,
state_dict, repr, error messages), loops of them against numbarnn.torch's networks, double backward,
torch.compile, autocast, and CellModule of a contrib cell.

numbarnn runs on backend="reference" (float64 unless stated); one test per cell on the default backend.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numbarnn.contrib.peephole_lstm as peephole  # noqa: E402
from numbarnn.torch import GRU, LSTM, RNN, RNNBase, RNNShapeError  # noqa: E402
from numbarnn.torch_cells import CellModule, GRUCell, LSTMCell, RNNCell, RNNCellDtypeError  # noqa: E402

F64 = torch.float64
BACKEND = "reference"
#: kind -> (ours, torch.nn's, constructor keywords)
KINDS = {"lstm": (LSTMCell, torch.nn.LSTMCell, {}), "gru": (GRUCell, torch.nn.GRUCell, {}),
         "rnn_tanh": (RNNCell, torch.nn.RNNCell, {}),
         "rnn_relu": (RNNCell, torch.nn.RNNCell, {"nonlinearity": "relu"})}


def pair(kind, input_size=3, hidden_size=4, dtype=F64, backend=BACKEND, **kw):
    """(ours, torch.nn's) with the same weights (ours' init, loaded into torch.nn's)."""
    ours_cls, torch_cls, extra = KINDS[kind]
    ours = ours_cls(input_size, hidden_size, **extra, **kw, dtype=dtype, backend=backend)
    ref = torch_cls(input_size, hidden_size, **extra, **kw, dtype=dtype)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def make_hx(kind, *shape, dtype=F64, requires_grad=True):
    def one():
        return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)
    return (one(), one()) if kind == "lstm" else one()


def leaves(x, hx, module):
    return [x, *(as_tuple(hx) if hx is not None else ()), *module.parameters()]


def assert_same_step(ours, ref, x, hx, atol=1e-12):
    """Forward outputs and the gradients of a random projection of them w.r.t. input, hx and every parameter."""
    got, want = as_tuple(ours(x, hx)), as_tuple(ref(x, hx))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=atol, rtol=0)
    weights = [torch.randn_like(w) for w in want]
    loss_ours = sum((g * d).sum() for g, d in zip(got, weights))
    loss_ref = sum((w * d).sum() for w, d in zip(want, weights))
    g_ours = torch.autograd.grad(loss_ours, leaves(x, hx, ours))
    g_ref = torch.autograd.grad(loss_ref, leaves(x, hx, ref))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------
# forward and gradients against torch.nn
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", list(KINDS))
def test_step_matches_torch_nn(kind, bias):
    """Batched and unbatched input, hx None and given: outputs and every gradient as torch.nn's."""
    torch.manual_seed(0)
    ours, ref = pair(kind, bias=bias)
    for batch in ((5,), ()):                                  # [B, I] and unbatched [I]
        for given in (False, True):
            x = torch.randn(*batch, 3, dtype=F64, requires_grad=True)
            hx = make_hx(kind, *batch, 4) if given else None
            assert_same_step(ours, ref, x, hx)
    if not bias:
        assert ours.bias_ih is None and ours.bias_hh is None
        assert [n for n, _ in ours.named_parameters()] == ["weight_ih", "weight_hh"]


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_default_backend_matches_torch_nn(kind):
    """backend=None (numbarnn's default: "cpu" here), float32 and float64."""
    torch.manual_seed(1)
    for dtype, atol in ((F64, 1e-12), (torch.float32, 1e-5)):
        ours, ref = pair(kind, dtype=dtype, backend=None)
        x = torch.randn(4, 3, dtype=dtype, requires_grad=True)
        assert_same_step(ours, ref, x, make_hx(kind, 4, 4, dtype=dtype), atol=atol)
        assert_same_step(ours, ref, x, None, atol=atol)


def test_batch_size_zero_and_no_grad():
    """B = 0 gives empty outputs as torch.nn does; under no_grad (inference, no reserve) the same numbers."""
    torch.manual_seed(2)
    for kind in KINDS:
        ours, ref = pair(kind)
        x = torch.zeros(0, 3, dtype=F64, requires_grad=True)
        for g, w in zip(as_tuple(ours(x)), as_tuple(ref(x))):
            assert g.shape == w.shape == (0, 4)
        x = torch.randn(2, 3, dtype=F64)
        with torch.no_grad():
            got, want = as_tuple(ours(x)), as_tuple(ref(x))
        for g, w in zip(got, want):
            assert not g.requires_grad
            torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_rnn_cell_reads_nonlinearity_at_call():
    """As torch.nn.RNNCell: nonlinearity is an attribute read at every call; positional order as torch.nn's."""
    torch.manual_seed(3)
    ours = RNNCell(3, 4, True, "tanh", None, F64, backend=BACKEND)
    ref = torch.nn.RNNCell(3, 4, True, "tanh", None, F64)
    ref.load_state_dict(ours.state_dict())
    ours.nonlinearity = ref.nonlinearity = "relu"
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    assert_same_step(ours, ref, x, None)
    assert LSTMCell(3, 4, False, None, F64).weight_ih.dtype == F64
    assert GRUCell(3, 4, False, None, F64).bias_hh is None


# ---------------------------------------------------------------------------------------------------
# module compatibility: init, state_dict, repr
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_init_matches_torch_nn_under_manual_seed(kind):
    ours_cls, torch_cls, extra = KINDS[kind]
    for bias in (True, False):
        torch.manual_seed(7)
        ours = ours_cls(5, 6, bias=bias, **extra)
        torch.manual_seed(7)
        ref = torch_cls(5, 6, bias=bias, **extra)
        got, want = dict(ours.named_parameters()), dict(ref.named_parameters())
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_dict_round_trips(kind):
    torch.manual_seed(4)
    ours_cls, torch_cls, extra = KINDS[kind]
    ours, ref = ours_cls(3, 4, **extra, dtype=F64, backend=BACKEND), torch_cls(3, 4, **extra, dtype=F64)
    ours.load_state_dict(ref.state_dict())                       # torch.nn -> ours
    assert list(ours.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    ours.reset_parameters()
    ref.load_state_dict(ours.state_dict())                       # ours -> torch.nn
    for k, v in ours.state_dict().items():
        assert torch.equal(ref.state_dict()[k], v)
    x = torch.randn(2, 3, dtype=F64)
    for g, w in zip(as_tuple(ours(x)), as_tuple(ref(x))):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_repr_matches_torch_nn():
    for args, kw in (((3, 4), {}), ((3, 4, False), {}), ((2, 7), {"bias": False})):
        for ours_cls, torch_cls in ((LSTMCell, torch.nn.LSTMCell), (GRUCell, torch.nn.GRUCell),
                                    (RNNCell, torch.nn.RNNCell)):
            assert repr(ours_cls(*args, **kw)) == repr(torch_cls(*args, **kw))
    for nonlinearity in ("tanh", "relu"):
        assert repr(RNNCell(3, 4, False, nonlinearity)) == repr(torch.nn.RNNCell(3, 4, False, nonlinearity))
    assert repr(GRUCell(3, 4, backend="reference")) == "GRUCell(3, 4, backend='reference')"
    assert repr(CellModule("gru", 3, 4)) == "CellModule('gru', 3, 4)"


# ---------------------------------------------------------------------------------------------------
# errors: torch.nn's messages first
# ---------------------------------------------------------------------------------------------------

def _z(*shape, dtype=F64):
    return torch.zeros(*shape, dtype=dtype)


#: (kind, input, hx) that torch.nn's cells reject
BAD_CALLS = [
    (k, x, hx) for k in KINDS for x, hx in (
        (_z(2, 2, 3), None), (_z(()), None),                          # input rank
        (_z(2, 5), None), (_z(5), None),                              # input_size
        (_z(2, 3), "3D"), (_z(2, 3), "batch3"), (_z(2, 3), "hidden5"),
        (_z(3), "2D"), (_z(2, 3), "1D"), (_z(1, 3), "1D"),            # batched / unbatched mixes
        (_z(2, 3, dtype=torch.float32), None), (_z(2, 3, dtype=torch.int64), None),   # dtypes
        (_z(2, 3), "float32"))]


def _bad_hx(kind, spec, lstm_second=False):
    shape = {"3D": (1, 2, 4), "batch3": (3, 4), "hidden5": (2, 5), "2D": (1, 4), "1D": (4,), "float32": (2, 4)}[spec]
    dtype = torch.float32 if spec == "float32" else F64
    if kind != "lstm":
        return _z(*shape, dtype=dtype)
    good = _z(*((2, 4) if spec not in ("2D", "1D") else (4,) if spec == "2D" else (1, 4)))
    bad = _z(*shape, dtype=dtype)
    return (good, bad) if lstm_second else (bad, good)


def _expect_same_error(ours, ref, x, hx):
    with pytest.raises(Exception) as theirs:
        ref(x, hx)
    with pytest.raises(Exception) as mine:
        ours(x, hx)
    assert isinstance(mine.value, type(theirs.value)), (mine.value, theirs.value)
    assert str(mine.value).startswith(str(theirs.value)), (str(mine.value), str(theirs.value))


@pytest.mark.parametrize("kind, x, hx", BAD_CALLS)
def test_errors_match_torch_nn(kind, x, hx):
    ours, ref = pair(kind)
    for second in ((False, True) if kind == "lstm" and isinstance(hx, str) else (False,)):
        if second and hx == "float32":      # torch.nn promotes a c of another dtype; numbarnn rejects it
            with pytest.raises(RNNCellDtypeError, match=r"^LSTMCell: hx\[1\]: expected dtype torch.float64"):
                ours(x, _bad_hx(kind, hx, second))
            continue
        _expect_same_error(ours, ref, x, _bad_hx(kind, hx, second) if isinstance(hx, str) else hx)


def test_more_errors():
    """LSTMCell hx of the wrong length / type, RNNCell's unknown nonlinearity (at call, as torch.nn), bad sizes."""
    ours, ref = pair("lstm")
    x = _z(2, 3)
    for hx in ((_z(2, 4),), (_z(2, 4),) * 3, _z(2, 4)):
        _expect_same_error(ours, ref, x, hx)
    ours, ref = RNNCell(3, 4, nonlinearity="sigmoid"), torch.nn.RNNCell(3, 4, nonlinearity="sigmoid")
    _expect_same_error(ours, ref, _z(2, 3, dtype=torch.float32), None)
    with pytest.raises(RNNShapeError, match="RNNCell: Expected input to be 1D or 2D, got 3D instead"):
        ours(_z(1, 2, 3, dtype=torch.float32))
    with pytest.raises(RNNCellDtypeError, match="^mat1 and mat2 must have the same dtype"):
        LSTMCell(3, 4, backend=BACKEND)(_z(2, 3))
    with pytest.raises(TypeError, match="hidden_size should be of type int"):
        LSTMCell(3, 4.0)
    with pytest.raises(ValueError, match="input_size must be non-negative"):
        GRUCell(-1, 4)
    with pytest.raises(ValueError, match="backend"):
        GRUCell(3, 4, backend="tpu")
    with pytest.raises(ValueError, match="rnn_mode"):
        CellModule("no_such_cell", 3, 4)


# ---------------------------------------------------------------------------------------------------
# cells over time against numbarnn.torch's networks; double backward; torch.compile; autocast
# ---------------------------------------------------------------------------------------------------

def _layer_state(cell) -> dict:
    return {f"{name}_l0": p for name, p in cell.state_dict().items()}


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_relu"])
def test_cell_loop_equals_network(kind):
    """A Python loop of the cell over T steps equals numbarnn.torch.LSTM/GRU/RNN on the same weights."""
    torch.manual_seed(5)
    cell, _ = pair(kind)
    net = {"lstm": LSTM(3, 4, dtype=F64, backend=BACKEND), "gru": GRU(3, 4, dtype=F64, backend=BACKEND),
           "rnn_relu": RNN(3, 4, nonlinearity="relu", dtype=F64, backend=BACKEND)}[kind]
    net.load_state_dict(_layer_state(cell))
    x = torch.randn(6, 2, 3, dtype=F64, requires_grad=True)
    hx = make_hx(kind, 2, 4)
    state, outs = hx, []
    for t in range(x.shape[0]):
        state = cell(x[t], state)
        outs.append(state[0] if kind == "lstm" else state)
    y, final = net(x, tuple(s.unsqueeze(0) for s in hx) if kind == "lstm" else hx.unsqueeze(0))
    torch.testing.assert_close(torch.stack(outs), y, atol=1e-12, rtol=0)
    for a, b in zip(as_tuple(state), as_tuple(final)):
        torch.testing.assert_close(a, b[0], atol=1e-12, rtol=0)
    dy = torch.randn_like(y)
    g_cell = torch.autograd.grad((torch.stack(outs) * dy).sum(), [x, *as_tuple(hx), *cell.parameters()])
    g_net = torch.autograd.grad((y * dy).sum(), [x, *as_tuple(hx), *net.parameters()])
    for a, b in zip(g_cell, g_net):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_gradgradcheck(kind):
    torch.manual_seed(6)
    cell, _ = pair(kind, 2, 2)
    names = [n for n, _ in cell.named_parameters()]
    x = torch.randn(2, 2, dtype=F64, requires_grad=True)
    hx = make_hx(kind, 2, 2)

    def fn(x, *rest):
        n = 2 if kind == "lstm" else 1
        state = tuple(rest[:n]) if kind == "lstm" else rest[0]
        out = torch.func.functional_call(cell, dict(zip(names, rest[n:])), (x, state))
        return out

    params = [p.detach().clone().requires_grad_() for p in cell.parameters()]
    assert torch.autograd.gradcheck(fn, (x, *as_tuple(hx), *params))
    assert torch.autograd.gradgradcheck(fn, (x, *as_tuple(hx), *params))


def test_compile_fullgraph_loop_over_a_cell():
    """torch.compile(fullgraph=True) of a loop over LSTMCell: no graph break; same values and gradients."""
    torch.manual_seed(8)
    cell, ref = pair("lstm")

    def run(module, x):
        h = c = torch.zeros(x.shape[1], 4, dtype=x.dtype)
        outs = []
        for t in range(x.shape[0]):
            h, c = module(x[t], (h, c))
            outs.append(h)
        return torch.stack(outs), c

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: run(cell, x), fullgraph=True, backend="eager")
    x = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
    got, want = compiled(x), run(ref, x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    g1 = torch.autograd.grad(got[0].sum() + got[1].sum(), [x, *cell.parameters()])
    g2 = torch.autograd.grad(want[0].sum() + want[1].sum(), [x, *ref.parameters()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_bfloat16_and_autocast():
    """bfloat16 cells (computed in float32); under torch.autocast all outputs come in the autocast dtype."""
    torch.manual_seed(9)
    cell = GRUCell(3, 4, backend=BACKEND)
    x = torch.randn(2, 3)
    want = cell(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cell(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=0)
    lstm = LSTMCell(3, 4, backend=BACKEND)
    h, c = lstm.to(torch.bfloat16)(x.to(torch.bfloat16).requires_grad_())
    assert h.dtype == c.dtype == torch.bfloat16
    h.float().sum().backward()
    assert lstm.weight_ih.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# CellModule: any registered cell
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell_arg", ["peephole_lstm", peephole.SPEC])
def test_cell_module_of_contrib_cell_matches_network(cell_arg):
    """CellModule("peephole_lstm") against numbarnn.torch.RNNBase("peephole_lstm") with T = 1, same weights."""
    torch.manual_seed(10)
    cell = CellModule(cell_arg, 3, 4, dtype=F64, backend=BACKEND)
    assert [n for n, _ in cell.named_parameters()] == ["weight_ih", "weight_hh", "bias_ih", "bias_hh",
                                                       "w_ci", "w_cf", "w_co"]
    assert cell.w_ci.shape == (4,)
    net = RNNBase("peephole_lstm", 3, 4, dtype=F64, backend=BACKEND)
    net.load_state_dict(_layer_state(cell))
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    hx = make_hx("lstm", 2, 4)
    h, c = cell(x, hx)
    y, (hn, cn) = net(x.unsqueeze(0), tuple(t.unsqueeze(0) for t in hx))
    torch.testing.assert_close(h, hn[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(c, cn[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(h, y[0], atol=1e-12, rtol=0)
    g_cell = torch.autograd.grad(h.sum() + 2 * c.sum(), [x, *hx, *cell.parameters()])
    g_net = torch.autograd.grad(hn.sum() + 2 * cn.sum(), [x, *hx, *net.parameters()])
    for a, b in zip(g_cell, g_net):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    hu, cu = cell(x[0])                                          # unbatched, hx None
    assert hu.shape == cu.shape == (4,)
    with pytest.raises(RNNShapeError, match=r"^CellModule: Expected hx\[1\] to be 1D or 2D"):
        cell(x, (hx[0], _z(1, 2, 4)))


def test_cell_module_of_builtin_cell_is_the_specialisation():
    torch.manual_seed(11)
    generic = CellModule("gru", 3, 4, dtype=F64, backend=BACKEND)
    special = GRUCell(3, 4, dtype=F64, backend=BACKEND)
    special.load_state_dict(generic.state_dict())
    x = torch.randn(2, 3, dtype=F64)
    torch.testing.assert_close(generic(x), special(x), atol=0, rtol=0)
    assert isinstance(special, CellModule) and isinstance(LSTMCell(2, 2), CellModule)


def test_torch_func_transforms():
    """vmap over extra leading dims, jacrev (reverse) and jacfwd (forward mode) of a cell step."""
    torch.manual_seed(12)
    cell, ref = pair("gru")
    x = torch.randn(5, 2, 3, dtype=F64)
    torch.testing.assert_close(torch.func.vmap(cell)(x), torch.stack([ref(xi) for xi in x]), atol=1e-12, rtol=0)
    jr = torch.func.jacrev(cell)(x[0])
    torch.testing.assert_close(jr, torch.func.jacrev(ref)(x[0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.func.jacfwd(cell)(x[0]), jr, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cls, ref_cls", [(RNNCell, torch.nn.RNNCell), (GRUCell, torch.nn.GRUCell),
                                          (LSTMCell, torch.nn.LSTMCell)])
@pytest.mark.parametrize("input_size, hidden_size", [(3, 0), (0, 4)])
def test_empty_cells_as_torch_nn(cls, ref_cls, input_size, hidden_size):
    """torch.nn builds cells with hidden_size 0 (an empty h') or input_size 0 (h' from h alone): the same
    parameters, initial values and outputs, batched and unbatched."""
    torch.manual_seed(2)
    ours = cls(input_size, hidden_size, dtype=F64)
    torch.manual_seed(2)
    ref = ref_cls(input_size, hidden_size, dtype=F64)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))
    for x in (torch.randn(2, input_size, dtype=F64), torch.randn(input_size, dtype=F64)):
        got, want = ours(x), ref(x)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("how", ["optimizer", "data_inplace", "load_state_dict", "new_parameter"])
@pytest.mark.parametrize("kind, bias", [("lstm", True), ("gru", False), ("rnn_tanh", True)])
def test_weights_changed_between_steps_are_seen(kind, bias, how):
    """A cell's weights gathered through its cached views: a step after the weights changed (an optimizer step,
    an in-place write through `.data`, load_state_dict, new Parameters) computes with the new weights (outputs and
    gradients: torch.nn's holding the same weights)."""
    ours, ref = pair(kind, bias=bias)
    x, hx = torch.randn(2, 3, dtype=F64, requires_grad=True), make_hx(kind, 2, 4)
    with torch.no_grad():
        ours(x, hx)                                           # fills the cache
    ours(x, hx)
    if how == "optimizer":
        for p in ours.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.SGD(ours.parameters(), lr=0.5).step()
    elif how == "data_inplace":
        for p in ours.parameters():
            p.data.mul_(-1.5).add_(0.25)
    elif how == "load_state_dict":
        ours.load_state_dict({k: v * 2.0 - 0.5 for k, v in ours.state_dict().items()})
    else:
        for name in ours._weight_names:
            setattr(ours, name, torch.nn.Parameter(getattr(ours, name).detach() * -1.0 + 0.5))
    ref.load_state_dict(ours.state_dict())
    ours.zero_grad(set_to_none=True)
    assert_same_step(ours, ref, x, hx)

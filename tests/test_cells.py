"""Cells as data: the CellSpec contract, the registry, layouts derived from specs, the kernel templates'
exact argument lists, user cells (numbarnn.contrib) on every backend, and numbarnn.testing.check_cell."""
import ast
import pathlib

import numpy as np
import pytest

import numbarnn
import numbarnn.contrib.cifg_lstm  # noqa: F401  (registers cifg_lstm)
import numbarnn.contrib.peephole_lstm  # noqa: F401  (registers peephole_lstm)
from numbarnn import cells, ops
from numbarnn.cells import CellSpec, get_cell, register
from numbarnn.config import params_size, rnn_config
from numbarnn.kernels import cell_steps
from numbarnn.params import param_regions, to_torch_state_dict, from_torch_state_dict
from numbarnn.reserve import reserve_contents, reserve_entries
from numbarnn.testing import check_cell, check_rnn_gradients, make_rnn_case, relative_error, run_backward, run_forward

PACKAGE = pathlib.Path(numbarnn.__file__).parent
USER_CELLS = ("peephole_lstm", "cifg_lstm")


# ---------------------------------------------------------------------------------------------------
# the spec and the registry
# ---------------------------------------------------------------------------------------------------

def _fwd(wx, rh, v, h, c, saved):
    saved[0] = wx[0] + rh[0]
    return saved[0], c


def _bwd(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    dwx[0] = dm
    return 0.0, dc


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(name="bad name"), ValueError, "CellSpec.name"),
    (dict(gates=()), ValueError, "at least one gate"),
    (dict(gates="ab"), TypeError, "CellSpec.gates"),
    (dict(saved=()), ValueError, "CellSpec.saved"),
    (dict(gates=("a", "a")), ValueError, "distinct"),
    (dict(split_recurrent=("z",)), ValueError, "split_recurrent"),
    (dict(projection=True), ValueError, "needs a cell state"),
    (dict(forward=lambda wx, rh: 0), TypeError, "CellSpec.forward: expected a function of 6"),
    (dict(backward=print), TypeError, "CellSpec.backward: expected a plain Python function"),
])
def test_cellspec_rejects_bad_descriptions(kwargs, error, message):
    base = dict(name="tiny", gates=("a",), saved=("a",), forward=_fwd, backward=_bwd)
    with pytest.raises(error, match=message):
        CellSpec(**{**base, **kwargs})


def test_registry_names_and_errors():
    assert cells.cell_names()[:4] == cells.BUILTIN
    assert set(USER_CELLS) <= set(cells.cell_names())
    with pytest.raises(ValueError, match="rnn_mode: expected one of .*'peephole_lstm'.*got 'nope'"):
        get_cell("nope")
    with pytest.raises(TypeError, match="CellSpec"):
        register("lstm")
    other = CellSpec(name="cifg_lstm", gates=("a",), saved=("a",), forward=_fwd, backward=_bwd)
    with pytest.raises(ValueError, match="already registered"):
        register(other)
    register(get_cell("cifg_lstm"))                 # the same spec again: accepted (a module imported twice)


def test_builtin_specs_describe_the_cudnn_cells():
    assert [(c.name, c.G, c.S, c.cell_state, c.projection, c.split_recurrent) for c in map(get_cell, cells.BUILTIN)] \
        == [("lstm", 4, 4, True, True, ()), ("gru", 3, 4, False, False, ("n",)),
            ("rnn_tanh", 1, 1, False, False, ()), ("rnn_relu", 1, 1, False, False, ())]


# ---------------------------------------------------------------------------------------------------
# layouts derived from the spec
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", cells.BUILTIN + USER_CELLS)
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
def test_params_size_formula_equals_the_regions(mode, direction):
    cell = get_cell(mode)
    cfg = rnn_config(2, 3, 5, mode, "linear_input", direction, 2 if cell.projection else 0)
    regions = param_regions(cfg)
    assert params_size(cfg) == sum(r.size for r in regions) == ops.cudnn_rnn_params_size(
        2, 3, 5, mode, direction=direction, num_proj=cfg.num_proj)
    assert sum(r.kind == "V" for r in regions) == cfg.L * cfg.D * cell.V
    offsets = [r.offset for r in regions]
    assert offsets == sorted(offsets) and regions[-1].offset + regions[-1].size == params_size(cfg)


def test_peephole_vectors_follow_each_pseudo_layers_biases_and_round_trip():
    cfg = rnn_config(1, 3, 2, "peephole_lstm", direction="bidirectional")
    kinds = [(r.p, r.kind) for r in param_regions(cfg) if r.kind in ("bR", "V")]
    assert kinds[4:7] == [(0, "V")] * 3 and kinds[-3:] == [(1, "V")] * 3
    params = np.random.default_rng(0).standard_normal(params_size(cfg))
    w, b = ops.cudnn_rnn_params_to_canonical(1, 3, 2, params, "peephole_lstm", direction="bidirectional")
    assert [tuple(a.shape) for a in w[-6:]] == [(3,)] * 6            # the vectors close the weight list
    assert np.array_equal(ops.cudnn_rnn_canonical_to_params(1, 3, 2, w, b, "peephole_lstm",
                                                            direction="bidirectional"), params)
    sd = to_torch_state_dict(cfg, params)
    assert {"w_ci_l0", "w_cf_l0", "w_co_l0_reverse"} <= set(sd)
    assert np.array_equal(from_torch_state_dict(cfg, sd), params)


@pytest.mark.parametrize("mode,acts", [("lstm", 4), ("gru", 4), ("rnn_relu", 1), ("cifg_lstm", 3)])
def test_reserve_layout_follows_saved_and_cell_state(mode, acts):
    from numbarnn.config import RNNCall
    cfg = rnn_config(1, 3, 2, mode)
    entries = {e.name: e.shape for e in reserve_entries(RNNCall(cfg, 4, 2, np.dtype("float32")))}
    assert entries["acts0"] == (1, 4, 2, acts * 3)
    assert ("c0" in entries) == get_cell(mode).cell_state


def test_projection_only_for_cells_that_allow_it():
    rnn_config(1, 3, 2, "cifg_lstm", num_proj=2)
    with pytest.raises(ValueError, match="num_proj: projection is only defined for rnn_mode in"):
        rnn_config(1, 3, 2, "gru", num_proj=2)


# ---------------------------------------------------------------------------------------------------
# kernel templates: every argument a kernel takes is used by its cell
# ---------------------------------------------------------------------------------------------------

def _args(maker, mode, proj=False):
    return maker(get_cell(mode), "float32", proj).__code__.co_varnames[:maker(get_cell(mode), "float32",
                                                                              proj).__code__.co_argcount]


def test_kernels_take_exactly_the_arguments_their_cell_uses():
    gru_fwd = _args(cell_steps.make_forward_step, "gru")
    assert "c" not in gru_fwd and "cs" not in gru_fwd and "ms" not in gru_fwd
    lstm_bwd = _args(cell_steps.make_backward_step, "lstm")
    assert {"c0", "cs", "dc"} <= set(lstm_bwd) and "unit_params" not in lstm_bwd and "Wp_fwd" not in lstm_bwd
    proj_fwd = _args(cell_steps.make_forward_step, "lstm", True)
    assert "ms" in proj_fwd and "h_out" not in proj_fwd and "y" not in proj_fwd
    peep_bwd = _args(cell_steps.make_backward_step, "peephole_lstm")
    assert {"unit_params", "dvec"} <= set(peep_bwd)
    rnn_bwd = _args(cell_steps.make_backward_step, "rnn_tanh")
    assert rnn_bwd == ("s", "lens", "dy", "y", "h0", "acts", "dh_in", "dh_out", "dgx", "dgh", "h_prev")
    src = cell_steps.make_forward_step(get_cell("rnn_tanh"), "float32", False).source
    assert "def rnn_tanh_forward_step(" in src and "# [T, B, D*P] layer output" in src


def test_kernel_signatures_match_the_argument_lists():
    for mode in cells.cell_names():
        cell = get_cell(mode)
        for proj in cell_steps.proj_variants(cell):
            for table, maker in ((cell_steps.FORWARD_ARGS, cell_steps.make_forward_step),
                                 (cell_steps.BACKWARD_ARGS, cell_steps.make_backward_step)):
                assert len(cell_steps.signature(table, cell, "float32", proj)) == \
                       maker(cell, "float32", proj).__code__.co_argcount


# ---------------------------------------------------------------------------------------------------
# architecture: no import cycle; the kernels import nothing from the reference
# ---------------------------------------------------------------------------------------------------

def _imports(path: pathlib.Path, module: str) -> set:
    """Every numbarnn module `path` imports, at any level (function-level imports included)."""
    out = set()
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:            # `if TYPE_CHECKING:` imports never run
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] + [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.startswith("numbarnn")}
    return out


def _graph() -> dict:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    return {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}


def test_kernels_import_nothing_from_the_reference():
    graph = _graph()
    bad = {m: sorted(i for i in deps if i.startswith("numbarnn.reference"))
           for m, deps in graph.items() if m.startswith("numbarnn.kernels")}
    assert not any(bad.values()), bad


def test_description_modules_have_no_import_cycle():
    graph = _graph()
    core = ["numbarnn.cells", "numbarnn.cells.spec", "numbarnn.config", "numbarnn.params", "numbarnn.reserve",
            "numbarnn.dropout", "numbarnn.validation"]
    for start in core:
        seen, stack = set(), [(start, (start,))]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if not nxt.startswith(("numbarnn.cells", "numbarnn.config", "numbarnn.params", "numbarnn.reserve",
                                       "numbarnn.dropout", "numbarnn.validation")):
                    continue
                assert nxt != start, f"import cycle: {' -> '.join(path + (nxt,))}"
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))


# ---------------------------------------------------------------------------------------------------
# user cells on every backend
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", USER_CELLS)
def test_user_cell_kernels_equal_the_spec_reference(mode):
    """cuda (simulator) vs the reference built from the spec: ragged lengths with 0, bidirectional, two layers,
    dropout, projection; every output and gradient."""
    cfg = rnn_config(2, 3, 4, mode, "linear_input", "bidirectional", 2, 0.3, 3, 4)
    case = make_rnn_case(cfg, 4, 5, lengths=[4, 0, 2, 3, 1], seed=2)
    ref, got = run_forward(case, "reference"), run_forward(case, "cuda")
    for name, a, b in zip(("output", "output_h", "output_c", "reserve_space"), ref[:4], got[:4]):
        if name == "reserve_space":           # the nonce (a per-call random tag) differs by design
            a, b = reserve_contents(a), reserve_contents(b)
        assert relative_error(b, a) < 1e-12, name
    for name, a, b in zip(("dx", "dh0", "dc0", "dparams"), run_backward(case, ref, "reference"),
                          run_backward(case, got, "cuda")):
        assert relative_error(b, a) < 1e-12, name


@pytest.mark.parametrize("mode", USER_CELLS)
def test_user_cell_network_gradients_by_finite_differences_on_cuda(mode):
    cfg = rnn_config(2, 2, 3, mode, "linear_input", "bidirectional", 0, 0.5, 1, 2)
    case = make_rnn_case(cfg, 3, 3, lengths=[3, 0, 2], seed=5)
    report = check_rnn_gradients(case, "cuda")
    assert max(report.values()) < 1e-6, report


@pytest.mark.parametrize("mode", cells.BUILTIN + USER_CELLS)
def test_check_cell_passes_for_correct_cells(mode):
    report = check_cell(mode, max_examples=10)
    assert report.ok and report.worst < 1e-6 and report.failing is None, str(report)


def test_check_cell_finds_a_wrong_backward_and_reports_the_example():
    lstm = get_cell("cifg_lstm")

    def wrong_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
        dh, dc_prev = lstm.backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv)
        dwx[2] = dwx[2] * 1.01                     # a 1% error in the output gate's gradient
        return dh, dc_prev

    bad = CellSpec(name="wrong_cifg", gates=lstm.gates, saved=lstm.saved, forward=lstm.forward,
                   backward=wrong_backward, cell_state=True)
    report = check_cell(bad, max_examples=10, raise_on_failure=False)
    assert not report.ok and report.pointwise > 1e-3 and report.failing.startswith("pointwise"), str(report)
    with pytest.raises(AssertionError, match="failing example: pointwise"):
        check_cell(bad, max_examples=10)


def test_check_cell_without_hypothesis(monkeypatch):
    """Without hypothesis (a base install: it is the `test` extra) check_cell draws its examples from a seeded
    NumPy generator: a right cell passes on the whole network (ragged, both directions, dropout), a 1% error in
    one gate's gradient is caught and reported."""
    from numbarnn import testing

    monkeypatch.setattr(testing, "st", None)
    monkeypatch.setitem(__import__("sys").modules, "hypothesis", None)        # importing it fails
    report = check_cell("cifg_lstm", backends=("reference", "cpu"), max_examples=8, network_examples=6)
    assert report.ok and set(report.network) == {"reference", "cpu"} and report.examples == 8 + 2 * 6, str(report)
    lstm = get_cell("cifg_lstm")

    def wrong_backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
        dh, dc_prev = lstm.backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv)
        dwx[2] = dwx[2] * 1.01
        return dh, dc_prev

    bad = CellSpec(name="wrong_cifg_numpy", gates=lstm.gates, saved=lstm.saved, forward=lstm.forward,
                   backward=wrong_backward, cell_state=True)
    try:
        with pytest.raises(AssertionError, match="failing example: pointwise"):
            check_cell(bad, max_examples=8)
    finally:
        from numbarnn.cells import spec as cell_spec
        cell_spec._CELLS.pop(bad.name, None)


def test_check_cell_of_a_user_cell_on_cuda():
    report = check_cell("cifg_lstm", backends=("cuda",), max_examples=4, network_examples=2)
    assert report.ok and set(report.network) == {"cuda"}, str(report)


def test_layer_and_torch_module_of_a_user_cell():
    layer = numbarnn.CudnnRNN("peephole_lstm", 1, 3, direction="bidirectional", seed=0, dtype="float64",
                              backend="reference")
    x = np.random.default_rng(0).standard_normal((4, 2, 5))
    y, (h, c) = layer(x, sequence_lengths=np.array([4, 2], np.int32))
    assert y.shape == (4, 2, 6) and h.shape == c.shape == (2, 2, 3)
    dx, (dh0, dc0) = layer.backward(np.ones_like(y))
    assert dx.shape == x.shape and layer.params_grad.shape == layer.weights[0].shape
    assert type(layer).from_config(layer.get_config()).rnn_mode == "peephole_lstm"
    torch = pytest.importorskip("torch")
    from numbarnn.torch import RNNBase
    module = RNNBase("cifg_lstm", 3, 2, bidirectional=True, dtype=torch.float64, backend="reference")
    assert {"weight_ih_l0", "weight_hh_l0_reverse"} <= set(dict(module.named_parameters()))
    inp = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: module(t)[0], (inp,))
    peep = RNNBase("peephole_lstm", 2, 2, dtype=torch.float64, backend="reference")
    assert "w_co_l0" in dict(peep.named_parameters())
    out, (hn, cn) = peep(torch.randn(3, 1, 2, dtype=torch.float64))
    (out.sum() + cn.sum()).backward()
    assert peep.w_co_l0.grad is not None and peep.w_co_l0.grad.abs().sum() > 0


def test_tf_cells_round_trip_for_plain_rnn_modes():
    from numbarnn.params import from_tf_cells, to_tf_cells
    for mode in ("rnn_tanh", "rnn_relu"):
        cfg = rnn_config(2, 3, 4, mode, direction="bidirectional")
        params = np.random.default_rng(1).standard_normal(params_size(cfg))
        tf = to_tf_cells(cfg, params)
        assert tf["cell_1/bw/kernel"].shape == (6 + 3, 3) and tf["cell_0/fw/bias"].shape == (3,)
        back = from_tf_cells(cfg, tf)
        W = [r for r in param_regions(cfg) if r.kind in ("W", "R")]
        for r in W:                                   # matrices exactly; biases as the split of their sum
            assert np.array_equal(back[r.offset:r.offset + r.size], params[r.offset:r.offset + r.size])
        x = np.random.default_rng(2).standard_normal((3, 2, 4))
        h0 = np.zeros((4, 2, 3))
        a = ops.cudnn_rnn_v3(x, h0, None, params, rnn_mode=mode, direction="bidirectional", backend="reference")
        b = ops.cudnn_rnn_v3(x, h0, None, back, rnn_mode=mode, direction="bidirectional", backend="reference")
        assert relative_error(b[0], a[0]) < 1e-14
    with pytest.raises(ValueError, match="CudnnCompatible cells exist for"):
        to_tf_cells(rnn_config(1, 3, 2, "cifg_lstm"), np.zeros(params_size(rnn_config(1, 3, 2, "cifg_lstm"))))


def test_cli_checks_a_user_cell(capsys):
    from numbarnn import cli
    assert cli.main(["check", "--cells", "numbarnn.contrib.cifg_lstm", "--mode", "cifg_lstm", "--layers", "2",
                     "--direction", "bidirectional", "--lengths", "3,0,2", "--dtype", "float64",
                     "--backends", "reference,cuda"]) == 0
    out = capsys.readouterr().out
    assert "cifg_lstm" in out and "ok" in out


# ---------------------------------------------------------------------------------------------------
# the registry's edges: cells loaded from a .py path, the same cell registered again by a re-imported module
# ---------------------------------------------------------------------------------------------------

USER_CELL_FILE = """\
from numbarnn.cells import CellSpec, dtanh, register, tanh


def forward(wx, rh, v, h, c, saved):
    m = tanh(wx[0] + rh[0])
    saved[0] = m
    return m, c


def backward(dm, dc, saved, v, h, c, c_new, dwx, drh, dv):
    dwx[0] = dm * dtanh(saved[0])
    return 0.0, 0.0


SPEC = register(CellSpec(name="{name}", gates=("a",), saved=("m",), forward=forward, backward=backward))
"""


def _write_cell(tmp_path, name, file_name=None):
    path = tmp_path / (file_name or f"{name}.py")
    path.write_text(USER_CELL_FILE.format(name=name))
    return path


def test_a_cell_file_loads_by_path_once_and_runs_everywhere(tmp_path, capsys):
    """`numbarnn check --cells path/to/cell.py` (load_cell_modules): the file registers its cell, which then runs
    on every backend; loading it again does not run it again; a missing file or module is a ValueError naming
    the argument."""
    import sys

    from numbarnn import cli
    from numbarnn.cells import get_cell, load_cell_modules
    from numbarnn.cells import spec as cell_spec

    name = "test_path_cell"
    path = _write_cell(tmp_path, name)
    module = "numbarnn_user_cells_" + name
    try:
        load_cell_modules([str(path)])
        spec = get_cell(name)
        assert sys.modules[module].SPEC is spec
        load_cell_modules([str(path)])                               # already loaded: not run again
        assert get_cell(name) is spec
        assert cli.main(["check", "--cells", str(path), "--mode", name, "--layers", "2", "--direction",
                         "bidirectional", "--lengths", "3,0,2", "--dtype", "float64",
                         "--backends", "reference,cpu,cuda"]) == 0
        out = capsys.readouterr().out
        assert name in out and "ok" in out
        with pytest.raises(ValueError, match=r"^--cells: no such file"):
            load_cell_modules([str(tmp_path / "missing.py")])
        with pytest.raises(ValueError, match=r"^--cells: cannot import 'no_such_module_of_cells'"):
            load_cell_modules(["no_such_module_of_cells"])
    finally:
        cell_spec._CELLS.pop(name, None)
        sys.modules.pop(module, None)


def test_a_reimported_cell_module_registers_an_equal_spec_again(tmp_path):
    """The same file imported under two module names (a module re-imported, as a notebook's reload does) registers
    an equal spec again: accepted, not a clash; a different cell under the name is refused without replace=True."""
    import importlib.util
    import sys

    from numbarnn.cells import get_cell, register
    from numbarnn.cells import spec as cell_spec

    name = "test_reimported_cell"
    path = _write_cell(tmp_path, name)
    loaded = []
    try:
        for module_name in ("test_reimport_a", "test_reimport_b"):
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            loaded.append(module)
        assert loaded[0].SPEC is not loaded[1].SPEC and get_cell(name) is loaded[1].SPEC
        other = _write_cell(tmp_path, name, "other.py")
        other.write_text(other.read_text().replace("m = tanh(wx[0] + rh[0])", "m = tanh(wx[0] - rh[0])"))
        spec = importlib.util.spec_from_file_location("test_reimport_other", other)
        module = importlib.util.module_from_spec(spec)
        with pytest.raises(ValueError, match=r"^spec: a different cell named 'test_reimported_cell'"):
            spec.loader.exec_module(module)
        import dataclasses
        replaced = register(dataclasses.replace(get_cell("gru"), name=name), replace=True)
        assert get_cell(name) is replaced
    finally:
        cell_spec._CELLS.pop(name, None)
        for module_name in ("test_reimport_a", "test_reimport_b"):
            sys.modules.pop(module_name, None)



def test_a_definition_run_again_elsewhere_is_the_same_cell_unless_its_globals_differ():
    """A notebook runs the same cell definition again in another cell (another code file name, new function
    objects): an equal spec, accepted.  The same code reading different globals (another activation bound to the
    name, another gate offset) is a different cell: refused without replace=True."""
    from numbarnn.cells import functions
    from numbarnn.cells import spec as cell_spec

    name = "test_notebook_cell"
    source = USER_CELL_FILE.format(name=name)
    try:
        for cell_number in (1, 2):                          # IPython names each cell's code differently
            namespace = {"__name__": "__main__"}
            exec(compile(source, f"<ipython-input-{cell_number}-0123456789ab>", "exec"), namespace)
        assert get_cell(name) is namespace["SPEC"]
        for change in ({"tanh": functions.sigmoid}, {"dtanh": functions.dsigmoid}):
            namespace = {"__name__": "__main__"}
            with pytest.raises(ValueError, match=r"^spec: a different cell named 'test_notebook_cell'"):
                exec(compile(source.replace("from numbarnn.cells import CellSpec, dtanh, register, tanh",
                                            "from numbarnn.cells import CellSpec, dtanh, register, tanh\n"
                                            + "\n".join(f"{k} = _changed_{k}" for k in change)),
                             "<ipython-input-3-0123456789ab>", "exec"),
                     {**namespace, **{f"_changed_{k}": v for k, v in change.items()}})
        offsets = source.replace("saved[0] = m", "saved[A] = m").replace("def forward", "A = 0\n\n\ndef forward")
        cell_spec._CELLS.pop(name)
        for cell_number in (4, 6):                          # a global number: the same value, the same cell
            exec(compile(offsets, f"<ipython-input-{cell_number}-0123456789ab>", "exec"), {"__name__": "__main__"})
        with pytest.raises(ValueError, match=r"^spec: a different cell named 'test_notebook_cell'"):
            exec(compile(offsets.replace("A = 0", "A = 1"), "<ipython-input-5-0123456789ab>", "exec"),
                 {"__name__": "__main__"})
    finally:
        cell_spec._CELLS.pop(name, None)

"""BlockLSTM on the "cuda" backend (numba.cuda kernels, run in the simulator) against the NumPy reference.

What is checked (SPEC sections 9, 10, 11):
- forward outputs and all eight gradients agree with the reference over layouts, peephole on/off, clip
  off / a small clip that triggers, forget_bias, 0 <= seq_len_max <= T and float64/32/16 (float16: against
  the reference run on the same float16 inputs); past seq_len_max everything is exactly 0;
- the public ops (V1 defaults, V2) on backend="cuda";
- T == 0, B == 0, seq_len_max == 0; two identical calls are bit-identical; device arrays in -> device
  arrays out; bad inputs raise the same error on "cuda" as on "reference";
- launch counts: 1 launch per forward step, 2 per backward step;
- kernel_specs(): one specialisation per dtype / layout / peephole (/ clip), each signature fits its kernel.
Shapes stay tiny (T <= 4, B <= 3, C <= 4, I <= 3): the simulator runs one Python thread per CUDA thread.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from numba import cuda

from numbarnn import ops
from numbarnn.block_lstm_config import validate_block_lstm, validate_block_lstm_grad
from numbarnn.kernels import backend as cuda_backend
from numbarnn.kernels import block_lstm as kernels
from numbarnn.kernels import driver
from numbarnn.reference import backend as ref_backend
from numbarnn.verify import TOLERANCES as TOL  # (outputs, gradients): SPEC 10

FORWARD_ARGS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
SAVED = ("i", "cs", "f", "o", "ci", "co", "h")
GRADS = tuple(f"{name}_grad" for name in FORWARD_ARGS)


def make_inputs(rng, T, B, I, C, dtype):
    arrays = dict(
        x=rng.standard_normal((T, B, I)),                  # [T, B, I]
        cs_prev=1.5 * rng.standard_normal((B, C)),         # [B, C]
        h_prev=0.8 * rng.uniform(-1, 1, (B, C)),           # [B, C]
        w=0.6 * rng.standard_normal((I + C, 4 * C)),       # [I+C, 4C]
        wci=0.7 * rng.standard_normal(C),                  # [C]
        wcf=0.7 * rng.standard_normal(C),                  # [C]
        wco=0.7 * rng.standard_normal(C),                  # [C]
        b=0.5 * rng.standard_normal(4 * C),                # [4C]
    )
    return {k: v.astype(dtype) for k, v in arrays.items()}


def make_upstream(rng, T, B, C, dtype):
    return dict(cs_grad=rng.standard_normal((T, B, C)).astype(dtype),     # [T, B, C]
                h_grad=rng.standard_normal((T, B, C)).astype(dtype))      # [T, B, C]


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    diff = np.linalg.norm((out - ref).ravel())
    scale = np.linalg.norm(ref.ravel())
    return float(diff) if scale == 0.0 else float(diff / scale)


def run_both(layout, S, inp, up, forget_bias, cell_clip, peephole):
    """Forward and backward on both backends (the backward of both gets the reference's saved outputs).
    Returns (reference dict, cuda dict), names SAVED + GRADS."""
    call = validate_block_lstm(layout, S, **inp, forget_bias=forget_bias, cell_clip=cell_clip,
                               use_peephole=peephole)
    args = [inp[k] for k in FORWARD_ARGS]
    ref_fwd = ref_backend.block_lstm(call, *args)
    got_fwd = cuda_backend.block_lstm(call, *args)
    saved = dict(zip(SAVED, ref_fwd))
    gcall = validate_block_lstm_grad(layout, S, **inp, **saved, **up, use_peephole=peephole)
    ref_bwd = ref_backend.block_lstm_grad(gcall, *args, *ref_fwd, up["cs_grad"], up["h_grad"])
    got_bwd = cuda_backend.block_lstm_grad(gcall, *args, *ref_fwd, up["cs_grad"], up["h_grad"])
    ref = dict(zip(SAVED + GRADS, tuple(ref_fwd) + tuple(ref_bwd)))
    got = dict(zip(SAVED + GRADS, tuple(got_fwd) + tuple(got_bwd)))
    return ref, got


def assert_agree(ref, got, dtype):
    tol_out, tol_grad = TOL[np.dtype(dtype)]
    for name in SAVED + GRADS:
        assert isinstance(got[name], np.ndarray), name
        assert got[name].dtype == np.dtype(dtype), (name, got[name].dtype)
        assert got[name].shape == ref[name].shape, (name, got[name].shape, ref[name].shape)
        tol = tol_out if name in SAVED else tol_grad
        err = rel_err(got[name], ref[name])
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:g}"


# ----------------------------------------------------------------------------------------------
# agreement with the reference
# ----------------------------------------------------------------------------------------------
dims = st.tuples(st.integers(0, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4))


@given(dims=dims, layout=st.sampled_from(["icfo", "ifco"]), peephole=st.booleans(),
       forget_bias=st.sampled_from([0.0, 1.0, -0.6]), cell_clip=st.sampled_from([0.0, 0.4]),
       s_frac=st.floats(0, 1), dtype=st.sampled_from(["float64", "float32", "float16"]),
       seed=st.integers(0, 2**32 - 1))
@example(dims=(4, 3, 3, 4), layout="icfo", peephole=True, forget_bias=1.0, cell_clip=0.4, s_frac=1.0,
         dtype="float64", seed=1)
@example(dims=(3, 2, 2, 3), layout="ifco", peephole=True, forget_bias=0.0, cell_clip=0.0, s_frac=0.7,
         dtype="float16", seed=2)
def test_matches_reference(dims, layout, peephole, forget_bias, cell_clip, s_frac, dtype, seed):
    T, B, I, C = dims
    S = int(round(s_frac * T))
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, T, B, I, C, dtype)
    up = make_upstream(rng, T, B, C, dtype)
    ref, got = run_both(layout, S, inp, up, forget_bias, cell_clip, peephole)
    assert_agree(ref, got, dtype)
    for name in SAVED:                                      # SPEC 9 (choice): all seven are 0 past S
        assert not np.any(got[name][S:]), name
    assert not np.any(got["x_grad"][S:])
    if cell_clip > 0:
        assert np.all(np.abs(got["cs"]) <= np.dtype(dtype).type(cell_clip))    # the clip in the dtype
    if not peephole:
        for name in ("wci_grad", "wcf_grad", "wco_grad"):
            assert not np.any(got[name]), name


def test_small_clip_triggers_and_gradient_ignores_it():
    """The clip of the test above really acts on these inputs (cs_prev ~ 1.5 N(0, 1) > 0.4)."""
    rng = np.random.default_rng(7)
    inp = make_inputs(rng, 3, 2, 2, 3, np.float64)
    up = make_upstream(rng, 3, 2, 3, np.float64)
    ref, got = run_both("icfo", 3, inp, up, 0.0, 0.4, True)
    assert np.sum(np.abs(got["cs"]) == 0.4) >= 3              # clipped values sit exactly on the bound
    assert_agree(ref, got, np.float64)


@pytest.mark.parametrize("v1", [True, False])
def test_public_ops_on_cuda(v1):
    """ops.block_lstm(_v2) / block_lstm_grad(_v2) with backend="cuda": the ops' defaults reach the kernels."""
    rng = np.random.default_rng(3)
    T, B, I, C = 3, 2, 3, 2
    inp = make_inputs(rng, T, B, I, C, np.float32)
    up = make_upstream(rng, T, B, C, np.float32)
    args = [inp[k] for k in FORWARD_ARGS]
    fwd, grad = (ops.block_lstm, ops.block_lstm_grad) if v1 else (ops.block_lstm_v2, ops.block_lstm_grad_v2)
    outs = {be: fwd(2, *args, use_peephole=True, backend=be) for be in ("reference", "cuda")}
    grads = {be: grad(2, *args, *outs["reference"], up["cs_grad"], up["h_grad"], use_peephole=True, backend=be)
             for be in ("reference", "cuda")}
    ref = dict(zip(SAVED + GRADS, tuple(outs["reference"]) + tuple(grads["reference"])))
    got = dict(zip(SAVED + GRADS, tuple(outs["cuda"]) + tuple(grads["cuda"])))
    assert_agree(ref, got, np.float32)


# ----------------------------------------------------------------------------------------------
# edge cases, determinism, device arrays, launch counts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T, B, S", [(0, 2, 0), (3, 0, 2), (3, 2, 0)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_empty_shapes_and_no_steps(T, B, S, dtype):
    rng = np.random.default_rng(5)
    inp = make_inputs(rng, T, B, 2, 3, dtype)
    up = make_upstream(rng, T, B, 3, dtype)
    ref, got = run_both("ifco", S, inp, up, 0.0, 0.0, True)
    for name in SAVED + GRADS:
        assert got[name].shape == ref[name].shape and got[name].dtype == np.dtype(dtype), name
        assert not np.any(got[name]), name                   # nothing ran: every output and gradient is 0


def test_two_identical_calls_are_bit_identical():
    rng = np.random.default_rng(11)
    inp = make_inputs(rng, 4, 3, 3, 4, np.float32)
    up = make_upstream(rng, 4, 3, 4, np.float32)
    first = run_both("icfo", 4, inp, up, 1.0, 0.0, True)[1]
    second = run_both("icfo", 4, inp, up, 1.0, 0.0, True)[1]
    for name in SAVED + GRADS:
        assert first[name].tobytes() == second[name].tobytes(), name


def test_device_arrays_in_device_arrays_out():
    rng = np.random.default_rng(13)
    T, B, I, C, S = 3, 2, 2, 3, 2
    inp = make_inputs(rng, T, B, I, C, np.float64)
    up = make_upstream(rng, T, B, C, np.float64)
    d_args = [cuda.to_device(inp[k]) for k in FORWARD_ARGS]
    outs = ops.block_lstm(S, *d_args, use_peephole=True, backend="cuda")
    assert len(outs) == 7 and all(cuda.devicearray.is_cuda_ndarray(a) for a in outs)
    grads = ops.block_lstm_grad(S, *d_args, *outs, cuda.to_device(up["cs_grad"]), cuda.to_device(up["h_grad"]),
                                use_peephole=True, backend="cuda")
    assert len(grads) == 8 and all(cuda.devicearray.is_cuda_ndarray(a) for a in grads)
    ref_outs = ops.block_lstm(S, *[inp[k] for k in FORWARD_ARGS], use_peephole=True, backend="reference")
    ref_grads = ops.block_lstm_grad(S, *[inp[k] for k in FORWARD_ARGS], *ref_outs, up["cs_grad"], up["h_grad"],
                                    use_peephole=True, backend="reference")
    ref = dict(zip(SAVED + GRADS, tuple(ref_outs) + tuple(ref_grads)))
    got = dict(zip(SAVED + GRADS, [a.copy_to_host() for a in tuple(outs) + tuple(grads)]))
    assert_agree(ref, got, np.float64)


def test_launch_counts_per_step():
    """Forward: one fused launch per step; backward: pointwise + dh matvec = 2 per step."""
    rng = np.random.default_rng(17)
    inp = make_inputs(rng, 4, 2, 2, 3, np.float32)
    up = make_upstream(rng, 4, 2, 3, np.float32)
    run_both("ifco", 3, inp, up, 0.0, 0.0, False)
    logs = kernels.last_launch_count()
    assert (logs["forward"].steps, logs["forward"].per_step) == (3, 1)
    assert logs["forward"].by_kernel["block_lstm_forward_step"] == 3
    assert (logs["backward"].steps, logs["backward"].per_step) == (3, 2)
    assert logs["backward"].by_kernel["block_lstm_backward_step"] == 3
    assert logs["backward"].by_kernel["block_lstm_dh_prev"] == 3


# ----------------------------------------------------------------------------------------------
# bad input: the same error on both backends (SPEC 11)
# ----------------------------------------------------------------------------------------------
def _bad_cases():
    rng = np.random.default_rng(19)
    good = make_inputs(rng, 2, 2, 2, 3, np.float32)
    cases = {
        "x rank": dict(good, x=np.zeros((1, 1), np.float32)),
        "everything [1,1,1]": {k: np.zeros((1, 1, 1), np.float32) for k in good},
        "w shape": dict(good, w=np.zeros((4, 12), np.float32)),
        "b shape": dict(good, b=np.zeros(11, np.float32)),
        "wco shape": dict(good, wco=np.zeros(2, np.float32)),
        "h_prev shape": dict(good, h_prev=np.zeros((3, 3), np.float32)),
        "mixed dtype": dict(good, cs_prev=good["cs_prev"].astype(np.float64)),
        "int dtype": {k: v.astype(np.int32) for k, v in good.items()},
    }
    return [(name, 2, case) for name, case in cases.items()] + [("seq_len_max > T", 3, good),
                                                                ("seq_len_max < 0", -1, good),
                                                                ("seq_len_max array", np.array([1, 2]), good)]


@pytest.mark.parametrize("name, S, inp", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_same_error_on_both_backends(name, S, inp):
    errors = {}
    for be in ("reference", "cuda"):
        with pytest.raises((ValueError, TypeError)) as info:
            ops.block_lstm_v2(S, *[inp[k] for k in FORWARD_ARGS], backend=be)
        errors[be] = (type(info.value), str(info.value))
    assert errors["reference"] == errors["cuda"]


def test_bad_grad_input_same_error_on_both_backends():
    rng = np.random.default_rng(23)
    inp = make_inputs(rng, 2, 2, 2, 3, np.float64)
    saved = ops.block_lstm(2, *[inp[k] for k in FORWARD_ARGS], backend="reference")
    up = make_upstream(rng, 2, 2, 3, np.float64)
    bad_h_grad = up["h_grad"][:, :, :2]                       # [T, B, C-1]
    errors = {}
    for be in ("reference", "cuda"):
        with pytest.raises(ValueError) as info:
            ops.block_lstm_grad(2, *[inp[k] for k in FORWARD_ARGS], *saved, up["cs_grad"], bad_h_grad, backend=be)
        errors[be] = str(info.value)
    assert errors["reference"] == errors["cuda"] and errors["cuda"].startswith("h_grad")


# ----------------------------------------------------------------------------------------------
# specialisations for the kernel report
# ----------------------------------------------------------------------------------------------
def test_kernel_specs_cover_every_specialisation():
    specs = kernels.kernel_specs()
    keys = [(name, dtype) for name, dtype, *_ in specs]
    assert len(keys) == len(set(keys))                       # the registry keys on (name, dtype)
    for dtype in ("float16", "float32", "float64"):
        names = {name for name, dt, *_ in specs if dt == dtype}
        for layout in ("icfo", "ifco"):
            for peep in ("", "_peephole"):
                assert f"block_lstm_backward_step_{layout}{peep}" in names
                for clip in ("", "_clip"):
                    assert f"block_lstm_forward_step_{layout}{peep}{clip}" in names
            assert f"block_lstm_peephole_grads_{layout}" in names
        assert {"block_lstm_dh_prev", "block_lstm_bias_grad"} <= names
    for name, dtype, pyfunc, signature, block in specs:
        assert len(signature) == len(inspect.signature(pyfunc).parameters), name
        assert block == 128


def test_split_k_products_agree(monkeypatch):
    """BlockLSTM's GEMMs through split-K (allowed at these tiny shapes: one k-tile per slice) agree with the
    reference; stage 2 runs (counted in the launch log)."""
    from numbarnn.kernels import gemm
    monkeypatch.setattr(gemm, "SPLIT_MIN_K_TILES", 1)
    rng = np.random.default_rng(21)
    inp = make_inputs(rng, 4, 3, 3, 2, np.float32)          # x_grad = dgates w^T: M = 12, N = 3, K = 8
    up = make_upstream(rng, 4, 3, 2, np.float32)
    ref, got = run_both("icfo", 4, inp, up, 1.0, 0.0, True)
    assert_agree(ref, got, np.float32)
    assert driver.last_launch_count()["backward"].by_kernel.get("split_k_sum", 0) >= 1

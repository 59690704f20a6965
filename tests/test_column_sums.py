"""Bias-gradient column sums (numbarnn.kernels.layer_ops): v2 two-stage reduction against NumPy float64,
bit-for-bit reproducible and bit-for-bit equal to a NumPy replay of its fixed summation order; v1 kept."""
import numpy as np
import pytest
from numba import cuda

from numbarnn.kernels import layer_ops as LO
from numbarnn.kernels.common import acc_dtype, jit

TOL = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-14}   # relative to sum_r |x[r, c]| (float16 stored: 2**-11)
TC, TR, ROWS = LO.column_sums_config()


def run_v2(a, b=None):
    """(out [S, C] on the host, kernel names launched) of layer_ops.column_sums on device copies."""
    names = []

    def launch(kernel, name, grid, block, *args):
        kernel[grid, block](*args)
        names.append(name)

    S = 1 if b is None else 2
    out = cuda.to_device(np.full((S, a.shape[1]), np.nan, a.dtype))   # every entry must be written
    LO.column_sums(launch, cuda.to_device(a), None if b is None else cuda.to_device(b), out)
    return out.copy_to_host(), names


def replay(x):
    """column sums of x [N, C] in the exact order of v2 (stage 1 lanes, tree, then chunks), in the compute dtype."""
    t = acc_dtype(x.dtype).type
    N, C = x.shape
    chunks = max(1, -(-N // ROWS))
    partial = np.zeros((chunks, C), t)
    for chunk in range(chunks):
        lanes = np.zeros((TR, C), t)
        for ty in range(TR):
            for k in range(ROWS // TR):
                r = chunk * ROWS + ty + k * TR
                if r < N:
                    lanes[ty] = lanes[ty] + x[r].astype(t)
        half = TR // 2
        while half:
            lanes[:half] = lanes[:half] + lanes[half:2 * half]
            half //= 2
        partial[chunk] = lanes[0]
    total = np.zeros(C, t)
    for chunk in range(chunks):
        total = total + partial[chunk]
    return total.astype(x.dtype)


def check_close(out, x, dtype):
    ref = x.astype(np.float64).sum(axis=0)
    scale = np.abs(x.astype(np.float64)).sum(axis=0) + 1e-300
    err = np.max(np.abs(out.astype(np.float64) - ref) / scale) if x.shape[1] else 0.0
    assert err <= TOL[dtype], f"{dtype}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("N", [0, 1, ROWS - 1, ROWS, ROWS + 1, 3 * ROWS + 2])
def test_v2_two_sources_match_numpy_and_replay(dtype, N):
    """Rows not a multiple of the chunk (and 0, 1), columns not a multiple of the column tile."""
    assert ROWS % TR == 0 and ROWS > TR > 1   # several lanes per chunk and a tree of more than one level
    rng = np.random.default_rng(N)
    C = 2 * TC + 3
    a = rng.standard_normal((N, C)).astype(dtype)
    b = (100 * rng.standard_normal((N, C))).astype(dtype)
    out, names = run_v2(a, b)
    assert names == ["column_partials", "column_totals"]
    assert out.dtype == np.dtype(dtype) and out.shape == (2, C)
    for s, x in enumerate((a, b)):
        check_close(out[s], x, dtype)
        np.testing.assert_array_equal(out[s], replay(x))   # bit for bit: the summation order is fixed
    if N == 0:
        assert not out.any()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_v2_one_source_is_deterministic(dtype):
    """b = None sums a only (the cell vectors); two calls give the same bits."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((5 * ROWS + 3, TC + 1)) * 10.0 ** rng.integers(-6, 6, TC + 1)).astype(dtype)
    first, names = run_v2(a)
    second, _ = run_v2(a)
    assert names == ["column_partials", "column_totals"] and first.shape == (1, TC + 1)
    assert first.tobytes() == second.tobytes()
    check_close(first[0], a, dtype)
    np.testing.assert_array_equal(first[0], replay(a))


def test_v1_matches_numpy():
    """The one-thread-per-column version stays correct (kept for teaching, no longer launched)."""
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((7, 5)), rng.standard_normal((7, 5))
    out = cuda.to_device(np.zeros((2, 5)))
    jit(LO.make_column_sums, "float64")[3, 4](cuda.to_device(a), cuda.to_device(b), out)
    np.testing.assert_allclose(out.copy_to_host(), np.stack([a.sum(0), b.sum(0)]), rtol=1e-14)


def test_launch_sizes():
    """GPU: 32 x 8 threads per block, 256 rows per chunk; T*B = 3200 rows, G*H = 2048 columns, 2 sources."""
    assert LO.column_sums_launches(3200, 2048, 2, simulator=False) == [
        ("column_partials", (64, 13, 2), 256), ("column_totals", (16,), 256)]
    assert LO.column_sums_launches(0, 6, 1, simulator=False)[0] == ("column_partials", (1, 1, 1), 256)


def test_bad_out_shape():
    a = cuda.to_device(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4\), got \(1, 4\)"):
        LO.column_sums(None, a, a, cuda.to_device(np.zeros((1, 4), np.float32)))


def test_bad_config():
    with pytest.raises(ValueError, match="config: TR=3 must be a power of two"):
        LO.make_column_partials.__wrapped__("float32", 4, 3, 6)

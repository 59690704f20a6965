"""GEMM kernels v1..v4 (simulator) against numpy.matmul: dtypes, transposes, odd shapes, alpha/beta,
batches, strided views; bad input raises clear errors."""
import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda

from numbarnn.kernels import gemm as G

#: ||out - ref|| / ||ref|| against a float64 reference from the same (rounded) inputs (SPEC section 10)
RTOL = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}


def op(x, trans):  # x: [..., rows, cols]
    return np.swapaxes(x, -1, -2) if trans else x


def reference(a, b, c, alpha, beta, trans_a, trans_b):
    """alpha * op(A) @ op(B) + beta * C in float64; c None = zeros."""
    out = alpha * np.matmul(op(a.astype(np.float64), trans_a), op(b.astype(np.float64), trans_b))
    if c is not None and beta != 0:
        out = out + beta * c.astype(np.float64)
    return out


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    err = np.linalg.norm(out.astype(np.float64) - ref)
    scale = max(np.linalg.norm(ref), 1e-30)
    assert err / scale <= RTOL[dtype], f"relative error {err / scale:.3e} > {RTOL[dtype]:.0e} ({dtype})"


def operands(rng, dtype, Z, M, N, K, trans_a, trans_b):
    """a: [Z?, M, K] or [Z?, K, M]; b: [Z?, K, N] or [Z?, N, K]; c: [Z?, M, N]."""
    batch = (Z,) if Z else ()
    a = rng.standard_normal(batch + ((K, M) if trans_a else (M, K))).astype(dtype)
    b = rng.standard_normal(batch + ((N, K) if trans_b else (K, N))).astype(dtype)
    c = rng.standard_normal(batch + (M, N)).astype(dtype)
    return a, b, c


dims = st.integers(1, 13)
scalars = st.sampled_from([1.0, 0.0, -0.5, 2.0, 0.25])


@given(version=st.sampled_from(sorted(G.VERSIONS)), dtype=st.sampled_from(G.DTYPES),
       trans_a=st.booleans(), trans_b=st.booleans(), M=dims, N=dims, K=dims,
       alpha=scalars, beta=scalars, Z=st.sampled_from([0, 0, 1, 3]), seed=st.integers(0, 2**16))
def test_matches_numpy(version, dtype, trans_a, trans_b, M, N, K, alpha, beta, Z, seed):
    rng = np.random.default_rng(seed)
    a, b, c = operands(rng, dtype, Z, M, N, K, trans_a, trans_b)
    out = G.matmul(a, b, c, alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b, version=version)
    assert out.dtype == np.dtype(dtype)
    assert_close(out, reference(a, b, c, alpha, beta, trans_a, trans_b), dtype)


@given(version=st.sampled_from(sorted(G.VERSIONS)), dtype=st.sampled_from(G.DTYPES),
       trans_a=st.booleans(), trans_b=st.booleans(), M=dims, N=dims, K=dims,
       batched=st.booleans(), step=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_strided_device_views(version, dtype, trans_a, trans_b, M, N, K, batched, step, seed):
    """Operands and C are slices (offset + step) of larger device arrays: strides come from the views."""
    rng = np.random.default_rng(seed)
    Z = 2 if batched else 0
    a, b, c = operands(rng, dtype, Z, M, N, K, trans_a, trans_b)

    def embed(x):  # a device view equal to x inside a bigger array
        rows, cols = x.shape[-2:]
        big = rng.standard_normal(x.shape[:-2] + (1 + step * rows, 2 + step * cols)).astype(dtype)
        index = (slice(None),) * (x.ndim - 2) + (slice(1, 1 + step * rows, step), slice(2, 2 + step * cols, step))
        big[index] = x
        return cuda.to_device(big)[index], big

    d_a, _ = embed(a)
    d_b, _ = embed(b)
    d_c, _ = embed(c)
    G.gemm(d_a, d_b, d_c, alpha=1.5, beta=-1.0, trans_a=trans_a, trans_b=trans_b, version=version)
    cuda.synchronize()
    host = d_c.copy_to_host()
    assert_close(host, reference(a, b, c, 1.5, -1.0, trans_a, trans_b), dtype)


@pytest.mark.parametrize("version", sorted(G.VERSIONS))
def test_transposed_views_are_free(version):
    """A^T given as a transposed device view with trans_a=True is A again: no copy, same result."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 7)).astype(np.float32)  # [M, K]
    b = rng.standard_normal((7, 6)).astype(np.float32)  # [K, N]
    d_at = cuda.to_device(np.ascontiguousarray(a.T)).T  # view [M, K] of a [K, M] buffer
    d_bt = cuda.to_device(np.ascontiguousarray(b.T))    # [N, K]
    d_c = cuda.device_array((5, 6), np.float32)
    G.gemm(d_at, d_bt, d_c, trans_b=True, version=version)
    assert_close(d_c.copy_to_host(), a.astype(np.float64) @ b, "float32")
    d_c2 = cuda.device_array((5, 6), np.float32)
    G.gemm(d_at.T, d_bt, d_c2, trans_a=True, trans_b=True, version=version)  # op(A) = (A^T)^T
    assert_close(d_c2.copy_to_host(), a.astype(np.float64) @ b, "float32")


@pytest.mark.parametrize("version", sorted(G.VERSIONS))
def test_beta_zero_never_reads_c(version):
    """BLAS rule: beta == 0 makes C write-only, so NaN in an uninitialised C does not leak."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 6, 5))
    b = rng.standard_normal((2, 5, 9))
    c = np.full((2, 6, 9), np.nan)
    out = G.matmul(a, b, c, alpha=0.5, beta=0.0, version=version)
    assert_close(out, 0.5 * np.matmul(a, b), "float64")


@pytest.mark.parametrize("version,shape", [(1, (17, 5, 6)), (2, (17, 5, 20)), (3, (65, 7, 9)), (4, (130, 5, 9))])
def test_gpu_tiles(version, shape):
    """The tile sizes used on a real GPU (bigger blocks) are correct too, across block and k-tile edges."""
    M, N, K = shape
    rng = np.random.default_rng(3)
    a, b, c = operands(rng, "float32", 0, M, N, K, True, False)
    cfg = G.VERSIONS[version].gpu_config
    out = G.matmul(a, b, c, alpha=1.0, beta=1.0, trans_a=True, version=version, config=cfg)
    assert_close(out, reference(a, b, c, 1.0, 1.0, True, False), "float32")


def test_float16_accumulates_in_float32():
    """sum_k 1 * (1 + 2**-10) over K = 12: exact in float32, then rounded once to half on the store.
    A half accumulator rounds at every step (from 3 on the spacing of half is 2**-9) and ends elsewhere."""
    K = 12
    a = np.ones((1, K), np.float16)
    b = np.full((K, 1), 1 + 2**-10, np.float16)  # exactly representable in half
    for version in G.VERSIONS:
        out = G.matmul(a, b, version=version)
        exact = np.float16(np.float32(K * (1 + 2**-10)))
        assert out[0, 0] == exact, (version, out[0, 0], exact)


@pytest.mark.parametrize("dtype", G.DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, True), (False, True), (True, False)])
def test_v4_double_buffer_edges(dtype, trans_a, trans_b):
    """v4 against v3 and NumPy at K around its k-tile (simulator BK = 2): K = 0 (no k-tile: C = beta C),
    1 (only the prologue's tile, partly outside), BK (one full tile), BK + 1 and 3 BK + 1 (the prefetch of a
    partial last tile into the other buffer); M, N not multiples of BM, BN (partial blocks on both edges)."""
    BM, BN, BK, TM, TN = G.VERSIONS[4].sim_config
    assert TM != TN and BM != BN  # a non-square micro-tile and block catch swapped row/column indices
    rng = np.random.default_rng(7)
    M, N = BM + 3, 2 * BN + 1
    for K in (0, 1, BK, BK + 1, 3 * BK + 1):
        a, b, c = operands(rng, dtype, 2, M, N, K, trans_a, trans_b)
        ref = reference(a, b, c, -1.5, 0.5, trans_a, trans_b)
        out4 = G.matmul(a, b, c, alpha=-1.5, beta=0.5, trans_a=trans_a, trans_b=trans_b, version=4)
        out3 = G.matmul(a, b, c, alpha=-1.5, beta=0.5, trans_a=trans_a, trans_b=trans_b, version=3)
        if K == 0:
            np.testing.assert_array_equal(out4, (np.asarray(0.5, dtype) * c).astype(dtype))
        assert_close(out4, ref, dtype)
        assert_close(out3, ref, dtype)


def test_default_version_is_v4():
    """The gemm entry point (so the RNN and BlockLSTM drivers) runs v4 unless a version is given."""
    assert G.DEFAULT_VERSION == 4
    assert inspect.signature(G.gemm).parameters["version"].default is None
    calls = []
    real = G.get_kernel

    def spy(version, *args, **kw):
        calls.append(version)
        return real(version, *args, **kw)

    G.get_kernel = spy
    try:
        G.matmul(np.ones((2, 3)), np.ones((3, 2)))
        G.matmul(np.ones((2, 3)), np.ones((3, 2)), version=3)
    finally:
        G.get_kernel = real
    assert calls == [4, 3]


def test_kernels_are_cached():
    k1 = G.get_kernel(3, "float32", True, False, False)
    k2 = G.get_kernel(3, "float32", True, False, False)
    assert k1 is k2
    assert G.get_kernel(3, "float32", False, False, False) is not k1


def test_every_version_says_what_changed():
    for number, v in G.VERSIONS.items():
        src = inspect.getsource(v.make_pyfunc).splitlines()
        first_comment = next(line.strip() for line in src if line.strip().startswith("#"))
        assert first_comment.startswith(f"# v{number} "), first_comment


def test_kernel_specs_cover_all_specialisations():
    specs = G.kernel_specs()
    keys = {(name, dtype) for name, dtype, *_ in specs}
    # every version x dtype x trans_a x trans_b x batched, plus split-K: v4 stage 1 per trans pair and the
    # stage 2 sum, for float32 and float64
    assert len(specs) == len(keys) == len(G.VERSIONS) * 3 * 2 * 2 * 2 + 2 * (4 + 1)
    assert len(G.VERSIONS) == 4
    for name, dtype, pyfunc, sig, block in specs:
        assert inspect.isfunction(pyfunc)  # the plain Python function, nothing compiled
        if name == "split_k_sum":
            assert len(sig) == 3 and block == G.SPLIT_SUM_THREADS
        else:
            assert len(sig) == 8 and block == G.VERSIONS[int(name[6])].threads(G.VERSIONS[int(name[6])].gpu_config)
    assert {n for n, *_ in specs if n.endswith("_splitk")} == {"gemm_v4_nn_splitk", "gemm_v4_nt_splitk",
                                                              "gemm_v4_tn_splitk", "gemm_v4_tt_splitk"}


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def dev(*shape, dtype=np.float32):
    return cuda.to_device(np.zeros(shape, dtype))


@pytest.mark.parametrize("a,b,c,kw,match", [
    ((3, 4), (5, 2), (3, 2), {}, r"b: expected \[K, N\] with K = 4"),
    ((3, 4), (4, 2), (3, 3), {}, r"c: expected shape \[M, N\] = \(3, 2\), got \(3, 3\)"),
    ((3, 4), (4, 2), (2, 3), {"trans_a": True}, r"b: expected \[K, N\] with K = 3"),
    ((3, 4), (2, 4), (3, 2), {"trans_b": False}, r"b: expected \[K, N\] with K = 4"),
    ((3, 4), (4, 2), (2, 2), {"trans_b": True}, r"b: expected \[N, K\] with K = 4"),
    ((4,), (4, 2), (1, 2), {}, r"a: expected rank 2 .* or 3 .*, got rank 1"),
    ((2, 3, 4), (4, 2), (2, 3, 2), {}, r"b: expected rank 3 like a"),
    ((2, 3, 4), (3, 4, 2), (2, 3, 2), {}, r"b: expected batch size Z = 2"),
    ((2, 3, 4), (2, 4, 2), (3, 2), {}, r"c: expected shape \[Z, M, N\] = \(2, 3, 2\)"),
    ((1, 1, 3, 4), (4, 2), (3, 2), {}, r"a: expected rank 2"),
])
def test_bad_shapes(a, b, c, kw, match):
    with pytest.raises(ValueError, match=match):
        G.gemm(dev(*a), dev(*b), dev(*c), **kw)
    with pytest.raises(ValueError, match=match):
        G.matmul(np.zeros(a, np.float32), np.zeros(b, np.float32), np.zeros(c, np.float32), **kw)


def test_bad_arguments():
    a, b, c = dev(3, 4), dev(4, 2), dev(3, 2)
    with pytest.raises(TypeError, match="b: expected dtype float32"):
        G.gemm(a, dev(4, 2, dtype=np.float64), c)
    with pytest.raises(TypeError, match="a: expected dtype float16, float32 or float64, got int32"):
        G.gemm(dev(3, 4, dtype=np.int32), dev(4, 2, dtype=np.int32), dev(3, 2, dtype=np.int32))
    with pytest.raises(TypeError, match="a: expected a device array"):
        G.gemm(np.zeros((3, 4), np.float32), b, c)
    with pytest.raises(ValueError, match=r"version: expected one of \[1, 2, 3, 4\], got 5"):
        G.gemm(a, b, c, version=5)
    with pytest.raises(TypeError, match="trans_a: expected True or False"):
        G.gemm(a, b, c, trans_a=1)
    with pytest.raises(TypeError, match="alpha: expected a real number"):
        G.gemm(a, b, c, alpha="1")
    with pytest.raises(ValueError, match="beta: expected a finite number"):
        G.gemm(a, b, c, beta=float("nan"))
    with pytest.raises(ValueError, match="config: the tiles"):
        G.make_gemm_v3_pyfunc("float32", False, False, False, 8, 8, 1, 1, 1)
    with pytest.raises(ValueError, match="config: BM=8 must be a multiple of TM=3"):
        G.make_gemm_v3_pyfunc("float32", False, False, False, 8, 8, 4, 3, 2)
    with pytest.raises(ValueError, match="config: the tiles"):
        G.make_gemm_v4_pyfunc("float32", False, False, False, 8, 8, 1, 1, 1)
    with pytest.raises(ValueError, match="config: BM=8 must be a multiple of TM=3"):
        G.make_gemm_v4_pyfunc("float32", False, False, False, 8, 8, 4, 3, 2)


def test_empty_output_is_a_no_op():
    c = dev(0, 3)
    assert G.gemm(dev(0, 4), dev(4, 3), c) is c


# ------------------------------------------------------------------------------------------------
# split-K (v4 stage 1 over K slices + the fixed-order stage 2 sum)
# ------------------------------------------------------------------------------------------------
class Counter:
    def __init__(self):
        self.by_kernel = {}

    def count(self, name):
        self.by_kernel[name] = self.by_kernel.get(name, 0) + 1


@given(dtype=st.sampled_from(G.SPLIT_DTYPES), trans_a=st.booleans(), trans_b=st.booleans(),
       M=st.integers(1, 9), N=st.integers(1, 9), K=st.integers(1, 24), split=st.integers(2, 7), alpha=scalars,
       beta=scalars, seed=st.integers(0, 2**16))
def test_split_k_matches_numpy(dtype, trans_a, trans_b, M, N, K, split, alpha, beta, seed):
    """Any number of slices, also more than K has k-tiles (empty slices add zeros), any alpha and beta."""
    rng = np.random.default_rng(seed)
    a, b, c = operands(rng, dtype, 0, M, N, K, trans_a, trans_b)
    d_c, log = cuda.to_device(c), Counter()
    G.gemm(cuda.to_device(a), cuda.to_device(b), d_c, alpha=alpha, beta=beta, trans_a=trans_a, trans_b=trans_b,
           split_k=split, log=log)
    assert log.by_kernel == {"gemm": 1, "split_k_sum": 1}
    assert_close(d_c.copy_to_host(), reference(a, b, c, alpha, beta, trans_a, trans_b), dtype)


def test_split_k_is_deterministic_and_uses_the_given_scratch():
    rng = np.random.default_rng(4)
    a, b, c = operands(rng, "float32", 0, 9, 5, 33, True, False)
    d_a, d_b = cuda.to_device(a), cuda.to_device(b)
    asked = []

    def scratch(name, shape, dtype):
        asked.append((name, shape, str(np.dtype(dtype))))
        return cuda.to_device(np.full(shape, np.nan, dtype))     # garbage: stage 1 writes every element

    runs = []
    for _ in range(2):
        d_c = cuda.to_device(c)
        G.gemm(d_a, d_b, d_c, beta=1.0, trans_a=True, split_k=4, scratch=scratch)
        runs.append(d_c.copy_to_host())
    assert runs[0].tobytes() == runs[1].tobytes()
    assert asked == [("split_k_partials", (4, 9, 5), "float32")] * 2
    assert_close(runs[0], reference(a, b, c, 1.0, 1.0, True, False), "float32")


def test_split_k_for_known_answers():
    gpu = G.VERSIONS[4].gpu_config                   # 128 x 128 tiles, BK = 4
    # H100 (132 SMs), LSTM H=768 B=16 T=8: dx = dgx W is M = 128, N = 768, K = 3072: 6 tiles -> 22 slices
    assert G.split_k_for(128, 768, 3072, gpu, 132) == 22
    # enough tiles already (the input projection at T*B = 16384): no split
    assert G.split_k_for(16384, 3072, 768, gpu, 132) == 1
    # a short K keeps SPLIT_MIN_K_TILES k-tiles per slice: K = 256 is 64 k-tiles -> at most 4 slices
    assert G.split_k_for(128, 128, 256, gpu, 132) == 4
    assert G.split_k_for(128, 128, 60, gpu, 132) == 1
    assert G.sm_count(simulator=True) == G.SIM_SMS and G.sm_count(simulator=False) == G.MODEL_SMS
    # a process without the simulator and maybe without a GPU: the device's count, or the model's without one
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", "from numbarnn.kernels import gemm; print(gemm.sm_count())"],
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and int(out.stdout) > 0, out.stderr


def test_split_k_automatic_only_where_it_applies(monkeypatch):
    """split_k=None splits v4 2-D float32/float64 products with few tiles and a long K; never float16 (its
    partials would round to half), batched products or other versions."""
    monkeypatch.setattr(G, "SPLIT_MIN_K_TILES", 1)
    rng = np.random.default_rng(5)
    for dtype, version, Z, splits in (("float32", 4, 0, True), ("float64", 4, 0, True), ("float16", 4, 0, False),
                                      ("float32", 3, 0, False), ("float32", 4, 2, False)):
        a, b, c = operands(rng, dtype, Z, 5, 3, 16, False, False)
        d_c, log = cuda.to_device(c), Counter()
        G.gemm(cuda.to_device(a), cuda.to_device(b), d_c, beta=0.5, version=version, log=log)
        assert ("split_k_sum" in log.by_kernel) == splits, (dtype, version, Z)
        assert_close(d_c.copy_to_host(), reference(a, b, c, 1.0, 0.5, False, False), dtype)


def test_split_k_bad_arguments():
    a, b, c = dev(3, 4), dev(4, 2), dev(3, 2)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="split_k: expected None or an integer >= 1"):
            G.gemm(a, b, c, split_k=bad)
    with pytest.raises(ValueError, match="split_k: split-K runs with version 4, 2-D operands and float32/float64"):
        G.gemm(dev(3, 4, dtype=np.float16), dev(4, 2, dtype=np.float16), dev(3, 2, dtype=np.float16), split_k=2)
    with pytest.raises(ValueError, match="split_k: split-K runs with version 4"):
        G.gemm(a, b, c, split_k=2, version=3)
    with pytest.raises(ValueError, match="split_k: split-K runs with version 4.*batched"):
        G.gemm(dev(2, 3, 4), dev(2, 4, 2), dev(2, 3, 2), split_k=2)
    with pytest.raises(ValueError, match="split: split-K uses grid dimension z"):
        G.make_gemm_v4_pyfunc("float32", False, False, True, 8, 4, 2, 4, 2, split=True)

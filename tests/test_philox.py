"""Philox4x32-10 and the dropout keep-mask (SPEC section 6): reference, device functions, kernel."""
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import example, given, strategies as st
from numba import cuda

from numbarnn.kernels import philox as kphilox
from numbarnn.reference import philox as rphilox

# Random123 known answers: (counter, key, result)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


# ---------------------------------------------------------------------------------------------
# known answers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_reference_known_answers(counter, key, expected):
    got = rphilox.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))   # [4]
    assert got.dtype == np.uint32
    assert tuple(int(v) for v in got) == expected


def test_reference_batched_and_broadcast():
    counter = np.array([c for c, _, _ in KNOWN_ANSWERS], np.uint32)     # [3, 4]
    key = np.array([k for _, k, _ in KNOWN_ANSWERS], np.uint32)         # [3, 2]
    expected = np.array([e for _, _, e in KNOWN_ANSWERS], np.uint32)    # [3, 4]
    np.testing.assert_array_equal(rphilox.philox4x32_10(counter, key), expected)
    # one key broadcast over a batch of counters [2, 3, 4]
    ctrs = np.arange(24, dtype=np.uint32).reshape(2, 3, 4)
    k = np.array([7, 9], np.uint32)
    got = rphilox.philox4x32_10(ctrs, k)
    assert got.shape == (2, 3, 4)
    for idx in np.ndindex(2, 3):
        np.testing.assert_array_equal(got[idx], rphilox.philox4x32_10(ctrs[idx], k))


def test_reference_rejects_bad_words():
    with pytest.raises(ValueError, match="counter"):
        rphilox.philox4x32_10(np.zeros(3, np.uint32), np.zeros(2, np.uint32))
    with pytest.raises(ValueError, match="key"):
        rphilox.philox4x32_10(np.zeros(4, np.uint32), np.zeros(4, np.uint32))
    with pytest.raises(ValueError, match="counter"):
        rphilox.philox4x32_10(np.array([-1, 0, 0, 0]), np.zeros(2, np.uint32))
    with pytest.raises(TypeError, match="key"):
        rphilox.philox4x32_10(np.zeros(4, np.uint32), np.zeros(2, np.float32))


@cuda.jit
def _philox_test_kernel(
    counter,  # [N, 4] uint32
    key,      # [N, 2] uint32
    out,      # [N, 4] uint32 (written)
):
    i = cuda.grid(1)
    if i < out.shape[0]:
        x0, x1, x2, x3 = kphilox.philox4x32_10(counter[i, 0], counter[i, 1], counter[i, 2], counter[i, 3],
                                               key[i, 0], key[i, 1])
        out[i, 0] = x0
        out[i, 1] = x1
        out[i, 2] = x2
        out[i, 3] = x3


def test_device_known_answers():
    counter = np.array([c for c, _, _ in KNOWN_ANSWERS], np.uint32)     # [3, 4]
    key = np.array([k for _, k, _ in KNOWN_ANSWERS], np.uint32)         # [3, 2]
    expected = np.array([e for _, _, e in KNOWN_ANSWERS], np.uint32)    # [3, 4]
    out = cuda.device_array((3, 4), np.uint32)
    _philox_test_kernel[1, 4](cuda.to_device(counter), cuda.to_device(key), out)
    np.testing.assert_array_equal(out.copy_to_host(), expected)


# ---------------------------------------------------------------------------------------------
# threshold and key
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, expected", [
    (0.0, 0),
    (1.0, 2 ** 24),
    (0.5, 2 ** 23),
    (0.25, 2 ** 22),
    (0.1, 1677722),               # 0.1 * 2**24 = 1677721.6000000000931... -> ceil
    (2.0 ** -24, 1),
    (2.0 ** -24 + 2.0 ** -60, 2),  # just above one step: exact ceil, not float rounding
    (5e-324, 1),                  # smallest subnormal
    (1.0 - 2.0 ** -53, 2 ** 24),  # just below 1: ceil(2**24 - 2**-29)
    (np.float32(0.3), 5033165),   # float32 value read exactly: 0.300000011920928955078125 * 2**24 = 5033165.0
])
def test_dropout_threshold(p, expected):
    got = rphilox.dropout_threshold(p)
    assert isinstance(got, int)
    assert got == expected


@pytest.mark.parametrize("p", [-1e-9, 1.0000001, float("nan"), float("inf")])
def test_dropout_threshold_rejects_out_of_range(p):
    with pytest.raises(ValueError, match="p"):
        rphilox.dropout_threshold(p)


def test_dropout_threshold_rejects_non_numbers():
    with pytest.raises(TypeError, match="p"):
        rphilox.dropout_threshold("0.5")


@pytest.mark.parametrize("seed, seed2, expected", [
    (0, 0, (0, 0)),
    (1, 2, (2, 1)),
    (-1, -2, (2 ** 32 - 2, 2 ** 32 - 1)),
    (2 ** 32 + 5, 2 ** 32 - 1, (2 ** 32 - 1, 5)),
    (np.int64(-(2 ** 63)), np.uint64(2 ** 64 - 1), (2 ** 32 - 1, 0)),
])
def test_dropout_key(seed, seed2, expected):
    assert rphilox.dropout_key(seed, seed2) == expected


def test_dropout_key_rejects_non_integers():
    with pytest.raises(TypeError, match="seed"):
        rphilox.dropout_key(1.0, 2)
    with pytest.raises(TypeError, match="seed2"):
        rphilox.dropout_key(1, True)


# ---------------------------------------------------------------------------------------------
# reference mask: layout and statistics
# ---------------------------------------------------------------------------------------------

def _scalar_keep(seed, seed2, layer, T, B, W, p, t, b, j):
    """The SPEC formula for one element, with Python integers (p * 2**24 is exact for a float p)."""
    k0, k1 = seed2 % 2 ** 32, seed % 2 ** 32
    n = (((layer - 1) * T + t) * B + b) * W + j
    q = n // 4
    x = int(rphilox.philox4x32_10(np.array([q % 2 ** 32, q >> 32, 0, 0], np.uint64),
                                  np.array([k0, k1], np.uint64))[n % 4])
    return (x >> 8) >= min(2 ** 24, math.ceil(p * 2 ** 24))


@pytest.mark.parametrize("seed, seed2, layer, T, B, W, p", [
    (0, 0, 1, 2, 3, 4, 0.5),
    (-7, 2 ** 32 + 3, 3, 3, 2, 5, 0.3),
    (123456789, 987654321, 2, 1, 4, 6, 0.9),
])
def test_reference_mask_matches_scalar_formula(seed, seed2, layer, T, B, W, p):
    mask = rphilox.dropout_keep_mask(seed, seed2, layer, T, B, W, p)
    assert mask.dtype == np.bool_ and mask.shape == (T, B, W)
    for t, b, j in np.ndindex(T, B, W):
        assert bool(mask[t, b, j]) == _scalar_keep(seed, seed2, layer, T, B, W, p, t, b, j), (t, b, j)


def test_reference_counter_hi_word():
    """n // 4 >= 2**32 puts hi32(n // 4) in counter word 1 (hand-computed cases)."""
    seed, seed2 = 11, 22
    k = np.array([22, 11], np.uint32)                      # key (seed2, seed)

    def philox(lo, hi):
        return rphilox.philox4x32_10(np.array([lo, hi, 0, 0], np.uint32), k)   # [4]

    # T = B = 1, W = 1: n = layer - 1.  n = 4 * (2**32 + 5) + 2 -> counter (5, 1, 0, 0), lane 2
    n = 4 * (2 ** 32 + 5) + 2
    x = rphilox.dropout_random_bits(seed, seed2, n + 1, 1, 1, 1)[0, 0, 0]
    assert x == philox(5, 1)[2]
    assert x != philox(5, 0)[2]                            # the hi word matters
    thr = rphilox.dropout_threshold(0.5)
    assert bool(rphilox.dropout_keep_mask(seed, seed2, n + 1, 1, 1, 1, 0.5)[0, 0, 0]) == ((int(x) >> 8) >= thr)
    # T = B = 1, W = 6: n = (layer - 1) * 6 + j; layer - 1 = (2**34 - 4) / 6 gives n = 2**34 - 4 .. 2**34 + 1,
    # i.e. counter 2**32 - 1 = (0xFFFFFFFF, 0) lanes 0..3, then counter 2**32 = (0, 1) lanes 0, 1
    assert (2 ** 34 - 4) % 6 == 0
    row = rphilox.dropout_random_bits(seed, seed2, (2 ** 34 - 4) // 6 + 1, 1, 1, 6)[0, 0]   # [6]
    np.testing.assert_array_equal(row[:4], philox(0xFFFFFFFF, 0))
    np.testing.assert_array_equal(row[4:], philox(0, 1)[:2])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_reference_keep_fraction(p):
    T, B, W = 16, 32, 256          # 131072 elements
    mask = rphilox.dropout_keep_mask(3, 4, 2, T, B, W, p)
    expected = 1.0 - rphilox.dropout_threshold(p) / 2 ** 24
    sigma = np.sqrt(p * (1 - p) / mask.size)
    assert abs(mask.mean() - expected) < 6 * sigma
    # different layers and seeds give different masks
    assert not np.array_equal(mask, rphilox.dropout_keep_mask(3, 4, 3, T, B, W, p))
    assert not np.array_equal(mask, rphilox.dropout_keep_mask(4, 3, 2, T, B, W, p))


def test_reference_p_edges():
    assert rphilox.dropout_keep_mask(1, 2, 1, 4, 5, 6, 0.0).all()
    assert not rphilox.dropout_keep_mask(1, 2, 1, 4, 5, 6, 1.0).any()


def test_reference_mask_is_deterministic_and_layers_tile():
    """Layer l's elements continue where layer l-1's stopped (n runs over all layers)."""
    a = rphilox.dropout_random_bits(5, 6, 1, 2, 3, 4).ravel()
    b = rphilox.dropout_random_bits(5, 6, 2, 2, 3, 4).ravel()
    both = rphilox.dropout_random_bits(5, 6, 1, 4, 3, 4).ravel()   # T doubled: layer 1 spans 2 layers' n
    np.testing.assert_array_equal(np.concatenate([a, b]), both)
    np.testing.assert_array_equal(a, rphilox.dropout_random_bits(5, 6, 1, 2, 3, 4).ravel())


@pytest.mark.parametrize("kwargs, exc", [
    (dict(layer=0), ValueError),
    (dict(T=-1), ValueError),
    (dict(layer=1.0), TypeError),
    (dict(p=1.5), ValueError),
    (dict(layer=2 ** 62, T=4, B=4, W=4), ValueError),   # n would not fit in uint64
])
def test_mask_rejects_bad_arguments(kwargs, exc):
    args = dict(seed=1, seed2=2, layer=1, T=2, B=2, W=2, p=0.5)
    args.update(kwargs)
    with pytest.raises(exc):
        rphilox.dropout_keep_mask(**args)
    with pytest.raises(exc):
        kphilox.dropout_keep_mask(**args)


def test_reference_empty_mask():
    assert rphilox.dropout_keep_mask(1, 2, 1, 0, 3, 4, 0.5).shape == (0, 3, 4)


# ---------------------------------------------------------------------------------------------
# device mask == reference mask, bit for bit
# ---------------------------------------------------------------------------------------------

_seeds = st.one_of(
    st.integers(-(2 ** 63), 2 ** 63 - 1),
    st.sampled_from([0, 1, -1, 2 ** 31 - 1, -(2 ** 31), 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 1, -(2 ** 32),
                     2 ** 63 - 1, -(2 ** 63)]),
)
_layers = st.one_of(st.integers(1, 4), st.integers(2 ** 30, 2 ** 40))   # large: n // 4 >= 2**32
_ps = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0))


@given(seed=_seeds, seed2=_seeds, layer=_layers, T=st.integers(1, 4), B=st.integers(1, 5),
       W=st.integers(1, 8), p=_ps)
@example(seed=2 ** 32 - 1, seed2=-1, layer=2 ** 40, T=2, B=3, W=4, p=0.0)
@example(seed=-(2 ** 32), seed2=2 ** 32 + 1, layer=3, T=2, B=3, W=4, p=1.0)
@example(seed=-5, seed2=2 ** 63 - 1, layer=(2 ** 34 - 4) // 6 + 1, T=1, B=2, W=6, p=0.5)
def test_device_mask_matches_reference(seed, seed2, layer, T, B, W, p):
    expected = rphilox.dropout_keep_mask(seed, seed2, layer, T, B, W, p)          # [T, B, W] bool
    out = kphilox.dropout_keep_mask(seed, seed2, layer, T, B, W, p)               # [T, B, W] uint8
    got = out.copy_to_host()
    assert got.dtype == np.uint8 and got.shape == (T, B, W)
    assert set(np.unique(got)) <= {0, 1}
    np.testing.assert_array_equal(got.astype(bool), expected)


def test_device_mask_p_edges_and_out_argument():
    out = cuda.to_device(np.full((2, 3, 4), 7, np.uint8))
    assert kphilox.dropout_keep_mask(9, 8, 2, 2, 3, 4, 0.0, out=out) is out
    assert np.all(out.copy_to_host() == 1)
    kphilox.dropout_keep_mask(9, 8, 2, 2, 3, 4, 1.0, out=out)
    assert np.all(out.copy_to_host() == 0)
    # counters straddling 2**32 (hi word), through the kernel
    layer = (4 * (2 ** 32 - 1) - 4) // 8 + 1
    got = kphilox.dropout_keep_mask(11, 22, layer, 1, 2, 8, 0.5).copy_to_host().astype(bool)
    np.testing.assert_array_equal(got, rphilox.dropout_keep_mask(11, 22, layer, 1, 2, 8, 0.5))
    # empty: nothing launched
    assert kphilox.dropout_keep_mask(1, 2, 1, 0, 2, 3, 0.5).shape == (0, 2, 3)


def test_threshold_compare_is_inclusive():
    """keep iff (x >> 8) >= threshold: an element whose 24 bits equal the threshold is kept (both backends)."""
    seed, seed2, layer, T, B, W = 3, 1, 2, 2, 2, 3
    x = rphilox.dropout_random_bits(seed, seed2, layer, T, B, W)          # [T, B, W] uint32
    u = int(x[1, 1, 2]) >> 8
    assert 0 < u < 2 ** 24 - 1
    for p, kept in [(u / 2 ** 24, True), ((u + 1) / 2 ** 24, False)]:   # exact dyadic p: threshold u, u + 1
        assert rphilox.dropout_threshold(p) == (u if kept else u + 1)
        assert bool(rphilox.dropout_keep_mask(seed, seed2, layer, T, B, W, p)[1, 1, 2]) == kept
        got = kphilox.dropout_keep_mask(seed, seed2, layer, T, B, W, p).copy_to_host()
        assert bool(got[1, 1, 2]) == kept


def test_device_mask_rejects_bad_out():
    with pytest.raises(ValueError, match="out"):
        kphilox.dropout_keep_mask(1, 2, 1, 2, 3, 4, 0.5, out=cuda.device_array((2, 3, 5), np.uint8))
    with pytest.raises(TypeError, match="out"):
        kphilox.dropout_keep_mask(1, 2, 1, 2, 3, 4, 0.5, out=cuda.device_array((2, 3, 4), np.float32))


# ---------------------------------------------------------------------------------------------
# real-GPU compilation (no simulator, no GPU needed)
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent("""
    from numba import cuda
    from numbarnn.kernels import philox

    # plain compile_ptx, as the kernel report does it: no GPU, no driver, no stand-in device
    for cc in [(8, 0), (9, 0)]:
        assert philox.KERNEL_SPECS
        for name, dtype, pyfunc, sig, block in philox.KERNEL_SPECS:
            ptx, resty = cuda.compile_ptx(pyfunc, sig, cc=cc)
            assert ".entry" in ptx, name
            assert "f64" not in ptx, (name, "integer code promoted to float64")
            print("ok", name, cc, len(ptx))
        ptx, resty = cuda.compile_ptx(philox.philox4x32_10.py_func,
                                      "UniTuple(uint32, 4)(uint32, uint32, uint32, uint32, uint32, uint32)",
                                      device=True, cc=cc)
        assert str(resty) == "UniTuple(uint32 x 4)" and "f64" not in ptx, resty
        ptx, resty = cuda.compile_ptx(philox.dropout_keep.py_func, "boolean(uint64, uint32, uint32, uint32)",
                                      device=True, cc=cc)
        assert str(resty) == "bool" and "f64" not in ptx, resty
    print("all compiled")
""")


@pytest.mark.compile
def test_kernels_compile_for_real_gpu():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all compiled" in res.stdout

"""numbarnn/cpu/jitcache.py: numba's on-disk cache with its index locked across processes."""
from __future__ import annotations

import numpy as np
import pytest

from numbarnn.cells import get_cell
from numbarnn.cpu import block_lstm, cells, fused, jitcache, microkernel, network


def test_processes_saving_at_once_file_every_key_under_its_own_data(tmp_path):
    """3 processes x 150 keys into one index at once: every key loads back its own data, none lost.  (numba's
    own class in the same race, `python -m numbarnn.cpu.jitcache`, three runs here: 9, 14 and 20 of 300 keys
    loaded another key's data.)"""
    if jitcache.fcntl is None:
        pytest.skip("no fcntl on this platform: the cache is numba's own, unlocked")
    assert jitcache.race(jitcache.LockedCacheFile, str(tmp_path), processes=3, saves=150) == (0, 0)


def test_a_key_saved_again_keeps_its_data_file(tmp_path):
    f = jitcache.LockedCacheFile(cache_path=str(tmp_path), filename_base="f", source_stamp=("s", 1))
    f.save("a", 1)
    f.save("b", 2)
    f.save("a", 3)
    assert (f.load("a"), f.load("b")) == (3, 2)
    assert sorted(p.name for p in tmp_path.glob("f.*.nbc")) == ["f.1.nbc", "f.2.nbc"]
    stale = jitcache.LockedCacheFile(cache_path=str(tmp_path), filename_base="f", source_stamp=("s", 2))
    assert stale.load("a") is None                    # another source stamp: numba's rule, kept


def test_every_cached_function_of_the_cpu_backend_is_locked():
    dispatchers = [microkernel.pack, microkernel.pack_columns, network.commit_projection, network.total_dh,
                   block_lstm.cell_forward, block_lstm.cell_backward,
                   cells.forward_step(get_cell("gru"), "float32", False, False),
                   cells.backward_step(get_cell("lstm"), "float64", True, False),
                   fused.forward_group(get_cell("lstm"), "float32"),
                   fused.backward_group(get_cell("rnn_tanh"), "float32", fused.COLUMN_VECTORS, True)]
    for d in dispatchers:
        assert type(d._cache._cache_file) is jitcache.LockedCacheFile, d


def test_njit_cached_compiles_and_caches(tmp_path):
    @jitcache.njit_cached
    def twice(x):
        return 2 * x

    @jitcache.njit_cached(error_model="numpy")
    def ratio(a, b):
        return a / b

    assert twice(np.float32(2.5)) == 5.0 and np.isinf(ratio(1.0, 0.0))
    assert type(twice._cache._cache_file) is jitcache.LockedCacheFile


def test_a_filesystem_without_locks_saves_unlocked(tmp_path, monkeypatch):
    """flock failing (some NFS mounts: ENOLCK) falls back to numba's unlocked save instead of failing."""
    if jitcache.fcntl is None:
        pytest.skip("no fcntl on this platform")

    def no_locks(handle, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(jitcache.fcntl, "flock", no_locks)
    f = jitcache.LockedCacheFile(cache_path=str(tmp_path), filename_base="f", source_stamp=("s", 1))
    f.save("a", 1)
    assert f.load("a") == 1


def test_each_variant_of_a_loop_closure_has_its_own_symbol_name():
    """numba names a function's symbol by module, qualified name, argument types and a counter of the compiling
    process; a cached loop brings the symbols of what it calls into the process that loads it, where the first
    definition of a name wins.  So two variants of one closure (two cells, one dtype) must differ in name, and one
    variant must have the same name in every process (else numba's disk cache never finds it)."""
    import subprocess
    import sys

    import numbarnn.contrib.layer_norm_gru  # noqa: F401  (registers the cells)
    import numbarnn.contrib.layer_norm_lstm  # noqa: F401
    from numbarnn.cpu import layer_norm
    names = {mode: fused.forward_group(get_cell(mode), "float64").py_func.__qualname__ for mode in ("lstm", "gru")}
    assert names["lstm"] != names["gru"] and names["lstm"].startswith("forward_group.<locals>.group_")
    row_loop = layer_norm.backward_loop(get_cell("layer_norm_lstm"), "float64").py_func.__qualname__
    assert row_loop != layer_norm.backward_loop(get_cell("layer_norm_gru"), "float64").py_func.__qualname__
    code = ("import numbarnn.contrib.layer_norm_lstm; from numbarnn.cells import get_cell; "
            "from numbarnn.cpu import fused, layer_norm; "
            "print(fused.forward_group(get_cell('lstm'), 'float64').py_func.__qualname__); "
            "print(layer_norm.backward_loop(get_cell('layer_norm_lstm'), 'float64').py_func.__qualname__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [names["lstm"], row_loop]

"""numbarnn's fix to numba's CUDA simulator (numbarnn/kernels/simulator.py): static shared arrays are shared.

The simulator creates a block's shared array for a source line on the first thread's request, with no lock
between its lookup and its store; two threads inside that window get different arrays.  These tests widen the
window (a slow allocation) so that the race happens every time without the lock.  And a new shared array
starts as NaN (floats) or the most negative value (integers), as garbage a GPU might leave, not zeros.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
from conftest import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="a fix to the CUDA simulator: nothing to test on a GPU")

from numba import cuda  # noqa: E402

from numbarnn.kernels import simulator  # noqa: E402


class SlowEmpty:
    """numpy, except that np.empty and np.full take 50 ms: every thread of a block arrives inside the lookup's window
    (even on a loaded machine, where starting a thread can take milliseconds)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(*args, **kwargs):
        time.sleep(0.05)
        return np.empty(*args, **kwargs)

    @staticmethod
    def full(*args, **kwargs):
        time.sleep(0.05)
        return np.full(*args, **kwargs)


@cuda.jit
def reverse_through_shared(out):
    a = cuda.shared.array(8, np.float32)      # two arrays on two lines: they must not alias either
    b = cuda.shared.array(8, np.float32)
    t = cuda.threadIdx.x
    a[t] = t
    b[t] = 10 * t
    cuda.syncthreads()
    out[cuda.blockIdx.x, t] = a[7 - t] + b[t]


def run():
    out = np.zeros((2, 8), np.float32)
    reverse_through_shared[2, 8](out)
    return out


WANT = np.tile(np.arange(7, -1, -1, dtype=np.float32) + 10 * np.arange(8, dtype=np.float32), (2, 1))


def test_the_fix_is_installed_with_the_simulator():
    from numba.cuda.simulator import kernelapi
    assert kernelapi.FakeCUDAShared.array is simulator._shared_array


def test_every_thread_of_a_block_gets_the_same_shared_array(monkeypatch):
    monkeypatch.setattr(simulator, "np", SlowEmpty())
    np.testing.assert_array_equal(run(), WANT)


def test_without_the_lock_the_race_shows(monkeypatch):
    """The same kernel with the lock taken out: threads get arrays of their own (so the test above can fail)."""
    monkeypatch.setattr(simulator, "np", SlowEmpty())
    monkeypatch.setattr(simulator, "_LOCK", contextlib.nullcontext())
    assert not np.array_equal(run(), WANT)


@cuda.jit
def read_before_write(out, iout):
    f = cuda.shared.array(4, np.float32)
    i = cuda.shared.array(4, np.int32)
    t = cuda.threadIdx.x
    if t < 2:
        f[t] = 1.0
        i[t] = 1
    cuda.syncthreads()
    out[t] = f[t]
    iout[t] = i[t]


def test_unwritten_shared_memory_reads_as_garbage():
    """Shared memory a kernel never wrote is not zero (a padded column it forgot to zero would pass in the
    simulator and read whatever is there on a GPU): NaN for floats, the most negative value for integers."""
    out, iout = np.zeros(4, np.float32), np.zeros(4, np.int32)
    read_before_write[1, 4](out, iout)
    np.testing.assert_array_equal(out[:2], 1.0)
    assert np.isnan(out[2:]).all()
    np.testing.assert_array_equal(iout, [1, 1, np.iinfo(np.int32).min, np.iinfo(np.int32).min])


@cuda.jit
def dynamic_shared(out):
    s = cuda.shared.array(0, np.float32)       # dynamic shared memory: the launch's size, one buffer
    t = cuda.threadIdx.x
    s[t] = t + 1
    cuda.syncthreads()
    out[t] = s[3 - t]


def test_dynamic_shared_memory_still_works():
    """One buffer of the launch's size for every request (np.float32 as the dtype: the simulator's own version
    asked a NumPy scalar type for its itemsize and raised)."""
    out = np.zeros(4, np.float32)
    dynamic_shared[1, 4, 0, 4 * 4](out)
    np.testing.assert_array_equal(out, [4, 3, 2, 1])


# ---------------------------------------------------------------------------------------------------
# the block barrier (syncthreads as a condition variable, not the simulator's polling loop)
# ---------------------------------------------------------------------------------------------------

def test_the_barrier_is_installed_with_the_simulator():
    from numba.cuda.simulator import kernel
    assert kernel.BlockManager.run is simulator._run_block and kernel.BlockThread.syncthreads is simulator._syncthreads


@cuda.jit
def early_exit(out):
    s = cuda.shared.array(8, np.float32)
    t = cuda.threadIdx.x
    if t >= 5:                 # these threads leave before the barriers: the others must not wait for them
        return
    for rep in range(3):       # several barriers in a row (a generation must not release the next one)
        s[t] = t + rep
        cuda.syncthreads()
        out[rep, t] = s[4 - t]
        cuda.syncthreads()


def test_threads_that_return_early_leave_the_barrier():
    out = np.full((3, 8), -1.0, np.float32)
    early_exit[1, 8](out)
    for rep in range(3):
        np.testing.assert_array_equal(out[rep, :5], np.arange(4, -1, -1) + rep)
    assert (out[:, 5:] == -1).all()


@cuda.jit
def one_thread_fails(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 3:
        out[100] = 1.0         # out of bounds: IndexError in this thread, the others wait at the barrier
    cuda.syncthreads()
    out[t] = t


def test_an_error_in_one_thread_is_raised_from_the_launch_and_nothing_hangs():
    """Thread 3 of block 0 fails between two barriers: the launch raises its error with its indices (the
    others, waiting at the barrier, are aborted), and the next launch runs normally."""
    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]"):
        one_thread_fails[2, 6](np.zeros(6, np.float32))
    test_threads_that_return_early_leave_the_barrier()


@cuda.jit
def count_votes(out):
    t = cuda.threadIdx.x
    out[t] = cuda.syncthreads_count(t % 3 == 0)


def test_syncthreads_count_sees_every_thread():
    out = np.zeros(10, np.int32)
    count_votes[1, 10](out)
    assert (out == 4).all()                  # t = 0, 3, 6, 9


# ---------------------------------------------------------------------------------------------------
# cooperative launches of many blocks: all blocks at once, a grid barrier, shared memory per block
# ---------------------------------------------------------------------------------------------------

def pass_along(a, out, steps):
    """Each step, every thread takes its right neighbour's value of the step before (across block edges)."""
    s_mem = cuda.shared.array(4, np.float64)   # per block: blocks running at once must not share it
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    n = cuda.gridDim.x * cuda.blockDim.x
    for s in range(steps):
        s_mem[t] = a[s, (i + 1) % n] + 1
        cuda.syncthreads()
        a[s + 1, i] = s_mem[t]
        cuda.cg.this_grid().sync()              # every block's step s is written before any reads it


pass_along.cooperative = True
pass_along_kernel = cuda.jit(pass_along)


def test_a_cooperative_launch_runs_its_blocks_at_once_with_a_grid_barrier():
    blocks, threads, steps = 3, 4, 5
    n = blocks * threads
    a = np.zeros((steps + 1, n))
    a[0] = np.arange(n)
    pass_along_kernel[blocks, threads](a, np.zeros(n), steps)
    np.testing.assert_array_equal(a[steps], (np.arange(n) + steps) % n + steps)
    assert simulator.cooperative_blocks() == simulator.COOPERATIVE_BLOCKS > 1


def fails_in_block_one(a):
    if cuda.blockIdx.x == 1 and cuda.threadIdx.x == 2:
        a[1000] = 1.0                           # out of bounds, while the other blocks wait at the grid barrier
    cuda.cg.this_grid().sync()
    a[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = 1.0


fails_in_block_one.cooperative = True
fails_kernel = cuda.jit(fails_in_block_one)


def test_an_error_in_a_cooperative_launch_aborts_every_block():
    with pytest.raises(IndexError, match=r"tid=\[2, 0, 0\] ctaid=\[1, 0, 0\]"):
        fails_kernel[3, 4](np.zeros(12))
    test_a_cooperative_launch_runs_its_blocks_at_once_with_a_grid_barrier()   # and the next one runs


# ---------------------------------------------------------------------------------------------------
# kernels whose threads never meet run in turn in the launching thread (simulator.meets)
# ---------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _meet_here():
    cuda.syncthreads()


def _barrier_through(helper):
    """A kernel reaching a barrier only through `helper`, a device function held in its closure."""
    @cuda.jit
    def kernel(out):
        t = cuda.threadIdx.x
        out[t] = t
        helper()
        v = out[(t + 1) % out.shape[0]]      # every thread's write is done
        helper()
        out[t] = v                           # every thread's read is done
    return kernel


@cuda.jit
def where_each_thread_ran(out, threads):
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if t < out.shape[0]:
        out[t] = cuda.threadIdx.x + 100 * cuda.blockIdx.x
        threads[t] = threading.get_ident()


def test_a_kernel_without_barriers_runs_its_threads_in_turn_in_the_launching_thread():
    """Indices and results as with a thread each (blocks of 4 over 10 items: a partial last block); every
    simulated thread ran in the caller's thread; NumPy's error state is each thread's own default, as a new
    thread's, not the caller's."""
    out, threads = np.full(10, -1, np.int64), np.zeros(10, np.int64)
    with np.errstate(all="raise"):
        where_each_thread_ran[3, 4](out, threads)
    np.testing.assert_array_equal(out, [0, 1, 2, 3, 100, 101, 102, 103, 200, 201])
    assert (threads == threading.get_ident()).all()
    assert threading.current_thread() is threading.main_thread()


def test_meets_finds_barriers_in_the_kernel_its_closure_and_its_device_functions():
    assert simulator.meets(reverse_through_shared.py_func) and simulator.meets(one_thread_fails.py_func)
    assert simulator.meets(_barrier_through(_meet_here).py_func)            # closure -> device function
    assert not simulator.meets(where_each_thread_ran.py_func)
    out = np.zeros(6, np.float32)
    _barrier_through(_meet_here)[1, 6](out)                                 # with a thread each: the barrier works
    np.testing.assert_array_equal(out, [1, 2, 3, 4, 5, 0])


def test_a_barrier_missed_by_meets_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(simulator, "meets", lambda fn: False)
    with pytest.raises(RuntimeError, match="syncthreads in .*ran one after another"):
        _barrier_through(_meet_here)[1, 4](np.zeros(4, np.float32))


@cuda.jit
def fails_at_thread_2(out):
    t = cuda.threadIdx.x
    out[t] = t
    if t == 2:
        out[100] = 1.0


def test_an_error_in_a_kernel_run_in_turn_names_its_thread():
    with pytest.raises(IndexError, match=r"tid=\[2, 0, 0\] ctaid=\[0, 0, 0\]"):
        fails_at_thread_2[2, 4](np.zeros(4, np.float32))
    assert threading.current_thread() is threading.main_thread()

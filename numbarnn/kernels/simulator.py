"""Two fixes to numba's CUDA simulator (installed by numbarnn.kernels when the simulator is on).

1. Static shared memory (`cuda.shared.array`): the simulator gives the threads of a block one array per
source line, looked up and created without a lock (``get``, then ``np.empty``, then store).  Two threads of a
block inside that window get two different arrays, and from then on "shared" memory is not shared: each
thread sees only its own writes, and the kernel's result is silently wrong.  It is rare (the window is a few
microseconds; the interpreter switches threads every few milliseconds): found by running GEMM v1-v4 on random
shapes under ``sys.setswitchinterval(1e-6)``, one wrong result (v4) in 200 launches, and the likely cause of
a test that failed once under load with a wrong gradient (stop 15, never reproduced).  Widening the window
(a slow ``np.empty``) makes it fail every time (tests/test_simulator.py).  Seen in numba-cuda 0.30.4,
`numba/cuda/simulator/kernelapi.py`, FakeCUDAShared.array.  `install()` replaces that method with the same
lookup (keyed by the caller's file and line, as the simulator does) under a lock, finding the caller with
``sys._getframe(1)`` instead of formatting the whole stack on every call (measured: 5 GEMM v4 launches
24.4/26.0 s before, 22.8/23.3 s after, with the simulator's barrier).  The profiler's recording wrapper
uses `shared_array_for` too.

2. `syncthreads`: a barrier on a condition variable instead of the simulator's polling loop (below).
"""
from __future__ import annotations

import sys
import threading

import numpy as np

_LOCK = threading.Lock()


def shared_array_for(shared, key, shape, dtype):
    """The block's static shared array for `key` (the requesting source line): created by the first thread that
    asks, under a lock, so every thread of the block gets the same one."""
    with _LOCK:
        ary = shared._allocations.get(key)
        if ary is None:
            ary = shared._allocations[key] = np.empty(shape, dtype)
    return ary


def _shared_array(self, shape, dtype, alignment=None):
    """FakeCUDAShared.array with the lookup under a lock (see the module docstring); otherwise the same."""
    from numba.cuda.simulator.kernelapi import numpy_support, types
    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
    if shape == 0:                       # dynamic shared memory: one buffer for every request, as before
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    caller = sys._getframe(1)
    return shared_array_for(self, (caller.f_code.co_filename, caller.f_lineno), shape, dtype)


_shared_array.numbarnn_locked = True


def install() -> None:
    """Replace the simulator's FakeCUDAShared.array and its block barrier (once; only call it when the simulator
    is on).  The barrier is replaced only where the simulator is the one these functions were written against
    (its BlockManager and BlockThread as in numba-cuda 0.30: `_f`, `_block_dim`, `_debug`, `_manager`)."""
    from numba.cuda.simulator import kernel, kernelapi
    if not getattr(kernelapi.FakeCUDAShared.array, "numbarnn_locked", False):
        kernelapi.FakeCUDAShared.array = _shared_array
    manager_init = kernel.BlockManager.__init__.__code__.co_names
    thread_init = kernel.BlockThread.__init__.__code__.co_names
    if (kernel.BlockManager.run is not _run_block and {"_f", "_block_dim", "_debug"} <= set(manager_init)
            and {"_manager", "threadIdx", "blockIdx"} <= set(thread_init)):
        kernel.BlockManager.run = _run_block
        kernel.BlockThread.run = _thread_run
        kernel.BlockThread.syncthreads = _syncthreads


# ---------------------------------------------------------------------------------------------------
# __syncthreads() as a barrier (a condition variable) instead of the simulator's polling loop
# ---------------------------------------------------------------------------------------------------
# The simulator's BlockManager.run polls every thread of a block in a loop that never sleeps, holding the
# interpreter's lock most of the time, to see which are waiting in syncthreads; the threads that do the
# work get the rest (`python bench/bench_simulator.py`: GEMM v4 40x30x24, 3 launches, 14.0-14.4 s; 0.8-0.9 s
# with the barrier below).  Here a barrier counts arrivals under a condition variable: the last thread to arrive
# (or to exit: a thread that returned early no longer takes part, as in the simulator) releases the others,
# and the manager just joins the threads.  Same semantics: an exception in any thread aborts the others
# (they raise at their next or current barrier) and is raised from the launch with the thread's indices.

def _run_block(self, grid_point, *args):
    """BlockManager.run: the block's threads share a barrier; wait for all of them; raise the first error."""
    from numba.cuda.simulator.kernel import BlockThread
    self._cond = threading.Condition()
    self._arrived = 0
    self._generation = 0
    self._abort = False
    self._errors = []
    threads = []
    for block_point in np.ndindex(*self._block_dim):
        def target(args=args):
            self._f(*args)
        threads.append(BlockThread(target, self, grid_point, block_point, self._debug))
    self._live = len(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if self._errors:
        error, tb = self._errors[0]
        raise error.with_traceback(tb)


def _thread_run(self):
    """BlockThread.run: run the kernel; on leaving, no longer count for the barrier; record an error."""
    m = self._manager
    try:
        threading.Thread.run(self)
    except Exception as e:  # noqa: BLE001  (as the simulator: any error of a thread is the launch's error)
        tid, ctaid = f"tid={list(self.threadIdx)}", f"ctaid={list(self.blockIdx)}"
        msg = f"{tid} {ctaid}" if str(e) == "" else f"{tid} {ctaid}: {e}"
        with m._cond:
            if not m._abort:                  # the first error; the others are the aborts it causes
                m._errors.append((type(e)(msg), sys.exc_info()[2]))
            m._abort = True
            m._cond.notify_all()
    finally:
        with m._cond:
            m._live -= 1
            if m._arrived and m._arrived >= m._live:        # the rest are all waiting: let them go
                m._arrived = 0
                m._generation += 1
                m._cond.notify_all()


def _syncthreads(self):
    """BlockThread.syncthreads: wait until every live thread of the block has arrived."""
    m = self._manager
    with m._cond:
        if m._abort:
            raise RuntimeError("abort flag set on syncthreads call")
        generation = m._generation
        m._arrived += 1
        if m._arrived >= m._live:
            m._arrived = 0
            m._generation += 1
            m._cond.notify_all()
        else:
            while m._generation == generation and not m._abort:
                m._cond.wait()
        if m._abort:
            raise RuntimeError("abort flag set on syncthreads clear")

"""Fixes to numba's CUDA simulator (installed by numbarnn.kernels.common when the simulator is on).

1. Static shared memory (`cuda.shared.array`): the simulator gives the threads of a block one array per
source line, looked up and created without a lock (``get``, then ``np.empty``, then store).  Two threads of a
block inside that window get two different arrays, and from then on "shared" memory is not shared: each
thread sees only its own writes, and the kernel's result is silently wrong.  It is rare (the window is a few
microseconds; the interpreter switches threads every few milliseconds): found by running GEMM v1-v4 on random
shapes under ``sys.setswitchinterval(1e-6)``, one wrong result (v4) in 200 launches, and the likely cause of
a test that once failed under load with a wrong gradient (never reproduced).  Widening the window
(a slow ``np.empty``) makes it fail every time (tests/test_simulator.py).  Seen in numba-cuda 0.30.4,
`numba/cuda/simulator/kernelapi.py`, FakeCUDAShared.array.  `install()` replaces that method with the same
lookup (keyed by the caller's file and line, as the simulator does) under a lock, finding the caller with
``sys._getframe(1)`` instead of formatting the whole stack on every call (5 GEMM v4 launches: 22.8-23.3 s,
24.4-26.0 s with the stack formatted).  The profiler's recording wrapper
uses `static_shared_array` too.

2. Uninitialised shared memory: a GPU's shared memory holds whatever the last block left there; the simulator's
``np.empty`` usually gives zeros, so a kernel that reads shared memory it never wrote (a padded column, a row
past the batch) passed in the simulator and could read NaN on a GPU.  Floating-point shared arrays now start
as NaN (integers as the most negative value), so such a read shows in the result.

3. `syncthreads`: a barrier on a condition variable instead of the simulator's polling loop (below); and
with it, cooperative launches of more than one block (the simulator ran blocks one after another, so a grid
barrier could only work with one): a kernel marked ``cooperative`` runs all its blocks at once, and
``cuda.cg.this_grid().sync()`` waits for every thread of the grid.

4. `CountingMatrix`: a matrix that records every element a kernel reads (the simulator hands kernels any
Python object): how the tests and tutorial 07 count the reads of R per step.

5. Kernels whose threads never meet (no barrier anywhere in their code, `meets`) run their block's threads one
after another in the launching thread instead of a Python thread each: the same results (no thread waits for
another; the interpreter ran each such thread's few lines mostly in one go anyway), without two thread hand-offs
per simulated thread, which cost milliseconds each when other processes keep the cores busy (a simulator test
4-10x its time alone in the test suite's two-worker run).
"""
from __future__ import annotations

import contextvars
import sys
import threading
import types
import weakref

import numpy as np

_LOCK = threading.Lock()


def _numpy_dtype(dtype) -> np.dtype:
    """A numba type, a NumPy scalar type or a dtype, as a NumPy dtype."""
    from numba.cuda.simulator.kernelapi import numpy_support, types  # lazy: numba.cuda after the simulator switch
    return numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)


def static_shared_array(shared, caller, shape, dtype):
    """-> (the block's static shared array that source frame `caller` asks for, its key).  Keyed by the requesting
    line (as the simulator keys it) and the block: the simulator keeps one set of shared arrays per launch, which
    its blocks, run one after another, reuse; the blocks of a cooperative launch run at once, and each needs its
    own (as on a GPU).  Created by the first thread that asks, under a lock, so every thread of the block gets
    the same one."""
    dtype = _numpy_dtype(dtype)
    key = caller.f_code.co_filename, caller.f_lineno, tuple(threading.current_thread().blockIdx)
    with _LOCK:
        ary = shared._allocations.get(key)
        if ary is None:
            ary = shared._allocations[key] = poisoned(shape, dtype)
    return ary, key


def poisoned(shape, dtype) -> np.ndarray:
    """A new static shared array as a GPU may hand it over: NaN (floats) or the most negative value (integers),
    never the zeros a kernel might silently rely on (module docstring, 2)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.full(shape, np.nan, dtype)
    if dtype.kind in "iu":
        return np.full(shape, np.iinfo(dtype).min, dtype)
    return np.empty(shape, dtype)


def check_alignment(alignment) -> None:
    """numba-cuda's rule for a shared or local array's `alignment`: None, or a power of two multiple of 8."""
    if alignment is not None and (alignment < 8 or alignment & (alignment - 1)):
        raise ValueError(f"alignment: a power of two multiple of 8 bytes, got {alignment}")


def _shared_array(self, shape, dtype, alignment=None):
    """FakeCUDAShared.array with the lookup under a lock (see the module docstring); otherwise the same, except
    that it takes an `alignment` (the simulator's refuses one): checked as numba checks it on a GPU, and moot
    here, where nothing reads an address (the profiler places its shared arrays at such a boundary)."""
    check_alignment(alignment)
    if shape == 0:                       # dynamic shared memory: one buffer for every request, as before
        dtype = _numpy_dtype(dtype)
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
    return static_shared_array(self, sys._getframe(1), shape, dtype)[0]


def install() -> None:
    """Replace the simulator's FakeCUDAShared.array and its block barrier (once; only call it when the simulator
    is on).  The barrier is replaced only where the simulator is the one these functions were written against
    (its BlockManager and BlockThread as in numba-cuda 0.30: `_f`, `_block_dim`, `_debug`, `_manager`)."""
    from numba.cuda.simulator import kernel, kernelapi  # lazy: numba.cuda after the simulator switch
    kernelapi.FakeCUDAShared.array = _shared_array
    manager_init = kernel.BlockManager.__init__.__code__.co_names
    thread_init = kernel.BlockThread.__init__.__code__.co_names
    if (kernel.BlockManager.run is not _run_block and {"_f", "_block_dim", "_debug"} <= set(manager_init)
            and {"_manager", "threadIdx", "blockIdx"} <= set(thread_init)):
        kernel.BlockManager.run = _run_block
        kernel.BlockThread.run = _thread_run
        kernel.BlockThread.syncthreads = _syncthreads
        kernelapi.GridGroup.sync = _grid_sync


def cooperative_blocks() -> int:
    """Blocks a cooperative launch may have here: COOPERATIVE_BLOCKS with numbarnn's barrier installed, else the
    simulator's own limit, 1."""
    from numba.cuda.simulator import kernel  # lazy: numba.cuda after the simulator switch
    return COOPERATIVE_BLOCKS if kernel.BlockManager.run is _run_block else 1


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

class _Barrier:
    """The threads of a block (or of a cooperative grid) meeting at syncthreads (or a grid sync): the last to
    arrive, or to leave the kernel, releases the others; `abort` wakes everyone (to raise)."""

    def __init__(self, live: int):
        self.cond = threading.Condition()
        self.live = live                # threads that still take part (started or not yet)
        self.arrived = 0
        self.generation = 0
        self.aborted = False

    def _release(self):
        self.arrived = 0
        self.generation += 1
        self.cond.notify_all()

    def wait(self, what: str):
        with self.cond:
            if self.aborted:
                raise RuntimeError(f"abort flag set on {what} call")
            generation = self.generation
            self.arrived += 1
            if self.arrived >= self.live:
                self._release()
            else:
                while self.generation == generation and not self.aborted:
                    self.cond.wait()
            if self.aborted:
                raise RuntimeError(f"abort flag set on {what} clear")

    def leave(self):
        """A thread returned from the kernel: it no longer takes part; if all the others wait, they go."""
        with self.cond:
            self.live -= 1
            if self.arrived and self.arrived >= self.live:
                self._release()

    def abort(self):
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


class _Grid:
    """A cooperative launch in the simulator: the threads of all its blocks run at once, with a grid barrier."""

    def __init__(self, threads: int):
        self.barrier = _Barrier(threads)    # every thread of the grid, started or not yet
        self.managers = []
        self.threads = []


#: blocks a cooperative launch may have in the simulator (all of them run at once: a Python thread per thread)
COOPERATIVE_BLOCKS = 64
_GRID = None                            # the cooperative launch being started (the simulator runs one at a time)


def _run_block(self, grid_point, *args):
    """BlockManager.run: the block's threads share a barrier; wait for all of them; raise the first error.
    A kernel marked ``cooperative`` (its Python function has ``cooperative = True``: a grid-wide barrier) runs
    all its blocks at once instead: each block's threads are started here, and the last block joins them all.
    A kernel that names no barrier (`meets`) runs its threads in turn in this thread (`_run_in_turn`)."""
    global _GRID
    from numba.cuda.simulator.kernel import BlockThread  # lazy: numba.cuda after the simulator switch
    threads = []
    for block_point in np.ndindex(*self._block_dim):
        def target(args=args):
            self._f(*args)
        threads.append(BlockThread(target, self, grid_point, block_point, self._debug))
    cooperative = getattr(self._f, "cooperative", False)
    in_turn = not self._debug and not cooperative and not meets(self._f)
    self._barrier = _Unmet(self._f) if in_turn else _Barrier(len(threads))
    self._errors = []
    self._grid = None
    if in_turn:
        _run_in_turn(self, threads)
        threads = []                    # nothing to join
    elif cooperative:
        if not any(grid_point):         # the first block: a new grid
            _GRID = _Grid(int(np.prod(self._grid_dim)) * len(threads))
        self._grid = grid = _GRID
        grid.managers.append(self)
        grid.threads += threads
        if grid.barrier.aborted:        # an earlier block failed: this one's threads abort at their first barrier
            self._barrier.abort()
        for t in threads:
            t.start()
        if tuple(grid_point) != tuple(d - 1 for d in self._grid_dim):
            return                      # not the last block: its threads run on, the last block waits
        _GRID = None
        threads = grid.threads
    else:
        for t in threads:
            t.start()
    for t in threads:
        t.join()
    errors = [e for m in (self._grid.managers if self._grid else [self]) for e in m._errors]
    if errors:
        error, tb = errors[0]
        raise error.with_traceback(tb)


def _run_in_turn(manager, threads):
    """The block's threads one after another in this thread (a kernel without barriers), each seen by
    ``threading.current_thread()`` (how the simulator's cuda.threadIdx finds its indices) and each in a fresh
    context (as a new thread starts: NumPy's error state the default, not the caller's); stops at the first
    error (the others would not have waited for it: none meets another)."""
    ident = threading.get_ident()
    own = threading._active[ident]
    try:
        for t in threads:
            threading._active[ident] = t
            contextvars.Context().run(t.run)
            if manager._errors:
                break
    finally:
        threading._active[ident] = own


class _Unmet(_Barrier):
    """The barrier of a block run in turn: reaching it is an error (`meets` missed a barrier), never a hang."""

    def __init__(self, fn):
        super().__init__(0)
        self.fn = fn

    def wait(self, what: str):
        raise RuntimeError(f"{what} in {getattr(self.fn, '__qualname__', self.fn)}, whose threads ran one after "
                           "another: numbarnn.kernels.simulator.meets found no barrier in its code")


#: names whose appearance in a kernel's code means its threads may meet: block barriers and the grid's
BARRIER_NAMES = frozenset({"syncthreads", "syncthreads_count", "syncthreads_and", "syncthreads_or", "this_grid",
                           "sync"})
_MEETS = weakref.WeakKeyDictionary()


def meets(fn) -> bool:
    """Whether kernel function `fn` may reach a barrier: one of BARRIER_NAMES among the names of its code, of
    the functions nested in it or of any function it names (device functions, found in its globals, its
    closure or as attributes of modules it names).  Conservative: a name is enough, reached or not."""
    known = _MEETS.get(fn)
    if known is None:
        known = _MEETS[fn] = _names_a_barrier(fn, set())
    return known


def _names_a_barrier(fn, seen: set) -> bool:
    fn = getattr(fn, "py_func", fn)                      # a simulated device function wraps its Python function
    if not isinstance(fn, types.FunctionType) or fn in seen:
        return False
    seen.add(fn)
    codes, names = [fn.__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names + code.co_freevars)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    if names & BARRIER_NAMES:
        return True
    scope = dict(fn.__globals__)
    scope.update(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ()
                                               if _filled(cell))))
    called = [scope[n] for n in names if n in scope]
    called += [getattr(m, n) for m in called if isinstance(m, types.ModuleType) for n in names if hasattr(m, n)]
    return any(_names_a_barrier(f, seen) for f in called if not isinstance(f, types.ModuleType))


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:                                   # a closure variable not assigned yet
        return False
    return True


def _thread_run(self):
    """BlockThread.run: run the kernel; on leaving, no longer take part in the barriers; on an error, record it
    (the first one) and abort every other thread of the block, or of the grid."""
    m = self._manager
    grid = m._grid
    try:
        threading.Thread.run(self)
    except Exception as e:  # noqa: BLE001  (as the simulator: any error of a thread is the launch's error)
        tid, ctaid = f"tid={list(self.threadIdx)}", f"ctaid={list(self.blockIdx)}"
        msg = f"{tid} {ctaid}" if str(e) == "" else f"{tid} {ctaid}: {e}"
        barriers = [grid.barrier] + [other._barrier for other in grid.managers] if grid else [m._barrier]
        with barriers[0].cond:
            if not barriers[0].aborted:       # the first error; the others are the aborts it causes
                m._errors.append((type(e)(msg), sys.exc_info()[2]))
        for barrier in barriers:
            barrier.abort()
    finally:
        m._barrier.leave()
        if grid is not None:
            grid.barrier.leave()


def _syncthreads(self):
    """BlockThread.syncthreads: wait until every live thread of the block has arrived."""
    self._manager._barrier.wait("syncthreads")


def _grid_sync(group):
    """GridGroup.sync: wait until every live thread of the cooperative grid has arrived (a kernel not marked
    cooperative, launched as one block: the block's barrier, as the simulator does)."""
    t = threading.current_thread()
    grid = getattr(t._manager, "_grid", None)
    if grid is None:
        t.syncthreads()
    else:
        grid.barrier.wait("grid sync")


class FlatIndex:
    """``m.flat`` for a Python object standing in for an array in the simulator: ``FlatIndex(m, shape)[e]`` is
    ``m[row, ..., k]`` of the C-order index e, so whatever the object records for ``m[...]`` it records for
    ``m.flat[e]`` too (the v2 staging reads weights so: numbarnn/kernels/staging.py)."""

    def __init__(self, matrix, shape):
        self.matrix = matrix
        self.shape = shape

    def __getitem__(self, e):
        return self.matrix[np.unravel_index(int(e), self.shape)]


class CountingMatrix:
    """A 2-D array passed to a kernel in the simulator that records every element read as (row, column) in
    `reads`, whether read as ``M[row, k]`` or, as the v2 staging does (numbarnn/kernels/staging.py), as
    ``M.flat[e]`` (C order).  ``a`` is the array itself."""

    def __init__(self, a):
        self.a = a
        self.shape = a.shape
        self.reads: list = []
        self._lock = threading.Lock()

    def __getitem__(self, index):
        with self._lock:
            self.reads.append(tuple(int(i) for i in index))
        return self.a[index]

    @property
    def flat(self):
        return FlatIndex(self, self.shape)

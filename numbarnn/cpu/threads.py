"""One thread budget per call: the fused loops run on the caller's count of threads (torch's OpenMP workers where
torch has them, else numbarnn's own), and BLAS uses at most that count.

A process holding numbarnn may have three thread pools: numba's, the BLAS library's that NumPy loaded
(OpenBLAS) and, with PyTorch, torch's.  The caller chooses one count: ``numba.set_num_threads(n)`` for NumPy
callers; inside ``numbarnn.torch``, ``torch.set_num_threads(n)``, which the modules hand to numba for the call.
The fused loops split their work over that many threads (`team`), and their backward's weight-gradient products
run in slices on the same threads with BLAS on one thread each (`serial_blas`): no pool is started that would
spin after its work on a core another pool, or torch's next operation, wants (bench/results/cpu.md).  The threads
are torch's own OpenMP workers where torch is imported and runs on OpenMP (`_torch_openmp`: one pool in the
process, whose worker still spinning after torch's last operation takes numbarnn's work at once), else the
caller's and numbarnn's helpers, which wait on a lock when idle.  Elsewhere (the BLAS loops)
`budget` lowers BLAS's pool to the count for the call (through threadpoolctl, which finds the BLAS libraries
NumPy loaded) and puts it back afterwards.  Nothing is raised above what it was.  Without threadpoolctl (an
install without the dependency) BLAS keeps its own setting.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from .. import settings


@functools.cache
def _blas_libraries() -> tuple:
    """threadpoolctl's controllers of the BLAS libraries loaded now (looked up once, ~2 ms: NumPy loads its
    BLAS at import, before any call), or () without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController  # lazy: threadpoolctl may be absent
    except ImportError:       # pragma: no cover - threadpoolctl is a dependency
        return ()
    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


try:                                               # numba's internals, read by `num_threads` where present
    from numba.np.ufunc import parallel as _parallel
except ImportError:                                # pragma: no cover - another numba
    _parallel = None


def _layer_functions() -> tuple | None:
    """numba's (_get_num_threads, _set_num_threads) of its threading layer once the layer is up (numba defines
    them when it launches its threads: not yet when this module is imported), else None."""
    if _parallel is None or not getattr(_parallel, "_is_initialized", False):
        return None
    get, put = getattr(_parallel, "_get_num_threads", None), getattr(_parallel, "_set_num_threads", None)
    return None if get is None or put is None else (get, put)


def num_threads() -> int:
    """numba.get_num_threads(), without its two locks once numba's threading layer is up (~0.2 us instead of
    ~1.4: a tiny call asks several times); numba's own function otherwise."""
    layer = _layer_functions()
    if layer is not None:
        n = layer[0]()
        if n > 0:
            return n
    return numba.get_num_threads()


def set_num_threads(n: int) -> None:
    """numba.set_num_threads(n) for 1 <= n <= NUMBA_NUM_THREADS, without its locks and checks once numba's
    threading layer is up (numbarnn.torch sets torch's count around every call, and back: ~10 us a tiny call)."""
    layer = _layer_functions()
    if layer is not None and 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        layer[1](n)
    else:
        numba.set_num_threads(n)


@contextlib.contextmanager
def _blas_at_most(n: int):
    """BLAS at most at n threads inside the block, put back after (~1 us a library when it already is); nothing on
    a helper thread (its caller set what the call uses: a helper that touched OpenBLAS's count would become the one
    thread threadpoolctl lets change it, for the life of the process)."""
    lowered = [] if _helping() else [(lib, lib.num_threads) for lib in _blas_libraries() if lib.num_threads > n]
    for lib, _ in lowered:
        lib.set_num_threads(n)
    try:
        yield
    finally:
        for lib, old in lowered:
            lib.set_num_threads(old)


def budget():
    """BLAS at most at numba's thread count inside the block (`_blas_at_most`)."""
    return _blas_at_most(num_threads())


def within_budget(fn):
    """`fn` run inside `budget` (the cpu backend's entry points)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with budget():
            return fn(*args, **kwargs)
    return call


def serial_blas():
    """BLAS on one thread inside the block: where a call's threads are numbarnn's (`team`, `matmul`: each slice of
    a product on one BLAS thread), and in loops of small per-step products (a modulated cell's two per step,
    cpu/modulated.py), where waking BLAS's other threads at every product cost more than they gave (measured on
    2 shared cores: a [256, 256] x [256, 32] float32 product 0.1-0.3 ms on one thread, several ms on two).
    OpenBLAS's count is the process's, and threadpoolctl lets only one thread change it (the first that did, while
    it lives): elsewhere the block changes nothing, and `blas_serial` says so; nor on a helper (`_blas_at_most`)."""
    return _blas_at_most(1)


_helper: list = []                                 # [(the helpers' executor, its threads)], made at first use
_helper_lock = threading.Lock()
_on_helper = threading.local()                     # .yes on numbarnn's helper threads


def _helper_executor(workers: int) -> ThreadPoolExecutor:
    """The helpers' executor, with at least `workers` threads (a larger thread count later makes a larger one:
    jobs already handed to the old one finish there)."""
    with _helper_lock:
        if not _helper or _helper[0][1] < workers:
            if _helper:
                _helper.pop()[0].shutdown(wait=False)
            _helper.append((ThreadPoolExecutor(max_workers=workers, thread_name_prefix="numbarnn",
                                               initializer=_mark_helper), workers))
        return _helper[0][0]


def _mark_helper() -> None:
    _on_helper.yes = True


def _helping() -> bool:
    """Whether this thread is one of numbarnn's helpers."""
    return getattr(_on_helper, "yes", False)


def _forget_helper() -> None:
    """In a forked child: its parent's helper threads do not exist there (a job handed to one would wait forever),
    and the lock may have been held by another thread at the fork; the child makes its own at first use."""
    global _helper_lock
    _helper.clear()
    _helper_lock = threading.Lock()
    _openmp["torch"] = None                        # libgomp's workers do not survive a fork either


os.register_at_fork(after_in_child=_forget_helper)


def team(pieces) -> list:
    """pieces[0]() here while every other piece runs on a thread of its own (in this thread's settings), all
    finished on return -> their results, in order: torch's OpenMP workers where torch is imported and has them
    (`_torch_openmp`; the setting cpu_torch_pool), else numbarnn's helper threads.  The call's threads, for
    independent pieces of one call: row groups of a time loop, slices of a product, the two directions of a layer.
    Compiled loops release the GIL (`cells.cached_step`), NumPy's BLAS calls do (one BLAS thread each:
    `serial_blas`).

    Why not numba's parallel loops and BLAS's own threads: each pool's idle workers spin after their work
    (libgomp's ~3-17 ms after a parallel region, OpenBLAS's ~0.1 s after a product) on the cores the next pool
    wants; a helper waits on a lock and takes no core, and torch's workers are the pool that spins anyway
    (bench/results/cpu.md).  A hand-off costs ~0.1 ms: the callers split only work far larger.  On a helper
    thread (a piece that asks for a team) the pieces run here, one after the other.  An exception of any piece is
    raised here once all have finished."""
    if len(pieces) == 1 or _helping():
        return [piece() for piece in pieces]
    scope = settings.current()
    openmp = _torch_openmp() if settings.get("cpu_torch_pool") else None
    if openmp is not None:
        return _openmp_team(openmp, pieces, scope)

    def run(piece):
        with settings.override(**scope):
            return piece()

    executor = _helper_executor(len(pieces) - 1)
    later = [executor.submit(run, piece) for piece in pieces[1:]]
    try:
        here = pieces[0]()
    finally:
        done = [(f.exception(), f) for f in later]   # waits for every piece, even when the first raised
    for error, _ in done:
        if error is not None:
            raise error
    return [here] + [f.result() for _, f in done]


_openmp: dict = {}                                # "torch" -> torch's OpenMP runtime (ctypes), or None: none usable
_openmp_jobs: dict = {}                           # key -> the work of a team running on OpenMP's threads
_openmp_keys = itertools.count(1)


def _torch_openmp():
    """torch's OpenMP runtime, loaded by torch (a ctypes handle whose ``GOMP_parallel`` runs a function on torch's
    thread pool), or None: torch not imported, its parallel backend not OpenMP, no such library in the process's
    maps (Linux only), or this process forked from one whose pool ran (`_forget_helper`).  Looked up once torch is
    imported.  GNU's libgomp, and LLVM's and Intel's runtimes, which export the same entry point.

    Why: torch's operations leave its OpenMP worker spinning for a few ms on a core; numbarnn's helper thread
    then shared that core with it (a layer's helper piece began ~3 ms late, bench/results/cpu.md).  On torch's
    workers, the one still spinning takes numbarnn's piece at once, and the process has one pool."""
    if "torch" not in sys.modules:
        return None
    try:
        return _openmp["torch"]
    except KeyError:
        pass
    _openmp["torch"] = found = _find_openmp(sys.modules["torch"])
    return found


def _find_openmp(torch):
    """`_torch_openmp`'s search: the OpenMP runtime under torch's directory, or the only one in the process."""
    try:
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return None
        with open("/proc/self/maps") as maps:
            paths = set(re.findall(r"(/\S*/lib(?:g|i|)omp[^/\s]*\.so[^/\s]*)$", maps.read(), re.MULTILINE))
    except (AttributeError, OSError, RuntimeError):
        return None
    home = os.path.dirname(os.path.realpath(getattr(torch, "__file__", None) or "/nonexistent")) + os.sep
    mine = sorted(p for p in paths if os.path.realpath(p).startswith(home))
    path = mine[0] if mine else (paths.pop() if len(paths) == 1 else None)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.GOMP_parallel.argtypes = [_OPENMP_BODY_TYPE, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
        lib.omp_get_thread_num.restype = lib.omp_get_num_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


def _openmp_body(key) -> None:
    """What each thread of an OpenMP team runs: the work `_openmp_team` left under `key`."""
    _openmp_jobs[key]()


_OPENMP_BODY_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_OPENMP_BODY = _OPENMP_BODY_TYPE(_openmp_body)   # kept alive here: OpenMP's threads call it


def _openmp_team(openmp, pieces, scope) -> list:
    """`team` on an OpenMP runtime's threads: ``GOMP_parallel`` with one thread per piece (ctypes releases the GIL
    for the call; each thread takes it back to run Python and drops it in the compiled loops).  Thread i runs
    piece i: pieces[0] on the caller (OpenMP's thread 0), every other on a worker named numbarnn-openmp-i, in the
    caller's settings, as a helper (`_helping`); a team given fewer threads (a nested region, a thread limit)
    runs the rest in turn on the threads it has.  An exception of any piece is raised here once all have
    finished."""
    n = len(pieces)
    results, errors = [None] * n, {}

    def work():
        me, count = openmp.omp_get_thread_num(), openmp.omp_get_num_threads()
        helper = me > 0
        if helper:
            threading.current_thread().name = f"numbarnn-openmp-{me}"
        _on_helper.yes = helper
        try:
            with settings.override(**scope) if helper else contextlib.nullcontext():
                for i in range(me, n, count):
                    try:
                        results[i] = pieces[i]()
                    except BaseException as exc:   # raised in the caller, after every piece
                        errors[i] = exc
        finally:
            _on_helper.yes = False

    key = next(_openmp_keys)
    _openmp_jobs[key] = work
    try:
        openmp.GOMP_parallel(_OPENMP_BODY, key, n, 0)
    finally:
        del _openmp_jobs[key]
    if errors:
        raise errors[min(errors)]
    return results


def relay(run, chains: int, links: int) -> None:
    """run(c, k) for every chain c < `chains` and link k < `links`, a chain's links in order and one at a time, on
    `chains` of the call's threads (`team`); a thread that ends a link takes the next link of the chain that no
    thread runs and has the most links left (its own on a tie).  An exception of any link stops every chain
    (no new link starts) and is raised here.

    Why: the row groups of a time loop are chains of step ranges (rows independent, a group's state in shared
    arrays), and a thread may run slower than the others for a while: a helper that waits for a core where
    another pool's worker spins (torch's OpenMP worker after torch's own operation: a layer's helper piece began
    ~3 ms late and ran ~25% slower than the caller's, bench/results/cpu.md), a noisy neighbour.  With each group on
    its own thread the call waits for the slowest; relayed, the caller runs both groups' links while the helper
    is away, and each thread keeps its own group otherwise."""
    done = [0] * chains                            # links finished, per chain
    busy = [False] * chains
    cond = threading.Condition()
    failed = []

    def take(me):
        """The next (chain, link) for thread `me`, or None when every chain is finished (or a link failed)."""
        with cond:
            while True:
                if failed:
                    return None
                free = [c for c in range(chains) if not busy[c] and done[c] < links]
                if free:
                    c = max(free, key=lambda c: (links - done[c], c == me))
                    busy[c] = True
                    return c, done[c]
                if all(d == links for d in done):
                    return None
                cond.wait()

    def worker(me):
        def go():
            while (job := take(me)) is not None:
                try:
                    run(*job)
                except BaseException:
                    with cond:
                        failed.append(True)
                        cond.notify_all()
                    raise
                with cond:
                    done[job[0]] += 1
                    busy[job[0]] = False
                    cond.notify_all()
        return go

    team([worker(me) for me in range(chains)])


def part(n: int, i: int, pieces: int) -> slice:
    """Slice i of `pieces` near-equal slices of range(n): a thread's share of rows or columns."""
    return slice(n * i // pieces, n * (i + 1) // pieces)


def blas_serial() -> bool:
    """Whether BLAS runs on one thread now (inside `serial_blas`, where this thread may change it), so that slices
    of products on the call's threads do not multiply BLAS's threads."""
    return all(lib.num_threads == 1 for lib in _blas_libraries())


#: products of fewer multiply-adds than this are made on the caller alone (a hand-off costs ~0.1 ms)
SPLIT_MIN_MACS = 1 << 24


def pieces_for(macs: int) -> int:
    """Into how many slices, one per thread of the call, to cut products of `macs` multiply-adds: the call's
    threads where BLAS is at one thread now (`blas_serial`) and the products are big enough, else 1."""
    return num_threads() if macs >= SPLIT_MIN_MACS and blas_serial() else 1


def matmul(a, b, out):
    """out [M, N] = a [M, K] @ b [K, N]: inside `serial_blas`, in slices of out's rows, one per thread of the call
    (`team`), each on one BLAS thread; elsewhere, or below SPLIT_MIN_MACS, one product on the caller (BLAS's own
    threads, within the budget)."""
    M = out.shape[0]
    pieces = pieces_for(M * a.shape[1] * out.shape[1])

    def piece(i):
        rows = part(M, i, pieces)
        np.matmul(a[rows], b, out=out[rows])
    team([functools.partial(piece, i) for i in range(pieces)])
    return out


def side_by_side(first, second):
    """first() here while second() runs on a helper thread (`team` of two) -> (first's result, second's)."""
    here, there = team([first, second])
    return here, there

"""What a GPU's memory system would see of a numba.cuda launch, recorded in numba's CUDA simulator: no GPU needed.

What a GPU's memory system sees of a kernel is decided by its addresses, and the simulator computes every
address: each CUDA thread is a Python thread that indexes NumPy arrays.  While `recording()` is active the
profiler wraps every array argument of a launch in a proxy that turns each element access into a byte address
and writes it down with who made it:

    (space, kind, block, warp, instruction, occurrence, address, size, tag)

    space        "global" (the kernel's array arguments and views of them) or "shared" (cuda.shared.array)
    kind         "load", "store" or "atomic"
    warp         threadIdx linearised (x fastest, as on a GPU) // 32
    instruction  (code object, bytecode offset) of the Python instruction that indexed the array: the
                 simulator's "program counter"; its source line is kept for the report
    occurrence   how many times this thread has executed that instruction before (loop iterations)

On a GPU the 32 threads of a warp issue each memory instruction together, so the accesses that share
(block, warp, instruction, occurrence) form one warp-level *request*.  Per request the profiler counts the
32-byte *sectors* it touches (what the L1/L2 actually move) and the distinct bytes it uses; per launch:

    requests        warp-level memory instructions
    sectors         summed over requests (sectors / request: 4 = a coalesced float32 warp, 32 = one per thread)
    coalescing      bytes used / bytes in the touched sectors (1.0 = every byte moved is used; 1/8 = stride-32
                    float32; a broadcast, all lanes one address: 4 / 32)
    l1_bytes        sectors x 32: what moves between L1 and the SM's load/store unit when nothing is reused
    l2_bytes        L2 <-> SM traffic if each block's L1 keeps what that block loaded: loads count each
                    block's distinct sectors once, stores and atomics every request's sectors (L1 is
                    write-through)
    dram_bytes      distinct sectors of the whole launch x 32: DRAM traffic if L2 keeps everything for the
                    duration of the launch (a lower bound)
    shared          bytes allocated per block (static + dynamic), bytes loaded / stored, requests, and bank
                    wavefronts (the most distinct 4-byte words any one of the 32 banks serves in a request);
                    a warp's consecutive loads that NVVM fuses into one LDS.64/LDS.128 (from an array declared
                    with an `alignment`, the k loops' tiles) are one request (`fuse_vector_loads`)

Device addresses: every host buffer behind a simulated device array gets a fake device address aligned to
256 bytes (as cudaMalloc aligns), so sector boundaries fall where they would on a GPU.  `tag(name, array)`
labels an address range (e.g. the recurrent matrices R inside the opaque params buffer): the report splits
traffic by tag, which is how an op call's "bytes of R read per step" is measured.

Results do not change: the proxies read and write the same NumPy memory, atomics run the simulator's own
code, and the simulator is restored when `recording()` exits (even on an exception).  One launch at a time,
as the simulator itself.  Not modelled: caches between launches, L1 capacity, instruction costs.

One file: the recorder, the array proxies and the simulator patches share one state (the active recording) and
are only correct together (`numbarnn.analysis.profiler` runs whole op calls through it).  Imports no numba at
module level: numba's simulator modules only inside `recording()`.

Why one file (over 500 lines): one mechanism: the array proxies, the trace they write and its grouping into
warp requests and sectors.
"""
from __future__ import annotations

import bisect
import contextlib
import dis
import os
import sys
import threading

import numpy as np

from .. import settings  # imports no numba
from ..kernels import simulator  # numbarnn's fixes to the simulator: imports no numba
from ..kernels.gpus import BANK_WIDTH, BANKS, SECTOR, VECTOR_BYTES, WARP

SIM_VAR = settings.SIM_VAR
ALIGN = 256          # cudaMalloc alignment

_RECORDER = None     # the active Recorder (one at a time, like the simulator's kernel context)


def simulator_active() -> bool:
    numba = sys.modules.get("numba")
    if numba is not None:
        return bool(getattr(numba.config, "ENABLE_CUDASIM", 0))
    return settings.simulator()


# ---------------------------------------------------------------------------------------------------
# fake device addresses
# ---------------------------------------------------------------------------------------------------

class AddressSpace:
    """Host buffer -> fake device address (256-byte aligned allocations, in order of first sight)."""

    def __init__(self, start: int = 1 << 32):
        self._next = start
        self._roots = {}       # root data pointer -> (device base, root) (root kept alive: no address reuse)

    def device_address(self, ary) -> int:
        root = ary
        while isinstance(root.base, np.ndarray):
            root = root.base
        key = root.__array_interface__["data"][0]
        entry = self._roots.get(key)
        if entry is None:
            entry = (self._next, root)
            self._roots[key] = entry
            self._next += -(-max(root.nbytes, 1) // ALIGN) * ALIGN
        return entry[0] + ary.__array_interface__["data"][0] - key


# ---------------------------------------------------------------------------------------------------
# the recording proxies
# ---------------------------------------------------------------------------------------------------

def _offset(ary, idx) -> int | None:
    """Byte offset of element `idx` of `ary` (negative indices wrap, as NumPy and the simulator do);
    None if `idx` is not one integer per dimension."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if len(idx) != ary.ndim:
        return None
    off = 0
    for i, n, st in zip(idx, ary.shape, ary.strides):
        try:
            i = int(i)
        except TypeError:
            return None
        off += (i + n if i < 0 else i) * st
    return off


def _element_offsets(ary, idx):
    """Byte offsets of every element `ary[idx]` selects (slice assignments / loads)."""
    sel = np.arange(ary.size, dtype=np.int64).reshape(ary.shape) if ary.ndim else np.zeros((), np.int64)
    picked = np.asarray(sel[idx]).ravel()
    coords = np.unravel_index(picked, ary.shape)
    return [int(sum(int(c[k]) * s for c, s in zip(coords, ary.strides))) for k in range(picked.size)]


def _make_global_proxy_class():
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # lazy: numba.cuda after the simulator switch

    class GlobalProxy(FakeCUDAArray):
        """A FakeCUDAArray whose element loads and stores are recorded; views stay proxies."""

        def __init__(self, ary, recorder, stream=0):
            super().__init__(ary, stream)
            self._rec = recorder
            self._dev = recorder.addresses.device_address(ary)
            self._tags = recorder.tags_for(self._dev, ary)
            self._size = ary.dtype.itemsize

        def _wrap(self, ary):
            return GlobalProxy(ary, self._rec, self.stream)

        def __getitem__(self, idx):
            ret = self._ary[idx]
            if type(ret) is np.ndarray:
                if not np.may_share_memory(ret, self._ary):   # fancy indexing: a copy, one load each
                    self._record_many(idx, "load")
                    return FakeCUDAArray(ret, stream=self.stream)
                return self._wrap(ret)
            off = _offset(self._ary, idx)
            if off is None:
                self._record_many(idx, "load")
            else:
                self._rec.access("global", "load", self._dev + off, self._size, self._tag(off))
            return ret

        def __setitem__(self, idx, val):
            off = _offset(self._ary, idx)
            if off is None:
                self._record_many(idx, "store")
            else:
                self._rec.access("global", "store", self._dev + off, self._size, self._tag(off))
            self._ary[idx] = val

        def _record_many(self, idx, kind):
            for off in _element_offsets(self._ary, idx):
                self._rec.access("global", kind, self._dev + off, self._size, self._tag(off))

        def _tag(self, off):
            tags = self._tags
            if not tags:
                return None
            if len(tags) == 1 and tags[0][0] is None:
                return tags[0][1]
            addr = self._dev + off
            for (lo, hi), name in tags:
                if lo <= addr < hi:
                    return name
            return None

        def atomic_address(self, index):
            off = _offset(self._ary, index)
            return None if off is None else (self._dev + off, self._size, self._tag(off))

        def reshape(self, *args, **kwargs):
            return self._wrap(self._ary.reshape(*args, **kwargs))

        @property
        def flat(self):
            """ary.flat[e]: element e in C order (staging.make_stage_matrix reads weights so), recorded."""
            return simulator.FlatIndex(self, self._ary.shape)

        def ravel(self, *args, **kwargs):
            return self._wrap(self._ary.ravel(*args, **kwargs))

        def view(self, *args, **kwargs):
            return self._wrap(self._ary.view(*args, **kwargs))

        def transpose(self, axes=None):
            return self._wrap(np.transpose(self._ary, axes=axes))

        def bind(self, stream=0):
            return GlobalProxy(self._ary, self._rec, stream)

    return GlobalProxy


class SharedProxy:
    """A cuda.shared.array whose loads and stores are recorded (offsets within the block's shared memory).  Its
    loads carry the array's declared `alignment` (None: its element's) in the record's tag slot: what
    `fuse_vector_loads` needs to know which loads NVVM may fuse."""

    def __init__(self, ary, recorder, base: int, alignment=None):
        self.__dict__.update(_ary=ary, _rec=recorder, _base=base, _size=ary.dtype.itemsize, _align=alignment)

    def __getitem__(self, idx):
        ret = self._ary[idx]
        off = _offset(self._ary, idx)
        if off is not None:
            self._rec.access("shared", "load", self._base + off, self._size, self._align)
        else:
            for o in _element_offsets(self._ary, idx):
                self._rec.access("shared", "load", self._base + o, self._size, self._align)
        return ret

    def __setitem__(self, idx, val):
        off = _offset(self._ary, idx)
        if off is not None:
            self._rec.access("shared", "store", self._base + off, self._size, None)
        else:
            for o in _element_offsets(self._ary, idx):
                self._rec.access("shared", "store", self._base + o, self._size, None)
        self._ary[idx] = val

    def __getattr__(self, name):
        return getattr(self.__dict__["_ary"], name)

    def __len__(self):
        return len(self._ary)

    def atomic_address(self, index):
        off = _offset(self._ary, index)
        return None if off is None else (self._base + off, self._size, None)


# ---------------------------------------------------------------------------------------------------
# the recorder
# ---------------------------------------------------------------------------------------------------

class Recorder:
    """Collects the accesses of every launch made while `recording()` is active and reduces each launch to
    its statistics (`launches`: a list of dicts, see `launch_stats`)."""

    def __init__(self, keep_lines: bool = True):
        self.addresses = AddressSpace()
        self.launches: list[dict] = []
        self.keep_lines = keep_lines
        self.label = None          # copied into every launch's stats (e.g. the phase of an op call)
        self._tags = []            # ((lo, hi), name) in device addresses
        self._records = None
        self._lines = {}
        self._skip = set()
        self._shared = None
        self._lock = threading.Lock()   # simulated threads ask for their shared arrays at the same time

    # tags ------------------------------------------------------------------------------------------
    def tag(self, name: str, array, start: int = 0, stop: int | None = None) -> None:
        """Label bytes [start, stop) of `array` (a simulated device array or NumPy array) as `name`."""
        ary = getattr(array, "_ary", array)
        lo = self.addresses.device_address(ary)
        stop = ary.nbytes if stop is None else stop
        self._tags.append(((lo + start, lo + stop), name))

    def tags_for(self, dev: int, ary):
        """The tags overlapping an array at `dev`: [(None, name)] if one tag covers it entirely."""
        lo, hi = dev, dev + max(ary.nbytes, 1)   # views with positive strides (all the driver makes)
        hits = [(rng, name) for rng, name in self._tags if rng[0] < hi and lo < rng[1]]
        if len(hits) == 1 and hits[0][0][0] <= lo and hi <= hits[0][0][1]:
            return [(None, hits[0][1])]
        return hits

    # accesses --------------------------------------------------------------------------------------
    def access(self, space, kind, addr, size, tag):
        th = threading.current_thread()
        f = sys._getframe(2)
        skip = self._skip
        while f.f_code.co_filename in skip:
            f = f.f_back
        key = (f.f_code, _instruction(f.f_code, f.f_lasti))
        occ = th.__dict__.get("_nbrnn_occ")
        if occ is None:
            occ = th.__dict__["_nbrnn_occ"] = {}
        n = occ.get(key, 0)
        occ[key] = n + 1
        if self.keep_lines and key not in self._lines:
            self._lines[key] = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"
        b = th.blockIdx
        self._records.append((space, kind, (b.x, b.y, b.z), th.thread_id // WARP, key, n, addr, size, tag))

    def shared_array(self, ary, line, alignment=None):
        """Proxy for a shared array of the current launch: its offset in the block's shared memory is assigned per
        requesting source line, in order of first sight, so every block (each has its own arrays) has the same
        layout, and the bytes per block count each line once."""
        table = self._shared
        with self._lock:
            entry = table.get(line)
            if entry is None:
                entry = table[line] = table["_next"]
                table["_next"] += -(-ary.nbytes // 16) * 16
        return SharedProxy(ary, self, entry, alignment)

    # one launch --------------------------------------------------------------------------------------
    def begin(self):
        self._records = []
        self._lines = {}
        self._shared = {"_next": 0}

    def end(self, name, grid, block, dynshared, args) -> dict:
        stats = launch_stats(self._records, self._lines, name, grid, block)
        static = self._shared["_next"]
        stats["shared"]["bytes_per_block"] = int(static + dynshared)
        stats["label"] = self.label
        stats["args"] = args
        self._records = None
        self.launches.append(stats)
        return stats


_STARTS: dict = {}   # code object -> sorted offsets of its instructions


def _instruction(code, lasti: int) -> int:
    """The offset of the instruction that owns bytecode offset `lasti`.  Python 3.11 specialises a
    BINARY_SUBSCR on a Python class into an inlined call whose frame reports an offset inside the
    instruction's inline cache, so the raw f_lasti of one instruction changes once it is specialised."""
    starts = _STARTS.get(code)
    if starts is None:
        starts = _STARTS[code] = [ins.offset for ins in dis.get_instructions(code)]
    return starts[bisect.bisect_right(starts, lasti) - 1]


def _sectors(addr: int, size: int):
    first, last = addr // SECTOR, (addr + size - 1) // SECTOR
    return range(first, last + 1)


def fuse_vector_loads(requests: dict) -> dict:
    """NVVM's load vectorizer, as the profiler models it: a warp's n = alignment / element-size consecutive
    executions o0 .. o0+n-1 (o0 a multiple of n) of one shared-load instruction of an array declared with an
    `alignment` of 8 or 16 bytes (tag slot), whose words are those of the first execution shifted by 1 .. n-1
    elements, all starting on an n-element boundary, are ONE request (an LDS.64 or LDS.128): what an unrolled
    loop over k compiles to when the array's rows start on such a boundary (the SASS shows it:
    tests/test_sass.py).  The simulator runs Python, whose loads are scalar; a loop NVVM does not unroll would
    not fuse, so only arrays that ask for an alignment, the k loops' tiles, are considered.  Other requests are
    returned unchanged; a fused one holds the accesses of all n executions under the key of the first."""
    out, groups = {}, {}
    for key, acc in requests.items():
        space, kind, blk, warp, instr, occ = key
        align = acc[0][2] if space == "shared" and kind == "load" else None
        n = min(align or 0, VECTOR_BYTES) // acc[0][1]
        if n < 2:
            out[key] = acc
        else:
            groups.setdefault((space, kind, blk, warp, instr, occ // n, n), {})[occ % n] = (key, acc)
    for (*_, n), parts in groups.items():
        first = parts.get(0)
        words = None if first is None else {a for a, _, _ in first[1]}
        size = first[1][0][1] if first else 0
        if (len(parts) == n and all(a % (n * size) == 0 for a in words)
                and all({a for a, _, _ in parts[i][1]} == {a + i * size for a in words} for i in range(1, n))):
            out[first[0]] = [x for i in range(n) for x in parts[i][1]]
        else:
            out.update(parts.values())
    return out


def launch_stats(records, lines, name, grid, block) -> dict:
    """Reduce one launch's access records to its statistics (plain dict); shared loads that NVVM fuses into
    vector loads count as one request (`fuse_vector_loads`)."""
    requests = {}
    for rec in records:
        space, kind, blk, warp, key, occ, addr, size, tag = rec
        requests.setdefault((space, kind, blk, warp, key, occ), []).append((addr, size, tag))
    requests = fuse_vector_loads(requests)

    def zero():
        return dict(requests=0, accesses=0, bytes_requested=0, bytes_used=0, sectors=0)

    glob = {k: zero() for k in ("load", "store", "atomic")}
    tags: dict = {}
    by_line: dict = {}
    block_sectors: dict = {}      # (block) -> set of load sectors
    block_tag_sectors: dict = {}  # (tag, block) -> set of load sectors
    launch_sectors, tag_launch_sectors = set(), {}
    store_sector_bytes, tag_store_bytes = 0, {}
    shared = dict(requests=0, load_bytes=0, store_bytes=0, wavefronts=0)
    for (space, kind, blk, warp, key, occ), acc in requests.items():
        if space == "shared":
            shared["requests"] += 1
            shared["load_bytes" if kind == "load" else "store_bytes"] += sum(s for _, s in
                                                                             ((a, s) for a, s, _ in acc))
            words_per_bank: dict = {}
            for a, s, _ in acc:
                for w in range(a // BANK_WIDTH, (a + s - 1) // BANK_WIDTH + 1):
                    words_per_bank.setdefault(w % BANKS, set()).add(w)
            shared["wavefronts"] += max(len(v) for v in words_per_bank.values())
            continue
        sectors = set()
        used = set()
        for a, s, _ in acc:
            sectors.update(_sectors(a, s))
            used.update(range(a, a + s))
        row = glob[kind]
        row["requests"] += 1
        row["accesses"] += len(acc)
        row["bytes_requested"] += sum(s for _, s, _ in acc)
        row["bytes_used"] += len(used)
        row["sectors"] += len(sectors)
        launch_sectors.update(sectors)
        if kind == "load":
            block_sectors.setdefault(blk, set()).update(sectors)
        else:
            store_sector_bytes += len(sectors) * SECTOR
        line = by_line.setdefault((key, kind), dict(requests=0, sectors=0, bytes_used=0, tag=acc[0][2]))
        line["requests"] += 1
        line["sectors"] += len(sectors)
        line["bytes_used"] += len(used)
        # per tag (a request may mix tags only if it straddles a tag boundary: split by access)
        for tag in {t for _, _, t in acc if t is not None}:
            mine = [(a, s) for a, s, t in acc if t == tag]
            ts = set()
            tu = set()
            for a, s in mine:
                ts.update(_sectors(a, s))
                tu.update(range(a, a + s))
            t = tags.setdefault(tag, dict(load_requests=0, store_requests=0, sectors=0, bytes_used=0))
            t["load_requests" if kind == "load" else "store_requests"] += 1
            t["sectors"] += len(ts)
            t["bytes_used"] += len(tu)
            tag_launch_sectors.setdefault(tag, set()).update(ts)
            if kind == "load":
                block_tag_sectors.setdefault((tag, blk), set()).update(ts)
            else:
                tag_store_bytes[tag] = tag_store_bytes.get(tag, 0) + len(ts) * SECTOR
    for row in glob.values():
        row["coalescing"] = row["bytes_used"] / (row["sectors"] * SECTOR) if row["sectors"] else None
        row["sectors_per_request"] = row["sectors"] / row["requests"] if row["requests"] else None
    l1 = sum(r["sectors"] for r in glob.values()) * SECTOR
    l2 = sum(len(v) for v in block_sectors.values()) * SECTOR + store_sector_bytes
    for tag, t in tags.items():
        t["requests"] = t["load_requests"] + t["store_requests"]
        t["sectors_per_request"] = t["sectors"] / t["requests"] if t["requests"] else None
        t["coalescing"] = t["bytes_used"] / (t["sectors"] * SECTOR) if t["sectors"] else None
        t["l1_bytes"] = t["sectors"] * SECTOR
        t["l2_bytes"] = (sum(len(v) for (tg, _), v in block_tag_sectors.items() if tg == tag) * SECTOR
                         + tag_store_bytes.get(tag, 0))
        t["dram_bytes"] = len(tag_launch_sectors[tag]) * SECTOR
    line_rows = []
    for (key, kind), row in by_line.items():
        row.update(where=lines.get(key, "?"), instr=key[1], kind=kind,
                   sectors_per_request=row["sectors"] / row["requests"],
                   coalescing=row["bytes_used"] / (row["sectors"] * SECTOR))
        line_rows.append(row)
    line_rows.sort(key=lambda r: -r["sectors"])
    threads = int(block[0] * block[1] * block[2])
    return dict(kernel=name, grid=[int(g) for g in grid], block=[int(b) for b in block],
                blocks=int(grid[0] * grid[1] * grid[2]), threads_per_block=threads,
                warps_per_block=-(-threads // WARP), global_=glob, l1_bytes=l1, l2_bytes=l2,
                dram_bytes=len(launch_sectors) * SECTOR, tags=tags, lines=line_rows, shared=shared)


# ---------------------------------------------------------------------------------------------------
# hooking the simulator
# ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def recording(recorder: Recorder | None = None, geometry: str = "simulator"):
    """Record every kernel launch (numba CUDA simulator only) into `recorder` (a new one if None; yielded).

    geometry: "simulator" leaves launch sizes alone; "gpu" makes numbarnn's launchers use the GPU's block
    sizes and GEMM tiles (numbarnn.kernels.common.threads, GemmVersion.default_config) while recording.
    Everything patched is restored on exit.
    """
    global _RECORDER
    if geometry not in ("simulator", "gpu"):
        raise ValueError(f"geometry: expected 'simulator' or 'gpu', got {geometry!r}")
    if not simulator_active():
        raise RuntimeError(f"the profiler runs in numba's CUDA simulator: set {SIM_VAR}=1 before numba is "
                           f"imported (run_profile does this in a subprocess for you)")
    if _RECORDER is not None:
        raise RuntimeError("recording() is already active (one profile at a time)")
    from numba.cuda.simulator import kernel as sim_kernel  # lazy: numba.cuda after the simulator switch
    from numba.cuda.simulator import kernelapi  # lazy: numba.cuda after the simulator switch
    from numba.cuda.simulator.cudadrv import devicearray  # lazy: numba.cuda after the simulator switch

    rec = Recorder() if recorder is None else recorder
    GlobalProxy = _make_global_proxy_class()
    rec._skip = {devicearray.__file__, kernelapi.__file__, __file__, sim_kernel.__file__}
    kernel_cls, shared_cls, atomic_cls = sim_kernel.FakeCUDAKernel, kernelapi.FakeCUDAShared, \
        kernelapi.FakeCUDAAtomic
    orig_call, orig_shared = kernel_cls.__call__, shared_cls.array
    atomic_names = [n for n in vars(atomic_cls) if not n.startswith("_") and callable(vars(atomic_cls)[n])]
    orig_atomics = {n: vars(atomic_cls)[n] for n in atomic_names}

    def wrap(arg):
        if isinstance(arg, GlobalProxy):
            return arg
        if isinstance(arg, devicearray.FakeCUDAArray):
            return GlobalProxy(arg._ary, rec, arg.stream)
        if isinstance(arg, np.ndarray) and arg.ndim > 0:
            return GlobalProxy(arg, rec)      # a host array: the simulator would copy it in and back out
        return arg

    def call(self, *args):
        if self._device or sim_kernel._kernel_context is not None:
            return orig_call(self, *args)
        rec.begin()
        try:
            orig_call(self, *[wrap(a) for a in args])
        except BaseException:
            rec._records = None
            raise
        rec.end(getattr(self.fn, "__name__", "kernel"), self.grid_dim, self.block_dim, self.dynshared_size,
                [_describe(a) for a in args])

    def shared_array(self, shape, dtype, alignment=None):
        simulator.check_alignment(alignment)   # every array starts on a 16-byte boundary here (Recorder.shared_array)
        if shape == 0:
            ary, line = orig_shared(self, shape, dtype), "dynamic"
        else:
            # The simulator keys a static shared array by the line that asks for it; through this wrapper that
            # would be one line for every array of a kernel (all aliased), so key by the kernel's line here.
            ary, key = simulator.static_shared_array(self, sys._getframe(1), shape, dtype)   # per block and line
            line = key[:2]
        if rec._shared is None:
            return ary
        return rec.shared_array(ary, line, alignment)

    def atomic(name):
        fn = orig_atomics[name]

        def op(self, array, *rest):
            target = getattr(array, "_item", array)         # FakeWithinKernelCUDAArray -> the proxy
            if isinstance(target, (GlobalProxy, SharedProxy)) and rec._records is not None:
                index = (0,) * target._ary.ndim if name == "compare_and_swap" else rest[0]
                where = target.atomic_address(index)
                if where is not None:
                    space = "shared" if isinstance(target, SharedProxy) else "global"
                    rec.access(space, "atomic", *where)
                return fn(self, target._ary, *rest)
            return fn(self, array, *rest)
        return op

    patches = []
    try:
        kernel_cls.__call__ = call
        patches.append(lambda: setattr(kernel_cls, "__call__", orig_call))
        shared_cls.array = shared_array
        patches.append(lambda: setattr(shared_cls, "array", orig_shared))
        for n in atomic_names:
            setattr(atomic_cls, n, atomic(n))
        patches.append(lambda: [setattr(atomic_cls, n, f) for n, f in orig_atomics.items()])
        if geometry == "gpu":       # a GPU's launch sizes, GEMM tiles and v3 slices, run here (v3's blocks all
            #                             at once, as numbarnn's simulator runs a cooperative grid)
            from ..kernels.target import Target, planning_for  # lazy: kernels.target imports numba.cuda
            scope = contextlib.ExitStack()
            scope.enter_context(planning_for(Target.gpu_in_simulator()))
            patches.append(scope.close)
        _RECORDER = rec
        yield rec
    finally:
        _RECORDER = None
        for undo in reversed(patches):
            undo()


def _describe(a) -> str:
    shape = getattr(a, "shape", None)
    if shape is not None and hasattr(a, "dtype"):
        return f"{a.dtype}[{','.join(str(s) for s in shape)}]"
    return type(a).__name__ if not isinstance(a, (int, float)) else repr(a)


def profile_launch(kernel, grid, block, *args, geometry: str = "simulator") -> dict:
    """Run one launch ``kernel[grid, block](*args)`` in the simulator and return its statistics."""
    with recording(geometry=geometry) as rec:
        kernel[grid, block](*args)
    return rec.launches[-1]

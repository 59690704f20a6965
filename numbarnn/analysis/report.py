"""Kernel resource report: registers, spills, stack and shared memory of every registered kernel.

Every spec of ``numbarnn.kernels.registry`` is compiled to PTX by numba for each compute capability
(``numba.cuda.compile_ptx(pyfunc, sig, cc=cc)``), then linked to SASS by nvJitLink with ``-verbose``;
the linker's info log gives per kernel

    used 40 registers, used 1 barriers, 0 stack, 4096 bytes smem, 464 bytes cmem[0], 0 bytes lmem
    ... bytes stack frame, 0 bytes spill stores, 0 bytes spill loads

No GPU is needed, but numba must not be in simulator mode: ``main`` re-runs itself in a subprocess
without NUMBA_ENABLE_CUDASIM when that variable is set (and ``collect`` does the same), so
``numbarnn kernels`` / ``python -m numbarnn.analysis.report`` work from anywhere.  A whole report is kept on disk
with the hash of its sources and compilers and read back while they are unchanged (``report_cache``; --no-cache
compiles anyway).

Theoretical occupancy (resident warps / max warps per SM) for the spec's block size follows the CUDA
occupancy calculator: warps (64 per SM, 32 blocks), registers (64K per SM, at most 255 per thread,
allocated per warp in units of 256) and shared memory (164 KiB per SM on sm_80, 228 KiB on sm_90;
static smem rounded up to 128 bytes plus 1 KiB reserved per block) each cap the resident blocks
(numbarnn.kernels.gpus: the limits step_v3 estimates its co-residency with).
The ``shared`` column is the linker's static smem as printed: on sm_90 it includes the 1 KiB reserve
whenever the kernel has any shared memory.  Dynamic shared memory is not counted.

Usage: python -m numbarnn.analysis.report [--json] [--cc 80 90] [--block 256] [--only SUBSTRING] [--jobs N]
                                          [--no-cache]
Each row also lists the device functions NVVM left as calls (``not_inlined``: a ``.func`` defined in the PTX;
numbarnn's are `common.device`, forceinline): the kernels are written to have none, and a call would cost a
kernel its registers across the call and the loads it could have fused.

Exit code 1 when any kernel fails to compile, spills, keeps a device function call, or a kernel module is broken.

numba, the CUDA bindings and the kernel modules (which import numba) are imported inside the functions that use
them: `numbarnn kernels` imports this module in whatever process it runs in, simulator or not.

Why one file (over 500 lines): one tool's pipeline: compile every spec, parse the linker's log, check, print.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time

from .. import settings
from ..kernels import registry
from . import report_cache
from ..kernels.gpus import ARCH, GPUS, occupancy

ROW_KEYS = ("kernel", "dtype", "cc", "registers", "spill_stores", "spill_loads", "stack", "shared", "not_inlined")

DEFAULT_BLOCK = 256



# --------------------------------------------------------------------------------------------------
# parsing the nvJitLink / ptxas info log
# --------------------------------------------------------------------------------------------------
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for '?([^'\s:]+)'?:?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"[Uu]sed (\d+) registers")
_STACK = re.compile(r"(\d+) stack\b")
_SMEM = re.compile(r"(\d+) bytes smem")
_LMEM = re.compile(r"(\d+) bytes lmem")


def parse_functions(log: str) -> dict:
    """Per function name: whatever the log says of registers, spill_stores, spill_loads, stack, shared, lmem.

    ptxas lines ("ptxas info : Function properties for NAME" / "N bytes stack frame, N bytes spill
    stores, N bytes spill loads" / "Used N registers, ...") and the linker's summary ("info : Function
    properties for 'NAME':" / "used N registers, ..., N stack, N bytes smem, ..., N bytes lmem") both
    count; the linker's numbers win where both give one.
    """
    funcs: dict = {}
    current = None
    for line in log.splitlines():
        m = _PROPS.search(line)
        if m:
            current = funcs.setdefault(m.group(1), {})
            continue
        m = _ENTRY.search(line)
        if m:
            current = funcs.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current["stack"] = int(m.group(1))
            current["spill_stores"] = int(m.group(2))
            current["spill_loads"] = int(m.group(3))
            continue
        m = _USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            for key, rx in (("stack", _STACK), ("shared", _SMEM), ("lmem", _LMEM)):
                found = rx.search(line)
                if found:
                    current[key] = int(found.group(1))
    return funcs


def parse_info_log(log: str) -> dict:
    """registers, spill_stores, spill_loads, stack, shared of the (single) entry kernel of one link.

    Numbers of other functions in the log (non-inlined device functions) add their spills and stack.
    ValueError when the log names no function with a register count.
    """
    funcs = parse_functions(log)
    entries = _ENTRY.findall(log)
    main = None
    for name in entries + list(funcs):
        if "registers" in funcs.get(name, {}):
            main = name
            break
    if main is None:
        raise ValueError(f"no register count found in the linker log:\n{log}")
    row = {"registers": funcs[main]["registers"], "spill_stores": 0, "spill_loads": 0, "stack": 0,
           "shared": funcs[main].get("shared", 0)}
    for props in funcs.values():
        row["spill_stores"] += props.get("spill_stores", 0)
        row["spill_loads"] += props.get("spill_loads", 0)
        row["stack"] = max(row["stack"], props.get("stack", 0))
    return row


# --------------------------------------------------------------------------------------------------
# compiling
# --------------------------------------------------------------------------------------------------
def link_info_log(ptx: str, cc: tuple, name: str = "kernel") -> str:
    """Link PTX to SASS for sm_XY with nvJitLink -verbose and return its info log."""
    from cuda.bindings import nvjitlink  # lazy: the CUDA toolkit wheels are optional

    data = ptx.encode()
    handle = nvjitlink.create(2, [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), name)
        if "cudaCGSynchronize" in ptx:          # a grid barrier (cooperative groups): the device runtime library
            from numba.cuda.cudadrv.libs import get_cudalib  # lazy: numba.cuda after the simulator switch
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, get_cudalib("cudadevrt", static=True))
        try:
            nvjitlink.complete(handle)
        except Exception as exc:
            size = nvjitlink.get_error_log_size(handle)
            buf = bytearray(size)
            if size:
                nvjitlink.get_error_log(handle, buf)
            raise RuntimeError(f"nvJitLink failed: {exc}: {buf.decode(errors='replace').strip()}") from exc
        size = nvjitlink.get_info_log_size(handle)
        buf = bytearray(size)
        if size:
            nvjitlink.get_info_log(handle, buf)
        return buf.rstrip(b"\0").decode(errors="replace")
    finally:
        nvjitlink.destroy(handle)


def functions_left(ptx: str) -> list:
    """The device functions a kernel's PTX still defines (``.func`` bodies, not ``.extern`` declarations such as
    the CUDA device runtime's grid barrier): the calls NVVM did not inline."""
    return re.findall(r"^(?:\.visible\s+|\.weak\s+)?\.func\s+(?:\([^)]*\)\s*)?([\w$]+)", ptx, re.M)


_MANGLED = re.compile(r"_ZN[\w$]+")
_SHARED = re.compile(r"_cudapy_smem_\d+")      # numba numbers shared arrays per process, in compile order
_ENV_DECLARATION = re.compile(r"^\.common \.global \.align \d+ \.u64 _ZN08NumbaEnv[\w$]*;\n", re.M)


def ptx_digest(ptx: str) -> str:
    """sha256 of a kernel's PTX with its mangled symbol names and its shared arrays' names numbered in order of
    appearance and numba's environment declarations left out: the code itself, unchanged when a kernel or device
    function only moves to another module or is renamed, or when other kernels compile before it in the process
    (numba names shared arrays from a counter and declares the environments in the order it made them)."""
    names: dict = {}
    text = _ENV_DECLARATION.sub("", ptx)          # (declared in the order numba made them, not the code's)
    text = _MANGLED.sub(lambda m: names.setdefault(m.group(0), f"_sym{len(names)}"), text)
    shared: dict = {}
    text = _SHARED.sub(lambda m: shared.setdefault(m.group(0), f"_smem{len(shared)}"), text)
    return hashlib.sha256(text.encode()).hexdigest()


def compile_spec(spec, ccs, block: int = DEFAULT_BLOCK) -> list[dict]:
    """Rows for one spec, one per compute capability (``error`` key set when it does not compile).

    numba's typing and lowering (most of the time) run once: the PTX is generated for the lowest target and
    nvJitLink turns it into SASS for every target, so ptxas still allocates registers per architecture.
    """
    from numba import cuda  # lazy: numba.cuda after the simulator switch

    ccs = [tuple(cc) for cc in ([ccs] if isinstance(ccs[0], int) else ccs)]
    rows = [{"kernel": spec.name, "dtype": spec.dtype, "cc": f"{cc[0]}{cc[1]}", "registers": None,
             "spill_stores": None, "spill_loads": None, "stack": None, "shared": None,
             "not_inlined": None, "block": spec.block or block, "occupancy": None, "module": spec.module}
            for cc in ccs]
    try:
        ptx, _ = cuda.compile_ptx(spec.pyfunc, spec.signature, cc=min(ccs))
    except Exception as exc:
        for row in rows:
            row["error"] = _error_text(exc)
        return rows
    left = functions_left(ptx)
    digest = ptx_digest(ptx)                                # the kernel's code, to compare two reports by
    for cc, row in zip(ccs, rows):
        row["not_inlined"] = left
        row["ptx_sha256"] = digest
        try:
            row.update(parse_info_log(link_info_log(ptx, cc, spec.name)))
            row["occupancy"] = round(occupancy(cc, row["block"], row["registers"], row["shared"]), 4)
        except Exception as exc:
            row["error"] = _error_text(exc)
    return rows


def _error_text(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _simulator_on() -> bool:
    if settings.simulator():
        return True
    numba = sys.modules.get("numba")
    return bool(numba is not None and getattr(numba.config, "ENABLE_CUDASIM", 0))


def _env_without_simulator() -> dict:
    return settings.environment(simulator=False)


def default_jobs() -> int:
    """Worker processes for compiling: the CPUs this process may use, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


_TASK_SPECS: list = []  # set before forking the workers, which inherit it (closures do not pickle)


def _compile_task(task) -> tuple[list[dict], list[str]]:
    """One spec's rows, and the numbarnn source files its compilation imported that were not loaded before
    (such a file is not in the stored report's key: the report is then not stored).  Compared by module name:
    `report_cache.source_files` before and after walked every loaded module's path, ~6 ms with torch loaded."""
    index, ccs, block = task
    before = set(sys.modules)
    rows = compile_spec(_TASK_SPECS[index], ccs, block)
    new = [sys.modules[name] for name in set(sys.modules) - before
           if name == "numbarnn" or name.startswith("numbarnn.")]
    files = (getattr(module, "__file__", None) or "" for module in new)
    return rows, sorted(os.path.abspath(path) for path in files if path.endswith(".py"))


def toolkit_problem() -> str | None:
    """None when the CUDA compiler libraries the report needs (NVVM, nvJitLink) load, else what to install."""
    try:
        from cuda import pathfinder  # lazy: the CUDA toolkit wheels are optional
    except ImportError:   # pragma: no cover - numba-cuda always brings cuda-pathfinder
        return None
    missing = []
    for lib in ("nvvm", "nvJitLink"):
        try:
            pathfinder.load_nvidia_dynamic_lib(lib)
        except Exception:
            missing.append(lib)
    if not missing:
        return None
    what = f"library {missing[0]} was" if len(missing) == 1 else f"libraries {' and '.join(missing)} were"
    return (f"the CUDA compiler {what} not found; numbarnn kernels compiles with NVVM and nvJitLink "
            f"(no GPU needed). Install them with: pip install 'numbarnn[cuda]' (from a checkout: "
            f"pip install -e '.[cuda]'; the numba-cuda[cu13] wheels, about 200 MB), or install a CUDA toolkit")


def collect(ccs=((8, 0), (9, 0)), block: int = DEFAULT_BLOCK, only: str | None = None,
            jobs: int | None = None, progress=None, cache: bool = True, info: dict | None = None) -> list[dict]:
    """Rows (dicts with ROW_KEYS, plus block, occupancy, module, ptx_sha256; error on failure) for every spec x cc.

    Broken kernel modules give a row with kernel "<module>" and the error.  ``only``: kernels whose
    name contains it.  ``jobs``: compiling processes (forked; default ``default_jobs()``, 1 = here).
    ``progress(done, total, spec_rows)``: called after each spec (in this process only, not in a subprocess).
    In a simulator process the work runs in a subprocess without the simulator.
    ``cache``: a whole report (no ``only``) is read from ``report_cache`` when its sources and compilers are
    unchanged, and stored after compiling.  ``info`` (a dict) receives ``cached`` and, on a miss, ``miss`` (why).
    """
    ccs = [tuple(cc) for cc in ccs]
    for cc in ccs:
        if cc not in ARCH:
            raise ValueError(f"ccs: expected compute capabilities among {sorted(ARCH)}, got {cc}")
    jobs = default_jobs() if jobs is None else max(1, int(jobs))
    if _simulator_on():
        argv = ["--json", "--cc", *[f"{a}{b}" for a, b in ccs], "--block", str(block), "--jobs", str(jobs)]
        if only:
            argv += ["--only", only]
        if not cache:
            argv += ["--no-cache"]
        proc = subprocess.run([sys.executable, "-m", "numbarnn.analysis.report", *argv],
                              env=_env_without_simulator(), capture_output=True, text=True)
        try:
            result = json.loads(proc.stdout)
            if info is not None:
                info.update(cached=result.get("cached", False), miss=result.get("miss", []))
            return result["rows"]
        except (ValueError, KeyError) as exc:
            raise RuntimeError(f"kernel report subprocess failed (exit {proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}") from exc

    specs, broken = registry.load_specs()
    key = report_cache.source_key({"ccs": [list(cc) for cc in ccs], "block": block}) if cache and not only else None
    if key is not None:
        stored = report_cache.load(key)
        if info is not None:
            info.update(cached=stored is not None, miss=[] if stored is not None else report_cache.differences(key))
        if stored is not None:
            return stored
    rows = [{"kernel": "<module>", "dtype": "-", "cc": "-", "registers": None, "spill_stores": None,
             "spill_loads": None, "stack": None, "shared": None, "not_inlined": None, "error": p} for p in broken]
    specs = [spec for spec in specs if not only or only in spec.name]
    tasks = [(i, ccs, block) for i in range(len(specs))]
    _TASK_SPECS[:] = specs
    unkeyed: set = set()
    try:
        results = []
        if jobs > 1 and len(tasks) > 1 and "fork" in multiprocessing.get_all_start_methods():
            # runs of neighbouring specs (one module, dtype and cell) to one worker: they share device functions,
            # which a worker compiles once (`common.device`); 8 runs a worker keep the workers' loads even.
            # The whole report on 2 cores: 338 s one spec at a time, 314 s in runs of 24
            chunk = max(1, len(tasks) // (8 * jobs))
            with multiprocessing.get_context("fork").Pool(min(jobs, len(tasks))) as pool:
                for spec_rows, new_files in pool.imap(_compile_task, tasks, chunksize=chunk):
                    results.append(spec_rows)
                    unkeyed.update(new_files)
                    if progress:
                        progress(len(results), len(tasks), spec_rows)
        else:
            for task in tasks:
                spec_rows, new_files = _compile_task(task)
                results.append(spec_rows)
                unkeyed.update(new_files)
                if progress:
                    progress(len(results), len(tasks), spec_rows)
    finally:
        _TASK_SPECS.clear()
    rows += [row for spec_rows in results for row in spec_rows]
    # stored only when compiling imported no numbarnn module the key did not hash (one the kernels might read)
    if key is not None and not unkeyed:
        report_cache.store(key, rows)
    return rows


def problems(rows: list[dict]) -> list[str]:
    """One line per compile error, spill or device function left as a call."""
    out = []
    for r in rows:
        if r.get("error"):
            out.append(f"{r['kernel']} {r['dtype']} sm_{r['cc']}: compile error: {r['error']}")
        elif r.get("spill_stores") or r.get("spill_loads"):
            out.append(f"{r['kernel']} {r['dtype']} sm_{r['cc']}: spills {r['spill_stores']} bytes stores, "
                       f"{r['spill_loads']} bytes loads")
        if not r.get("error") and r.get("not_inlined"):
            out.append(f"{r['kernel']} {r['dtype']} sm_{r['cc']}: device functions not inlined: "
                       f"{', '.join(r['not_inlined'])}")
    return out


def format_table(rows: list[dict]) -> str:
    """Plain-text table, one line per row (errors shown in the last column)."""
    cols = ["kernel", "dtype", "cc", "registers", "spill_stores", "spill_loads", "stack", "shared",
            "block", "occupancy"]
    heads = ["kernel", "dtype", "cc", "regs", "spill_st", "spill_ld", "stack", "smem", "block", "occ"]

    def cell(r, k):
        v = r.get(k)
        if v is None:
            return "-"
        if k == "occupancy":
            return f"{100 * v:.0f}%"
        return str(v)

    table = [[cell(r, k) for k in cols] + [r.get("error", "")] for r in rows]
    widths = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(heads, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for t in table:
        body = "  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(t, widths)))
        lines.append((body + ("  " + t[-1] if t[-1] else "")).rstrip())
    return "\n".join(lines)


#: the layer widths at which the report states whether the persistent v3 kernels' blocks are all co-resident
CO_RESIDENCY_H = (256, 512, 1024)


def persistent_co_residency(rows: list[dict]) -> list[dict]:
    """Whether every block of the persistent v3 kernels (step_v3: one cooperative launch per layer, which
    fails unless all its blocks are resident at once) fits on the reference GPU of each compiled compute
    capability (gpus.GPUS: A100 for sm_80, H100 for sm_90), LSTM float32 at H = P = CO_RESIDENCY_H, one
    and two directions: the slice v3_slices.plan picks (its shared memory) and the registers compiled here (the
    kernels are compiled at the H = 512 slice; the TJ = 2 slices of H = 768 and 1024 stage twice the rows a
    thread and take more: v3_slices.V3_REGISTERS).  The driver asks the device itself
    (max_cooperative_grid_blocks) and runs v2 where this says no."""
    from ..kernels.v3_slices import v3_co_residency  # lazy: the kernels import numba.cuda
    gpus = {tuple(g.cc): g for g in reversed(list(GPUS.values()))}     # the first GPU listed per cc
    out = []
    for r in rows:
        if r.get("kernel") not in ("lstm_forward_persistent_v3", "lstm_backward_persistent_v3") or \
                r.get("dtype") != "float32" or not r.get("registers"):
            continue
        gpu = gpus.get((int(r["cc"][0]), int(r["cc"][1:])))
        if gpu is None:
            continue
        for H in CO_RESIDENCY_H:
            for D in (1, 2):
                sl, n, limit, _ = v3_co_residency(gpu, H, H, 4, D, "float32", registers=r["registers"])
                out.append(dict(kernel=r["kernel"], cc=r["cc"], gpu=gpu.name, sms=gpu.sms, registers=r["registers"],
                                H=H, D=D, TJ=sl.TJ if sl is not None else None, blocks=n, limit=limit,
                                co_resident=sl is not None))
    return out


def format_co_residency(entries: list[dict]) -> str:
    """One line per (kernel, cc): blocks needed / co-resident limit at each H, one and two directions."""
    lines = []
    keys = list(dict.fromkeys((e["kernel"], e["cc"]) for e in entries))
    for kernel, cc in keys:
        es = [e for e in entries if (e["kernel"], e["cc"]) == (kernel, cc)]
        parts = [f"H={e['H']}{' bidir' if e['D'] == 2 else ''}: {e['blocks']}/{e['limit']} "
                 + ("ok" if e["co_resident"] else "NO, v2 runs") for e in es]
        lines.append(f"{kernel} float32 sm_{cc} on {es[0]['gpu']} ({es[0]['sms']} SMs, {es[0]['registers']} "
                     f"registers): " + ", ".join(parts))
    if lines:
        lines.insert(0, "persistent v3 co-residency (blocks needed / blocks that fit at once; LSTM, P = H):")
    return "\n".join(lines)


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="numbarnn kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print {rows, problems, seconds, co_residency} as JSON")
    p.add_argument("--cc", nargs="+", default=["80", "90"], help="compute capabilities, e.g. 80 90")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK,
                   help="threads per block for the occupancy of kernels that declare none")
    p.add_argument("--only", default=None, help="only kernels whose name contains this")
    p.add_argument("--no-cache", action="store_true",
                   help="compile even when the stored report's sources and compilers are unchanged")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"compiling processes (default: usable CPUs, at most 8; here {default_jobs()})")
    return p.parse_args(argv)


def _progress_line(done: int, total: int, spec_rows: list) -> None:
    """One updating line on a terminal: [done/total] the kernel just compiled."""
    name = f"{spec_rows[0]['kernel']} {spec_rows[0]['dtype']}" if spec_rows else ""
    end = "\n" if done == total else ""
    print(f"\r  [{done:>{len(str(total))}}/{total}] {name[:60]:<60}", end=end, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    args = _parse_args(argv)
    ccs = []
    for text in args.cc:
        if not re.fullmatch(r"\d\d", text) or (int(text[0]), int(text[1])) not in ARCH:
            print(f"--cc: expected some of {' '.join(f'{a}{b}' for a, b in ARCH)}, got {text!r}", file=sys.stderr)
            return 2
        ccs.append((int(text[0]), int(text[1])))
    if _simulator_on():
        # compile_ptx needs the real CUDA target: run the same command without the simulator
        sys.stdout.flush()
        proc = subprocess.run([sys.executable, "-m", "numbarnn.analysis.report", *argv],
                              env=_env_without_simulator())
        return proc.returncode
    problem = toolkit_problem()
    if problem:
        print(f"numbarnn kernels: {problem}", file=sys.stderr)
        return 2
    progress = None
    if not args.json:
        print(f"numbarnn kernels: compiling every kernel for {', '.join(f'sm_{a}{b}' for a, b in ccs)} with "
              f"{args.jobs or default_jobs()} processes (all of them: about 8 minutes on 2 cores)...", file=sys.stderr,
              flush=True)
        if sys.stderr.isatty():
            progress = _progress_line
    start = time.perf_counter()
    info: dict = {}
    rows = collect(ccs, block=args.block, only=args.only, jobs=args.jobs, progress=progress,
                   cache=not args.no_cache, info=info)
    seconds = time.perf_counter() - start
    if info.get("cached") and not args.json:
        print(f"numbarnn kernels: read from {report_cache.PATH}: sources and compilers unchanged since it was "
              f"compiled (--no-cache compiles again)", file=sys.stderr)
    if args.only and not any(r["kernel"] != "<module>" for r in rows):
        print(f"numbarnn kernels: no kernel name contains {args.only!r} (--only matches a substring of the kernel "
              f"names in the table of a plain `numbarnn kernels`)", file=sys.stderr)
        return 2
    found = problems(rows)
    co_residency = persistent_co_residency(rows)
    if args.json:
        print(json.dumps({"rows": rows, "problems": found, "seconds": round(seconds, 2),
                          "co_residency": co_residency, "cached": bool(info.get("cached")),
                          "miss": info.get("miss", [])}, indent=1))
        sys.stdout.flush()
    else:
        print(format_table(rows))
        if co_residency:
            print("\n" + format_co_residency(co_residency))
        print(f"\n{len(rows)} rows in {seconds:.1f} s ({args.jobs or default_jobs()} processes)")
        if found:
            print(f"\n{len(found)} problem(s):")
            for line in found:
                print("  " + line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

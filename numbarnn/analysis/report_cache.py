"""The kernel report's memory: the last whole report, kept with the key of everything that decides it.

Compiling all ~400 kernel specialisations takes minutes (numba's typing and lowering, then NVVM and ptxas per
architecture), and the result is a pure function of its inputs: the source of every numbarnn module the kernel
modules import (cells, contrib cells, config, the kernels themselves, the report's own parsing), the compiler
versions (numba, numba-cuda, llvmlite, NVVM, nvJitLink, NumPy), Python's version and the report's options.  Like ccache,
the whole report is stored with the hash of those inputs (`source_key`), and a report with the same key is read
back instead of compiled again.  Any change to any of those files or versions misses, and the report compiles.

The file (`kernel_report.json` beside this module) is written by every whole, successful report run
(`numbarnn kernels`, the compile test), atomically; commit it with a change to the kernels so that CI's fresh
clone reads it.  Each row keeps the sha256 of its kernel's PTX, so two reports (before and after a refactor) show
mechanically whether any kernel's code changed (`ptx_changes`).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from importlib import metadata

import llvmlite
import numpy

#: where the last whole report lives (inside the package: a source checkout commits it)
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_report.json")

FORMAT = 1


def _compiler_versions() -> dict:
    """numba, numba-cuda, llvmlite, NumPy, NVVM's and nvJitLink's versions, Python's (what compiles the kernels)."""
    import numba  # lazy: numba after the simulator switch

    versions = {"python": "%d.%d" % sys.version_info[:2], "numpy": numpy.__version__, "numba": numba.__version__,
                "llvmlite": llvmlite.__version__}
    for dist in ("numba-cuda", "cuda-bindings", "nvidia-nvvm", "nvidia-nvjitlink", "nvidia-cuda-nvdisasm"):   # wheels
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        from numba.cuda.cudadrv.nvvm import NVVM  # lazy: numba.cuda after the simulator switch
        versions["nvvm"] = ".".join(map(str, NVVM().get_version()))
    except Exception as exc:                      # no NVVM: the report fails anyway; keep the key honest
        versions["nvvm"] = f"unavailable: {type(exc).__name__}"
    try:
        from cuda.bindings import nvjitlink  # lazy: the CUDA toolkit wheels are optional
        versions["nvjitlink"] = ".".join(map(str, nvjitlink.version()))
    except Exception as exc:
        versions["nvjitlink"] = f"unavailable: {type(exc).__name__}"
    return versions


def source_files() -> list[str]:
    """The source files of every numbarnn module loaded in this process (call after loading the kernel specs:
    then these are exactly the modules the kernels can depend on)."""
    files = set()
    for name, module in list(sys.modules.items()):
        if name == "numbarnn" or name.startswith("numbarnn."):
            path = getattr(module, "__file__", None)
            if path and path.endswith(".py"):
                files.add(os.path.abspath(path))
    return sorted(files)


def source_key(options: dict) -> dict:
    """What decides a whole report: per source file (relative to the package) its sha256, the compiler versions
    and the report's options.  Returned as a dict (stored whole, so a miss can say what changed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))          # numbarnn/
    sources = {}
    for path in source_files():
        with open(path, "rb") as f:
            sources[os.path.relpath(path, os.path.dirname(root)).replace(os.sep, "/")] = \
                hashlib.sha256(f.read()).hexdigest()[:16]
    return {"format": FORMAT, "options": options, "compilers": _compiler_versions(), "sources": sources}


def remembered(path: str, options: dict, compute):
    """compute() -- any analysis of the kernels that is a pure function of their sources and compilers (JSON
    rows) -- read from `path` while the key of `options`, the sources and the compilers is unchanged, else
    computed and stored there (when computing imported no numbarnn module the key did not cover)."""
    key = source_key(options)
    rows = load(key, path)
    if rows is None:
        rows = compute()
        if source_key(options) == key:
            store(key, rows, path)
    return rows


def load(key: dict, path: str | None = None) -> list[dict] | dict | None:
    """The stored rows when the stored key equals `key`, else None."""
    try:
        with open(path or PATH) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("rows"), (list, dict)):
        return None
    return stored["rows"]


def differences(key: dict, path: str | None = None) -> list[str]:
    """Why the stored report does not apply: the options, compilers and files whose entries differ."""
    try:
        with open(path or PATH) as f:
            old = json.load(f).get("key", {})
    except (OSError, ValueError, AttributeError):
        return ["no stored report"]
    out = []
    for part in ("format", "options", "compilers"):
        if old.get(part) != key.get(part):
            out.append(f"{part}: {old.get(part)} -> {key.get(part)}")
    old_src, new_src = old.get("sources", {}), key.get("sources", {})
    out += [f"changed {p}" for p in sorted(set(old_src) & set(new_src)) if old_src[p] != new_src[p]]
    out += [f"new {p}" for p in sorted(set(new_src) - set(old_src))]
    out += [f"gone {p}" for p in sorted(set(old_src) - set(new_src))]
    return out


def store(key: dict, rows: list[dict] | dict, path: str | None = None) -> bool:
    """Write the report atomically (a temporary file renamed over the old one: concurrent writers leave one
    whole file).  False when the folder is not writable (an installed package): the report still stands."""
    path = path or PATH
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kernel_report.", suffix=".json", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "rows": rows}, f, indent=0, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)                    # mkstemp makes it private; it is a shared, committed file
        os.replace(tmp, path)
        return True
    except OSError:
        if "tmp" in locals() and os.path.exists(tmp):
            os.unlink(tmp)
        return False


def ptx_changes(old_rows: list[dict], new_rows: list[dict]) -> list[str]:
    """Kernels whose PTX differs between two reports (or that only one has): `kernel dtype sm_cc: why`."""
    def by_key(rows):
        return {(r["kernel"], r["dtype"], r["cc"]): r.get("ptx_sha256") for r in rows}
    old, new = by_key(old_rows), by_key(new_rows)
    out = [f"{k} {d} sm_{c}: PTX changed" for (k, d, c) in sorted(set(old) & set(new)) if old[(k, d, c)] != new[(k, d, c)]]
    out += [f"{k} {d} sm_{c}: new" for (k, d, c) in sorted(set(new) - set(old))]
    out += [f"{k} {d} sm_{c}: gone" for (k, d, c) in sorted(set(old) - set(new))]
    return out

"""numbarnn's settings: every NUMBARNN_* environment variable, parsed in one place and overridable in a scope.

    from numbarnn import settings
    settings.get("step_version")                 # None (the driver's choice) or 1, 2, 3
    with settings.override(step_version=2):      # this thread, inside the block: tests, the profiler, the bench
        ...

| setting | variable | values | default |
| --- | --- | --- | --- |
| backend | NUMBARNN_BACKEND | reference, cpu, cuda | None: cuda on a GPU, else cpu |
| step_version | NUMBARNN_STEP_VERSION | 1, 2, 3 | None: 3 on a GPU, 1 in the simulator |
| fast_launch | NUMBARNN_FAST_LAUNCH | 0 / 1 | True: numbarnn's kernel launch (kernels/launch.py) |
| v2_narrow | NUMBARNN_V2_NARROW | 0 / 1 | True: v2's narrow tiles on a small grid |
| v3_wide | NUMBARNN_V3_WIDE | 0 / 1 | True: v3's widest co-resident blocks |
| cpu_tune | NUMBARNN_CPU_TUNE | 0 / 1 | True: the cpu micro-kernel's tile measured per machine |
| cpu_fused | NUMBARNN_CPU_FUSED | 0 / 1 | True: the cpu backend's fused time loops (0: its BLAS loops, to compare) |
| cpu_side_by_side | NUMBARNN_CPU_SIDE_BY_SIDE | 0 / 1 | True: a bidirectional layer's directions at once on 2 threads |
| cpu_torch_pool | NUMBARNN_CPU_TORCH_POOL | 0 / 1 | True: the cpu backend's threads are torch's OpenMP workers if any |
| real_gpu | NUMBARNN_REAL_GPU | 0 / 1 | None: a GPU if numba finds one (1: must; 0: the simulator) |

A setting is read from the environment when it is asked for (cheap: one lookup), so a variable exported before
a call counts; an `override` wins over the environment in its thread until the block ends.  Passing a choice on
never writes os.environ.  numba's own switch, NUMBA_ENABLE_CUDASIM, is read by numba at its import and cannot be
overridden here (`simulator()` tells what this process runs).
"""
from __future__ import annotations

import contextlib
import os
import threading

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

#: name -> (environment variable, its values: bool for a flag, a tuple of the allowed ones, or None for any text
#: (the backend's name, checked by backends.py), the default when unset or empty)
SETTINGS = {
    "backend": ("NUMBARNN_BACKEND", None, None),
    "step_version": ("NUMBARNN_STEP_VERSION", (1, 2, 3), None),
    "fast_launch": ("NUMBARNN_FAST_LAUNCH", bool, True),
    "v2_narrow": ("NUMBARNN_V2_NARROW", bool, True),
    "v3_wide": ("NUMBARNN_V3_WIDE", bool, True),
    "cpu_tune": ("NUMBARNN_CPU_TUNE", bool, True),
    "cpu_fused": ("NUMBARNN_CPU_FUSED", bool, True),
    "cpu_side_by_side": ("NUMBARNN_CPU_SIDE_BY_SIDE", bool, True),
    "cpu_torch_pool": ("NUMBARNN_CPU_TORCH_POOL", bool, True),
    "real_gpu": ("NUMBARNN_REAL_GPU", ("0", "1"), None),
}


def _parse(var: str, values, default, raw: str):
    """The value of a variable's text (see SETTINGS); ValueError naming the variable for text it cannot be."""
    raw = raw.strip()
    if not raw:
        return default
    if values is None:
        return raw
    if values is bool:
        if raw.lower() in _TRUE or raw.lower() in _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"{var}: expected 0 or 1, got {raw!r}")
    for value in values:
        if raw == str(value):
            return value
    raise ValueError(f"{var}: expected one of {values}, got {raw!r}")


SIM_VAR = "NUMBA_ENABLE_CUDASIM"

_local = threading.local()


def _overrides() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def get(name: str):
    """The value of setting `name`: the innermost override of this thread, else the environment's, else the
    default (ValueError naming the variable for text it cannot parse)."""
    for scope in reversed(_overrides()):
        if name in scope:
            return scope[name]
    var, values, default = SETTINGS[name]
    raw = os.environ.get(var)
    return default if raw is None else _parse(var, values, default, raw)


def current() -> dict:
    """This thread's overrides, innermost winning: ``override(**current())`` in another thread gives it the same
    settings (a helper thread running part of a call, cpu/threads.py)."""
    merged = {}
    for scope in _overrides():
        merged.update(scope)
    return merged


@contextlib.contextmanager
def override(**values):
    """The settings given, in this thread, inside the block (None: the setting's default, whatever the
    environment says).  Unknown names are an error."""
    unknown = sorted(set(values) - set(SETTINGS))
    if unknown:
        raise TypeError(f"override: unknown setting(s) {unknown}; the settings are {sorted(SETTINGS)}"
                        + (" (NUMBA_ENABLE_CUDASIM is numba's, read at its import)" if "simulator" in unknown else ""))
    values = {k: SETTINGS[k][2] if v is None else v for k, v in values.items()}
    stack = _overrides()
    stack.append(values)
    try:
        yield
    finally:
        stack.pop()                              # blocks nest: this one is the innermost


def simulator() -> bool:
    """Whether this process asked numba for its CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return os.environ.get(SIM_VAR) == "1"


def raw(var: str) -> str | None:
    """The text of environment variable `var` as the user set it (None: unset), for messages."""
    return os.environ.get(var)


def simulator_chosen() -> bool:
    """Whether the simulator switch is set at all (to any value: the user's choice, honoured as it is)."""
    return SIM_VAR in os.environ


def request_simulator(on: bool = True) -> None:
    """Ask numba for its CUDA simulator (or not) in this process: effective only before numba is first imported
    (numba reads the variable once); subprocesses inherit it."""
    os.environ[SIM_VAR] = "1" if on else "0"


def environment(simulator: bool | None) -> dict:
    """This process's environment for a subprocess, with the simulator switch on, off (removed), or as it is."""
    env = dict(os.environ)
    if simulator:
        env[SIM_VAR] = "1"
    elif simulator is not None:
        env.pop(SIM_VAR, None)
    return env

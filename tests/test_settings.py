"""numbarnn.settings: every NUMBARNN_* variable parsed in one place, an override per thread and block."""
from __future__ import annotations

import threading

import pytest

from numbarnn import settings
from numbarnn.kernels import common, driver


def test_environment_then_override_then_environment_again(monkeypatch):
    monkeypatch.setenv("NUMBARNN_STEP_VERSION", "2")
    assert settings.get("step_version") == 2 and driver.step_version() == 2
    with settings.override(step_version=3):
        assert driver.step_version() == 3
        with settings.override(step_version=None):               # the default, whatever the environment says
            assert settings.get("step_version") is None
            assert driver.step_version() == (1 if common.SIMULATOR else 3)    # the simulator's, a GPU's
        assert driver.step_version() == 3
    assert driver.step_version() == 2
    monkeypatch.delenv("NUMBARNN_STEP_VERSION")
    with driver.pinned_step_version(2):
        assert driver.step_version() == 2
        import os
        assert "NUMBARNN_STEP_VERSION" not in os.environ           # a choice is never passed through os.environ
    assert settings.get("step_version") is None


def test_an_override_is_this_threads_only():
    seen = []
    with settings.override(v3_wide=False):
        thread = threading.Thread(target=lambda: seen.append(settings.get("v3_wide")))
        thread.start()
        thread.join()
        assert settings.get("v3_wide") is False
    assert seen == [True]


def test_current_hands_this_threads_overrides_to_another():
    """settings.current(): the innermost override wins; another thread given it sees the same settings."""
    seen = []
    with settings.override(v3_wide=False, step_version=2), settings.override(step_version=3):
        scope = settings.current()

        def other():
            with settings.override(**scope):
                seen.append((settings.get("v3_wide"), settings.get("step_version"), settings.get("v2_narrow")))
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert scope == {"v3_wide": False, "step_version": 3}
    assert seen == [(False, 3, True)]
    assert settings.current() == {}


@pytest.mark.parametrize("var, name, raw, want", [
    ("NUMBARNN_FAST_LAUNCH", "fast_launch", "0", False), ("NUMBARNN_FAST_LAUNCH", "fast_launch", " 1 ", True),
    ("NUMBARNN_V2_NARROW", "v2_narrow", "", True), ("NUMBARNN_CPU_TUNE", "cpu_tune", "off", False),
    ("NUMBARNN_CPU_FUSED", "cpu_fused", "0", False), ("NUMBARNN_CPU_SIDE_BY_SIDE", "cpu_side_by_side", "0", False),
    ("NUMBARNN_REAL_GPU", "real_gpu", "0", "0"), ("NUMBARNN_BACKEND", "backend", "cpu", "cpu")])
def test_each_variable_is_parsed(monkeypatch, var, name, raw, want):
    monkeypatch.setenv(var, raw)
    assert settings.SETTINGS[name][0] == var and settings.get(name) == want


@pytest.mark.parametrize("var, raw", [("NUMBARNN_STEP_VERSION", "4"), ("NUMBARNN_V3_WIDE", "maybe"),
                                      ("NUMBARNN_REAL_GPU", "2")])
def test_bad_values_name_the_variable(monkeypatch, var, raw):
    monkeypatch.setenv(var, raw)
    name = next(k for k, (v, _, _) in settings.SETTINGS.items() if v == var)
    with pytest.raises(ValueError, match=rf"^{var}: expected"):
        settings.get(name)


def test_override_refuses_unknown_settings():
    with pytest.raises(TypeError, match="unknown setting.*simulator.*numba's"):
        with settings.override(simulator=False):
            pass
    with pytest.raises(ValueError, match="step_version: expected one of"):
        with driver.pinned_step_version(7):
            pass

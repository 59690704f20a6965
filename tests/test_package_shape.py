"""The library's shape, checked mechanically: a long module says why it is one file; no history (issue numbers,
dates, sessions) in the library's text; only numbarnn.settings writes the environment."""
from __future__ import annotations

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "numbarnn"
LONG = 500          # lines: a module longer than this says why it is one file ("Why one file" in its docstring)


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_long_modules_say_why_they_are_one_file():
    unexplained = []
    for path in _modules():
        text = path.read_text()
        if text.count("\n") > LONG and "Why one file" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(PACKAGE.parent)} ({text.count(chr(10))} lines)")
    assert not unexplained, "split these by topic, or say in their docstring why not: " + ", ".join(unexplained)


HISTORY = re.compile(r"\bissues? \d+\b|\bstop \d+\b|\b20\d\d-\d\d-\d\d\b|\bsession\b", re.IGNORECASE)


def test_no_history_in_the_library():
    """Measurements, dates and the story of a change live in bench/results/ and the commits, not in the code."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
             for path in _modules() for n, line in enumerate(path.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert not found, "\n".join(found)


def test_only_settings_writes_the_environment():
    """Choices travel as arguments or `settings.override`, never through os.environ (numba's simulator switch,
    read once by numba at import, is set in settings.request_simulator only)."""
    write = re.compile(r"os\.environ\[[^\]]+\]\s*=(?!=)|os\.environ\.(setdefault|update|pop)\(|os\.putenv\(")
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}"
             for path in _modules() if path.name != "settings.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if write.search(line)]
    assert not found, found

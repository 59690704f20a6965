"""The library's shape, checked mechanically: a long module says why it is one file; no history (issue numbers,
dates, sessions) in the library's text; only numbarnn.settings writes the environment; no import cycle between
the library's modules."""
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


def module_imports(package: pathlib.Path) -> dict:
    """module -> the package's modules it imports when it is imported (statements at module level, inside
    try/if included, `if TYPE_CHECKING:` not; function-local imports run later and are not edges).  A
    `from . import name` of a submodule is an edge to the submodule, not to the package's __init__."""
    names = {}
    for path in sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {}
    for name, path in names.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for top in ast.parse(path.read_text()).body:
            if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test):
                continue
            for node in ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else (top,):
                if isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = here
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                    subs = {f"{target}.{a.name}" for a in node.names} & names.keys()
                    deps |= subs | ({target} if len(subs) < len(node.names) else set())
        edges[name] = {d for d in deps if d in names and d != name}
    return edges


def import_cycles(edges: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, cycles = {}, {}, [], set(), []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_between_the_librarys_modules():
    """A module imports only modules that do not import it back, through any chain (the kernels' step versions,
    the analysis tools and the roofline model once imported each other, hidden by function-local imports)."""
    assert import_cycles(module_imports(PACKAGE)) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    from . import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("try:\n    from ..c import thing\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("import pkg.a\nthing = 1\n")
    edges = module_imports(pkg)
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.c"} and edges["pkg.c"] == {"pkg.a"}
    assert import_cycles(edges) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("thing = 1\n")
    assert import_cycles(module_imports(pkg)) == []


#: packages a function may import where it needs them, no reason written: optional extras, the CUDA wheels, and
#: numba.cuda (imported only after numbarnn.settings has settled numba's simulator switch)
OPTIONAL = ("torch", "hypothesis", "matplotlib", "tensorflow", "threadpoolctl", "cuda", "numba.cuda")
LAZY = re.compile(r"#\s*lazy:\s*\S")


def _of_optional_package(node) -> bool:
    """`import a, b` of OPTIONAL packages only, or `from m import x` where m or m.x is one (`from numba import
    cuda`); a relative import never is."""
    def optional(name):
        return any(name == p or name.startswith(p + ".") for p in OPTIONAL)
    if isinstance(node, ast.Import):
        return all(optional(a.name) for a in node.names)
    return not node.level and (optional(node.module) or any(optional(f"{node.module}.{a.name}") for a in node.names))


def unexplained_local_imports(package: pathlib.Path) -> list[str]:
    """'path:line: statement' of each import inside a function (methods and nested functions included) that is
    neither of an OPTIONAL package nor marked `# lazy: <reason>` on one of its lines."""
    found = {}
    for path in sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts):
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not _of_optional_package(node) and not any(
                        LAZY.search(lines[n - 1]) for n in range(node.lineno, node.end_lineno + 1)):
                    where = f"{path.relative_to(package.parent).as_posix()}:{node.lineno}"
                    found[path, node.lineno] = f"{where}: {lines[node.lineno - 1].strip()}"
    return [found[k] for k in sorted(found)]


def test_function_local_imports_say_why():
    """An import inside a function avoids an optional or heavy package (OPTIONAL, by name) or says why on its line:
    `# lazy: numba after the simulator switch`, `# lazy: cycle: tuning imports microkernel`, ...  Any other import
    (the standard library, a light numbarnn module) belongs at the top of its module."""
    found = unexplained_local_imports(PACKAGE)
    assert not found, "move these to module level, or say why not (`# lazy: <reason>`):\n" + "\n".join(found)


def test_the_local_import_check_finds_a_bare_one(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import json\n")
    source = ("import os\n\n\n"
              "def f():\n"
              "    import torch\n"
              "    from numba import cuda\n"
              "    from cuda.bindings import nvjitlink\n"
              "    from . import sibling  # lazy: cycle through sibling\n"
              "    from numba import (config,  # lazy: numba after the simulator switch\n"
              "                       types)\n\n"
              "    def inner():\n"
              "        import os\n\n\n"
              "class C:\n"
              "    import json\n\n"
              "    def method(self):\n"
              "        import numba\n"
              "        import torch, json\n")
    (pkg / "a.py").write_text(source)
    assert unexplained_local_imports(pkg) == ["pkg/a.py:13: import os", "pkg/a.py:20: import numba",
                                              "pkg/a.py:21: import torch, json"]
    (pkg / "a.py").write_text("def f():\n    import os  # lazy: the reason\n")
    assert unexplained_local_imports(pkg) == []

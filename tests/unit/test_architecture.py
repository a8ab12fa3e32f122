"""The package shape, read from the source: the six package folders exist, no import cycle
(counting every import: module level, in functions and under ``TYPE_CHECKING``), layers import
one way, the report renders only, and no function is longer than 150 lines."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest

PACKAGE = paths.SRC / "stepscope"
LAYERS = ("recording", "instrument", "listeners", "analysis", "report", "cli")
#: The face: the one place that knows everything (public API, Tracer facade, wiring).
FACE = ("stepscope", "stepscope.__main__", "stepscope.tracer", "stepscope.lifecycle",
        "stepscope.phase", "stepscope.prefetch", "stepscope.demo")
#: What each layer may import inside stepscope (besides itself and ``stepscope.common``).
ALLOWED = {
    "recording": (),
    "instrument": ("stepscope.recording",),
    "listeners": ("stepscope.recording", "stepscope.instrument"),
    "integrations": ("stepscope.recording", "stepscope.instrument", "stepscope.listeners", *FACE),
    "analysis": ("stepscope.recording.schema",),
    "report": (),
    "cli": ("stepscope.analysis", "stepscope.report", "stepscope.recording.schema",
            "stepscope.demo"),
}
#: Third-party modules a layer must never import: the report renders a document, it runs no SQL.
FORBIDDEN_THIRD_PARTY = {"report": ("duckdb", "pyarrow", "pandas")}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["stepscope", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every module ``name`` imports, wherever the import statement stands."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            prefix = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                sub = f"{prefix}.{alias.name}"
                yield sub if sub in MODULES else prefix


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for imp in _imports(name, path):
            while imp not in MODULES and "." in imp:
                imp = imp.rsplit(".", 1)[0]
            if imp in MODULES and imp != name:
                deps.add(imp)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in (*LAYERS, "integrations", "common") else None


def test_the_six_package_folders_exist():
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file(), layer


def test_no_import_cycle_counting_every_import():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_import_one_way(layer):
    bad = []
    for name, deps in _graph().items():
        if _layer(name) != layer:
            continue
        for dep in deps:
            if _layer(dep) in (layer, "common"):
                continue
            if not any(dep == a or dep.startswith(a + ".") for a in ALLOWED[layer]):
                bad.append((name, dep))
    assert bad == [], f"{layer} imports outside what it may: {sorted(bad)}"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN_THIRD_PARTY))
def test_the_report_runs_no_sql(layer):
    bad = []
    for name, path in MODULES.items():
        if _layer(name) == layer:
            bad += [(name, i) for i in _imports(name, path)
                    if i.split(".")[0] in FORBIDDEN_THIRD_PARTY[layer]]
    assert bad == []


def test_common_imports_nothing_above_it():
    for name, deps in _graph().items():
        if _layer(name) == "common":
            assert all(_layer(d) == "common" for d in deps), (name, deps)


def test_no_function_over_150_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 150:
                    long.append((name, node.name, lines))
    assert long == []


def test_no_two_modules_named_alike():
    seen: dict[str, list[str]] = {}
    for name in MODULES:
        if not MODULES[name].name.startswith("__"):  # __init__, __main__
            seen.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def _imports_the_package(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] == "stepscope"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "stepscope" for a in node.names)


@pytest.mark.parametrize("layer", ["recording", "instrument", "listeners", "integrations",
                                   "analysis", "report"])
def test_no_package_module_imported_inside_a_function(layer):
    """No stepscope module is imported lazily but where it keeps something light: the face
    (``import stepscope``) and the commands (``stepscope --help`` builds every parser without
    loading DuckDB or the analysis)."""
    lazy = []
    for name, path in MODULES.items():
        if _layer(name) != layer:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lazy += [(name, fn.name, node.lineno) for node in ast.walk(fn)
                         if _imports_the_package(node)]
    assert lazy == [], f"{layer} imports stepscope modules inside functions: {sorted(lazy)}"

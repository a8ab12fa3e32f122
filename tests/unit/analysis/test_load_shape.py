"""The loader's shape: no import cycle with the Parquet store, and short named stages."""

from __future__ import annotations

import ast

import paths  # tests/support: where the repository is

ANALYSIS = paths.SRC / "stepscope" / "analysis"


def _imported(module: str) -> set[str]:
    """The ``stepscope.analysis`` modules ``module`` imports, wherever the statement stands
    (module level, in a function, under ``TYPE_CHECKING``)."""
    found = set()
    for node in ast.walk(ast.parse((ANALYSIS / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.rsplit(".", 1)[-1] if n.startswith("stepscope.analysis.") else n
                  for n in names if n.startswith("stepscope.analysis.")}
    return found


def test_load_and_store_are_in_no_import_cycle():
    # load -> store -> record_files, and nothing back.
    assert "store" in _imported("load")
    assert "load" not in _imported("store")
    assert not {"load", "store"} & _imported("record_files")


def test_the_loader_is_built_of_short_stages():
    tree = ast.parse((ANALYSIS / "load.py").read_text())
    long = {n.name: (n.end_lineno or n.lineno) - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and (n.end_lineno or n.lineno) - n.lineno + 1 > 100}
    assert long == {}

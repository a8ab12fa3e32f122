"""The loader's shape: no import cycle with the Parquet store, and short named stages."""

from __future__ import annotations

import ast

import test_architecture as arch

LOADING = ("stepscope.analysis.load", "stepscope.analysis.store",
           "stepscope.analysis.record_files")


def test_load_and_store_are_in_no_import_cycle():
    graph = arch._graph()
    assert "stepscope.analysis.load" not in graph["stepscope.analysis.store"]
    assert [c for c in arch._cycles(graph) if set(c) & set(LOADING)] == []


def test_the_loader_is_built_of_short_stages():
    tree = ast.parse(arch.MODULES["stepscope.analysis.load"].read_text())
    long = {n.name: (n.end_lineno or n.lineno) - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and (n.end_lineno or n.lineno) - n.lineno + 1 > 100}
    assert long == {}

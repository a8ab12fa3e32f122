"""The command line's one convention: every command is a ``cli/<command>_cmd.py`` module with
``add_parser(subparsers)`` and ``run(args) -> int``, and ``build_parser`` wires each one."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from types import ModuleType

import stepscope.cli
from stepscope.cli import build_parser

SHARED = {"options"}  # what every command shares: not a command


def _command_modules() -> dict[str, ModuleType]:
    names = [m.name for m in pkgutil.iter_modules(stepscope.cli.__path__) if m.name not in SHARED]
    return {n: importlib.import_module(f"stepscope.cli.{n}") for n in names}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subs.choices)


def test_every_cli_module_is_a_command_with_add_parser_and_run():
    modules = _command_modules()
    assert modules and all(n.endswith("_cmd") for n in modules), sorted(modules)
    for name, mod in modules.items():
        assert callable(getattr(mod, "add_parser", None)), name
        assert callable(getattr(mod, "run", None)), name


def test_every_subcommand_runs_its_own_module():
    modules = _command_modules()
    subs = _subcommands()
    assert sorted(f"{c}_cmd" for c in subs) == sorted(modules)
    for command, parser in subs.items():
        assert parser.get_default("func") is modules[f"{command}_cmd"].run, command


def test_building_the_parser_imports_no_analysis_duckdb_or_rich():
    import subprocess
    import sys

    code = ("import sys; from stepscope.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('duckdb', 'rich', 'numpy', "
            "'torch') or m.startswith(('stepscope.analysis', 'stepscope.report'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

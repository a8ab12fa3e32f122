"""``import stepscope`` and the analysis/CLI side never import torch.

Importing torch costs ~1.5 s of CPU and ~190 MB per process; ``stepscope report`` and
``stepscope trace`` need none of it, and a job imports torch itself anyway.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_package_cli_and_analysis_import_without_torch() -> None:
    got = _run("""
        import sys
        import stepscope, stepscope.cli, stepscope.analysis.run, stepscope.analysis.trace
        import stepscope.analysis.comparison, stepscope.report.terminal
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    assert got == "[]", got


def test_lazy_names_resolve_and_phase_works_before_init() -> None:
    got = _run("""
        import sys
        import stepscope
        with stepscope.phase("data_prep"):  # no init(): a no-op, the name still checked
            pass
        try:
            stepscope.phase("residual")
        except ValueError:
            print("checked")
        print("torch" in sys.modules)
        from stepscope import Tracer
        from stepscope.tracer import Tracer as T2
        print(Tracer is T2, "torch" in sys.modules)
    """)
    assert got.split() == ["checked", "False", "True", "True"], got


def test_python_dash_m_runs_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "stepscope", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("demo", "report", "trace", "compare", "compact"):
        assert command in out.stdout, out.stdout

"""The public surface is a contract: names, and what importing stepscope pulls in."""

from __future__ import annotations

import inspect
import subprocess
import sys

import stepscope

EXPECTED = {
    "AnalysisError", "AutoProfileConfig", "Config", "ConfigError", "InstrumentationError", "NullTracer",
    "PrefetchLoader", "Profiler", "StepscopeError", "StepscopeWarning", "Tracer",
    "__version__", "count", "current", "finish", "init", "phase", "step", "summary", "wrap_h2d",
    "wrap_loader",
}


def test_all_is_sorted_and_complete():
    assert stepscope.__all__ == sorted(stepscope.__all__)
    assert set(stepscope.__all__) == EXPECTED
    for name in stepscope.__all__:
        assert getattr(stepscope, name) is not None


def test_init_signature_matches_the_documented_contract():
    params = inspect.signature(stepscope.init).parameters
    for name, default in {
        "start_step": 0, "end_step": None, "every_n_steps": 1, "flush_every_n_steps": 10,
        "ranks": None, "sink": "jsonl", "auto": True, "enabled": True,
    }.items():
        assert params[name].default == default, name
    assert list(params)[:3] == ["out_dir", "model", "optimizer"]


def test_import_is_light():
    code = (
        "import sys, stepscope; "
        "heavy = [m for m in ('duckdb', 'matplotlib', 'rich', 'pandas', 'ijson') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

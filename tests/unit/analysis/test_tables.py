"""Every DuckDB table and view the analysis makes is declared in ``analysis/tables.py``.

Two checks: one reads the analysis sources for the statements that create or register a
relation (multi-line SQL, f-string names) and looks each name up in the registry; the other
runs ``analyze_run`` on varied synthetic runs, notes every relation present after each
statement that creates one, and compares its columns with the declared ones.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path
from typing import Any

import paths  # tests/support: where the repository is
import pytest
import synth_collectives as sc
from synth_runs import Slow, SynthRun, write_run

from stepscope.analysis import load
from stepscope.analysis.run import analyze_run
from stepscope.analysis.tables import TABLES, Table

ANALYSIS = paths.SRC / "stepscope" / "analysis"

#: A statement that makes a relation: CREATE [OR REPLACE] [TEMP] TABLE|VIEW [IF NOT EXISTS] name
#: (the kind may be an f-string field: ``CREATE TEMP {kind} name``), or ``con.register(name, ..)``.
_NAME = r"(\{[^{}]+\}|\"[^\"]+\"|[A-Za-z_][A-Za-z_0-9]*)"
_CREATE = re.compile(
    r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(?:(?:TEMP|TEMPORARY)\s+)?(?:TABLE|VIEW|\{[^{}]+\})\s+"
    r"(?:IF\s+NOT\s+EXISTS\s+)?" + _NAME)
_REGISTER = re.compile(r"\.register\(\s*" + _NAME.replace(r"\"[^\"]+\"", r"[\"'][^\"']+[\"']"))


def created_names(module: str, source: str) -> list[tuple[str, int]]:
    """Each relation name ``source`` creates or registers, with its line; an f-string field
    (``{WAIT_MEDIANS}``) is resolved through the module's attributes."""
    found: list[tuple[str, int]] = []
    for rx in (_CREATE, _REGISTER):
        for m in rx.finditer(source):
            raw = m.group(1).strip("\"'")
            line = source.count("\n", 0, m.start()) + 1
            if raw.startswith("{"):
                value: Any = getattr(importlib.import_module(module), raw[1:-1], None)
                raw = value.name if isinstance(value, Table) else value
                if not isinstance(raw, str):
                    raw = f"<unresolved {m.group(1)}>"
            found.append((raw, line))
    return found


def _sources() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ANALYSIS.rglob("*.py")):
        parts = ["stepscope", "analysis", *path.relative_to(ANALYSIS).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def undeclared(module: str, source: str) -> list[str]:
    return [f"{module}:{line}: {name}" for name, line in created_names(module, source)
            if name not in TABLES]


def test_every_created_relation_is_declared():
    bad = []
    seen = set()
    for module, path in _sources():
        text = path.read_text()
        bad += undeclared(module, text)
        seen |= {n for n, _ in created_names(module, text)}
    assert bad == []
    # The scan finds the statements at all (a scan that found none would pass vacuously).
    assert {"steps", "phases", "collective_waits", "own_excess", "wait_medians"} <= seen


def test_the_registry_says_what_each_relation_is():
    assert len({t.name for t in TABLES.values()}) == len(TABLES)
    for name, t in TABLES.items():
        assert t.name == name
        assert len(name) >= 5 and re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert t.columns and len(set(t.columns)) == len(t.columns), name
        assert t.meaning and "\n" not in t.meaning, name


def test_the_scan_catches_a_planted_short_or_unknown_name():
    planted = """
def f(con, kind, frame):
    con.execute(f'''CREATE OR REPLACE TEMP
                    TABLE pw AS SELECT 1''')
    con.execute(f'''CREATE TEMP {kind}
        cin AS SELECT 2''')
    con.execute("CREATE VIEW IF NOT EXISTS phase_sums_typo AS SELECT 3")
    con.register("arr", frame)
    con.execute(f"CREATE TABLE {NOT_A_CONSTANT} AS SELECT 4")
    con.execute(f"CREATE TABLE {WAIT_MEDIANS} (path VARCHAR, median DOUBLE)")
"""
    bad = undeclared("stepscope.analysis.own", planted)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "pw", "cin", "phase_sums_typo", "<unresolved {NOT_A_CONSTANT}>", "arr"]
    assert ast.parse(planted)  # the planted text is Python, as the sources are


# -- runtime: what analyze_run leaves and makes on the way -------------------------------

class _Spy:
    """The load's connection, noting every relation and its columns after each CREATE."""

    def __init__(self, con: Any, seen: dict[str, set[tuple[str, ...]]]) -> None:
        self._con = con
        self._seen = seen

    def execute(self, sql: str, *args: Any) -> Any:
        out = self._con.execute(sql, *args)
        if sql.lstrip().upper().startswith("CREATE"):
            rows = self._con.execute(
                "SELECT table_name, column_name FROM information_schema.columns "
                "ORDER BY table_name, ordinal_position").fetchall()
            cols: dict[str, list[str]] = {}
            for table, column in rows:
                cols.setdefault(str(table), []).append(str(column))
            for table, names in cols.items():
                self._seen.setdefault(table, set()).add(tuple(names))
            out = self._con
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


def _pipeline_and_resources(root: Path) -> Path:
    """A two-stage run whose records carry point-to-point links, memory, throughput and
    device sections, run-queue waits and an unseen-collective counter."""
    write_run(root, SynthRun(ranks=2, steps=30, slow=(Slow(1, "forward", 4.0),)))
    for rank in (0, 1):
        path = root / f"rank{rank}.jsonl"
        out = []
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rec["schema"] = 2
            rec["collectives"] = [{"phase": "forward", "op": "send" if rank == 0 else "recv",
                                   "pg": "pp:0>1", "count": 1, "bytes": 4096,
                                   "ms": 0.5 + rank, "seq_first": rec["step"],
                                   "seq_last": rec["step"]}]
            rec["memory"] = {"peak_allocated_mb": 100.0 + rec["step"], "rss_mb": 900.0}
            rec["throughput"] = {"tokens": 2048, "tokens_per_s": 1000.0}
            rec["device"] = {"util_pct": 90.0, "power_w": 300.0}
            rec["counters"] = {"runq_ms": 0.5, "unseen_forward": 1}
            rec["dropped"] = {"queue_full": 1} if rec["step"] == 3 else None
            out.append(json.dumps(rec))
        path.write_text("\n".join(out) + "\n")
    return root


def _hostile(root: Path) -> Path:
    """A duplicate record, a corrupt line, a missing step, a torn last line, a record listing
    one phase path twice and a user phase named residual (the own-work stage's grouped path)."""
    write_run(root, SynthRun(ranks=3, steps=40, slow=(Slow(2, "forward", 9.0),)))
    first, *rest = (root / "rank0.jsonl").read_text().splitlines(True)
    rec = json.loads(first)
    rec["phases"] += [dict(rec["phases"][-1]), dict(rec["phases"][-1], name="residual", path=None)]
    (root / "rank0.jsonl").write_text(json.dumps(rec) + "\n" + "".join(rest))
    lines = (root / "rank1.jsonl").read_text().splitlines(True)
    (root / "rank1.jsonl").write_text(
        "".join([*lines[:10], lines[9], "{not json\n", *lines[10:20], *lines[21:]])
        + '{"schema": 1, "ra')
    return root


_RUNS = {
    "multihost_cuda": lambda d: write_run(d, SynthRun(ranks=4, steps=40, hosts=2, clock="cuda",
                                                      host_offset_ms=20.0, every=2,
                                                      h2d_hidden_ms=1.0,
                                                      slow=(Slow(3, "forward", 8.0),))),
    "fsdp": lambda d: sc.write(d, sc.make_records(sc.CollRun(sc.fsdp_program(layers=2), ranks=4,
                                                             steps=30))),
    "pipeline_resources": _pipeline_and_resources,
    "hostile": _hostile,
}


@pytest.fixture(scope="module")
def relations(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[str, ...]]]:
    """Every relation present after any CREATE while analysing the runs, with each set of
    columns it had, read both from the Parquet store and from the rank files directly."""
    seen: dict[str, set[tuple[str, ...]]] = {}
    mp = pytest.MonkeyPatch()
    connect = load._connect
    mp.setattr(load, "_connect", lambda *a: _Spy(connect(*a), seen))
    try:
        for name, make in _RUNS.items():
            root = tmp_path_factory.mktemp(name)
            make(root)
            analyze_run(root, threads=1)
            if name == "hostile":  # the rank files read directly: raw_records a table
                analyze_run(root, threads=1, store=False)
    finally:
        mp.undo()
    return seen


def test_every_relation_analyze_run_makes_is_declared_with_its_columns(relations):
    assert {n: c for n, c in relations.items() if n not in TABLES} == {}
    wrong = {}
    for name, variants in relations.items():
        t = TABLES[name]
        for cols in variants:
            if not set(t.columns) <= set(cols) <= {*t.columns, *t.optional} or len(set(cols)) < len(cols):
                wrong[name] = (cols, t.columns, t.optional)
    assert wrong == {}
    # The runs reach the relations of every stage (else this check would check little).
    assert {"raw_records", "kept_records", "collective_calls", "p2p_waits", "p2p_blame",
            "phase_waits", "own_excess", "residual_work", "step_resources", "own_work",
            "cell_middles", "dense_middles", "timeline_waits", "sync_ends"} <= set(relations)

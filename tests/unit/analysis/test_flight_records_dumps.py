"""Hostile Flight Recorder dumps: read as data, refused with one note, never evaluated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stepscope.analysis.flight_records import analyze_flight
from stepscope.cli import main

pytest.importorskip("torch.distributed.flight_recorder")


def _entry(seq: int, **kw: Any) -> dict[str, Any]:
    e = {"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"],
         "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
         "profiling_name": "gloo:all_reduce", "time_created_ns": seq, "input_sizes": [[4]],
         "output_sizes": [[4]], "input_dtypes": ["Float"], "output_dtypes": ["Float"],
         "state": "scheduled", "time_discovered_started_ns": 0,
         "time_discovered_completed_ns": 0, "retired": True, "is_p2p": False,
         "timeout_ms": 1000}
    e.update(kw)
    return e


def _dump(entries: list[Any], ranks: object = "[0, 1]") -> dict[str, Any]:
    return {"version": "2.10", "entries": entries,
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}}}


def _write(run: Path, rank: int | str, doc: object) -> None:
    (run / f"rank{rank}.flight.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))


def test_pg_config_ranks_are_never_evaluated(tmp_path: Path) -> None:
    # Torch's analyser calls eval() on a ranks text that parses to a string.
    marker = tmp_path / "ran"
    payload = repr(f"__import__('pathlib').Path({str(marker)!r}).write_text('x') or [0, 1]")
    for r in (0, 1):
        _write(tmp_path, r, _dump([_entry(1), _entry(2, retired=r == 0)], ranks=payload))
    fr = analyze_flight(tmp_path, 2)
    assert not marker.exists()
    assert fr is not None and [v["rank"] for v in fr["ranks"]] == [0, 1]
    assert any("pg_config" in n for n in fr["notes"])
    # The status command (no --trust-flight-dumps) does not run it either.
    assert main(["status", str(tmp_path), "--json"]) in (0, 1, 2)
    assert not marker.exists()


def test_plain_ranks_still_match(tmp_path: Path) -> None:
    _write(tmp_path, 0, _dump([_entry(1), _entry(2)], ranks=[0, 1]))
    _write(tmp_path, 1, _dump([_entry(1)], ranks="[0, 1]"))
    fr = analyze_flight(tmp_path, 2)
    assert fr is not None and fr["culprit_ranks"] == [1]
    assert not any("pg_config" in n for n in fr["notes"])


@pytest.mark.parametrize("doc", [
    _dump([1, 2, 3]),                                     # entries not objects
    _dump([_entry(1, collective_seq_id="7")]),            # wrong field type
    _dump([_entry(1, process_group=[0, 1, 2, 3])]),       # not [name, description]
    _dump([_entry(1, retired="no")]),
    [_entry(1)],                                          # not an object at all
    {"entries": {}, "pg_config": {}},
    "[" * 200_000 + "]" * 200_000,                        # nested too deeply
    '{"entries": ' + "[" * 200_000,
], ids=["entries-ints", "seq-text", "pg-list", "retired-text", "top-list", "entries-dict",
        "deep", "deep-torn"])
def test_malformed_dump_is_one_note(tmp_path: Path, doc: object,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, 0, doc)
    fr = analyze_flight(tmp_path, 1)
    assert fr is not None and fr["ranks"] == []
    notes = [n for n in fr["notes"] if "rank0.flight.json" in n]
    assert len(notes) == 1 and "\n" not in notes[0] and len(notes[0]) < 400
    rc = main(["status", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc in (0, 1, 2) and "Traceback" not in err


def test_huge_rank_in_the_file_name(tmp_path: Path) -> None:
    _write(tmp_path, 10**14, _dump([_entry(1)]))
    _write(tmp_path, 0, _dump([_entry(1)]))
    fr = analyze_flight(tmp_path, 2)  # no list of 10^14 missing dumps
    assert fr is not None and [v["rank"] for v in fr["ranks"]] == [0]
    assert fr["missing_dumps"] == [1]
    assert any(f"rank{10**14}.flight.json" in n for n in fr["notes"])

"""Only the project speaks in its files: no words about how it was made, no machine paths.

Every tracked text file is scanned for numbered work stops, tracker issue numbers, sessions,
people, branches, dated runs and absolute paths of the machine it was written on.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest

ROOT = paths.ROOT
SELF = Path(__file__).resolve()  # its planted examples are the words it looks for

# Each pattern names what it catches; the text of a hit says where.
PATTERNS: dict[str, re.Pattern[str]] = {
    "numbered work stop": re.compile(r"\b[Ss]tops? [0-9]+\b|\b[Tt]his stop\b|\bthe stop's\b"),
    "tracker issue number": re.compile(r"\b[Ii]ssues? #?[0-9]+\b"),
    "session": re.compile(r"(?<![-\w])[Ss]essions? [0-9]+\b|\b[Tt]his session\b|\bthe session's\b"),
    "people": re.compile(
        r"\bowned by (?:\w+ )?helpers?\b|\bby (?:the|a|another|other) helpers?\b"
        r"|\b(?:another|other|the|a|each) helpers?(?:'s?)? (?:runs?|ran|work|branch|measured|recorded"
        r"|found|wrote|merged)\b|\bhelper `\w+`|\bthe lead's\b|\b(?:other|five|another) agents?\b"
    ),
    "branch": re.compile(r"\b[Tt]his branch\b|\bbranch `[\w-]+`|\bon branch \w+"),
    "dated run": re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9](?:,| [0-2][0-9]:[0-5][0-9])"),
    "machine path": re.compile(
        r"(?<![\w.~-])/(?:work|root)/|(?<![\w.~-])/tmp/[\w.-]|(?<![\w.~-])/home/[a-z]"
    ),
}

BINARY_SUFFIXES = {".png", ".jpg", ".gz", ".pt", ".pkl", ".pickle", ".parquet", ".bin", ".whl"}


def find_words(text: str) -> list[tuple[int, str, str]]:
    """Each hit in ``text`` as (line number, what it is, the matched text)."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pat in PATTERNS.items():
            hits += [(n, what, m.group(0)) for m in pat.finditer(line)]
    return hits


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    files = []
    for name in out.decode().split("\0"):
        p = ROOT / name
        if not name or p.suffix in BINARY_SUFFIXES or not p.is_file() or p == SELF:
            continue
        data = p.read_bytes()
        if b"\0" in data[:8192]:
            continue
        files.append(p)
    return files


def test_no_tracked_file_speaks_of_how_the_project_was_made() -> None:
    bad = []
    for p in tracked_text_files():
        text = p.read_text(encoding="utf-8", errors="replace")
        bad += [f"{p.relative_to(ROOT)}:{n}: {what}: {hit!r}" for n, what, hit in find_words(text)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("measured at st" "op 12 on the new build", "numbered work stop"),
        ("Stops 34 and 35 cut it", "numbered work stop"),
        ("see iss" "ue 22 for the goals", "tracker issue number"),
        ("the hel" "per's runs above", "people"),
        ("as this session measured", "session"),
        ("a cut kept on branch `hot`", "branch"),
        ("recorded 2026-11-24 01:30 at load 9", "dated run"),
        ("python benchmarks/overhead.py --baseline-src /wo" "rk/main/src", "machine path"),
        ("--trace /t" "mp/trt/t54/rank0.pt.trace.json", "machine path"),
        ("open('/root/.cache/x')", "machine path"),
        ("HOME=/home/alice", "machine path"),
    ],
)
def test_the_checker_catches_planted_words(text: str, what: str) -> None:
    assert what in {w for _, w, _ in find_words("ok\n" + text)}


@pytest.mark.parametrize(
    "text",
    [
        "a helper function shared by both sides",
        "stop the profiler after 3 steps",
        "write the file under tmp_path / 'runs'",
        "point out_dir at /shared/runs/exp1",
        "stepscope status RUN --stalled-after 30",
        '"recorded": "2026-01-31T12:00:00Z"',
    ],
)
def test_the_checker_leaves_ordinary_words_alone(text: str) -> None:
    assert find_words(text) == []

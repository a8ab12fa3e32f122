"""The HTML report in a real headless browser: data cannot run script; tables sort; it renders.

Needs Debian's ``chromium`` (``apt-get install -y chromium``); skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from synth_runs import Slow, SynthRun, write_run

from stepscope.cli import main

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))
                 if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless browser: install Debian's chromium (apt-get install -y chromium)")

EVIL_PHASE = "<img src=x onerror=\"document.title='pwned'\">"
EVIL_HOST = "</script><script>document.title='pwned2'</script><!--"
EVIL_REASON = "<svg onload=\"document.title='pwned3'\">"


def _chromium(tmp: Path, url: str, *extra: str) -> str:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run",
           f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=5000", *extra, url]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("html")
    run = write_run(tmp / "run", SynthRun(ranks=4, steps=60, slow=(Slow(2, "forward", 25.0, 20, 39),)))
    for f in run.glob("rank*.jsonl"):
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        for r in recs:
            r["hostname"] = EVIL_HOST
            for p in r["phases"]:
                if p["name"] == "forward":
                    p["name"] = EVIL_PHASE
        f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "triggers.jsonl").write_text(json.dumps(
        {"trigger_step": 25, "rank": 2, "role": "affected", "status": "captured", "reason": EVIL_REASON,
         "trace": None}) + "\n")
    out = tmp / "report.html"
    assert main(["report", str(run), "--html", str(out)]) == 0
    return out


def test_data_cannot_run_script(page: Path, tmp_path: Path) -> None:
    text = page.read_text()
    data = text.split('id="stepscope-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in data  # the JSON cannot open or close an element
    dom = _chromium(tmp_path, page.as_uri(), "--dump-dom")
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert title is not None and "pwned" not in title.group(1)
    assert title.group(1).startswith("stepscope report")
    body = dom.split("<body", 1)[1]
    # Nothing created from data: no img/svg-with-onload, no second script from the hostname.
    assert "<img" not in body and "<svg onload" not in body and body.count("<script") == 2
    # ... and the names are shown as text: the page was built (JS ran) from the escaped data.
    assert "&lt;img src=x onerror=" in body and "&lt;/script&gt;&lt;script&gt;" in body
    assert 'id="ranks"' in body and 'id="windows"' in body


def test_tables_sort_on_click(page: Path, tmp_path: Path) -> None:
    clicked = tmp_path / "clicked.html"
    # Click the Ranks table's "step ms" header twice (ascending, then descending).
    clicker = ("<script>const th = document.querySelectorAll('#ranks th')[2]; th.click(); th.click();"
               "</script></body>")
    clicked.write_text(page.read_text().replace("</body>", clicker))
    dom = _chromium(tmp_path, clicked.as_uri(), "--dump-dom")
    table = dom.split('id="ranks"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1], re.S)
    col = [float(re.findall(r"<td[^>]*>(.*?)</td>", r)[2]) for r in rows]
    assert len(col) == 4 and col == sorted(col, reverse=True)
    assert 'class="desc"' in table


def test_screenshot_at_laptop_width(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1366,768",
              "--hide-scrollbars")
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000

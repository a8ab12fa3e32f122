"""The docs site builds strictly and its pages open in a headless browser without console errors.

Needs mkdocs (the ``docs`` extra) and Debian's ``chromium``; each test skips with its reason
otherwise.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import paths  # tests/support: where the repository is
import pytest

ROOT = paths.ROOT
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))
                 if p), None)
PAGES = ["", "getting-started/", "locate/", "cli/", "api/", "benchmarks/"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs not installed: pip install '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings not installed: pip install '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_cli_reference_lists_every_command_of_the_parser(site: Path) -> None:
    from stepscope.cli import build_parser

    html = (site / "cli" / "index.html").read_text(encoding="utf-8")
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    for name, parser in sub.choices.items():
        assert f"stepscope {name}" in html
        for action in parser._actions:
            for opt in action.option_strings:
                assert opt in html, (name, opt)


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.skipif(CHROMIUM is None,
                    reason="no headless browser: install Debian's chromium (apt-get install -y chromium)")
@pytest.mark.parametrize("page", PAGES)
def test_page_opens_without_console_errors(server: str, page: str, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--enable-logging=stderr",
           "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000",
           "--dump-dom", server + page]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "<h1" in res.stdout, "the page has no heading"
    console = [ln for ln in res.stderr.splitlines() if "CONSOLE" in ln]
    errors = [ln for ln in console if re.search(r"Uncaught|Error|Failed to load|404", ln)]
    assert not errors, "\n".join(errors)

"""A headless system Chromium driven by Playwright, for the playground tests and the README screenshot script.
Playwright's own browser download is never used: the browser is the system's (`apt-get install chromium`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
# Without the background-networking flags Chromium's own connections (updates, sync, QUIC probes) are refused on
# offline machines and slow everything down.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]


def find_chromium() -> str | None:
    """$DGEMMA_CHROMIUM, else the first system Chromium found."""
    explicit = os.environ.get("DGEMMA_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return next((c for c in CANDIDATES if Path(c).is_file()), None) or shutil.which("chromium")


def why_no_browser() -> str | None:
    """None when the tests can run; otherwise a one-line reason to skip."""
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e '.[test]')"
    if find_chromium() is None:
        return "no system Chromium found (apt-get install chromium, or set DGEMMA_CHROMIUM)"
    return None


@contextmanager
def chromium():
    """A launched browser, closed afterwards. Playwright gives each launch a fresh profile directory of its own
    (it refuses a --user-data-dir flag) and removes it on close."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=find_chromium(), args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()

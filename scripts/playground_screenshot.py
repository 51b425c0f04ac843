"""Screenshot of the playground mid-denoising, for the README: serves the bundled demo model on a free loopback
port, opens the page in the headless system Chromium the tests use (tests/browser.py), sends a chat prompt and
captures the page while the second canvas is being denoised.

    python scripts/playground_screenshot.py [--out docs/playground.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import chromium, why_no_browser  # noqa: E402
from server_fixtures import LiveServer  # noqa: E402

PROMPT = "Tell me about the sea and the ships upon it."
# Marks the body once the second canvas is a few steps in; the screenshot follows within a few steps.
MARK = """() => new MutationObserver((_, observer) => {
  if (/^canvas 2 · step [2-9]\//.test(document.getElementById("counter").textContent)) {
    document.body.dataset.shot = "1";
    observer.disconnect();
  }
}).observe(document.getElementById("counter"), {childList: true, characterData: true, subtree: true})"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "playground.png")
    p.add_argument("--seed", default="7")
    args = p.parse_args()
    if reason := why_no_browser():
        print(f"cannot take the screenshot: {reason}", file=sys.stderr)
        return 1
    import torch

    import dgemma
    from dgemma.server.app import create_app
    from dgemma.server.config import ServerConfig

    torch.set_num_threads(1)  # the demo model is small: one thread is fastest, and leaves a core to Chromium
    server = LiveServer(create_app(ServerConfig(model_name="demo"), dgemma.load)).start()
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(server.url + "/")
            page.wait_for_selector("body[data-state=idle]", timeout=120_000)
            page.fill("#system", "You are a poet of the sea.")
            page.fill("#seed", args.seed)
            page.fill("#prompt", PROMPT)
            page.evaluate(MARK)  # Playwright's own polling backs off to 1 s: the page marks the moment itself
            page.click("#send")
            page.wait_for_selector("body[data-shot]", timeout=120_000)
            page.screenshot(path=str(args.out))
            page.click("#stop")
    finally:
        server.stop()
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

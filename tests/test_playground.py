"""The playground page (GET /) in a real headless Chromium (the system's, driven by Playwright): it loads with no
console error and the checkpoint's defaults; a chat with a system prompt and two turns streams drafts that change
and then the text the API returns for the same seed and history; the completion tab and the replay work; Stop
aborts the request on the server; a missing or wrong API key, a refused parameter and a full server show
readable errors. Skipped, saying why, where Playwright or Chromium is missing."""

import re
import threading

import httpx
import pytest

from browser import chromium, why_no_browser
from server_fixtures import gemma4_checkpoint, load_with_eos, served_checkpoint, start_server, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(why_no_browser() is not None, reason=f"playground browser tests: {why_no_browser()}")]
KEY = "sk-play-7c1e"
WAIT_MS = 30_000
# Records every distinct look of the canvas (each position's text and state) while the page runs.
WATCH_CANVAS = """() => {
  window.looks = new Set();
  const grid = document.getElementById("canvas");
  const look = () => [...grid.children].map((c) => c.className + ":" + c.textContent).join("|");
  new MutationObserver(() => window.looks.add(look())).observe(grid, {subtree: true, childList: true,
    characterData: true, attributes: true});
}"""

# [text colour, the first non-transparent background behind it] of each element a selector matches.
COLOURS = """(selector) => [...document.querySelectorAll(selector)].map((el) => {
  const fg = getComputedStyle(el).color;
  for (let e = el; e; e = e.parentElement) {
    const bg = getComputedStyle(e).backgroundColor;
    if (bg !== "rgba(0, 0, 0, 0)" && bg !== "transparent") return [fg, bg];
  }
  return [fg, "rgb(255, 255, 255)"];
})"""


def _contrast(fg: str, bg: str) -> float:
    """WCAG 2 contrast ratio of two "rgb(r, g, b)" colours."""
    def luminance(colour: str) -> float:
        channels = [int(v) / 255 for v in re.findall(r"\d+", colour)[:3]]
        r, g, b = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * r + 0.7152 * g + 0.0722 * b
    hi, lo = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(served_checkpoint(tmp_path_factory), max_concurrency=4, max_queue=4)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser):
    """A fresh page; `page.problems` collects console errors and uncaught exceptions."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    p = context.new_page()
    p.problems = []
    p.on("console", lambda m: p.problems.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: p.problems.append(str(e)))
    yield p
    context.close()


def _open(page, url: str, state: str = "idle") -> None:
    page.goto(url + "/")
    page.wait_for_selector(f"body[data-state={state}]", timeout=WAIT_MS)


def _send(page, prompt: str, state: str = "done") -> None:
    page.fill("#prompt", prompt)
    page.press("#prompt", "Control+Enter")  # the keyboard path
    page.wait_for_selector(f"body[data-state={state}]", timeout=WAIT_MS)


def _chat(server, messages: list[dict], **kw) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_chat_streams_drafts_then_the_api_text(server, page):
    _open(page, server.url)
    defaults = {f: page.input_value(f"#{f}") for f in ("max-tokens", "steps", "t-max", "t-min", "entropy-bound")}
    assert defaults == {"max-tokens": "16", "steps": "12", "t-max": "0.8", "t-min": "0.4", "entropy-bound": "0.1"}
    assert "canvas 8 tokens" in page.text_content("#model-status")
    page.evaluate(WATCH_CANVAS)
    page.fill("#system", "Answer briefly.")
    page.fill("#seed", "5")
    _send(page, "Hello there, who are you?")
    assert page.evaluate("window.looks.size") >= 3  # drafts that change, drawn step by step
    first = page.text_content("#history li.assistant .text")
    assert first and page.text_content("#committed") == first
    assert page.locator("#stats tbody tr").count() == 2  # 16 tokens: two canvases of 8, one stats row each
    system = {"role": "system", "content": "Answer briefly."}
    user = {"role": "user", "content": "Hello there, who are you?"}
    assert first == _chat(server, [system, user], seed=5, max_tokens=16)
    _send(page, "And what do you do?")  # the second turn carries the history
    second = page.locator("#history li.assistant .text").nth(1).text_content()
    history = [system, user, {"role": "assistant", "content": first},
               {"role": "user", "content": "And what do you do?"}]
    assert second == _chat(server, history, seed=5, max_tokens=16)
    assert page.problems == []


def test_completion_tab_and_replay(server, page):
    _open(page, server.url)
    page.focus("#tab-chat")
    page.keyboard.press("ArrowRight")  # tabs by keyboard
    assert page.get_attribute("#tab-completion", "aria-selected") == "true"
    assert page.is_visible("#completion-out") and not page.is_visible("#history")
    page.fill("#seed", "3")
    page.fill("#max-tokens", "12")
    _send(page, "Once upon a time")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "seed": 3, "max_tokens": 12})
    assert page.text_content("#completion-out .text") == r.json()["choices"][0]["text"]
    live_stats = page.inner_text("#stats tbody")
    for scheme in ("light", "dark"):  # every text the page shows, in both colour schemes, reads at >= 4.5:1
        page.emulate_media(color_scheme=scheme)
        pairs = page.evaluate(COLOURS, "h1, h2, label, #model-status, #counter, .tok, .legend li, button:enabled, "
                                       "td, th, .completion span, .note, input")
        assert pairs and min(_contrast(fg, bg) for fg, bg in pairs) >= 4.5, (scheme, pairs)
    page.set_viewport_size({"width": 360, "height": 740})  # phone width: nothing wider than the screen
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    page.evaluate(WATCH_CANVAS)
    page.select_option("#speed", "40")
    page.click("#replay")
    page.wait_for_selector("body[data-state=done]", timeout=WAIT_MS)
    assert page.evaluate("window.looks.size") >= 3
    assert page.inner_text("#stats tbody") == live_stats  # the replay rebuilds the same stats
    assert page.problems == []


def test_sampling_knobs_come_from_the_model_card_and_reach_the_request(server, page):
    _open(page, server.url)
    names = [k["name"] for k in httpx.get(server.url + "/v1/models").json()["data"][0]["dgemma_knobs"]]
    assert {"top_p", "top_k", "min_p", "repetition_penalty", "logit_bias"} <= set(names)
    assert all(page.locator(f"#knob-{name}").count() == 1 for name in names)  # an input per knob, none by hand
    page.click(".knobs summary")
    page.click("#tab-completion")
    page.fill("#seed", "3")
    page.fill("#max-tokens", "12")
    page.fill("#knob-top_k", "5")
    page.fill("#knob-repetition_penalty", "1.3")
    page.fill("#knob-logit_bias", "7: -100, 9: 2")
    _send(page, "Once upon a time")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "seed": 3, "max_tokens": 12,
                                                         "top_k": 5, "repetition_penalty": 1.3,
                                                         "logit_bias": {"7": -100, "9": 2}})
    assert page.text_content("#completion-out .text") == r.json()["choices"][0]["text"]
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "seed": 3, "max_tokens": 12})
    assert plain.json()["choices"][0]["text"] != r.json()["choices"][0]["text"]  # the knobs changed the answer
    page.click("#defaults")
    assert page.input_value("#knob-top_k") == ""
    assert page.problems == []


def test_stop_aborts_the_request_on_the_server(server, page):
    _open(page, server.url)
    aborted = server.service.metrics.total.finished.values["abort"]
    page.fill("#max-tokens", "20000")
    page.fill("#prompt", "Tell me a very long story.")
    page.click("#send")
    # canvas 3 or later: a fast machine can pass canvas 3 between two of Playwright's polls
    page.locator("#counter", has_text=re.compile(r"^canvas ([3-9]|[1-9]\d+) ")).wait_for(timeout=4 * WAIT_MS)
    assert server.service.in_use == 1
    page.keyboard.press("Escape")
    page.wait_for_selector("body[data-state=stopped]", timeout=WAIT_MS)
    assert wait_until(lambda: server.service.in_use == 0 and server.service.worker.running == 0, 10)
    assert server.service.metrics.total.finished.values["abort"] == aborted + 1  # ended by the Stop, not by length
    assert "stopped" in page.text_content("#history li.assistant")
    assert page.problems == []


def test_api_key_and_readable_errors(tmp_path_factory, page):
    keyed = start_server(served_checkpoint(tmp_path_factory), api_keys=(KEY,))
    try:
        _open(page, keyed.url, "locked")
        assert "401" in page.text_content("#error") and "API key" in page.text_content("#model-status")
        page.fill("#api-key", "sk-wrong")
        page.press("#api-key", "Enter")
        page.locator("#model-status", has_text="the API key was refused").wait_for(timeout=WAIT_MS)
        assert "401" in page.text_content("#error")
        page.fill("#api-key", KEY)
        page.press("#api-key", "Enter")
        page.wait_for_selector("body[data-state=idle]", timeout=WAIT_MS)
        assert page.is_hidden("#error")
        page.fill("#steps", "0")
        _send(page, "Hello", "error")
        error = page.text_content("#error")
        assert error.startswith("400") and "dgemma_sampling.max_denoising_steps" in error
        assert page.locator("#history li").count() == 0  # the refused turn is not kept, its prompt is back
        assert page.input_value("#prompt") == "Hello"
        page.click("#defaults")
        _send(page, "Hello")  # the key goes with the POST too
    finally:
        keyed.stop()


def test_a_full_server_shows_429(tmp_path_factory, page):
    full = start_server(served_checkpoint(tmp_path_factory), max_concurrency=1, max_queue=0, max_n=1)
    hold = threading.Event()

    def occupy():
        body = {"prompt": "x", "max_tokens": 20000, "stream": True}
        with httpx.stream("POST", full.url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if hold.is_set():
                    return

    thread = threading.Thread(target=occupy, daemon=True)
    try:
        thread.start()
        assert wait_until(lambda: full.service.in_use == 1, 10)
        _open(page, full.url)
        _send(page, "Hello", "error")
        assert page.text_content("#error").startswith("429") and "capacity" in page.text_content("#error")
    finally:
        hold.set()
        thread.join(10)
        full.stop()


def test_a_thought_is_shown_folded_above_the_answer(tmp_path_factory, page):
    """Thinking on (a checkpoint with Gemma 4's template): the page asks for it and shows the thought folded above
    the answer, both as the API returns them for the same seed (a seed whose reply thinks, found through the API)."""
    from dgemma.tokenizer import Tokenizer

    checkpoint = gemma4_checkpoint(tmp_path_factory)
    opener = Tokenizer(checkpoint).token_id("<|channel>")
    s = start_server(checkpoint, loader=lambda: load_with_eos(checkpoint), max_concurrency=2)
    try:
        user = {"role": "user", "content": "Hello"}
        ask = {"max_tokens": 16, "max_thinking_tokens": 4, "logit_bias": {str(opener): 6},
               "chat_template_kwargs": {"enable_thinking": True}}
        replies = {seed: httpx.post(s.url + "/v1/chat/completions", json={"messages": [user], "seed": seed, **ask},
                                    timeout=60).json()["choices"][0]["message"] for seed in range(24)}
        seed, reply = next((k, m) for k, m in replies.items() if m.get("reasoning_content") and m.get("content"))
        _open(page, s.url)
        page.check("#think")
        page.fill("#max-thinking", "4")
        page.fill("#seed", str(seed))
        page.fill("#max-tokens", "16")
        page.click(".knobs summary")
        page.fill("#knob-logit_bias", f"{opener}: 6")
        _send(page, "Hello")
        box = page.locator("#history li.assistant details.thought")
        assert box.count() == 1 and not box.evaluate("d => d.open")  # folded
        assert box.locator(".thought-text").text_content() == reply["reasoning_content"]
        assert page.text_content("#history li.assistant .text") == reply["content"]
        assert page.problems == []
    finally:
        s.stop()


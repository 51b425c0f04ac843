"""Images through the OpenAI server (the bundled model, as `dgemma serve` with no --model runs it) and through
`dgemma generate --image`: base64 data URLs accepted, every bad image a one-line 400 / exit 2."""

import base64
import io
import json
import subprocess
import sys

import pytest
import torch

from dgemma.api import DEMO_MODEL
from dgemma.image_limits import ImageLimits
from dgemma.images import preprocess
from server_fixtures import openai_server

Image = pytest.importorskip("PIL.Image")
openai = pytest.importorskip("openai")


def png(width=40, height=30, seed=0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image(u):
    return {"type": "image_url", "image_url": {"url": u}}


TEXT = {"type": "text", "text": "What is in this picture?"}


@pytest.fixture(scope="module")
def client():
    with openai_server(DEMO_MODEL, model_name="demo", images=ImageLimits(max_images=2, max_soft_tokens=70)) as pair:
        yield pair[1]


def test_openai_client_sends_a_base64_image(client):
    """The prompt counts the image's soft tokens (64 for a square at a 70-token budget)."""
    data = png(20, 20)
    soft = preprocess(Image.open(io.BytesIO(data)), 16, 3, 70).soft_tokens
    with_image = client.chat.completions.create(model="demo", messages=user(image(url(data)), TEXT), max_tokens=4,
                                                seed=0)
    text_only = client.chat.completions.create(model="demo", messages=user(TEXT), max_tokens=4, seed=0)
    assert with_image.choices[0].message.content is not None
    assert soft == 64 and with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + soft


@pytest.mark.parametrize("messages,message", [
    (user(image("https://example.com/cat.png"), TEXT), "not fetched by this server"),
    (user(image("data:image/png;base64,%%%"), TEXT), "not valid base64"),
    (user(image(url(b"not a png")), TEXT), "not a PNG, JPEG, GIF or WebP"),
    (user(image("HTTP://example.com/cat.png"), TEXT), "not fetched by this server"),
    # a path on the server's disk, however spelled: one answer that says nothing of the file (issue 39)
    (user(image("/etc/passwd"), TEXT), "400 - an image is a data:image/...;base64,... URL"),
    (user(image("file:///etc/hostname"), TEXT), "400 - an image is a data:image/...;base64,... URL"),
    (user(image("FILE:///dev/zero"), TEXT), "400 - an image is a data:image/...;base64,... URL"),
    (user(image(url(b"BM" + bytes(64))), TEXT), "not a PNG, JPEG, GIF or WebP"),
    (user(*[image(url(png()))] * 3, TEXT), "3 images; at most 2"),
    ([{"role": "system", "content": [image(url(png()))]}, {"role": "user", "content": "hi"}], "user messages"),
])
def test_bad_images_are_400(client, messages, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=messages, max_tokens=2)
    assert message in str(err.value)


def test_cli_generate_with_image(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png())
    cmd = [sys.executable, "-m", "dgemma", "generate", "--image", str(path), "--image-tokens", "70",
           "--max-new-tokens", "4", "--seed", "0", "--json", "Describe it."]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["prompt_tokens"] > 70
    bad = subprocess.run(cmd[:5] + [str(tmp_path / "missing.png")] + cmd[6:], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cannot read image" in bad.stderr


def test_playground_ships_the_attach_control():
    import httpx

    from server_fixtures import start_server

    server = start_server(DEMO_MODEL)
    try:
        page = httpx.get(server.url + "/").text
        assert 'id="image" type="file" accept="image/*"' in page
        script = httpx.get(server.url + "/playground/images.js")
        assert script.status_code == 200 and "image_url" in script.text and "https://" not in script.text
    finally:
        server.stop()


@pytest.mark.slow
def test_playground_attaches_an_image(tmp_path):
    """In a browser: attach a PNG, send; the turn shows the thumbnail and the answer is the API's for the same
    image, text and seed; the image stays in the history for the next turn."""
    import httpx

    from browser import chromium, why_no_browser
    from server_fixtures import start_server

    if why_no_browser() is not None:
        pytest.skip(f"playground browser tests: {why_no_browser()}")
    path = tmp_path / "a.png"
    path.write_bytes(png())
    server = start_server(DEMO_MODEL)
    try:
        with chromium() as browser:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("body[data-state=idle]", timeout=30_000)
            page.fill("#seed", "5")
            page.fill("#max-tokens", "8")
            page.set_input_files("#image", str(path))
            page.locator("#image-name", has_text="a.png").wait_for(timeout=30_000)  # no eval: the page's CSP forbids it
            page.fill("#prompt", "Describe it.")
            page.click("#send")
            page.wait_for_selector("body[data-state=done]", timeout=30_000)
            assert page.locator("#history img.attached").count() == 1
            answer = page.text_content("#history li.assistant .text")
            messages = user(image(url(png())), {"type": "text", "text": "Describe it."})
            r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "seed": 5,
                                                                     "max_tokens": 8}, timeout=60)
            assert answer == r.json()["choices"][0]["message"]["content"]
            assert page.text_content("#image-name") == ""  # detached once answered
    finally:
        server.stop()

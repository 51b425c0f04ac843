"""Image-input abuse benchmark for `dgemma serve` (issue 39), on loopback, bounded in time: what one client's images
cost the server and the other clients.

Each server is a subprocess serving the bundled demo model (it has a small vision tower) with two API keys: the
abuser's (K1) and the bystanders' (K2). Its memory is read from /proc/<pid>/status (Linux).
  prep       one chat request (max_tokens 1) with one image of an extreme aspect ratio or size just under the pixel cap
             (--max-image-pixels, 50M by default): 1 x 49M and 49M x 1 grayscale PNG, 7000 x 7000 RGB PNG, JPEG,
             palette GIF, 16383 x 2990 WebP; a fresh server per case, warmed by a small image. The server's peak RSS
             growth over the request (VmHWM, reset before it) and its wall time (targets: < 300 MB, < 2 s, on a
             2-core CPU). All bodies are under the server's 4 MiB body cap
  bystander  a 16-token text chat (K2), median of --requests, alone, beside two clients (K1) sending the control
             image back to back (64 x 64: as many soft tokens, so the same share of the engine, and next to no
             decoding), and beside each of prep's images the server accepts. Target: within 1.5x of the control,
             none failed (the image's preparation must cost the bystander little beyond the engine's share of two
             more requests, which any two requests cost it; the ratio to the request alone is reported too)
  mixed      two ordinary clients (K2: text and small-image chats, streamed or not) beside three abuse clients
             for --mixed-seconds, then until every abuse case was sent once (at most 4 x --timeout more). The
             abuse clients (K1) send server paths and file:// / FILE:// / HTTP:// URLs (/etc/passwd, /dev/zero, a
             FIFO, a PNG on the server's disk), wrong MIME types, TIFF/BMP/ICO/EPS, truncated and header-bomb PNGs,
             huge aspect ratios, many images, Content-Length + Transfer-Encoding. Targets: no 5xx, no failed ordinary
             request (non-200, a cut stream, finish_reason error, or no answer within --timeout), no 200 for a
             server path, every case sent

The server's address space is capped at its start-up size + --memory-cap-gb (prlimit), so that a runaway read ends in
the server's MemoryError instead of the machine's out-of-memory killer.

    python benchmarks/abuse_images.py [--scenarios prep,bystander,mixed] [--mixed-seconds 30] [--threads 1]
    python benchmarks/abuse_images.py --model DIR ...

Last stdout line: JSON with one object per scenario and "ok" (all targets met); exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import itertools
import json
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from functools import cache
from pathlib import Path

import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from abuse import _rss  # noqa: E402  (the abuse and load benchmarks' helpers)
from load import _start  # noqa: E402

CHAT = "/v1/chat/completions"
K1, K2 = "abuser-key", "bystander-key"  # K1 sends the hostile requests, K2 the ordinary ones
PREP_MB, PREP_S, BYSTANDER_RATIO = 300, 2.0, 1.5
CONTROL = "png_64x64_control"  # the bystander baseline: its soft tokens, next to no decoding


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint to serve (default: the bundled demo model)")
    p.add_argument("--scenarios", default="prep,bystander,mixed", help="comma-separated (default: all three)")
    p.add_argument("--prep-cases", default=",".join(PREP),
                   help=f"prep's and bystander's images, comma-separated (default: all of {', '.join(PREP)})")
    p.add_argument("--requests", type=int, default=5, help="bystander's text requests per phase (default 5)")
    p.add_argument("--bystander-seconds", type=float, default=60.0,
                   help="bystander's phase per image stops after this long, with at least one request (default 60)")
    p.add_argument("--mixed-seconds", type=float, default=30.0, help="mixed's duration (default 30)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a request may go without an answer before it counts as failed (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (default 1)")
    p.add_argument("--memory-cap-gb", type=float, default=8.0,
                   help="the server's address space above its start-up size, GiB (default 8)")
    args = p.parse_args(argv)
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS) or set(args.prep_cases.split(",")) - set(PREP)
    if unknown:
        p.error(f"unknown scenario or prep case: {', '.join(sorted(unknown))}")
    report = {}
    for name in args.scenarios.split(","):
        try:
            report[name] = SCENARIOS[name](args)
        except (Exception, SystemExit) as e:  # a server that would not start, say: reported, not raised
            report[name] = {"error": f"{type(e).__name__}: {e}", "ok": False}
            print(f"{name}: ERROR {report[name]['error']}")
    report["ok"] = all(r["ok"] for r in report.values())
    print(json.dumps(report))
    return 0 if report["ok"] else 1


# ---- the server ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _serve(args):
    """A `dgemma serve` with both keys and a capped address space; (process, url)."""
    server, url = _start(args.model, "cpu", args.threads, 8, ["--api-key", K1, "--api-key", K2, "--max-queue", "64"])
    try:
        size = _rss(server.pid, "VmSize:")
        hard = resource.prlimit(server.pid, resource.RLIMIT_AS)[1]
        cap = int(size + args.memory_cap_gb * 2**30)
        resource.prlimit(server.pid, resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
        yield server, url
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=45)
        except subprocess.TimeoutExpired:  # stuck threads (a FIFO read, say) keep it from exiting
            server.kill()
            server.wait()


def _exited(server) -> dict:
    return {} if server.poll() is None else {"server_exit_code": server.returncode}


def _peak_mb(pid: int, base: float) -> float | None:
    """VmHWM over `base`, MB; None once the process is gone."""
    try:
        return round((_rss(pid, "VmHWM:") - base) / 2**20, 1)
    except OSError:
        return None


# ---- requests -----------------------------------------------------------------------------------------------------
def _chat(content, max_tokens: int = 1, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "seed": 0, **extra}


def _images(*urls: str, text: str = "Describe it.") -> list[dict]:
    return [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _client() -> httpx.Client:
    """A connection per request: a kept-alive one the server is closing would read as a failure of ours."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def _post(client: httpx.Client, url: str, key: str, body, timeout: float) -> tuple[int | str, float, str]:
    """(status or "timeout" / "connection error", seconds, the start of the answer's text)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    t0 = time.perf_counter()
    try:
        r = client.post(url + CHAT, content=content, headers=headers, timeout=timeout)
        return r.status_code, time.perf_counter() - t0, r.text[:300]
    except httpx.TimeoutException:
        return "timeout", time.perf_counter() - t0, ""
    except httpx.TransportError as e:
        return "connection error", time.perf_counter() - t0, type(e).__name__


# ---- images (in memory, compressed: small bodies) -----------------------------------------------------------------
def _encode(mode: str, size: tuple[int, int], fmt: str, color=0, **save) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt, **save)
    return buf.getvalue()


PREP = {  # name -> (MIME type, a function making the encoded image); each under 50M pixels
    "png_1x49M_gray": ("image/png", lambda: _encode("L", (1, 49_000_000), "PNG")),
    "png_49Mx1_gray": ("image/png", lambda: _encode("L", (49_000_000, 1), "PNG")),
    "png_7000x7000_rgb": ("image/png", lambda: _encode("RGB", (7000, 7000), "PNG")),
    "jpeg_7000x7000": ("image/jpeg", lambda: _encode("RGB", (7000, 7000), "JPEG", (120, 80, 40), quality=90)),
    "gif_7000x7000_palette": ("image/gif", lambda: _encode("P", (7000, 7000), "GIF")),
    "webp_16383x2990": ("image/webp", lambda: _encode("RGB", (16383, 2990), "WEBP", (120, 80, 40), method=0)),
    "webp_16383x1024": ("image/webp", lambda: _encode("RGB", (16383, 1024), "WEBP", (120, 80, 40), method=0)),
    "rgba_png_7071x7071": ("image/png", lambda: _encode("RGBA", (7071, 7071), "PNG", (10, 20, 30, 128))),
    # the control: as many soft tokens (the engine's share of the work) with next to no decoding
    "png_64x64_control": ("image/png", lambda: _encode("RGB", (64, 64), "PNG", (200, 30, 30))),
}


@cache
def _prep_image(name: str) -> bytes:
    return PREP[name][1]()


@cache
def _small_png() -> bytes:
    return _encode("RGB", (64, 64), "PNG", (200, 30, 30))


# ---- prep ---------------------------------------------------------------------------------------------------------
def prep(args) -> dict:
    cases = {name: _prep_case(args, name) for name in args.prep_cases.split(",")}
    return {"cases": cases, "targets": {"rss_growth_mb": PREP_MB, "seconds": PREP_S},
            "ok": all(c["ok"] for c in cases.values())}


def _prep_case(args, name: str) -> dict:
    mime, data = PREP[name][0], _prep_image(name)
    body = json.dumps(_chat(_images(_data_url(mime, data)))).encode()
    with _serve(args) as (server, url), _client() as client:
        _post(client, url, K2, _chat(_images(_data_url("image/png", _small_png()))), args.timeout)  # warm-up
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        base = _rss(server.pid)
        status, seconds, text = _post(client, url, K1, body, args.timeout)
        out = {"status": status, "seconds": round(seconds, 3), "rss_growth_mb": _peak_mb(server.pid, base),
               "body_bytes": len(body)} | _exited(server)
    out["ok"] = (isinstance(status, int) and status < 500 and seconds < PREP_S and out["rss_growth_mb"] is not None
                 and out["rss_growth_mb"] < PREP_MB)
    if status != 200:
        out["answer"] = text[:200]
    print(f"prep  {name:<22} {status!s:>7} {seconds:7.2f} s  {out['rss_growth_mb']!s:>8} MB  "
          f"{'ok' if out['ok'] else f'FAIL (targets < {PREP_S} s, < {PREP_MB} MB)'}")
    return out


# ---- bystander ----------------------------------------------------------------------------------------------------
def bystander(args) -> dict:
    text = json.dumps(_chat("Tell me about the sea.", max_tokens=16)).encode()
    with _serve(args) as (server, url), _client() as client:
        _post(client, url, K2, text, args.timeout)  # warm-up
        alone = [_post(client, url, K2, text, args.timeout) for _ in range(args.requests)]
        p50 = statistics.median(s for _, s, _ in alone)
        control = _beside(args, server.pid, url, client, text, CONTROL, p50)
        images = {name: _beside(args, server.pid, url, client, text, name, p50, control["loaded_p50_s"])
                  for name in args.prep_cases.split(",") if name != CONTROL}
        exited = _exited(server)
    failed = sum(status != 200 for status, _, _ in alone) + sum(r.get("failed", 0) for r in images.values())
    worst = max((r["vs_control"] for r in images.values() if "vs_control" in r), default=0.0)
    return {"alone_p50_s": round(p50, 3), "control": control, "images": images, "worst_vs_control": worst,
            "failed": failed, "target_vs_control": BYSTANDER_RATIO,
            "ok": worst < BYSTANDER_RATIO and failed == 0 and not exited} | exited


def _beside(args, pid: int, url: str, client: httpx.Client, text: bytes, name: str, alone: float,
            control: float | None = None) -> dict:
    """The text request while two clients (K1) send image `name` back to back; nothing to measure if it is refused.
    `control`: the text request's p50 beside the control image (the same soft tokens, next to no decoding), so that
    `vs_control` is what the image's preparation costs beyond the engine's share of two more requests."""
    hostile = json.dumps(_chat(_images(_data_url(PREP[name][0], _prep_image(name))))).encode()
    status, _, answer = _post(client, url, K1, hostile, args.timeout)
    if status != 200:
        print(f"bystander  beside {name:<22} refused ({status}): no image work to be in flight")
        return {"refused": status, "answer": answer[:160], "ok": isinstance(status, int) and status < 500}
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base, statuses, stop = _rss(pid), Counter(), threading.Event()
    threads = [threading.Thread(target=_hostile, args=(url, hostile, stop, statuses, args.timeout), daemon=True)
               for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both uploaded and being prepared
    loaded, deadline = [], time.monotonic() + args.bystander_seconds
    while not loaded or (len(loaded) < args.requests and time.monotonic() < deadline):
        loaded.append(_post(client, url, K2, text, args.timeout))
    stop.set()
    for t in threads:
        t.join(args.timeout + 5)
    p50 = statistics.median(s for _, s, _ in loaded)
    out = {"loaded_p50_s": round(p50, 3), "ratio": round(p50 / alone, 2), "loaded_s": [round(s, 3) for _, s, _ in
           loaded], "failed": sum(s != 200 for s, _, _ in loaded), "hostile_statuses": dict(statuses),
           "server_peak_growth_mb": _peak_mb(pid, base)}  # over the RSS after one such image
    if control is not None:
        out["vs_control"] = round(p50 / control, 2)
    out["ok"] = out.get("vs_control", 0.0) < BYSTANDER_RATIO and out["failed"] == 0
    versus = f", {out['vs_control']:.2f}x the control" if control is not None else " (the control)"
    print(f"bystander  beside {name:<22} alone p50 {alone:.3f} s, with 2 in flight p50 {p50:.3f} s: "
          f"{out['ratio']:.2f}x{versus}, {out['failed']} failed, server +{out['server_peak_growth_mb']} MB  "
          f"{'ok' if out['ok'] else f'FAIL (target < {BYSTANDER_RATIO}x the control, 0 failed)'}")
    return out


def _hostile(url: str, body: bytes, stop: threading.Event, statuses: Counter, timeout: float) -> None:
    with _client() as client:
        while not stop.is_set():
            statuses[_post(client, url, K1, body, timeout)[0]] += 1


# ---- mixed --------------------------------------------------------------------------------------------------------
def mixed(args) -> dict:
    results: list[tuple[str, int | str, str]] = []  # (case, status, answer) of every request
    failures: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp, _serve(args) as (server, url):
        cases = _abuse_cases(Path(tmp), url, args.timeout)
        stop = threading.Event()
        threads = [threading.Thread(target=_ordinary, args=(url, i, stop, results, failures, args.timeout),
                                    daemon=True) for i in range(2)]
        threads += [threading.Thread(target=_abuser, args=(url, cases, i / 3, stop, results, args.timeout),
                                     daemon=True) for i in range(3)]
        try:
            for t in threads:
                t.start()
            time.sleep(args.mixed_seconds)
            deadline = time.monotonic() + 4 * args.timeout  # then until every abuse case was sent once, or this
            while set(cases) - {case for case, _, _ in list(results)} and time.monotonic() < deadline:
                time.sleep(0.5)
            stop.set()
            for t in threads:
                t.join(args.timeout + 10)
        finally:
            _release_fifo(Path(tmp) / "fifo")
        exited = _exited(server)
    return _mixed_report(results, failures, set(cases), exited)


def _mixed_report(results: list, failures: Counter, cases: set[str], exited: dict) -> dict:
    tally = Counter(f"{case} {status}" for case, status, _ in results)
    fivexx = sum(isinstance(s, int) and s >= 500 for _, s, _ in results)
    path_200 = sum(s == 200 for case, s, _ in results if case in PATH_CASES)
    ordinary = sum(case.startswith("ordinary") for case, _, _ in results)
    failed = sum(failures.values())
    answers = {case: answer[:160] for case, s, answer in results  # what paths reveal, and what went wrong
               if not case.startswith("ordinary") and (case in PATH_CASES or not isinstance(s, int) or s >= 500)}
    accepted = sorted({case for case, s, _ in results if s == 200 and case in OTHER_FORMATS})
    unsent = sorted(cases - {case for case, _, _ in results})
    framing = Counter(f"{s}, {answer}" for case, s, answer in results if case == "content_length_and_chunked")
    out = {"requests": len(results), "ordinary": ordinary, "failed_ordinary": failed, "failures": dict(failures),
           "5xx": fivexx, "server_path_200": path_200, "accepted_other_formats": accepted,
           "abuse_timeouts": sum(s == "timeout" for c, s, _ in results if not c.startswith("ordinary")),
           "content_length_and_chunked": dict(framing), "cases_not_sent": unsent,
           "tally": dict(sorted(tally.items())), "answers": answers,
           "ok": fivexx == 0 and failed == 0 and path_200 == 0 and not unsent and not exited} | exited
    print(f"mixed  {len(results)} requests: {fivexx} 5xx, {failed} of {ordinary} ordinary failed, {path_200} server "
          f"paths answered 200, formats beyond PNG/JPEG/GIF/WebP answered 200: {accepted or 'none'}"
          f"{', server exited ' + str(exited) if exited else ''}{', cases not sent: ' + str(unsent) if unsent else ''}"
          f"  {'ok' if out['ok'] else 'FAIL (targets: 0, 0, 0, every case sent)'}")
    for key, n in sorted(tally.items()):
        print(f"    {key:<40} {n}")
    return out


def _ordinary(url: str, seed: int, stop: threading.Event, results: list, failures: Counter, timeout: float) -> None:
    """Text and small-image chats, streamed or not, in turn; each failure's reason counted in `failures`."""
    small = _data_url("image/png", _small_png())
    with _client() as client:
        for i in itertools.count(seed):
            if stop.is_set():
                return
            content = "Hello there." if i % 2 else _images(small)
            stream = i % 4 >= 2
            status, why = _ordinary_one(client, url, _chat(content, max_tokens=8, stream=stream), timeout)
            results.append((f"ordinary {'text' if i % 2 else 'image'}{' stream' if stream else ''}", status, why))
            if why:
                failures[why] += 1


def _ordinary_one(client: httpx.Client, url: str, body: dict, timeout: float) -> tuple[int | str, str]:
    """(status, why it failed: "" when it did not)."""
    try:
        with client.stream("POST", url + CHAT, json=body, headers={"authorization": f"Bearer {K2}"},
                           timeout=timeout) as r:
            if r.status_code != 200:
                return r.status_code, f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:100]}"
            if not body["stream"]:
                r.read()
                return 200, "finish_reason error" if r.json()["choices"][0]["finish_reason"] == "error" else ""
            return 200, _stream_failure(r.iter_lines())
    except httpx.TimeoutException:
        return "timeout", f"no answer within {timeout:g} s"
    except httpx.TransportError as e:
        return "connection error", type(e).__name__


def _stream_failure(lines) -> str:
    for line in lines:
        if line == "data: [DONE]":
            return ""
        if line.startswith("data: "):
            chunk = json.loads(line[6:])
            if "error" in chunk or any(c.get("finish_reason") == "error" for c in chunk.get("choices", ())):
                return "error in the stream"
    return "stream cut before [DONE]"


def _abuser(url: str, cases: dict, start: float, stop: threading.Event, results: list, timeout: float) -> None:
    """Every case in turn, from `start` (a fraction of the list: the clients begin apart)."""
    names = list(cases)
    random.Random(0).shuffle(names)
    first = int(start * len(names))
    with _client() as client:
        for i in itertools.count(first):
            if stop.is_set():
                return
            name = names[i % len(names)]
            case = cases[name]
            if callable(case):
                status, answer = case()
            else:
                status, _, answer = _post(client, url, K1, case, timeout)
            results.append((name, status, answer))


PATH_CASES = {"path_png", "file_url_png", "FILE_url_png", "path_passwd", "file_url_passwd", "path_missing",
              "path_directory", "path_dev_zero", "path_fifo", "HTTP_upper_url"}
OTHER_FORMATS = {"tiff_as_png", "tiff_float", "bmp", "ico", "eps_as_png"}


def _abuse_cases(tmp: Path, url: str, timeout: float) -> dict:
    """name -> a chat body (bytes) sent with K1, or a function doing its own request: (status, answer)."""
    png = tmp / "on_the_server.png"
    png.write_bytes(_small_png())  # a valid image on the server's disk: answering it reads the server's files
    os.mkfifo(tmp / "fifo")
    paths = {"path_png": str(png), "file_url_png": png.as_uri(), "FILE_url_png": "FILE://" + str(png),
             "path_passwd": "/etc/passwd", "file_url_passwd": "file:///etc/passwd", "path_missing": str(tmp / "no.png"),
             "path_directory": str(tmp), "path_dev_zero": "/dev/zero", "path_fifo": str(tmp / "fifo"),
             "HTTP_upper_url": "HTTP://127.0.0.1:9/x.png", "http_url": "http://127.0.0.1:9/x.png"}
    payloads = {"png_as_jpeg": ("image/jpeg", _small_png()), "text_plain": ("text/plain", b"hello"),
                "svg": ("image/svg+xml", b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>'),
                "tiff_as_png": ("image/png", _encode("RGB", (64, 64), "TIFF")),
                "tiff_float": ("image/tiff", _encode("F", (64, 64), "TIFF")),
                "bmp": ("image/bmp", _encode("RGB", (64, 64), "BMP")),
                "ico": ("image/x-icon", _encode("RGB", (64, 64), "ICO")), "eps_as_png": ("image/png", EPS),
                "truncated_png": ("image/png", _noise_png()[:-20_000]), "header_bomb_png": ("image/png", _bomb()),
                "over_cap_png": ("image/png", _encode("L", (7072, 7072), "PNG")),
                "aspect_1x49M": ("image/png", _prep_image("png_1x49M_gray"))}
    gif = _data_url("image/gif", _prep_image("gif_7000x7000_palette"))
    cases = {name: _chat(_images(u)) for name, u in paths.items()}
    cases |= {name: _chat(_images(_data_url(*p))) for name, p in payloads.items()}
    cases |= {"bad_base64": _chat(_images("data:image/png;base64,!!!!")),
              "many_images_8x49M": _chat(_images(*[gif] * 8)),
              "too_many_images": _chat(_images(*[_data_url("image/png", _small_png())] * 9))}
    cases = {name: json.dumps(body).encode() for name, body in cases.items()}
    port = int(url.rsplit(":", 1)[1])
    return cases | {"content_length_and_chunked": lambda: _cl_te(port, timeout)}


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\nnewpath 0 0 moveto 64 64 lineto stroke\nshowpage\n%%EOF\n"


def _noise_png() -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (256, 256), random.Random(0).randbytes(256 * 256 * 3)).save(buf, "PNG")
    return buf.getvalue()


def _bomb() -> bytes:
    """A PNG header announcing 60000 x 60000 pixels (3.6G), with no pixels after it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = (60000).to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])
    idat = zlib.compress(b"\0" * 1000)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _cl_te(port: int, timeout: float) -> tuple[int | str, str]:
    """A chat with both Content-Length and Transfer-Encoding: chunked, then a pipelined GET /health on the same
    connection; the first status, and whether the connection was kept open for the second request."""
    body = json.dumps(_chat("hi")).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {K1}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n")
    request = head.encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    data = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(request)
            while chunk := sock.recv(65536):  # until the server closes (or its keep-alive timeout does)
                data += chunk
    except TimeoutError:
        pass
    except OSError as e:
        return "connection error", type(e).__name__
    statuses = re.findall(rb"HTTP/1\.1 (\d{3})", data)
    if not statuses:
        return "timeout" if not data else "no status line", ""
    return int(statuses[0]), f"{len(statuses)} responses on the connection" + (" (kept open)" * (len(statuses) > 1))


def _release_fifo(fifo: Path) -> None:
    """Opens and closes the FIFO for writing while a reader waits on it, so that no server thread stays blocked."""
    for _ in range(64):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: no reader (left), or the directory is gone
            return
        time.sleep(0.05)


SCENARIOS = {"prep": prep, "bystander": bystander, "mixed": mixed}

if __name__ == "__main__":
    sys.exit(main())

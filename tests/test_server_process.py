"""Shutdown and the command: SIGTERM drains (in-flight requests finish or are aborted within the timeout, new
ones are refused) and the process exits 0; API keys never reach the log; a bad model exits 2."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dgemma.server.command import main as serve_main
from server_fixtures import served_checkpoint, start_server, wait_until

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-4a1f9c0d"


def _serve(*args, timeout: float = 90):
    """Start the server on a free port; returns (process, base url, stderr lines collected so far)."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma.server.command", "--port", "0", "--threads", "1", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    proc.reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    proc.reader.start()
    assert wait_until(lambda: any("serving" in line for line in lines) or proc.poll() is not None, timeout)
    match = next((re.search(r"http://127\.0\.0\.1:(\d+)", line) for line in lines if "serving" in line), None)
    return proc, (f"http://127.0.0.1:{match.group(1)}" if match else None), lines


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory)


def _stream(url: str, body: dict, out: dict, name: str) -> None:
    """Collect a streamed completion's data lines into out[name] as they arrive (a transport error last)."""
    events = out[name] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEY}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as e:
        events.append(f"transport error: {e!r}")


def test_sigterm_drains_and_exits_cleanly(checkpoint):
    proc, url, log = _serve("--model", str(checkpoint), "--shutdown-timeout", "5", "--api-key", KEY,
                            "--api-key", "second-key")
    try:
        assert url, "".join(log)
        auth = {"authorization": f"Bearer {KEY}"}
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, 60)
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer wrong-key-77"}).status_code == 401
        assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(url + "/v1/models?api_key=query-key-31&x=1").status_code == 401  # keys only as bearer
        out: dict = {}
        long = threading.Thread(target=_stream, args=(url, {"prompt": "Hello", "max_tokens": 100_000, "stream": True},
                                                      out, "long"))
        short = threading.Thread(target=_stream, args=(url, {"prompt": "Hi", "max_tokens": 32, "seed": 1,
                                                             "stream": True}, out, "short"))
        long.start()
        assert wait_until(lambda: out.get("long"), 30)
        short.start()
        assert wait_until(lambda: out.get("short"), 30)  # both in flight: SIGTERM now
        late = httpx.Client(headers=auth)
        assert late.get(url + "/health").status_code == 200  # an open keep-alive connection
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = late.post(url + "/v1/completions", json={"prompt": "Hi"})  # on the open connection: 503, not a reset
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)  # but no new connections
        assert proc.wait(timeout=30) == 0
        elapsed = time.monotonic() - t0
        long.join(10)
        short.join(10)
        assert out["short"][-1] == "[DONE]"
        assert json.loads(out["short"][-2])["choices"][0]["finish_reason"] == "length"
        assert out["long"][-1] == "[DONE]" and json.loads(out["long"][-2])["error"]["code"] == "shutting_down"
        assert 4.5 < elapsed < 20  # the long one got the 5 s grace, then was aborted
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)  # stopped listening
        proc.reader.join(5)
        text = "".join(log)
        assert "Shutting down" in text or "shutdown" in text.lower()
        assert KEY not in text and "second-key" not in text and "wrong-key-77" not in text
        assert "query-key-31" not in text and "/v1/models?api_key=***&x=***" in text  # logged, redacted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_draining_refuses_new_work_and_aborts_after_the_timeout(checkpoint):
    """What SIGTERM starts (in-process, to see the window before the listener closes): new requests get 503,
    /health says shutting down, in-flight work goes on until the timeout and then ends with an error chunk."""
    s = start_server(checkpoint, shutdown_timeout=1.0)
    try:
        out: dict = {}
        long = threading.Thread(target=_stream, args=(s.url, {"prompt": "Hi", "max_tokens": 100_000, "stream": True,
                                                              "dgemma_drafts": True}, out, "long"))
        long.start()
        assert wait_until(lambda: s.service.worker.running == 1, 30)
        s.service.begin_drain()
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(s.url + "/health").json()["error"]["code"] == "shutting_down"
        long.join(15)
        assert 0.9 < time.monotonic() - t0 < 5
        assert out["long"][-1] == "[DONE]" and json.loads(out["long"][-2])["error"]["code"] == "shutting_down"
        assert len(out["long"]) > 2  # it kept streaming while draining
        assert wait_until(lambda: s.service.in_use == 0, 1)
    finally:
        s.stop()


def test_bad_model_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    proc, url, log = _serve("--model", str(tmp_path))
    assert proc.wait(timeout=60) == 2  # it loads after binding, so it fails after start-up, then exits
    proc.reader.join(5)
    assert any(line.startswith("error:") and "model_type" in line for line in log), log
    assert serve_main(["--model", str(tmp_path / "nope"), "--port", "0"]) == 2  # fails before binding
    assert "not found" in capsys.readouterr().err


def test_a_non_loopback_bind_needs_allowed_hosts(capsys):
    assert serve_main(["--host", "0.0.0.0", "--port", "0"]) == 2  # refused before loading or binding
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--allowed-hosts" in err and len(err.strip().splitlines()) == 1
    from dgemma.server.command import add_arguments, config_from_args

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--host", "0.0.0.0", "--allowed-hosts", "a.example,b.example", "--allowed-host", "c"])
    assert config_from_args(args).allowed_hosts == ("a.example", "b.example", "c")


def test_served_connections_send_small_writes_at_once():
    """The listening socket makes asyncio turn Nagle off on every connection (TCP_NODELAY): with it on, each
    response after a keep-alive connection's first waited ~40 ms for the client's delayed ACK (OpenAI clients
    keep connections alive), and a stream's chunks waited likewise."""
    import asyncio
    import socket

    from dgemma.server.command import _bind

    async def accepted_nodelay() -> int:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                got.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        listener = _bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            value = await asyncio.wait_for(got, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0

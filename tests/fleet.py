"""A fleet on loopback for tests and benchmarks: `dgemma serve --replicas N` (workers + a router binary; one server
for N = 1, with its ranks under -tp) as a subprocess, its workers' URLs and pids from the launcher's log, and the
prefix-cache counters of their /metrics."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = ("lookups", "hits", "tokens_reused")


def router_binary(name: str = "vllm-router") -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """`dgemma serve --replicas N ARGS` on a free port (`key`: the API key it sends); `workers`: [(pid, url)] once
    ready; `stop()` drains it."""

    def __init__(self, checkpoint: Path, replicas: int, *args: str, router: str = "vllm-router",
                 policy: str = "cache_aware", threads: int | None = None, key: str | None = None,
                 router_args: str = ""):
        self.port = free_port()
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.url = f"http://127.0.0.1:{self.port}"
        env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "dgemma", "serve", "--model", str(checkpoint), "--served-model-name",
                   "tiny", "--port", str(self.port), "--no-access-log", *args]
        if replicas > 1:
            command += ["--replicas", str(replicas), "--router", router, "--router-policy", policy,
                        "--router-args", router_args]
        command += ["--threads", str(threads)] if threads else []
        self.replicas = replicas
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()
        self.workers: list[tuple[int, str]] = []

    def wait_ready(self, timeout: float = 120.0) -> Fleet:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if _ok(self.url + "/health", {}) and _ok(self.url + "/v1/models", self.headers):
                self.workers = self._workers()
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the fleet did not start:\n" + "".join(self.lines[-30:]))

    def _workers(self) -> list[tuple[int, str]]:
        found = [re.search(r"worker \d+ \(pid (\d+)\) on (\S+)", line) for line in self.lines]
        workers = [(int(m.group(1)), m.group(2)) for m in found if m]
        return workers or [(self.process.pid, self.url)]

    def counters(self) -> list[dict[str, float]]:
        """Per worker: its prefix cache's lookups, hits and tokens reused so far."""
        return [prefix_counters(httpx.get(url + "/metrics", headers=self.headers, timeout=10).text)
                for _, url in self.workers]

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def prefix_counters(text: str) -> dict[str, float]:
    out = {}
    for name in COUNTERS:
        match = re.search(rf"^dgemma_prefix_cache_{name}_total (\S+)$", text, re.M)
        out[name] = float(match.group(1)) if match else 0.0
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def _ok(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(url, headers=headers, timeout=2).status_code == 200
    except httpx.TransportError:
        return False

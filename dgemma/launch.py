"""Child processes of a command on this machine: `dgemma ... -tp N` started as N ranks (the environment torchrun
would give them), passed the launcher's signals, stopped together; free loopback ports; children that die with
their launcher. No torch import: the launchers stay light."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

GRACE_SECONDS = 30.0  # after a rank fails, the others' time to stop on SIGTERM before SIGKILL


def launch_ranks(n: int, argv: list[str]) -> int:
    """`python -m dgemma ARGV` as ranks 0..n-1 (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT), each with
    cores / n threads unless OMP_NUM_THREADS is set. SIGTERM / SIGINT go to every rank once (a server's rank 0
    drains, the others follow it). Returns 0 when every rank succeeds; once one fails, the others are stopped and
    its code is returned."""
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))} | os.environ | {
        "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_ports(1)[0])}
    ranks = [spawn([sys.executable, "-m", "dgemma", *argv], env | {"RANK": str(r), "LOCAL_RANK": str(r)},
                   stdin=None if r == 0 else subprocess.DEVNULL) for r in range(n)]  # rank 0 reads (`chat`)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: _signal(ranks, s))
    while (code := _first_failure(ranks)) is None and any(r.poll() is None for r in ranks):
        time.sleep(0.1)
    if code:
        stop(ranks, GRACE_SECONDS)
    return code or 0


def spawn(command: list[str], env: dict[str, str], cores: list[int] | None = None,
          stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    """`command` in a session of its own (a terminal's Ctrl-C reaches the launcher only, which passes it on once),
    told to stop when the launcher dies, on `cores` when given; `stdin` None: the launcher's."""
    def child_setup() -> None:
        _die_with_parent()
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return subprocess.Popen(command, env=env, preexec_fn=child_setup, stdin=stdin, start_new_session=True)


def stop(children: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every child still running, then SIGKILL to any not gone within `grace` seconds."""
    _signal(children, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _signal(children: list[subprocess.Popen], sig: int) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(sig)


def _first_failure(children: list[subprocess.Popen]) -> int | None:
    return next((c.returncode for c in children if c.poll() not in (None, 0)), None)


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the launcher dies, however it dies (no orphans after a SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

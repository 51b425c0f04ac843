"""`dgemma ... -tp N` without torchrun (dgemma/launch.py): the ranks get torchrun's environment; one failing rank
stops the others at once and its code is the launcher's; a signal reaches every rank once. (Rank 0 reading the
launcher's standard input: test_parallel.py's `chat -tp 2`.)"""

import os
import signal
import subprocess
import sys
import threading
import time

from dgemma import launch

RANK_SCRIPT = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
say = lambda *words: os.write(1, (" ".join(map(str, words)) + "\\n").encode())  # one write: lines stay whole
signal.signal(signal.SIGTERM, lambda *_: (say(rank, "term"), sys.exit(0)))
say(rank, os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_PORT"])
if os.environ.get("FAIL") == str(rank):
    time.sleep(2)  # the others start meanwhile (a slow machine may still stop one before it says so)
    sys.exit(3)
time.sleep(60)
"""


def _launch(monkeypatch, n: int, fail: str = "", signal_after: float | None = None) -> tuple[int, float]:
    """launch_ranks running RANK_SCRIPT as its ranks (a SIGTERM to this process after `signal_after` s)."""
    children: list[subprocess.Popen] = []
    real = launch.spawn

    def spawn(command, env, cores=None, stdin=subprocess.DEVNULL):
        children.append(real([sys.executable, "-c", RANK_SCRIPT], env | {"FAIL": fail}, cores, subprocess.DEVNULL))
        return children[-1]

    monkeypatch.setattr(launch, "spawn", spawn)
    previous = signal.getsignal(signal.SIGTERM)
    if signal_after is not None:
        threading.Timer(signal_after, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    try:
        code = launch.launch_ranks(n, ["serve"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert all(c.poll() is not None for c in children)
    return code, time.monotonic() - start


def test_a_failing_rank_stops_the_others_and_gives_its_code(monkeypatch, capfd):
    code, seconds = _launch(monkeypatch, 3, fail="1")
    lines = sorted(capfd.readouterr().out.splitlines())
    assert code == 3 and seconds < 20
    started = [line.split() for line in lines if "term" not in line]
    assert ["1", "3", "1"] in [s[:3] for s in started] and all(s[0] == s[2] and s[1] == "3" for s in started)
    assert len({s[3] for s in started}) == 1  # one rendezvous port
    stopped = [line for line in lines if "term" in line]
    assert "1 term" not in stopped and len(stopped) == len(started) - 1  # each other rank that started was stopped


def test_a_signal_reaches_every_rank_once(monkeypatch, capfd):
    code, seconds = _launch(monkeypatch, 2, signal_after=2.0)
    lines = capfd.readouterr().out.splitlines()
    assert code == 0 and seconds < 20
    assert sorted(line for line in lines if "term" in line) == ["0 term", "1 term"]

"""Two replicas behind vllm-router (`dgemma serve --replicas 2`) on loopback: multi-turn chats through the router
answer as one server does for the same seed; with cache_aware a conversation's later turns go to the replica that
holds its prefix and continue from its prefix cache; a replica killed mid-run costs only its in-flight requests;
stopping the launcher leaves no process behind; replicas that are tensor-parallel groups answer as one process. Plus
the launcher's own checks (no router binary, a policy the router lacks, the flags the workers get)."""

import argparse
import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from dgemma.errors import DgemmaError
from dgemma.server import replicas
from dgemma.server.command import add_worker_arguments
from dgemma.server.command import main as serve_main
from fleet import Fleet, alive, router_binary
from server_fixtures import served_checkpoint, wait_until

openai = pytest.importorskip("openai")
needs_router = pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed "
                                  "(pip install vllm-router): the fleet tests need the router binary")
CHATS = [["Say hello to the server.", "What is block diffusion?", "And the tokenizer?"],
         ["Once upon a time there was a fox.", "What did the fox do next?", "Why was the dog lazy?"]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(served_checkpoint(tmp_path_factory), 2, "--max-concurrency", "4", policy="cache_aware")
    try:
        yield f.wait_ready()
    finally:
        pids = [pid for pid, _ in f.workers]
        assert f.stop() == 0
        assert wait_until(lambda: not any(alive(p) for p in pids), 10), "a worker outlived the launcher"


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(client, messages: list[dict], max_tokens: int = 8) -> str:
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                           seed=7)
    return reply.choices[0].message.content


def _served_by(before: list[dict], after: list[dict]) -> int:
    changed = [i for i, (b, a) in enumerate(zip(before, after)) if a["lookups"] > b["lookups"]]
    assert len(changed) == 1, (before, after)
    return changed[0]


@needs_router
def test_chats_follow_their_prefix_and_answer_as_one_server(fleet):
    """Each turn: the replica that served it (its prefix-cache lookups moved), a hit from turn 2 on, on the same
    replica as turn 1; then every turn asked of one replica directly gives the same answer."""
    routed, asked = _client(fleet.url), []
    for chat in CHATS:
        messages, replica = [], None
        for turn, text in enumerate(chat):
            messages.append({"role": "user", "content": text})
            before = fleet.counters()
            answer = _ask(routed, messages)
            after = fleet.counters()
            served = _served_by(before, after)
            if turn:
                assert served == replica, f"turn {turn} left the replica that holds its prefix"
                assert after[served]["hits"] > before[served]["hits"], "a later turn missed the prefix cache"
            replica = served
            asked.append((list(messages), answer))
            messages.append({"role": "assistant", "content": answer})
    one = _client(fleet.workers[0][1])
    assert [_ask(one, messages) for messages, _ in asked] == [answer for _, answer in asked]


@needs_router
def test_a_killed_replica_costs_only_its_in_flight_requests(fleet):
    """Six chats at once; the replica with the most of them in flight is killed: at most those fail (an error,
    no hang), the others finish, and once the router has dropped it every request is served."""
    routed = _client(fleet.url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_ask, routed, [{"role": "user", "content": f"{i}: count the foxes."}], 64)
                   for i in range(6)]
        assert wait_until(lambda: max(_in_flight(fleet)) >= 2, 30)
        loads = _in_flight(fleet)
        victim = loads.index(max(loads))
        os.kill(fleet.workers[victim][0], signal.SIGKILL)
        killed = time.monotonic()
        outcomes = [_outcome(f) for f in futures]
    assert "hang" not in outcomes
    assert outcomes.count("error") <= loads[victim] and outcomes.count("ok") >= 6 - loads[victim], (loads, outcomes)
    assert wait_until(lambda: any(f"worker {victim}" in line and "exited" in line for line in fleet.lines), 5)
    time.sleep(max(0.0, killed + 6 - time.monotonic()))  # the router drops it after 2 failed checks 2 s apart
    after = [_ask(routed, [{"role": "user", "content": f"Hello {i}."}]) for i in range(4)]
    assert all(isinstance(a, str) for a in after)


@needs_router
def test_replicas_of_tensor_parallel_workers_answer_as_one_process(tmp_path_factory):
    """`--replicas 2 -tp 2`: two torchrun groups of two ranks each behind the router; chats through it answer as
    one plain process does (float32, near-greedy); stopping the launcher leaves no rank behind."""
    checkpoint = served_checkpoint(tmp_path_factory)
    asks = [[{"role": "user", "content": chat[0]}] for chat in CHATS] * 2
    one = Fleet(checkpoint, 1, "--dtype", "float32").wait_ready(300)
    try:
        expected = [_ask(_client(one.url), m) for m in asks]
    finally:
        assert one.stop() == 0
    fleet = Fleet(checkpoint, 2, "--dtype", "float32", "-tp", "2", policy="round_robin").wait_ready(300)
    try:
        assert len(fleet.workers) == 2
        assert all(httpx.get(url + "/server_info", timeout=10).json()["tp_size"] == 2 for _, url in fleet.workers)
        assert [_ask(_client(fleet.url), m) for m in asks] == expected
        ports = [url.rsplit(":", 1)[1] for _, url in fleet.workers]
        assert len(_ranks(ports)) == 4
    finally:
        assert fleet.stop() == 0
    assert wait_until(lambda: not _ranks(ports), 20), "a rank outlived the launcher"


def _ranks(ports: list[str]) -> list[int]:
    """Live rank processes (RANK in their environment) serving on these worker ports."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv, env = (proc / "cmdline").read_bytes().split(b"\0"), (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(p.encode() in argv for p in ports) and any(e.startswith(b"RANK=") for e in env) and \
                alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def _in_flight(fleet) -> list[int]:
    return [httpx.get(url + "/get_load", timeout=5).json()["load"] for _, url in fleet.workers]


def _outcome(future) -> str:
    try:
        future.result(timeout=90)
        return "ok"
    except concurrent.futures.TimeoutError:
        return "hang"
    except openai.APIError:
        return "error"


def test_no_router_binary_is_one_line_naming_the_package(monkeypatch, capsys):
    monkeypatch.setattr(replicas.shutil, "which", lambda *a, **k: None)
    with pytest.raises(DgemmaError, match="pip install sglang-router"):
        replicas._router_binary("sglang-router", "round_robin")
    assert serve_main(["--replicas", "2", "--router", "sglang-router", "--router-policy", "consistent_hash"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --router-policy consistent_hash: sglang-router offers "
                                               "cache_aware, round_robin, power_of_two, random")


def test_workers_get_the_flags_that_were_set():
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    replicas.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--api-key", "a", "--api-key", "b", "--no-access-log", "--port", "9",
                              "--replicas", "2", "--max-n", "4", "--allowed-hosts", "x"])
    assert replicas.worker_argv(args, parser) == ["--model", "m", "--api-key", "a", "--api-key", "b", "--max-n", "4",
                                                  "--no-access-log"]

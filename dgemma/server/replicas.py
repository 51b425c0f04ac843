"""`dgemma serve --replicas N`: N `dgemma serve` workers on loopback ports (one GPU each, or a share of the CPU
cores each, threads split; with -tp M each worker is M ranks, on M GPUs) behind a router binary (vllm-router or
sglang-router, from PyPI) that listens on --host/--port; all started, and stopped, together (SIGTERM / Ctrl-C
drains the workers; the children are told to stop if this process dies)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dgemma.errors import ConfigError, DgemmaError
from dgemma.launch import free_ports, spawn, stop
from dgemma.server.config import KEY_ENV

log = logging.getLogger("dgemma.server")
POLICIES = {"vllm-router": ("cache_aware", "consistent_hash", "round_robin", "power_of_two", "random"),
            "sglang-router": ("cache_aware", "round_robin", "power_of_two", "random")}
WORKER_ONLY = ("replicas", "router", "router_policy", "router_args", "host", "port", "threads", "allowed_hosts",
               "cors_origins")
# a replica that died is dropped after two failed /health checks 2 s apart (the routers' defaults: 3 x 60 s)
HEALTH_CHECKS = ("--health-check-interval-secs", "2", "--health-failure-threshold", "2")
# cache_aware leaves the replica that holds a prompt's prefix when it has --max-concurrency / 2 more requests in
# flight than the least loaded and 1.2x as many (measured: a shared system prompt sent every chat to one replica)
BALANCE_RELATIVE = ("--balance-rel-threshold", "1.2")
STARTUP_SECONDS = 900.0  # a worker's load (a repo download included) before the launcher gives up


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=1, help="start this many workers (one per GPU with --device "
                   "cuda, N with -tp N; else a share of the CPU cores each) behind --router on --host/--port (default "
                   "1: no router)")
    p.add_argument("--router", default="vllm-router", choices=tuple(POLICIES),
                   help="router binary in front of the replicas (pip install vllm-router / sglang-router)")
    p.add_argument("--router-policy", default="cache_aware", choices=POLICIES["vllm-router"],
                   help="the router's policy: cache_aware sends a chat's turns to the replica that holds its "
                   "prefix (sglang-router has no consistent_hash)")
    p.add_argument("--router-args", default="", metavar="'ARGS'", help="more arguments for the router, as one "
                   "string (e.g. '--balance-abs-threshold 8': cache_aware's load balancing)")


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    url: str


def run(args: argparse.Namespace, worker_parser: argparse.ArgumentParser) -> int:
    """Start the workers, wait until each is healthy, start the router, and wait for a signal (or the router's
    end); then stop everything. `worker_parser`: `dgemma serve`'s own flags, to pass the workers theirs."""
    if args.replicas < 1:
        raise ConfigError("--replicas must be >= 1")
    router = _router_binary(args.router, args.router_policy)
    try:
        extra = shlex.split(args.router_args)
    except ValueError as e:
        raise ConfigError(f"--router-args: {e}") from None
    ports = free_ports(args.replicas + 2)
    metrics_port = ports.pop()  # the router's own Prometheus exporter (its default 29000 clashes between fleets)
    port = args.port or ports.pop()  # --port 0: any free port, as for one server
    children: list[Child] = []
    signals = _stop_on_signals()
    try:
        for i, worker_port in enumerate(ports[:args.replicas]):
            children.append(_start_worker(i, worker_port, args, worker_parser))
        _wait_healthy(children, signals)
        command = _router_command(router, args, port, [c.url for c in children], metrics_port) + extra
        children.append(Child(args.router, spawn(command, os.environ.copy()), f"http://{args.host}:{port}"))
        log.info("serving %d replicas behind %s (%s) on http://%s:%d (router metrics on 127.0.0.1:%d)",
                 args.replicas, args.router, args.router_policy, args.host, port, metrics_port)
        return _supervise(children, signals)
    finally:
        stop([c.process for c in children], args.shutdown_timeout + 10)  # the workers drain first


def _router_binary(name: str, policy: str) -> str:
    if policy not in POLICIES[name]:
        raise ConfigError(f"--router-policy {policy}: {name} offers {', '.join(POLICIES[name])}")
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise DgemmaError(f"--replicas needs the router binary {name}: pip install {name}")
    return found


def _router_command(binary: str, args: argparse.Namespace, port: int, urls: list[str], metrics_port: int) -> list[str]:
    """The router on --host and `port` over `urls` (--router-args go last: the routers take the last of a repeated
    flag). vllm-router passes each client's key on to the workers (which check it, and partition their prefix
    caches by it); sglang-router checks the first --api-key (or $DGEMMA_API_KEY) itself."""
    command = [binary, *(["launch"] if args.router == "sglang-router" else []), "--host", args.host,
               "--port", str(port), "--worker-urls", *urls, "--policy", args.router_policy,
               *HEALTH_CHECKS, "--log-level", "warn" if args.router == "sglang-router" else "warning",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    if args.router_policy == "cache_aware":  # the routers' 64 in flight is 4x dgemma's batch (default 16)
        command += ["--balance-abs-threshold", str(max(1, args.max_concurrency // 2)), *BALANCE_RELATIVE]
    keys = [*args.api_keys, *filter(None, [os.environ.get(KEY_ENV)])]
    if args.router == "sglang-router" and keys:
        command += ["--api-key", keys[0]]
    return command


def _start_worker(i: int, port: int, args: argparse.Namespace, parser: argparse.ArgumentParser) -> Child:
    """Worker i on 127.0.0.1:`port`: GPU i with --device cuda, else its share of the cores. With -tp N the worker
    is a group of N ranks: GPUs i*N .. i*N+N-1, or its cores' share split between its ranks' threads."""
    env = os.environ.copy()
    extra = ["--host", "127.0.0.1", "--port", str(port)]
    cores, tp = None, args.tensor_parallel_size
    if args.device.startswith("cuda"):
        visible = env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.replicas * tp)))).split(",")
        if (i + 1) * tp > len(visible):
            raise ConfigError(f"--replicas {args.replicas} x -tp {tp} needs {args.replicas * tp} GPUs; only "
                              f"{len(visible)} are visible")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i * tp:(i + 1) * tp])
    else:
        cores = _core_share(i, args.replicas)
        threads = args.threads or max(1, len(cores) // tp)
        env["OMP_NUM_THREADS"] = str(threads)
        extra += ["--threads", str(threads)]
    command = [sys.executable, "-m", "dgemma", "serve", *worker_argv(args, parser), *extra]  # -tp: it starts its ranks
    child = Child(f"worker {i}", spawn(command, env, cores), f"http://127.0.0.1:{port}")
    log.info("%s (pid %d) on %s", child.name, child.process.pid, child.url)
    return child


def worker_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The flags of `parser` that `args` sets to other than their defaults, launcher-only ones left out."""
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest in WORKER_ONLY or value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [part for v in value for part in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    return argv


def _core_share(i: int, n: int) -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n)
    return cores[i * per:(i + 1) * per] or cores[-per:]








def _stop_on_signals() -> list[int]:
    """The signals received so far (SIGTERM, SIGINT): the first stops the launcher, which drains the workers."""
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: received.append(s))
    return received


def _wait_healthy(children: list[Child], signals: list[int]) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.process.poll() is not None:
                raise DgemmaError(f"{child.name} exited with code {child.process.returncode} while starting")
            if _healthy(child.url):
                pending.remove(child)
        if signals:
            raise DgemmaError("interrupted while the workers started")
        if time.monotonic() > deadline:
            raise DgemmaError(f"{pending[0].name} was not ready after {STARTUP_SECONDS:g} s")
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _supervise(children: list[Child], signals: list[int]) -> int:
    """Until a signal (0) or the router's end (its code, or 1): a worker that ends is reported, and the router
    serves on with the others."""
    router, reported = children[-1], set()
    while not signals:
        if router.process.poll() is not None:
            log.error("%s exited with code %d; stopping the workers", router.name, router.process.returncode)
            return router.process.returncode or 1
        for child in children[:-1]:
            if child.process.poll() is not None and child.name not in reported:
                reported.add(child.name)
                log.warning("%s (%s) exited with code %d; the router serves on with the others", child.name,
                            child.url, child.process.returncode)
        time.sleep(0.2)
    return 0




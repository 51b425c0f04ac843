"""`dgemma serve`: arguments, binding the socket, and running uvicorn with a SIGTERM drain (with --replicas, the
launcher in replicas.py instead). Wired into
dgemma/cli.py as `add_arguments(parser)` + `run(args)`; also runnable as `python -m dgemma.server.command`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from dgemma.errors import DgemmaError
from dgemma.options import add_model_options, add_parallel_option, add_threads_option, apply_threads
from dgemma.server.config import KEY_ENV, METRICS_KEY_ENV, ServerConfig

log = logging.getLogger("dgemma.server")


def _load(args: argparse.Namespace):
    from dgemma.api import load_model_from_args  # torch: only once serving starts, so --help stays fast

    return load_model_from_args(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dgemma.server import replicas

    add_worker_arguments(p)
    replicas.add_arguments(p)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """One server's flags (`add_arguments` adds the launcher's: --replicas, --router, --router-policy, ...)."""
    add_model_options(p)
    add_threads_option(p)
    add_parallel_option(p)
    ServerConfig.add_flags(p)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    keys = tuple(args.api_keys) + ((os.environ[KEY_ENV],) if os.environ.get(KEY_ENV) else ())
    metrics_key = args.metrics_key or os.environ.get(METRICS_KEY_ENV) or None
    return ServerConfig.from_args(args, model_name=args.model_name or _default_name(args.model), api_keys=keys,
                                  metrics_key=metrics_key)


def run(args: argparse.Namespace) -> int:
    from dgemma.server.app import create_app
    from dgemma.server.connections import uvicorn_config
    from dgemma.server.security import RedactQuery

    config = config_from_args(args)
    _check_model(args.model, args.revision)
    _setup_logging(config.log_level)
    if getattr(args, "replicas", 1) != 1:
        from dgemma.server import replicas

        worker_flags = argparse.ArgumentParser(add_help=False)
        add_worker_arguments(worker_flags)
        return replicas.run(args, worker_flags)
    apply_threads(args)
    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        return _follow(args, config)  # rank 0 serves; this rank makes its engine calls
    sock = _bind(config.host, config.port)
    failure: list[str] = []
    server = None

    def on_fatal(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(config, lambda: _load(args), on_fatal)
    uv = uvicorn_config(app, config, log_level=config.log_level, access_log=config.access_log,
                        timeout_graceful_shutdown=int(config.shutdown_timeout) + 5)
    logging.getLogger("uvicorn.access").addFilter(RedactQuery())
    server = _uvicorn_server(uv, app.state.service)
    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d (API key %s; playground at /)", config.model_name, _url_host(host), port,
             "required" if config.api_keys else "not required")
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:  # uvicorn re-raises a caught signal after its graceful shutdown; these no-ops make that a clean exit
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
        if args.tensor_parallel_size > 1:
            _leave()
    if failure:
        raise DgemmaError(failure[0])
    return 0


def _follow(args: argparse.Namespace, config: ServerConfig) -> int:
    """A rank > 0 of `dgemma serve -tp N`: load this rank's shard, then follow rank 0's engine until it stops."""
    from dgemma.parallel.mirror import follow
    from dgemma.server.service import engines, prefix_cache_for

    for s in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains and then tells this rank to stop
        signal.signal(s, signal.SIG_IGN)
    model = _load(args)
    follow(engines(model, config, prefix_cache_for(config)), model.module.parallel)
    _leave()
    return 0


def _leave() -> None:
    """The process group's end; a rank that is gone already ends it too."""
    from dgemma.parallel import leave

    try:
        leave()
    except Exception as e:  # a peer that exited first: gloo reports its closed connection
        log.warning("tensor-parallel shutdown: %s", e)


def _uvicorn_server(config, service):
    """A uvicorn.Server whose first SIGTERM/SIGINT starts a drain: stop listening, answer 503 to requests on
    open connections, give in-flight ones --shutdown-timeout, then shut down. A second signal stops at once."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        draining = False

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame) -> None:
            if self.draining or self.should_exit or not hasattr(self, "loop"):
                return super().handle_exit(sig, frame)
            self.draining = True
            service.begin_drain()
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

        async def _drain(self) -> None:
            for listener in self.servers:
                listener.close()
            deadline = self.loop.time() + service.config.shutdown_timeout + 2
            while service.in_use and self.loop.time() < deadline:
                await asyncio.sleep(0.05)
            self.should_exit = True

    return Server(config)


def _check_model(model: str | None, revision: str | None = None) -> None:
    """Fail before binding when the checkpoint cannot exist, and fetch a repo id that is not cached yet (loading
    itself happens after start-up): the loader's own `locate`."""
    from dgemma.api.checkpoint import locate

    locate(model, revision)


def _default_name(model: str | None) -> str:
    if model is None:
        return "demo"
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without it every response
    # after a keep-alive connection's first waited ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise DgemmaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _setup_logging(level: str) -> None:
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgemma serve", description="OpenAI-compatible server.")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except DgemmaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

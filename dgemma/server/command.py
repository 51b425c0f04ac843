"""`dgemma serve`: arguments, binding the socket, and running uvicorn with a SIGTERM drain. Wired into
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
from dgemma.options import add_mode_option, add_model_options, load_model_from_args
from dgemma.server.config import ServerConfig

log = logging.getLogger("dgemma.server")
KEY_ENV = "DGEMMA_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    add_mode_option(p)
    p.add_argument("--served-model-name", help="model id clients send (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    p.add_argument("--api-key", action="append", default=[], help=f"accepted bearer key (repeatable; also "
                   f"${KEY_ENV}). Without keys the API is open")
    p.add_argument("--max-concurrency", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="admitted sequences waiting for a batch row; "
                   "more are refused with 429 (default 64)")
    p.add_argument("--max-cache-mb", type=float, help="largest KV cache one request may need (its prompt + "
                   "max_tokens), MiB; larger requests are refused with 400 before any work (default: no cap)")
    p.add_argument("--prefix-cache-mb", type=int, default=1024, help="MiB of KV cache kept from earlier prompts "
                   "and answers, so a chat's next turn or a shared system prompt is not encoded again (least "
                   "recently used out first; outputs are unchanged; 0: off; default 1024)")
    p.add_argument("--max-prompt-tokens", type=int, help="longest prompt in tokens (default: the context)")
    p.add_argument("--max-tokens", type=int, help="largest max_tokens a request may ask (default: the context)")
    p.add_argument("--max-n", type=int, default=8, help="choices per request, n x prompts (default 8)")
    p.add_argument("--max-stop", type=int, default=8, help="stop strings per request (default 8)")
    p.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string (default 256)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body cap (default 4 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to "
                   "finish after SIGTERM before they are aborted (default 30)")
    p.add_argument("--cors-origin", action="append", default=[], help="allow browser calls from this origin "
                   "(repeatable; default: CORS off)")
    p.add_argument("--allowed-host", action="append", default=[], help="Host header to accept besides the "
                   "loopback names (repeatable; on a loopback bind others are refused)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", action="store_true", help="do not log each request")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    keys = list(args.api_key) + ([os.environ[KEY_ENV]] if os.environ.get(KEY_ENV) else [])
    return ServerConfig(
        model_name=args.served_model_name or _default_name(args.model), host=args.host, api_keys=tuple(keys),
        max_concurrency=args.max_concurrency, max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens, max_n=args.max_n, max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
        max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
        cors_origins=tuple(args.cors_origin), allowed_hosts=tuple(args.allowed_host), mode=args.mode,
        max_cache_mb=args.max_cache_mb, prefix_cache_mb=args.prefix_cache_mb)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dgemma.server.app import create_app
    from dgemma.server.security import MAX_HEADER_BYTES, RedactQuery

    config = config_from_args(args)
    _check_model(args.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    _setup_logging(args.log_level)
    sock = _bind(config.host, args.port)
    failure: list[str] = []
    server = None

    def on_fatal(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(config, lambda: load_model_from_args(args), on_fatal)
    uv = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log, http="h11",
                        lifespan="on", server_header=False, h11_max_incomplete_event_size=MAX_HEADER_BYTES * 2,
                        timeout_graceful_shutdown=int(config.shutdown_timeout) + 5)
    logging.getLogger("uvicorn.access").addFilter(RedactQuery())
    server = _uvicorn_server(uv, on_signal=app.state.service.begin_drain)
    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d (API key %s)", config.model_name, _url_host(host), port,
             "required" if config.api_keys else "not required")
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:  # uvicorn re-raises a caught signal after its graceful shutdown; these no-ops make that a clean exit
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
    if failure:
        raise DgemmaError(failure[0])
    return 0


def _uvicorn_server(config, on_signal):
    """A uvicorn.Server whose first SIGTERM/SIGINT also starts the drain (refuse new work, deadline for the rest)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                on_signal()
            super().handle_exit(sig, frame)

    return Server(config)


def _check_model(model: str | None) -> None:
    """Fail before binding when the checkpoint cannot exist (loading itself happens after start-up)."""
    from dgemma.api import DEMO_MODEL
    from dgemma.weights import resolve_checkpoint

    if model is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise DgemmaError("the bundled demo model is missing from this install; pass --model PATH")
        return
    resolve_checkpoint(model)


def _default_name(model: str | None) -> str:
    if model is None:
        return "demo"
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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

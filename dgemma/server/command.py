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
from dgemma.image_limits import add_image_options, limits_from_args
from dgemma.options import add_mode_option, add_model_options
from dgemma.server.config import ServerConfig

log = logging.getLogger("dgemma.server")
KEY_ENV = "DGEMMA_API_KEY"


def _load(args: argparse.Namespace):
    from dgemma.api import load_model_from_args  # torch: only once serving starts, so --help stays fast

    return load_model_from_args(args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    add_mode_option(p)
    p.add_argument("--served-model-name", help="model id clients send (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all, "
                   "with --allowed-hosts)")
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
    _add_time_arguments(p)
    _add_fairness_arguments(p)
    p.add_argument("--cors-origin", action="append", default=[], help="allow browser calls from this origin "
                   "(repeatable; default: CORS off)")
    p.add_argument("--allowed-hosts", "--allowed-host", action="append", default=[], metavar="NAME[,NAME]",
                   help="Host headers to accept besides the loopback names (repeatable; others are refused). "
                   "Required with a non-loopback --host; '*' accepts any")
    add_image_options(p)
    p.add_argument("--fetch-image-urls", action="store_true", help="fetch http(s) image_url parts (default: "
                   "refused with 400; data: URLs are always accepted). The server then makes requests for clients")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", action="store_true", help="do not log each request")


def _add_time_arguments(p: argparse.ArgumentParser) -> None:
    """Deadlines and connection limits: what keeps one client from holding the others up."""
    p.add_argument("--max-queue-seconds", type=float, help="a request not in the batch after this long is "
                   "answered 503 with Retry-After (default: no limit)")
    p.add_argument("--request-timeout", type=float, help="seconds a request may run from arrival to its last "
                   "token; later it is aborted with 408 (default: no limit; requests may ask less with "
                   "dgemma_timeout)")
    p.add_argument("--header-timeout", type=float, default=10.0, help="seconds a client has to send a complete "
                   "request header, from connecting or from the previous response (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds a client has to send the whole "
                   "request body (default 30)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, help="an idle keep-alive connection is "
                   "closed after this many seconds (default 5)")
    p.add_argument("--max-connections", type=int, default=512, help="open connections; more are answered 503 "
                   "and closed (default 512)")
    p.add_argument("--tokenizer-threads", type=int, default=2, help="prompts tokenized at once, in threads off "
                   "the event loop (default 2)")


def _add_fairness_arguments(p: argparse.ArgumentParser) -> None:
    """Caps on what one request may cost the others; beyond them a request is refused with 400 naming the field
    (a checkpoint default above a cap is lowered to it)."""
    p.add_argument("--max-denoising-steps", type=int, help="most denoising steps per canvas a request may ask "
                   "(dgemma_sampling.max_denoising_steps; default: no cap beyond 10,000)")
    p.add_argument("--max-temperature", type=float, help="highest temperature a request may ask (temperature, "
                   "dgemma_sampling.t_max; default: no cap)")
    p.add_argument("--max-token-steps", type=int, help="most max_tokens x max_denoising_steps one request may "
                   "ask: the decoder work it can cause (default: no cap)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    keys = list(args.api_key) + ([os.environ[KEY_ENV]] if os.environ.get(KEY_ENV) else [])
    return ServerConfig(
        model_name=args.served_model_name or _default_name(args.model), host=args.host, api_keys=tuple(keys),
        max_concurrency=args.max_concurrency, max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens, max_n=args.max_n, max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
        max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
        cors_origins=tuple(args.cors_origin), allowed_hosts=_names(args.allowed_hosts), mode=args.mode,
        tokenizer_threads=args.tokenizer_threads, max_queue_seconds=args.max_queue_seconds,
        request_timeout=args.request_timeout, header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections,
        max_cache_mb=args.max_cache_mb, prefix_cache_mb=args.prefix_cache_mb,
        max_denoising_steps=args.max_denoising_steps, max_temperature=args.max_temperature,
        max_token_steps=args.max_token_steps,
        images=limits_from_args(args, args.fetch_image_urls))


def _names(values: list[str]) -> tuple[str, ...]:
    """Repeated and comma-separated values -> one tuple: ["a,b", "c"] -> ("a", "b", "c")."""
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


def run(args: argparse.Namespace) -> int:
    from dgemma.server.app import create_app
    from dgemma.server.connections import uvicorn_config
    from dgemma.server.security import RedactQuery

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

    app = create_app(config, lambda: _load(args), on_fatal)
    uv = uvicorn_config(app, config, log_level=args.log_level, access_log=not args.no_access_log,
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
    if failure:
        raise DgemmaError(failure[0])
    return 0


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

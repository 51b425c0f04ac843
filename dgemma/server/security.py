"""API keys (constant-time, checked by every protected route before it reads the body, never by looking at the URL),
JSON bodies parsed with a nesting cap,
refusal of foreign Host headers on loopback binds (DNS rebinding), header and body size caps, opt-in CORS, and
query strings kept out of the access log (a client may put a key there)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dgemma.server.config import ServerConfig, is_loopback
from dgemma.server.errors import ApiError, json_error

MAX_HEADER_BYTES = 32 << 10
MAX_JSON_DEPTH = 64  # nesting levels of a request body (a tool's JSON schema needs a few dozen at most)


class ApiKeys:
    """Compares a presented bearer token with every configured key in constant time (sha256 first, so the
    comparison does not depend on the keys' lengths either). Keys are kept only as digests."""

    def __init__(self, keys: tuple[str, ...]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def check(self, request: Request) -> int:
        """Which key the request carries (its position among the keys); 401 when none."""
        found = self.find(request)
        if found is None:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return found

    def find(self, request: Request) -> int | None:
        """Which key the request carries (its position among the keys), or None."""
        found = None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        for i, ref in enumerate(self._digests):  # every key, whatever matched
            if hmac.compare_digest(digest, ref):
                found = i
        return found if scheme.lower() == "bearer" else None


def parse_json(raw: bytes) -> Any:
    """A request body -> its JSON value; a value nested over MAX_JSON_DEPTH levels is a 400 (before it reaches the
    schema, templates or grammars, whose recursion would fail as a 500). Not JSON: None (FastAPI reports it)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        value = None
        deep = True
    except ValueError:
        return None
    else:
        deep = _too_deep(value)
    if deep:
        raise ApiError(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_body")
    return value


def _too_deep(value: Any) -> bool:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


class HostGuard:
    """Answer 400 to requests whose Host is neither a loopback name nor an allowed host (--allowed-hosts, which a
    non-loopback bind must give): a web page whose domain was rebound to this server's address still sends its own
    domain as Host."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]):
        self.app, self.allowed = app, {h.lower().rstrip(".") for h in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._ok(_header(scope, b"host")):
            await _send_error(send, 400, "the Host header names a host this server does not serve", "invalid_host")
            return
        await self.app(scope, receive, send)

    def _ok(self, host: str | None) -> bool:
        name = _hostname(host or "")
        return bool(name) and (is_loopback(name) or name in self.allowed)


class SizeLimits:
    """Refuse headers over MAX_HEADER_BYTES with 431, and bodies over `max_bytes` with 413: at once from
    Content-Length, or while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) for k, v in scope.get("headers", [])) > MAX_HEADER_BYTES:
            return await _send_error(send, 431, f"the request headers are over {MAX_HEADER_BYTES} bytes",
                                     "headers_too_large")
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            status = 413 if length.isdigit() else 400
            return await _send_error(send, status, f"the request body is over {self.max_bytes} bytes"
                                     if status == 413 else "invalid Content-Length", "request_too_large")
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413)  # FastAPI re-raises it from the body read; the handler formats it
            return message

        await self.app(scope, limited, send)


class Cors(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered by an OpenAI error object instead of plain text."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        message = response.body.decode(errors="replace").replace("Disallowed CORS", "CORS preflight refused:")
        return ApiError(400, message, code="cors_refused", headers=headers).response()


class SecurityHeaders:
    """Headers every response carries, errors from the other middleware included: no MIME sniffing, no framing
    (clickjacking), no referrer sent on."""

    HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
               (b"referrer-policy", b"no-referrer")]

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(h for h in self.HEADERS if h[0] not in present)]
            await send(message)

        await self.app(scope, receive, with_headers)


def install(app: FastAPI, config: ServerConfig) -> None:
    """Middleware, innermost first: CORS (only when origins are configured), size caps, Host check, headers."""
    if config.cors_origins:
        app.add_middleware(Cors, allow_origins=list(config.cors_origins), allow_credentials=False,
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"])
    app.add_middleware(SizeLimits, max_bytes=config.max_body_bytes)
    if "*" not in config.allowed_hosts:
        app.add_middleware(HostGuard, allowed=config.allowed_hosts)
    app.add_middleware(SecurityHeaders)


def _hostname(host: str) -> str:
    """Host header -> name: "[::1]:8000" -> "::1", "Example.COM.:80" -> "example.com"."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else ""
    return (host.split(":")[0] if host.count(":") == 1 else host).rstrip(".")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    status, headers, body = json_error(status, message, code)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RedactQuery(logging.Filter):
    """Uvicorn's access lines with every query value replaced by "***" (the API takes none; a client that sends
    `?api_key=...` must not have it written to the log)."""

    _VALUE = re.compile(r"=[^&#\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, query = args[2].split("?", 1)
            record.args = (*args[:2], f"{path}?{self._VALUE.sub('=***', query)}", *args[3:])
        return True

"""Connection hygiene for uvicorn's h11 server: a complete request header within --header-timeout of connecting
(or of the previous response), a whole body within --body-timeout, idle keep-alive connections closed after
--keep-alive-timeout, at most --max-connections open (more are answered 503 and closed), a request framed by both
Content-Length and Transfer-Encoding refused, and protocol errors answered with OpenAI error objects instead of
uvicorn's plain text (the connection closed after them). A slow or silent client costs one timer."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dgemma.server.config import ServerConfig
from dgemma.server.errors import json_error
from dgemma.server.security import MAX_HEADER_BYTES

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


class OneFraming(h11.Connection):
    """h11 frames a request carrying both Content-Length and Transfer-Encoding by the latter and keeps the
    connection; a proxy in front may have framed it by the former (request smuggling), so it is a protocol error
    here (RFC 9112 section 6.1), which the server answers 400 and closes on."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request) and {b"content-length", b"transfer-encoding"} <= dict(event.headers).keys():
            raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding", error_status_hint=400)
        return event


class GuardedH11Protocol(H11Protocol):
    limits: ServerConfig  # set on the subclass that `uvicorn_config` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = OneFraming(h11.SERVER, self.config.h11_max_incomplete_event_size)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = "header"
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"more than {self.limits.max_connections} open connections; retry later",
                         "too_many_connections")
            return
        self._arm(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer; may start a pipelined request
        self._follow(after_response=True)

    def _follow(self, after_response: bool = False) -> None:
        """The deadline of what the client owes now: a header (IDLE), a body (SEND_BODY), or nothing (the request
        is in: the app has it, however long it runs, pipelined or not)."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE and after_response:
            self._phase = "header"  # a connection that trickles bytes goes at the header deadline
            self._arm(self.limits.header_timeout)
        elif state is h11.SEND_BODY and self._phase != "body":
            self._phase = "body"
            self._arm(self.limits.body_timeout)
        elif state not in (h11.IDLE, h11.SEND_BODY):
            self._phase = "busy"
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "the request is not valid HTTP/1.1", "invalid_http")

    # ---- timers ---------------------------------------------------------------------------------------------
    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        what = "request header" if self._phase == "header" else "request body"
        seconds = self.limits.header_timeout if self._phase == "header" else self.limits.body_timeout
        if self._phase == "header" and self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # a silent keep-alive connection: nothing was asked, nothing to answer
            return
        self._refuse(408, f"the {what} did not arrive within {seconds:g} s", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer with an OpenAI error object and close, whatever state the HTTP exchange is in."""
        status, headers, body = json_error(status, message, code)
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Error"))
        head += b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"connection: close\r\n\r\n"
        self.transport.write(head + body)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app reads a disconnect; its own answer, if any, is dropped
            self.cycle.message_event.set()
        self.transport.close()


def uvicorn_config(app: Any, config: ServerConfig, **options: Any):
    """uvicorn.Config for `app` with dgemma's connection limits (`options`: other uvicorn settings)."""
    import uvicorn

    protocol = type("DgemmaH11Protocol", (GuardedH11Protocol,), {"limits": config})
    return uvicorn.Config(app, http=protocol, lifespan="on", server_header=False,
                          timeout_keep_alive=config.keep_alive_timeout,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES * 2, **options)

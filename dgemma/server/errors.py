"""Every error leaves the server as OpenAI's `{"error": {"message", "type", "param", "code"}}`: raised
`ApiError`s, framework and schema errors, unknown routes, and real faults (the only 500s)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("dgemma.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         431: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param, "unsupported_parameter")


def json_error(status: int, message: str, code: str | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A ready-to-send error for pure ASGI middleware: (status, headers, body)."""
    body = json.dumps(error_body(message, TYPES.get(status, "invalid_request_error"), None, code)).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


def param_path(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_fault)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"the body is not valid JSON ({detail})", code="invalid_json").response()
    param = param_path(tuple(err.get("loc", ())))
    if param is None:  # the body itself: missing, not JSON, or not an object
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            return bad_request("send the body as JSON with Content-Type: application/json",
                               code="invalid_content_type").response()
        return bad_request("the body must be a JSON object", code="invalid_body").response()
    return bad_request(f"{param}: {err.get('msg', 'invalid value')}", param).response()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 413:
        message = "the request body is too large"
    else:
        message = str(exc.detail)
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
    return ApiError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()


async def _server_fault(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, "internal server error").response()

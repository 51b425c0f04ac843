"""The browser playground: GET / answers the page and /playground/ its scripts and styles, all shipped in
static/ and public (the page asks for the API key itself). A strict Content-Security-Policy keeps the page to
this origin: no CDN, no external font, no inline script."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class _Files(StaticFiles):
    """The page's scripts and styles, with the page's headers (its policy covers what they do)."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(HEADERS)
        return response


def install(app: FastAPI) -> None:
    app.mount("/playground", _Files(directory=STATIC), name="playground")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

"""The dgemma files one chat request with a json_schema response_format enters in the server (issue 22's measure
of the request path), on the bundled model, through the ASGI app in process.

python benchmarks/request_path.py

Tracing (threading.settrace, set before the app starts so the engine thread is traced too) records only while
the second of two identical requests runs (the first warms imports and the grammar vocabulary). The last stdout
line is JSON: {"files": N, "paths": [...], "reply": ...}.
"""

import json
import os
import sys
import threading
import time

from fastapi.testclient import TestClient

import dgemma
from dgemma.server.app import create_app
from dgemma.server.config import ServerConfig

ROOT = os.path.dirname(dgemma.__file__)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
BODY = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 16, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}


def main() -> None:
    seen, active = set(), [False]

    def tracer(frame, event, arg):
        if active[0] and frame.f_code.co_filename.startswith(ROOT):
            seen.add(os.path.relpath(frame.f_code.co_filename, os.path.dirname(ROOT)))

    threading.settrace(tracer)
    app = create_app(ServerConfig(model_name="tiny"), lambda: dgemma.load())
    with TestClient(app, base_url="http://127.0.0.1") as client:
        while client.get("/health").status_code != 200:
            time.sleep(0.2)
        client.post("/v1/chat/completions", json=BODY)
        sys.settrace(tracer)
        active[0] = True
        reply = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]
        active[0] = False
        sys.settrace(None)
    print(json.dumps({"files": len(seen), "paths": sorted(seen), "reply": reply}))


if __name__ == "__main__":
    main()

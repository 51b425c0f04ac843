"""Request framing on a kept-alive connection: a request whose length two headers give (Content-Length and
Transfer-Encoding) is answered 400 and its connection closed, so what follows it on the socket is never read as
a request (RFC 9112 section 6.1: a proxy in front may have framed it the other way); ordinary pipelining works."""

import json

import pytest

from server_fixtures import error_of, raw_exchange, served_checkpoint, start_server

BODY = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
POST = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
LAST = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"  # the server closes after it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(served_checkpoint(tmp_path_factory), keep_alive_timeout=30)  # idle: open well past `wait`
    yield s
    s.stop()


@pytest.mark.parametrize("framing", [
    b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(CHUNKED),
    b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n" % len(CHUNKED),
    b"content-length: 4\r\ntransfer-encoding: CHUNKED\r\n",  # a front end reading 4 bytes sees "0\r\n\r" ...
])
def test_both_lengths_get_400_and_the_connection_closes(server, framing):
    out = raw_exchange(server, POST + framing + b"\r\n" + CHUNKED + LAST, wait=3)
    status, error = error_of(out)
    assert status == 400 and error["code"] == "invalid_http" and error["type"] == "invalid_request_error"
    assert out.count(b"HTTP/1.1 ") == 1 and b"connection: close" in out.lower()  # the pipelined GET: no answer
    alone = raw_exchange(server, POST + framing + b"\r\n" + CHUNKED, wait=3)  # nothing follows it: closed at once
    assert error_of(alone)[0] == 400 and not alone.endswith(b"<still open>")


@pytest.mark.parametrize("framing, body", [(b"Content-Length: %d\r\n" % len(BODY), BODY),
                                           (b"Transfer-Encoding: chunked\r\n", CHUNKED)])
def test_an_ordinary_pipelined_pair_is_answered(server, framing, body):
    out = raw_exchange(server, POST + framing + b"\r\n" + body + LAST, wait=30)
    assert out.count(b"HTTP/1.1 200") == 2 and not out.endswith(b"<still open>"), out
    assert b'"object":"text_completion"' in out and b'{"status":"ok"}' in out

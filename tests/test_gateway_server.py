"""The lean HTTP/1.1 server under raw sockets: keep-alive and pipelining, Expect: 100-continue,
and clear errors for what it refuses (malformed, chunked bodies, oversized headers/bodies, unknown paths)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("aiohttp")

from gateway_harness import Cluster, assert_no_leak, run


async def exchange(url: str, data: bytes, until: bytes = b"", count: int = 1) -> bytes:
    """Sends raw bytes; reads until ``until`` appears ``count`` times or the server closes."""
    host, port = url.removeprefix("http://").split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(data)
    out = b""
    while not (until and out.count(until) >= count):
        chunk = await r.read(65536)
        if not chunk:
            break
        out += chunk
    w.close()
    return out


def post(body: bytes, extra: str = "") -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


def test_lean_server_protocol() -> None:
    async def scenario() -> None:
        async with Cluster(1, server="lean", max_body_bytes=2048) as c:
            one = json.dumps({"prompt": "hello " * 20, "max_tokens": 2}).encode()
            # Two pipelined requests on one keep-alive connection, both answered in order.
            got = await exchange(c.url, post(one) + post(one, "Connection: close\r\n"))
            assert got.count(b"HTTP/1.1 200 OK") == 2 and got.count(b'"text_completion"') == 2
            assert b"Connection: close" in got.split(b"HTTP/1.1 200 OK")[2]
            # Expect: 100-continue gets the interim answer before the body is sent.
            host, port = c.url.removeprefix("http://").split(":")
            r, w = await asyncio.open_connection(host, int(port))
            w.write(post(one, "Expect: 100-continue\r\n")[: -len(one)])
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
            w.write(one)
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
            w.close()
            # Streaming arrives as a chunked body.
            got = await exchange(c.url, post(json.dumps({"prompt": "s", "max_tokens": 2, "stream": True}).encode()), until=b"0\r\n\r\n")
            assert b"Transfer-Encoding: chunked" in got and b"data: [DONE]" in got
            for raw, status, needle in [
                (b"GARBAGE\r\n\r\n", 400, b"request line"),
                (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411, b"Content-Length"),
                (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -3\r\n\r\n", 400, b"Content-Length"),
                (post(b"x" * 4000), 413, b"larger than 2048"),
                (b"GET /nowhere HTTP/1.1\r\n\r\n", 404, b"Not Found"),
                (b"GET /v1/completions HTTP/1.1\r\n\r\n", 405, b"Method Not Allowed"),
                (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000, 431, b"64 KiB"),
                (post(b"{not json"), 400, b"not valid JSON"),
            ]:
                got = await exchange(c.url, raw, until=b"}}")
                assert got.startswith(f"HTTP/1.1 {status} ".encode()), (raw[:40], got[:80])
                assert needle in got, got
            assert c.mocks[0].requests == 4
            assert_no_leak(c)

    run(scenario())

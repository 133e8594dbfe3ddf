"""The gateway's lean HTTP/1.1 client against scripted raw servers: framing (content-length,
chunked split at every byte, close-delimited), keep-alive reuse, stale connections, errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from gateway_harness import poll, run
from kvroute.gateway.upstream import UpstreamError, UpstreamPool


async def raw_server(reply: Callable[[int], list[bytes]], close_after: bool = False) -> tuple[asyncio.Server, str, list[bytes]]:
    """Answers the n-th request (counted across connections) with reply(n) written piece by piece."""
    seen: list[bytes] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
                seen.append(head + await r.readexactly(n))
                for piece in reply(len(seen)):
                    w.write(piece)
                    await w.drain()
                    await asyncio.sleep(0)
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}", seen


def test_content_length_keepalive_and_request_bytes() -> None:
    async def scenario() -> None:
        srv, url, seen = await raw_server(
            lambda n: [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n", b'{"n":', f"{n}}}".encode()]
        )
        pool = UpstreamPool(1.0, 1.0)
        for i in (1, 2, 3):
            r = await pool.post(url + "/v1/completions", b'{"a":1}', {"Authorization": "Bearer k"})
            assert r.status == 200 and r.headers.get("content-type") == "application/json"
            assert await r.read() == f'{{"n":{i}}}'.encode()
        assert len(pool._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]), False)]) == 1, "one connection reused for all three"
        assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in seen[0]
        assert seen[0].endswith(b'\r\n\r\n{"a":1}')
        pool.close()
        srv.close()

    run(scenario(), timeout=10)


def test_chunked_body_split_at_every_byte() -> None:
    body = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    for part in (body[:11], body[11:22], body[22:]):
        wire += f"{len(part):x};ext=1\r\n".encode() + part + b"\r\n"
    wire += b"0\r\nX-Trailer: t\r\n\r\n"

    async def scenario() -> None:
        for split in range(1, len(wire)):
            srv, url, _ = await raw_server(lambda n, s=split: [wire[:s], wire[s:]])
            pool = UpstreamPool(1.0, 1.0)
            r = await pool.post(url + "/x", b"{}")
            got = b""
            while chunk := await r.readany():
                got += chunk
            assert got == body, split
            assert r.done
            pool.close()
            srv.close()

    run(scenario(), timeout=30)


def test_close_delimited_body_and_errors() -> None:
    async def scenario() -> None:
        srv, url, _ = await raw_server(lambda n: [b"HTTP/1.1 200 OK\r\n\r\nstream until close"], close_after=True)
        pool = UpstreamPool(1.0, 1.0)
        r = await pool.post(url + "/x", b"{}")
        assert await r.read() == b"stream until close"
        srv.close()
        # Engine dies mid-body: the reader gets a clear error, not a short body.
        srv, url, _ = await raw_server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"], close_after=True)
        r = await pool.post(url + "/x", b"{}")
        with pytest.raises(UpstreamError, match="closed"):
            await r.read()
        srv.close()
        srv, url, _ = await raw_server(lambda n: [b"SPDY/3 200 OK\r\n\r\n"], close_after=True)
        with pytest.raises(UpstreamError, match="malformed status line"):
            await pool.post(url + "/x", b"{}")
        srv.close()
        srv, url, _ = await raw_server(lambda n: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], close_after=True)
        r = await pool.post(url + "/x", b"{}")
        with pytest.raises(UpstreamError, match="malformed chunk size"):
            await r.read()
        srv.close()
        # Silence past the read timeout.
        srv, url, _ = await raw_server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"])
        quick = UpstreamPool(1.0, 0.05)
        r = await quick.post(url + "/x", b"{}")
        with pytest.raises(asyncio.TimeoutError):
            await r.read()
        srv.close()
        with pytest.raises(OSError):
            await pool.post(url + "/x", b"{}")  # nothing listens any more
        pool.close()
        quick.close()

    run(scenario(), timeout=10)


def test_stale_keepalive_connection_is_replaced() -> None:
    async def scenario() -> None:
        # The server closes each connection after answering, without saying Connection: close.
        srv, url, seen = await raw_server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], close_after=True)
        pool = UpstreamPool(1.0, 1.0)
        assert await (await pool.post(url + "/x", b"{}")).read() == b"ok"
        [idle] = next(iter(pool._idle.values()))
        await poll(lambda: idle.eof, what="the server's FIN on the idle connection")
        assert await (await pool.post(url + "/x", b"{}")).read() == b"ok"
        assert len(seen) == 2
        pool.close()
        srv.close()

    run(scenario(), timeout=10)

"""A lean HTTP/1.1 client for the gateway's hot path (POST to an engine, stream the answer back):
one write per request, keep-alive pools per engine, no per-request tasks; about a third of aiohttp's client CPU.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from urllib.parse import urlsplit

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse"]

_MAX_HEAD = 64 * 1024


class UpstreamError(ConnectionError):
    """The engine's connection failed, closed early or sent a malformed HTTP response."""


class _Headers(dict[str, str]):
    """Response headers keyed in lower case; ``get`` takes any case."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())


class _Conn(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.exc: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.used = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof = True
        self.exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self.eof and not self.buf

    async def wait(self, timeout: float) -> None:
        """Waits for more bytes (or EOF); TimeoutError after ``timeout`` seconds of silence."""
        if self.eof:
            raise UpstreamError(f"connection closed by the engine{f': {self.exc!r}' if self.exc else ''}")
        w = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, w, timeout)
        try:
            await w
        finally:
            timer.cancel()
            self.waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _expire(w: asyncio.Future[None], timeout: float) -> None:
    if not w.done():
        w.set_exception(asyncio.TimeoutError(f"engine silent for {timeout} s"))


class UpstreamResponse:
    """An engine's answer: ``status``, ``headers``, then the body via ``readany``/``read``.
    ``close`` drops the connection unless the body was read to its end (then it is reused)."""

    def __init__(
        self, pool: UpstreamPool, key: tuple[str, int, bool], conn: _Conn, status: int, headers: _Headers, read_timeout: float
    ) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status = status
        self.headers = headers
        self._timeout = read_timeout
        te = headers.get("transfer-encoding", "") or ""
        cl = headers.get("content-length")
        self._chunked = "chunked" in te.lower()
        self._left: int | None = None if self._chunked or cl is None else int(cl)
        self._chunk_left = 0
        self._state = "size"  # chunked: size | data | crlf | trailer
        self._keep = (headers.get("connection", "") or "").lower() != "close" and (self._chunked or self._left is not None)
        self.done = False
        self.closed = False
        if self._left == 0 or status in (204, 304):
            self._finish()

    def _finish(self) -> None:
        self.done = True
        if not self.closed:
            self.closed = True
            if self._keep and self._conn.alive:
                self._pool._put(self._key, self._conn)
            else:
                self._conn.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._conn.close()

    async def readany(self) -> bytes:
        """The next piece of body bytes (as soon as any arrived); b"" at the end of the body."""
        if self.done:
            return b""
        if self.closed:
            raise UpstreamError("response already closed")
        c = self._conn
        if self._chunked:
            return await self._read_chunked()
        if self._left is None:  # body delimited by connection close
            while not c.buf:
                if c.eof:
                    self._finish()
                    return b""
                await c.wait(self._timeout)
            out = bytes(c.buf)
            c.buf.clear()
            return out
        while not c.buf:
            await c.wait(self._timeout)
        take = min(self._left, len(c.buf))
        out = bytes(c.buf[:take])
        del c.buf[:take]
        self._left -= take
        if self._left == 0:
            self._finish()
        return out

    async def _read_chunked(self) -> bytes:
        c = self._conn
        out = bytearray()
        while True:
            buf = c.buf
            if self._state == "size":
                i = buf.find(b"\r\n")
                if i < 0:
                    if len(buf) > 1024:
                        raise UpstreamError("malformed chunked body (chunk-size line too long)")
                else:
                    line = bytes(buf[:i]).split(b";", 1)[0].strip()
                    try:
                        size = int(line, 16)
                    except ValueError:
                        raise UpstreamError(f"malformed chunk size {line[:20]!r}") from None
                    del buf[: i + 2]
                    if size == 0:
                        self._state = "trailer"
                    else:
                        self._chunk_left = size
                        self._state = "data"
                    continue
            elif self._state == "data":
                if buf:
                    take = min(self._chunk_left, len(buf))
                    out += buf[:take]
                    del buf[:take]
                    self._chunk_left -= take
                    if self._chunk_left == 0:
                        self._state = "crlf"
                    continue
            elif self._state == "crlf":
                if len(buf) >= 2:
                    if buf[:2] != b"\r\n":
                        raise UpstreamError("malformed chunked body (missing CRLF after a chunk)")
                    del buf[:2]
                    self._state = "size"
                    continue
            else:  # trailer: an empty line, or trailer fields then an empty line
                if buf.startswith(b"\r\n"):
                    del buf[:2]
                    self._finish()
                    return bytes(out)
                i = buf.find(b"\r\n\r\n")
                if i >= 0:
                    del buf[: i + 4]
                    self._finish()
                    return bytes(out)
            if out:
                return bytes(out)  # hand over what arrived; don't wait for more
            await c.wait(self._timeout)

    async def read(self, limit: int = -1) -> bytes:
        """The rest of the body (at most ``limit`` bytes when given)."""
        parts: list[bytes] = []
        n = 0
        while limit < 0 or n < limit:
            b = await self.readany()
            if not b:
                break
            parts.append(b)
            n += len(b)
        data = b"".join(parts)
        return data if limit < 0 else data[:limit]


class UpstreamPool:
    """Keep-alive connections per engine; requests are POSTs with a JSON body."""

    def __init__(self, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: defaultdict[tuple[str, int, bool], list[_Conn]] = defaultdict(list)
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def _put(self, key: tuple[str, int, bool], conn: _Conn) -> None:
        if self._closed:
            conn.close()
        else:
            self._idle[key].append(conn)

    def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    async def _connect(self, key: tuple[str, int, bool]) -> _Conn:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop), host, port, ssl=self._ssl if tls else None), self.connect_timeout
            )
        except asyncio.TimeoutError as e:
            raise UpstreamError(f"connect to {host}:{port} timed out after {self.connect_timeout} s") from e
        return conn

    async def post(self, url: str, body: bytes, headers: dict[str, str] | None = None) -> UpstreamResponse:
        """Sends ``body`` to ``url`` and returns once the status line and headers arrived."""
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if tls else 80)
        key = (host, port, tls)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\nAccept: */*\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        ).encode("latin-1")
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.alive:
                try:
                    return await self._send(key, conn, head + body)
                except _StaleConnection:
                    continue  # the engine closed this idle connection before reading it: try another
        return await self._send(key, await self._connect(key), head + body, fresh=True)

    async def _send(self, key: tuple[str, int, bool], conn: _Conn, data: bytes, fresh: bool = False) -> UpstreamResponse:
        assert conn.transport is not None
        conn.transport.write(data)
        try:
            while True:
                i = conn.buf.find(b"\r\n\r\n")
                if i >= 0:
                    break
                if len(conn.buf) > _MAX_HEAD:
                    raise UpstreamError("response headers larger than 64 KiB")
                if conn.eof and not conn.buf and not fresh:
                    raise _StaleConnection
                await conn.wait(self.read_timeout)
        except BaseException:
            conn.close()
            raise
        head = bytes(conn.buf[:i]).decode("latin-1")
        del conn.buf[: i + 4]
        lines = head.split("\r\n")
        status_line = lines[0].split(" ", 2)
        try:
            if not status_line[0].startswith("HTTP/1."):
                raise ValueError(status_line[0])
            status = int(status_line[1])
        except (ValueError, IndexError):
            conn.close()
            raise UpstreamError(f"malformed status line {lines[0][:60]!r}") from None
        hdrs = _Headers()
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                hdrs[k.strip().lower()] = v.strip()
        if 100 <= status < 200:  # engines don't send interim responses for POSTs without Expect
            conn.close()
            raise UpstreamError(f"unexpected interim response {status}")
        return UpstreamResponse(self, key, conn, status, hdrs, self.read_timeout)


class _StaleConnection(Exception):
    pass

"""A lean HTTP/1.1 server for ``kvroute serve``: the gateway's handlers without aiohttp's server
machinery (about a quarter of its CPU per request), keep-alive, streaming, disconnect cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kvroute.gateway.app import Gateway

__all__ = ["LeanRequest", "serve_lean"]

log = logging.getLogger("kvroute.gateway")

_MAX_HEAD = 64 * 1024
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
Handler = Callable[[Any], Awaitable[web.StreamResponse]]


def _head(status: int, headers: CIMultiDict[str] | dict[str, str], extra: str) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for k, v in headers.items():
        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
            lines.append(f"{k}: {v}\r\n")
    lines.append(extra)
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class _LeanStream:
    """The StreamResponse subset the gateway's relay uses, written as a chunked body."""

    def __init__(self, conn: _Conn, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self.prepared = False
        self.eof = False

    async def prepare(self, _request: Any) -> None:
        self._conn.send(_head(self.status, self.headers, "Transfer-Encoding: chunked\r\n"))
        self.prepared = True

    async def write(self, data: bytes) -> None:
        if data:
            self._conn.send(b"%x\r\n%b\r\n" % (len(data), data))
            await self._conn.drain()

    async def write_eof(self) -> None:
        if not self.eof:
            self.eof = True
            self._conn.send(b"0\r\n\r\n")


class LeanRequest:
    """The aiohttp Request subset the gateway's handlers use."""

    __slots__ = ("_body", "_conn", "headers", "match_info", "method", "path", "remote")

    def __init__(self, conn: _Conn, method: str, path: str, headers: CIMultiDictProxy[str], body: bytes) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        self._body = body
        self.remote = conn.peer
        self.match_info: dict[str, str] = {}

    async def read(self) -> bytes:
        return self._body

    async def json(self) -> Any:
        return json.loads(self._body)

    def kvroute_stream(self, status: int, headers: dict[str, str]) -> _LeanStream:
        return _LeanStream(self._conn, status, headers)


class _Conn(asyncio.Protocol):
    def __init__(self, server: _LeanServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buf = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        # Armed while the connection waits for a request (head and body): a client that opens a
        # connection and trickles bytes, or never sends any, is closed after client_timeout.
        self._timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(self.server.gw.config.client_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.closed or self.task is not None:
            return
        if self.buf:
            self._fail(408, f"request not received within {self.server.gw.config.client_timeout:g} s")
        elif self.transport is not None:  # an idle keep-alive connection: just close it
            self.transport.close()
            self.closed = True

    # ---- asyncio callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else str(peer or "")
        self.server.conns.add(self)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._disarm()
        self.server.conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: cancel its upstream request
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.task is None:
            self._next()

    # ---- request handling ------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("client disconnected")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._paused:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def _fail(self, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
        with contextlib.suppress(ConnectionResetError):
            self.send(_head(status, {"Content-Type": "application/json"}, f"Content-Length: {len(body)}\r\nConnection: close\r\n") + body)
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    def _next(self) -> None:
        """Parses one complete request from the buffer, if there is one, and starts its handler."""
        if self.closed:
            return
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                self._fail(431, "request headers larger than 64 KiB")
            return
        try:
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ", 2)
            if not version.startswith("HTTP/1."):
                raise ValueError(version)
        except ValueError:
            self._fail(400, "malformed HTTP request line")
            return
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if not sep:
                self._fail(400, "malformed HTTP header line")
                return
            headers.add(k.strip(), v.strip())
        if "chunked" in headers.get("Transfer-Encoding", "").lower():
            self._fail(411, "chunked request bodies are not supported; send Content-Length")
            return
        try:
            length = int(headers.get("Content-Length", "0"))
            if length < 0:
                raise ValueError
        except ValueError:
            self._fail(400, "invalid Content-Length")
            return
        limit = self.server.gw.config.max_body_bytes
        if length > limit:
            self._fail(413, f"request body larger than {limit} bytes")
            return
        if len(buf) < end + 4 + length:
            if headers.get("Expect", "").lower() == "100-continue" and not getattr(self, "_continued", False):
                self._continued = True
                self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            return
        self._continued = False
        body = bytes(buf[end + 4 : end + 4 + length])
        del buf[: end + 4 + length]
        path = target.split("?", 1)[0]
        keep = version == "HTTP/1.1" and headers.get("Connection", "").lower() != "close"
        req = LeanRequest(self, method, path, CIMultiDictProxy(headers), body)
        self._disarm()
        self.task = asyncio.get_running_loop().create_task(self._run(req, keep))

    async def _run(self, req: LeanRequest, keep: bool) -> None:
        try:
            resp = await self.server.dispatch(req)
            if isinstance(resp, _LeanStream):
                if not resp.prepared:
                    await resp.prepare(req)
                await resp.write_eof()
            else:
                body = resp.body if isinstance(resp, web.Response) else b""
                data = body if isinstance(body, bytes) else b""
                extra = f"Content-Length: {len(data)}\r\n" + ("" if keep else "Connection: close\r\n")
                self.send(_head(resp.status, resp.headers, extra) + data)
        except (asyncio.CancelledError, ConnectionResetError):
            keep = False
        except Exception:
            log.exception("unhandled error serving %s %s", req.method, req.path)
            with contextlib.suppress(ConnectionResetError):
                self._fail(500, "internal gateway error")
            keep = False
        finally:
            self.task = None
        if not keep:
            if self.transport is not None:
                self.transport.close()
            self.closed = True
        else:
            self._arm()
            if self.buf:
                self._next()


class _LeanServer:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.conns: set[_Conn] = set()
        self.routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/completions"): gw.handle_completions,
            ("POST", "/v1/chat/completions"): gw.handle_chat,
            ("GET", "/v1/models"): gw.handle_models,
            ("GET", "/health"): gw.handle_health,
            ("GET", "/metrics"): gw.handle_metrics,
            ("GET", "/admin/workers"): gw.admin_list,
            ("POST", "/admin/workers"): gw.admin_add,
        }

    async def dispatch(self, req: LeanRequest) -> Any:
        handler = self.routes.get((req.method, req.path))
        if handler is None and req.method == "DELETE" and req.path.startswith("/admin/workers/") and len(req.path) > 15:
            req.match_info["worker"] = req.path[len("/admin/workers/") :]
            handler = self.gw.admin_remove
        if handler is None:
            known = {p for _, p in self.routes}
            status = 405 if req.path in known else 404
            return web.json_response(
                {"error": {"message": f"{req.method} {req.path}: {http.HTTPStatus(status).phrase}", "code": status}}, status=status
            )
        return await self.gw.admin_auth(req, handler)  # type: ignore[arg-type]


async def serve_lean(
    gw: Gateway, host: str, port: int, ready: Callable[[str], None] | None = None, *, sock: socket.socket | None = None
) -> None:
    """Runs the gateway on the lean server until cancelled; ``gw.start``/``gw.stop`` around it.
    ``sock``: an already bound socket to serve on instead of ``host:port``."""
    srv = _LeanServer(gw)
    await gw.start()
    loop = asyncio.get_running_loop()
    if sock is not None:
        server = await loop.create_server(lambda: _Conn(srv), sock=sock)
    else:
        server = await loop.create_server(lambda: _Conn(srv), host, port)
    try:
        if ready is not None:
            bound = server.sockets[0].getsockname()
            ready(f"http://{bound[0]}:{bound[1]}")
        await server.serve_forever()
    finally:
        server.close()
        for c in list(srv.conns):
            if c.transport is not None:
                c.transport.abort()
        await gw.stop()

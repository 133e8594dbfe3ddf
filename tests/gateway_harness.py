"""Test harness for the gateway: mock engines plus a gateway, all on 127.0.0.1 ephemeral ports,
inside one event loop; every scenario runs under a hard timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import kvroute
import pytest
from aiohttp import web
from kvroute.gateway.app import Gateway, gateway_app, make_gateway
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.mock import MockWorker, Rendezvous

__all__ = ["Cluster", "MockWorker", "Rendezvous", "assert_no_leak", "http_server", "poll", "run"]


def run(coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
    """Runs one scenario; a hang fails the test instead of stalling the suite."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def poll(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Waits for ``pred`` by polling the event loop (bounded), for effects that have no event to await."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


class Cluster:
    """``n`` mock engines (or explicit prefill/decode ones) behind one gateway.

    Use as ``async with Cluster(...) as c``: ``c.url`` is the gateway, ``c.client`` an aiohttp
    session, ``c.gw`` the Gateway, ``c.mocks`` the engines.
    """

    default_server = "aiohttp"  # set per test by the ``http_server`` fixture

    def __init__(
        self,
        n: int = 2,
        *,
        prefill: int = 0,
        decode: int = 0,
        router: dict[str, Any] | None = None,
        mock: dict[str, Any] | None = None,
        rendezvous: Rendezvous | None = None,
        kv_events_for: dict[int, str] | None = None,
        server: str | None = None,
        **gateway: Any,
    ) -> None:
        self.n, self.n_prefill, self.n_decode = n, prefill, decode
        self.router_kw = router or {}
        self.mock_kw = mock or {}
        self.rendezvous = rendezvous
        self.server = server or Cluster.default_server
        self.kv_events_for = kv_events_for or {}  # mock index -> KV-event endpoint, resolved once the mocks listen
        self.gateway_kw = {"health_interval": 0.05, "connect_timeout": 2.0, **gateway}
        self.mocks: list[MockWorker] = []
        self.prefill: list[MockWorker] = []
        self.decode: list[MockWorker] = []

    async def __aenter__(self) -> Cluster:
        if self.n_prefill:
            self.prefill = [MockWorker(f"p{i}", role="prefill", rendezvous=self.rendezvous, **self.mock_kw) for i in range(self.n_prefill)]
            self.decode = [MockWorker(f"d{i}", role="decode", rendezvous=self.rendezvous, **self.mock_kw) for i in range(self.n_decode)]
            self.mocks = self.prefill + self.decode
            workers: list[str] = []
        else:
            self.mocks = [MockWorker(f"w{i}", **self.mock_kw) for i in range(self.n)]
        for m in self.mocks:
            await m.start()
        if not self.n_prefill:
            workers = [m.url for m in self.mocks]
        if self.kv_events_for:
            self.gateway_kw["kv_events"] = {self.mocks[i].url: ep for i, ep in self.kv_events_for.items()}
        self.router = kvroute.Router(**self.router_kw)
        self._gw = make_gateway(
            self.router, workers, prefill=[m.url for m in self.prefill], decode=[m.url for m in self.decode], **self.gateway_kw
        )
        if self.server in ("lean", "rust"):
            from kvroute.gateway.dataplane import serve_with_data_plane
            from kvroute.gateway.server import serve_lean

            up: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            serve = serve_lean if self.server == "lean" else serve_with_data_plane
            self._lean = asyncio.ensure_future(serve(self._gw, "127.0.0.1", 0, up.set_result))
            done, _ = await asyncio.wait((up, self._lean), return_when=asyncio.FIRST_COMPLETED)
            if self._lean in done:
                self._lean.result()  # raises the startup error
            self.url = up.result()
        else:
            self.app = gateway_app(self._gw)
            self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            assert site._server is not None
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        if self.server in ("lean", "rust"):
            self._lean.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lean
        else:
            await self.runner.cleanup()
        for m in self.mocks:
            await m.stop()

    @property
    def gw(self) -> Gateway:
        return self._gw

    @property
    def metrics(self) -> GatewayMetrics:
        """The gateway's counters, the Rust data plane's folded in when it runs."""
        return self._gw.metrics_view()

    def in_flight(self) -> int:
        """Requests holding an admission slot, in the Python gateway and the data plane."""
        dp = self._gw.data_plane
        return self._gw._in_flight + (dp.in_flight if dp is not None else 0)

    def worker_id(self, mock: MockWorker) -> int:
        return next(w.id for w in self.gw.workers.values() if w.url == mock.url)

    def mock_by_url(self, url: str) -> MockWorker:
        return next(m for m in self.mocks if m.url == url)

    async def post(self, path: str, body: dict[str, Any], **kw: Any) -> tuple[int, dict[str, str], bytes]:
        async with self.client.post(self.url + path, json=body, **kw) as r:
            return r.status, dict(r.headers), await r.read()


def assert_no_leak(c: Cluster) -> None:
    """Every routed request released its load on the router and on the gateway's own counters."""
    gw = c.gw
    assert c.router.num_in_flight == 0, f"router still tracks {c.router.num_in_flight} requests"
    for wid in c.router.workers():
        load = c.router.load(wid)
        assert load["in_flight"] == 0 and load["prefilling"] == 0 and load["decoding"] == 0, (wid, load)
    assert all(w.in_flight == 0 for w in gw.workers.values()), [w.to_dict() for w in gw.workers.values()]
    assert gw._in_flight == 0 and not gw._client_active
    dp = gw.data_plane
    if dp is not None:
        assert dp.in_flight == 0 and dp.active_clients == 0, (dp.in_flight, dp.active_clients)
        assert all(w["in_flight"] == 0 for w in dp.workers()), dp.workers()


@pytest.fixture(params=["aiohttp", "lean", "rust"], autouse=False)
def http_server(request: pytest.FixtureRequest) -> Any:
    """Runs a test once per HTTP server the gateway can sit on, the Rust data plane in front of the
    lean server included (import it into a test module and
    mark the module ``pytestmark = pytest.mark.usefixtures("http_server")``)."""
    Cluster.default_server = request.param
    yield request.param
    Cluster.default_server = "aiohttp"

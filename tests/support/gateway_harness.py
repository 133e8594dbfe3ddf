"""Test harness for the gateway: mock engines plus a gateway (its Rust data plane and the Python
control plane), all on 127.0.0.1 ephemeral ports, inside one event loop; every scenario runs under a
hard timeout.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import aiohttp
import kvroute
from kvroute.gateway.app import Gateway, make_gateway
from kvroute.gateway.mock import MockWorker, Rendezvous

__all__ = ["Cluster", "MockWorker", "Rendezvous", "assert_no_leak", "poll", "run"]


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
        **gateway: Any,
    ) -> None:
        self.n, self.n_prefill, self.n_decode = n, prefill, decode
        self.router_kw = router or {}
        self.mock_kw = mock or {}
        self.rendezvous = rendezvous
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
        self.url = await self._gw.start("127.0.0.1", 0)
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self._gw.stop()
        for m in self.mocks:
            await m.stop()

    @property
    def gw(self) -> Gateway:
        return self._gw

    @property
    def metrics(self) -> Any:
        """The data plane's counters, with mappings that count missing keys as 0."""
        m = self._gw.metrics()
        return SimpleNamespace(
            **{**m, **{k: defaultdict(int, m[k]) for k in ("requests", "rejections", "upstream_errors")}},
        )

    def in_flight(self) -> int:
        """Requests holding an admission slot in the data plane."""
        return int(self._gw.plane.in_flight)

    def worker_id(self, mock: MockWorker) -> int:
        return next(w.id for w in self.gw.workers.values() if w.url == mock.url)

    def mock_by_url(self, url: str) -> MockWorker:
        return next(m for m in self.mocks if m.url == url)

    async def post(self, path: str, body: dict[str, Any], **kw: Any) -> tuple[int, dict[str, str], bytes]:
        async with self.client.post(self.url + path, json=body, **kw) as r:
            return r.status, dict(r.headers), await r.read()


def assert_no_leak(c: Cluster) -> None:
    """Every routed request released its load on the router and on the data plane's counters."""
    assert c.router.num_in_flight == 0, f"router still tracks {c.router.num_in_flight} requests"
    for wid in c.router.workers():
        load = c.router.load(wid)
        assert load["in_flight"] == 0 and load["prefilling"] == 0 and load["decoding"] == 0, (wid, load)
    dp = c.gw.plane
    assert dp.in_flight == 0 and dp.active_clients == 0, (dp.in_flight, dp.active_clients)
    assert all(w["in_flight"] == 0 for w in dp.workers()), dp.workers()

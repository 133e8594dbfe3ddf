"""Gateway behaviour against mock engines: pass-through, stickiness without collapse, load
accounting, failures and retries, limits, admin API, health and metrics."""

from __future__ import annotations

import asyncio
import collections
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

import aiohttp
from gateway_harness import (
    Cluster,
    MockWorker,
    assert_no_leak,
    poll,
    run,
)
from kvroute.fleet.engine_metrics import parse_engine_metrics
from kvroute.gateway import GatewayConfig

SYSTEM = "You are a careful assistant. " * 40  # ~1.1 KB shared prefix


def test_streaming_and_json_pass_through_byte_for_byte() -> None:
    async def scenario() -> None:
        async with Cluster(2, mock={"cost_per_token": 1e-7}) as c:
            for m in c.mocks:
                m.keep_bodies = True
            bodies = [
                ("/v1/completions", {"prompt": SYSTEM + "tell me a story", "max_tokens": 12, "stream": True}),
                ("/v1/completions", {"prompt": SYSTEM + "tell me a story", "max_tokens": 12}),
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}], "stream": True},
                ),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
                ("/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "stream": True}),
            ]
            for path, body in bodies:
                status, headers, data = await c.post(path, body)
                assert status == 200, data
                mock = c.mock_by_url(headers["X-Kvroute-Worker"])
                assert data == mock.outputs[-1], "gateway altered the upstream bytes"
                assert mock.bodies[-1] == body, "gateway altered the request"
                if body.get("stream"):
                    assert headers["Content-Type"].startswith("text/event-stream")
                    assert data.endswith(b"data: [DONE]\n\n")
                else:
                    json.loads(data)
            assert_no_leak(c)

    run(scenario())


def test_shared_prefixes_stick_while_load_stays_even() -> None:
    """8 conversations' system prompts over 4 workers: each prefix group lands on one worker, and
    the groups spread over the workers instead of collapsing onto the first one.

    In waves of 8 requests in flight at once: the engines hold every request of a wave until all 8
    were routed, so each decision sees the same load whatever the machine's speed (a busy machine
    used to finish some requests before others were routed and scatter a group)."""

    async def scenario() -> None:
        rng = random.Random(7)
        groups = [f"group {g}: " + f"system prompt number {g} with its own rules. " * 30 for g in range(8)]
        async with Cluster(4) as c:
            placed: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
            gate = asyncio.Event()
            for m in c.mocks:
                m.gate = gate

            async def one(i: int) -> None:
                g = rng.randrange(len(groups))
                body = {"prompt": groups[g] + f"question {i} " * rng.randrange(1, 20), "max_tokens": 4}
                status, headers, data = await c.post("/v1/completions", body)
                assert status == 200, data
                placed[g][headers["X-Kvroute-Worker"]] += 1

            for wave in range(30):
                gate.clear()
                tasks = [asyncio.ensure_future(one(wave * 8 + k)) for k in range(8)]
                await poll(lambda: sum(m.in_flight for m in c.mocks) == 8, what="a wave of 8 requests at the engines")
                gate.set()
                await asyncio.gather(*tasks)
            for g, where in placed.items():
                top = where.most_common(1)[0][1]
                assert top / sum(where.values()) >= 0.8, f"group {g} scattered: {where}"
            served = [m.requests for m in c.mocks]
            assert min(served) > 0 and max(served) <= 0.5 * sum(served), f"load collapsed: {served}"
            hit = sum(m.cached_tokens for m in c.mocks) / sum(m.prompt_tokens for m in c.mocks)
            assert hit > 0.6, f"engines' cache hit rate only {hit:.2f}"
            assert_no_leak(c)

    run(scenario(), timeout=60)


def test_client_disconnect_cancels_upstream_and_releases_load() -> None:
    async def scenario() -> None:
        async with Cluster(1, mock={"token_delay": 0.02}) as c:
            mock = c.mocks[0]
            # Mid-stream: read one chunk, then go away.
            async with (
                aiohttp.ClientSession() as s,
                s.post(c.url + "/v1/completions", json={"prompt": "x" * 100, "max_tokens": 500, "stream": True}) as r,
            ):
                assert r.status == 200
                await r.content.readany()
            await poll(lambda: mock.cancelled == 1, what="upstream cancellation after a mid-stream disconnect")
            # Before the first byte: the engine is still prefilling when the client times out.
            mock.cost_per_token = 1.0
            with pytest.raises(asyncio.TimeoutError):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as s:
                    await s.post(c.url + "/v1/completions", json={"prompt": "y" * 400, "max_tokens": 5})
            await poll(lambda: mock.cancelled == 2, what="upstream cancellation before the first byte")
            await poll(lambda: c.in_flight() == 0, what="gateway to release the request")
            assert c.metrics.client_disconnects == 2
            assert mock.completed == 0
            assert_no_leak(c)

    run(scenario())


def test_stream_read_to_done_is_a_2xx_even_if_the_client_closes_before_its_end() -> None:
    """The ``openai`` client closes a stream once it reads ``data: [DONE]``, often before the engine's
    end of stream reaches the gateway (issue #11: 5 of 20 were counted as disconnected)."""

    async def scenario() -> None:
        async with Cluster(1) as c:
            mock = c.mocks[0]
            mock.end_delay = 10.0  # the engine's end of stream trails its last event
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
            async with aiohttp.ClientSession() as s, s.post(c.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                got = b""
                while b"data: [DONE]" not in got:
                    chunk = await r.content.readany()
                    assert chunk, f"stream ended before [DONE]: {got!r}"
                    got += chunk
            await poll(lambda: c.in_flight() == 0, what="gateway to release the stream")
            # A client that leaves before the last event is still a disconnect.
            mock.token_delay = 0.05
            async with aiohttp.ClientSession() as s, s.post(c.url + "/v1/chat/completions", json={**body, "max_tokens": 200}) as r:
                await r.content.readany()
            await poll(lambda: c.in_flight() == 0, what="gateway to release the abandoned stream")
            counts = {k[1]: n for k, n in c.metrics.requests.items() if k[0] == "/v1/chat/completions"}
            assert counts == {"2xx": 1, "disconnected": 1}, counts
            assert_no_leak(c)

    run(scenario())


def test_streams_on_a_worker_marked_unhealthy_end_at_once() -> None:
    """A SIGTERMed vLLM aborts its engine but holds its open streams silent until it exits (issue
    #11: 2 of ~1130 streams hung until the client's timeout). Once the worker is marked unhealthy
    its streams end now, with the in-band error, not at the 600 s read timeout."""

    async def scenario() -> None:
        async with Cluster(1, mock={"token_delay": 2.0}) as c:
            w = next(iter(c.gw.workers.values()))
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}
            async with aiohttp.ClientSession() as s, s.post(c.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.content.readany()
                t0 = asyncio.get_running_loop().time()
                c.gw.mark_unhealthy(w, "test: the engine went away")
                rest = await asyncio.wait_for(r.content.read(), 5.0)
                elapsed = asyncio.get_running_loop().time() - t0
            assert b"upstream worker failed mid-stream" in rest, rest
            assert elapsed < 1.5, f"the stream ended {elapsed:.2f} s after its worker was marked unhealthy"
            await poll(lambda: c.in_flight() == 0, what="gateway to release the stream")
            assert_no_leak(c)

    run(scenario())


def _pin(c: Cluster, mock: MockWorker, body: dict, chat: bool = False) -> None:
    """Makes the router believe ``mock`` caches this prompt, so it is the first choice."""
    hashes, _, _ = c.gw.plane.prompt(json.dumps(body).encode(), chat)
    c.router.index.store(c.worker_id(mock), hashes)


def test_5xx_is_retried_on_next_worker_and_worker_probed_back() -> None:
    async def scenario() -> None:
        async with Cluster(2) as c:
            bad, good = c.mocks
            body = {"prompt": SYSTEM + "retry me", "max_tokens": 3, "stream": True}
            _pin(c, bad, body)
            bad.fail_next = 1
            bad.healthy = False  # its /health fails too, so it stays out until it recovers
            status, headers, data = await c.post("/v1/completions", body)
            assert status == 200 and headers["X-Kvroute-Worker"] == good.url, data
            assert data.endswith(b"data: [DONE]\n\n")
            assert bad.requests == 1 and c.metrics.retries == 1
            wbad = c.gw.workers[c.worker_id(bad)]
            assert not wbad.healthy and c.worker_id(bad) not in c.router.workers()
            assert c.metrics.upstream_errors[bad.url] == 1
            bad.healthy = True
            await poll(lambda: wbad.healthy, what="probe to bring the worker back")
            assert c.worker_id(bad) in c.router.workers()
            assert_no_leak(c)

    run(scenario())


def test_connection_refused_is_retried_and_all_failing_gives_clear_error() -> None:
    async def scenario() -> None:
        async with Cluster(2) as c:
            dead, alive = c.mocks
            await dead.stop()  # nothing listens on its port any more
            for i in range(6):
                status, headers, _ = await c.post("/v1/completions", {"prompt": f"p{i} " * 50, "max_tokens": 2})
                assert status == 200 and headers["X-Kvroute-Worker"] == alive.url
            assert not c.gw.workers[c.worker_id(dead)].healthy
            alive.fail_next = 10
            alive.healthy = False
            status, headers, data = await c.post("/v1/completions", {"prompt": "doomed " * 20, "max_tokens": 2})
            assert status in (502, 503), data
            err = json.loads(data)["error"]
            assert "HTTP 500" in err["message"] or "no healthy worker" in err["message"]
            assert_no_leak(c)

    run(scenario())


def test_no_healthy_worker_says_what_is_registered_and_why() -> None:
    async def scenario() -> None:
        async with Cluster(1, health_interval=60.0) as c:
            (dead,) = c.mocks
            await dead.stop()  # nothing listens on its port any more
            status, _, data = await c.post("/v1/completions", {"prompt": "p " * 50, "max_tokens": 2})
            assert status in (502, 503), data
            status, _, data = await c.post("/v1/completions", {"prompt": "q " * 50, "max_tokens": 2})
            assert status == 503, data
            msg = json.loads(data)["error"]["message"]
            assert f"1 registered, 0 healthy ({dead.url} unhealthy: connection failed" in msg, msg
            assert "call add_worker" not in msg
            assert_no_leak(c)

    run(scenario())


def test_worker_killed_mid_run_loses_no_request() -> None:
    """300 requests at concurrency 24 over 4 workers; one is killed after 100 have completed. Every
    non-streaming request still succeeds (retried elsewhere); a stream cut after its first bytes
    ends with an explicit error event; nothing hangs and no load leaks."""

    async def scenario() -> None:
        async with Cluster(4, mock={"cost_per_token": 2e-6, "token_delay": 0.002}) as c:
            victim = c.mocks[1]
            done = 0
            killed = asyncio.Event()
            outcomes: collections.Counter[str] = collections.Counter()
            sem = asyncio.Semaphore(24)
            rng = random.Random(3)

            async def one(i: int) -> None:
                nonlocal done
                stream = i % 3 == 0
                body = {"prompt": f"conversation {i % 16} " * 40 + f"turn {i}", "max_tokens": 8, "stream": stream}
                async with sem:
                    status, _, data = await c.post("/v1/completions", body)
                if stream and status == 200 and b'"upstream_error"' in data:
                    outcomes["stream_cut"] += 1
                elif status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n")):
                    outcomes["ok"] += 1
                else:
                    outcomes[f"failed {status} {data[:80]!r}"] += 1
                done += 1
                if done == 100:
                    killed.set()

            async def killer() -> None:
                await killed.wait()
                await victim.kill()

            order = list(range(300))
            rng.shuffle(order)
            await asyncio.gather(killer(), *(one(i) for i in order))
            assert set(outcomes) <= {"ok", "stream_cut"}, outcomes
            assert outcomes["stream_cut"] <= 24  # only streams running on the victim at the kill
            assert outcomes["ok"] + outcomes["stream_cut"] == 300
            assert not c.gw.workers[c.worker_id(victim)].healthy
            assert_no_leak(c)

    run(scenario(), timeout=45)


def test_early_rejection_answers_429_with_retry_after() -> None:
    async def scenario() -> None:
        async with Cluster(1, router={"ttft_slo": 0.05}) as c:
            # One worker at the default 20k tokens/s: 8k tokens take 0.4 s, past the 50 ms SLO.
            status, headers, data = await c.post("/v1/completions", {"prompt": "z" * 32_000, "max_tokens": 1})
            assert status == 429, data
            assert int(headers["Retry-After"]) >= 1
            assert "rejected" in json.loads(data)["error"]["message"]
            assert c.mocks[0].requests == 0
            assert sum(c.metrics.rejections.values()) == 1
            status, _, _ = await c.post("/v1/completions", {"prompt": "short", "max_tokens": 1})
            assert status == 200
            assert_no_leak(c)

    run(scenario())


def test_bad_requests_get_clear_400_and_413() -> None:
    async def scenario() -> None:
        async with Cluster(1, max_body_bytes=4096) as c:
            async with c.client.post(c.url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            for body, needle in [
                ([1, 2], "JSON object"),
                ({"max_tokens": 3}, "'prompt'"),
                ({"prompt": ""}, "empty prompt"),
                ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
                ({"prompt": [1, -2]}, ""),
            ]:
                status, _, data = await c.post("/v1/completions", body)  # type: ignore[arg-type]
                assert status == 400, (body, data)
                assert needle in json.loads(data)["error"]["message"]
            status, _, data = await c.post("/v1/chat/completions", {"messages": "hi"})
            assert status == 400 and "messages" in json.loads(data)["error"]["message"]
            status, _, data = await c.post("/v1/completions", {"prompt": "x" * 10_000})
            assert status == 413, data
            assert c.mocks[0].requests == 0
            assert_no_leak(c)

    run(scenario())


def test_per_client_concurrency_limit() -> None:
    async def scenario() -> None:
        async with Cluster(1, max_client_concurrency=2, client_key_header="X-Api-Key", mock={"cost_per_token": 0.002}) as c:
            mock = c.mocks[0]
            slow = [
                asyncio.ensure_future(c.post("/v1/completions", {"prompt": f"slow {i} " * 40}, headers={"X-Api-Key": "a"}))
                for i in range(2)
            ]
            await poll(lambda: mock.in_flight == 2, what="two slow requests in flight")
            status, headers, data = await c.post("/v1/completions", {"prompt": "third"}, headers={"X-Api-Key": "a"})
            assert status == 429 and headers["Retry-After"] == "1" and b"concurrent" in data
            status, _, _ = await c.post("/v1/completions", {"prompt": "other client"}, headers={"X-Api-Key": "b"})
            assert status == 200
            assert [s for s, _, _ in await asyncio.gather(*slow)] == [200, 200]
            assert c.metrics.rejections["client_concurrency"] == 1
            assert_no_leak(c)

    run(scenario())


def test_admin_api_requires_bearer_token() -> None:
    async def scenario() -> None:
        async with Cluster(1) as c:  # no token configured: the admin API is off
            r = await c.client.get(c.url + "/admin/workers", headers={"Authorization": "Bearer anything-at-all"})
            async with r:
                assert r.status == 403 and "--admin-token" in (await r.json())["error"]["message"]
        token = "s3cret-admin-token"
        async with Cluster(1, admin_token=token) as c:
            extra = MockWorker("extra")
            await extra.start()
            try:
                for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": token}, {"Authorization": f"Basic {token}"}):
                    for method, path, kw in (
                        ("GET", "/admin/workers", {}),
                        ("POST", "/admin/workers", {"json": {"url": extra.url}}),
                        ("DELETE", "/admin/workers/0", {}),
                    ):
                        async with c.client.request(method, c.url + path, headers=headers, **kw) as r:
                            assert r.status == 401, (method, headers)
                            assert r.headers["WWW-Authenticate"].startswith("Bearer")
                assert len(c.gw.workers) == 1
                auth = {"Authorization": f"Bearer {token}"}
                bad = {"url": extra.url, "prefix_cache_blocks": -1}
                async with c.client.post(c.url + "/admin/workers", headers=auth, json=bad) as r:
                    assert r.status == 400 and "prefix_cache_blocks" in (await r.json())["error"]["message"]
                spec = {"url": extra.url, "prefill_tokens_per_s": 40000.0, "prefix_cache_blocks": 4096}
                async with c.client.post(c.url + "/admin/workers", headers=auth, json=spec) as r:
                    assert r.status == 201
                    new_id = (await r.json())["id"]
                # The cache size reaches the Router, which the default policy ("capacity") charges against.
                assert c.router.load(new_id)["prefix_cache_blocks"] == 4096
                async with c.client.post(c.url + "/admin/workers", headers=auth, json={"url": extra.url}) as r:
                    assert r.status == 400 and "already" in (await r.json())["error"]["message"]
                async with c.client.post(c.url + "/admin/workers", headers=auth, json={"url": "ftp://x", "role": "both"}) as r:
                    assert r.status == 400
                async with c.client.post(c.url + "/admin/workers", headers=auth, json={"url": "http://h:1", "colour": "red"}) as r:
                    assert r.status == 400 and "colour" in (await r.json())["error"]["message"]
                assert new_id in c.router.workers()
                _pin(c, extra, {"prompt": SYSTEM})
                status, headers, _ = await c.post("/v1/completions", {"prompt": SYSTEM, "max_tokens": 1})
                assert status == 200 and headers["X-Kvroute-Worker"] == extra.url
                async with c.client.get(c.url + "/admin/workers", headers=auth) as r:
                    assert {w["url"] for w in (await r.json())["workers"]} == {c.mocks[0].url, extra.url}
                async with c.client.delete(c.url + f"/admin/workers/{new_id}", headers=auth) as r:
                    assert r.status == 200
                async with c.client.delete(c.url + f"/admin/workers/{new_id}", headers=auth) as r:
                    assert r.status == 404
                assert new_id not in c.router.workers()
                status, headers, _ = await c.post("/v1/completions", {"prompt": SYSTEM, "max_tokens": 1})
                assert status == 200 and headers["X-Kvroute-Worker"] == c.mocks[0].url
                assert_no_leak(c)
            finally:
                await extra.stop()

    run(scenario())


def test_health_models_and_metrics_endpoints() -> None:
    async def scenario() -> None:
        async with Cluster(2, models=("fallback-model",)) as c:
            async with c.client.get(c.url + "/health") as r:
                assert r.status == 200 and len((await r.json())["workers"]) == 2
            async with c.client.get(c.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "mock"
            await c.post("/v1/completions", {"prompt": SYSTEM, "max_tokens": 1})
            await c.post("/v1/completions", {"prompt": SYSTEM + "again", "max_tokens": 1})
            async with c.client.get(c.url + "/metrics") as r:
                text = await r.text()
                assert r.headers["Content-Type"].startswith("text/plain")
            assert 'kvroute_requests_total{endpoint="/v1/completions",status="2xx"} 2' in text
            assert "kvroute_routing_seconds_count 2" in text
            assert "kvroute_worker_in_flight{" in text and "kvroute_retries_total 0" in text
            ratio = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("kvroute_cache_hit_ratio ")))
            assert 0.3 < ratio < 0.6  # the second request hits the first one's ~1.1 KB of blocks
            for m in c.mocks:
                m.healthy = False
                m.fail_next = 100
            await c.post("/v1/completions", {"prompt": "a", "max_tokens": 1})
            async with c.client.get(c.url + "/health") as r:
                assert r.status == 503
            for m in c.mocks:
                await m.stop()
            async with c.client.get(c.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "fallback-model"

    run(scenario())


def test_engine_metrics_polling_feeds_router_observe() -> None:
    async def scenario() -> None:
        async with Cluster(1, mock={"cost_per_token": 0.01}) as c:
            mock = c.mocks[0]
            task = asyncio.ensure_future(c.post("/v1/completions", {"prompt": "q" * 400}))
            await poll(lambda: mock.in_flight == 1, what="request in flight")
            seen = await c.gw.poll_metrics(c.gw.workers[0])
            assert seen == {"waiting": 0.0, "running": 1.0, "kv_usage": pytest.approx(len(mock.cache) / mock.cache_blocks)}
            load = c.router.load(0)
            assert load["observed_running"] == 1 and load["observed_waiting"] == 0
            async with c.client.get(c.url + "/health") as r:
                row = (await r.json())["workers"][0]
            assert row["observed_running"] == 1 and row["observed_waiting"] == 0 and row["observed_kv_usage"] == load["observed_kv_usage"]
            assert (await task)[0] == 200

    run(scenario())


def test_parse_engine_metrics_vllm_and_sglang() -> None:
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:num_requests_waiting_by_reason{reason="x"} 9
garbage line
vllm:num_requests_running{weird="}"} nan
"""
    assert parse_engine_metrics(text) == {"waiting": 4.0, "running": 5.0, "kv_usage": 0.375}
    sg = 'sglang:num_running_reqs{model_name="m"} 7\nsglang:num_queue_reqs{model_name="m"} 1\nsglang:token_usage{model_name="m"} 0.9\n'
    assert parse_engine_metrics(sg) == {"waiting": 1.0, "running": 7.0, "kv_usage": 0.9}
    assert parse_engine_metrics("") == {}


def test_config_validation_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="pd_convention"):
        GatewayConfig(pd_convention="triton")
    with pytest.raises(ValueError, match="admin_token"):
        GatewayConfig(admin_token="short")
    with pytest.raises(ValueError, match="max_retries"):
        GatewayConfig(max_retries=-1)
    import kvroute
    from kvroute.gateway import WorkerConfig, make_gateway

    with pytest.raises(ValueError, match="worker url"):
        WorkerConfig("localhost:8000")
    with pytest.raises(ValueError, match="role"):
        WorkerConfig("http://h:1", role="encode")
    with pytest.raises(ValueError, match="at least one worker"):
        make_gateway(kvroute.Router())
    with pytest.raises(ValueError, match="already configured"):
        make_gateway(kvroute.Router(), ["http://h:1", "http://h:1/"])
    with pytest.raises(ValueError, match="kv_events names workers"):
        make_gateway(kvroute.Router(), ["http://h:1"], kv_events={"http://other:2": "tcp://127.0.0.1:5557"})


def test_slow_clients_are_cut_off_after_client_timeout() -> None:
    """A client that sends half a request head, or a head and part of its body, and goes silent
    gets 408 or a closed connection after client_timeout instead of holding the connection; the
    gateway keeps serving others and no load is taken."""

    async def read_all(reader: asyncio.StreamReader) -> bytes:
        return await asyncio.wait_for(reader.read(), 10.0)  # until the gateway closes (bounded)

    async def scenario() -> None:
        async with Cluster(1, client_timeout=0.3) as c:
            host, port = c.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            await writer.drain()
            answer = await read_all(reader)  # hyper closes without a response
            assert answer == b"", answer
            writer.close()

            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro')
            await writer.drain()
            answer = await read_all(reader)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"not received within 0.3 s" in answer, answer
            writer.close()

            status, _, _ = await c.post("/v1/completions", {"prompt": "still served", "max_tokens": 1})
            assert status == 200
            assert c.mocks[0].requests == 1
            assert_no_leak(c)

    run(scenario())


def test_client_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="client_timeout"):
        GatewayConfig(client_timeout=0)


def test_https_engines_are_served_and_probed_with_the_configured_ca(tmp_path: Path) -> None:
    """An engine behind a self-signed certificate (made here with openssl) is routed to over TLS, its
    health is probed over TLS with the same CA file, and it comes back after being marked down."""
    import shutil
    import ssl
    import subprocess

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (needed to make a self-signed certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:FALSE", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def scenario() -> None:
        tls = MockWorker("tls", ssl_context=server_ctx)
        await tls.start()
        try:
            import kvroute
            from kvroute.gateway import make_gateway

            gw = make_gateway(kvroute.Router(), [tls.url], ca_file=str(cert), health_interval=0.05)
            url = await gw.start()
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                    async with s.post(url + "/v1/completions", json={"prompt": "over tls", "max_tokens": 2, "stream": True}) as r:
                        assert r.status == 200 and r.headers["X-Kvroute-Worker"] == tls.url
                        assert (await r.read()).endswith(b"data: [DONE]\n\n")
                    w = gw.workers[0]
                    gw.mark_unhealthy(w, "test: taken out")
                    assert not w.healthy
                    await poll(lambda: w.healthy, what="the https worker probed back over TLS")
                    async with s.get(url + "/v1/models") as r:
                        assert r.status == 200 and (await r.json())["data"][0]["id"] == "mock"
            finally:
                await gw.stop()
        finally:
            await tls.stop()

    run(scenario())

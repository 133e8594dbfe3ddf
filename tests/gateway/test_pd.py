"""Gateway PD mode in both handshakes (vLLM's kv_transfer_params, SGLang's bootstrap) with their
failures (dead workers on either side, errors, client disconnects), exact-token mode with a tokenizer
built here, and the ``kvroute serve`` argument handling; all on the Rust data plane."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp")

import aiohttp
import kvroute
from gateway_harness import (
    Cluster,
    Rendezvous,
    assert_no_leak,
    poll,
    run,
)
from kvroute.prompt import ApproxCache, ApproxPrompter, ExactPrompter
from prompt_reference import ExactReference

CHAT = {"messages": [{"role": "system", "content": "be brief " * 50}, {"role": "user", "content": "why is the sky blue?"}], "max_tokens": 6}


def assert_served_by_the_plane_in_front(c: Cluster) -> None:
    """The data plane counted the completions it served."""
    m = c.gw.plane.metrics()
    assert sum(m["requests"].values()) > 0, m


def _hashes(c: Cluster, body: dict[str, Any]) -> Any:
    """The block hashes the data plane routes this completions body on."""
    return c.gw.plane.prompt(json.dumps(body).encode(), False)[0]


def test_pd_vllm_convention_two_steps() -> None:
    async def scenario() -> None:
        async with Cluster(prefill=2, decode=2, pd_convention="vllm") as c:
            for m in c.mocks:
                m.keep_bodies = True
            for path, body in (
                ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
                ("/v1/completions", {"prompt": "once upon a time " * 30, "max_tokens": 5, "max_completion_tokens": 5}),
            ):
                status, headers, data = await c.post(path, body)
                assert status == 200, data
                decode = c.mock_by_url(headers["X-Kvroute-Worker"])
                assert decode in c.decode
                assert data == decode.outputs[-1]
                [prefill] = [m for m in c.prefill if m.bodies and m.bodies[-1].get("kv_transfer_params", {}).get("do_remote_decode")]
                pb = prefill.bodies.pop()
                assert pb["max_tokens"] == 1 and pb["stream"] is False and "stream_options" not in pb
                assert pb.get("max_completion_tokens", 1) == 1
                assert pb["kv_transfer_params"] == {
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "remote_host": None,
                    "remote_port": None,
                }
                returned = json.loads(prefill.outputs[-1])["kv_transfer_params"]
                db = decode.bodies[-1]
                assert db["kv_transfer_params"] == returned and returned["remote_engine_id"] == prefill.name
                assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == body
                assert decode.prompt_tokens == 0, "the decode worker recomputed the prompt instead of receiving its KV"
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


def test_pd_sglang_convention_bootstrap_to_both() -> None:
    async def scenario() -> None:
        rv = Rendezvous()
        async with Cluster(prefill=2, decode=1, pd_convention="sglang", rendezvous=rv) as c:
            for m in c.mocks:
                m.keep_bodies = True
            status, headers, data = await c.post("/v1/chat/completions", {**CHAT, "stream": True})
            assert status == 200, data
            [decode] = c.decode
            assert headers["X-Kvroute-Worker"] == decode.url and data == decode.outputs[-1]
            [prefill] = [m for m in c.prefill if m.bodies]
            pb, db = prefill.bodies[-1], decode.bodies[-1]
            assert pb == db, "prefill and decode must get the same tagged request"
            assert pb["bootstrap_host"] == "127.0.0.1" and pb["bootstrap_port"] == 8998
            assert 0 <= pb["bootstrap_room"] < 2**63
            assert rv.owners[pb["bootstrap_room"]] == ("127.0.0.1", 8998)
            assert {k: v for k, v in pb.items() if not k.startswith("bootstrap_")} == {**CHAT, "stream": True}

            # A failing prefill is retried with a fresh room on the other prefill server.
            body = {"prompt": "pd retry " * 40, "max_tokens": 3}
            c.router.index.store(c.worker_id(prefill), _hashes(c, body))
            prefill.fail_next, prefill.healthy = 1, False
            status, headers, data = await c.post("/v1/completions", body)
            assert status == 200, data
            other = next(m for m in c.prefill if m is not prefill)
            assert other.bodies[-1]["bootstrap_room"] != pb["bootstrap_room"]
            assert c.metrics.retries == 1
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


def test_pd_vllm_retries_past_a_dead_prefill_and_a_dead_decode_worker() -> None:
    async def scenario() -> None:
        async with Cluster(prefill=2, decode=2, pd_convention="vllm") as c:
            p0, p1 = c.prefill
            d0, d1 = c.decode
            body = {"prompt": "dead prefill " * 40, "max_tokens": 3, "stream": True}
            c.router.index.store(c.worker_id(p0), _hashes(c, body))  # p0 is the first choice
            await p0.stop()  # refuses connections, and its health probe fails: it stays out
            status, headers, data = await c.post("/v1/completions", body)
            assert status == 200 and data.endswith(b"data: [DONE]\n\n"), data
            assert p1.requests == 1 and c.metrics.retries == 1
            assert c.worker_id(p0) not in c.router.workers()

            # A dead decode worker: the attempt fails after its prefill, so the retry prefills again.
            await d0.stop()
            prefills, sent = p1.requests, 0
            for i in range(4):  # the router's decode choice rotates over idle workers: d0 comes within a few
                status, headers, data = await c.post("/v1/completions", {"prompt": f"dead decode {i} " * 30, "max_tokens": 2})
                sent += 1
                assert status == 200 and headers["X-Kvroute-Worker"] == d1.url, data
                if c.worker_id(d0) not in c.router.workers():
                    break
            else:
                raise AssertionError("the router never chose the dead decode worker")
            assert p1.requests - prefills == sent + 1 and d1.requests == 1 + sent
            assert c.metrics.retries == 2 and c.metrics.upstream_errors[d0.url] == 1
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


def test_pd_vllm_prefill_errors_reach_the_client() -> None:
    async def scenario() -> None:
        async with Cluster(prefill=1, decode=1, pd_convention="vllm", max_retries=0) as c:
            [p], [d] = c.prefill, c.decode
            body = {"prompt": "bad request " * 20, "max_tokens": 2}
            # A 4xx from the prefill is the client's error: passed through, nothing marked, no decode.
            p.fail_next, p.fail_status = 1, 422
            status, headers, data = await c.post("/v1/completions", body)
            assert status == 422 and json.loads(data) == {"error": {"message": "p0: injected failure"}}, data
            assert "X-Kvroute-Worker" not in headers and d.requests == 0
            assert c.worker_id(p) in c.router.workers() and c.metrics.retries == 0
            # A 5xx with no retry left: 502 naming the worker and its answer.
            p.fail_next, p.fail_status, p.healthy = 1, 500, False
            status, headers, data = await c.post("/v1/completions", body)
            err = json.loads(data)["error"]
            assert status == 502 and err["type"] == "upstream_error" and err["code"] == 502, data
            assert err["message"].startswith(f"all 1 attempts failed; last: {p.url}: HTTP 500"), err
            # No prefill worker left to route to: 503 with Retry-After, nothing sent anywhere.
            status, headers, data = await c.post("/v1/completions", body)
            assert status == 503 and headers["Retry-After"] == "1", data
            assert json.loads(data)["error"]["type"] == "service_unavailable"
            assert d.requests == 0 and p.requests == 2
            # Probed back once its /health answers: served again.
            p.healthy = True
            await poll(lambda: c.worker_id(p) in c.router.workers(), what="the prefill worker probed back")
            status, headers, data = await c.post("/v1/completions", body)
            assert status == 200 and headers["X-Kvroute-Worker"] == d.url, data
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


def test_pd_decode_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def scenario() -> None:
        async with Cluster(prefill=1, decode=1, pd_convention="vllm") as c:
            [d] = c.decode
            d.token_delay = 0.02
            async with c.client.post(c.url + "/v1/completions", json={"prompt": "dies " * 30, "max_tokens": 500, "stream": True}) as r:
                assert r.status == 200 and r.headers["X-Kvroute-Worker"] == d.url
                assert await r.content.readany()
                await d.kill()
                rest = await r.read()
            assert b'"upstream_error"' in rest and not rest.endswith(b"data: [DONE]\n\n"), rest[-200:]
            assert c.worker_id(d) not in c.router.workers() and c.metrics.upstream_errors[d.url] == 1
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


@pytest.mark.parametrize("convention", ["vllm", "sglang"])
def test_pd_concurrent_load_loses_no_request_and_leaks_no_load(convention: str) -> None:
    async def scenario() -> None:
        rv = Rendezvous() if convention == "sglang" else None
        async with Cluster(prefill=2, decode=2, pd_convention=convention, rendezvous=rv, mock={"token_delay": 0.001}) as c:
            sem = asyncio.Semaphore(32)
            answers: list[tuple[int, bool]] = []

            async def one(i: int) -> None:
                body = {"prompt": f"group {i % 8} " * 60 + f"question {i}", "max_tokens": 6, "stream": i % 2 == 0}
                async with sem:
                    status, _, data = await c.post("/v1/completions", body)
                answers.append((status, data.endswith(b"data: [DONE]\n\n") if body["stream"] else "choices" in json.loads(data)))

            await asyncio.gather(*(one(i) for i in range(240)))
            assert answers == [(200, True)] * 240
            assert sum(m.requests for m in c.decode) == 240 and sum(m.requests for m in c.prefill) == 240
            assert min(m.requests for m in c.mocks) > 0, [m.requests for m in c.mocks]
            await poll(lambda: c.in_flight() == 0, what="every request released")
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


async def _disconnect_mid_stream(c: Cluster, body: dict[str, Any]) -> None:
    """Reads the first chunk of a streamed answer, then goes away."""
    async with aiohttp.ClientSession() as s, s.post(c.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        assert await r.content.readany()


async def _disconnect_before_first_byte(c: Cluster, body: dict[str, Any]) -> None:
    with pytest.raises(asyncio.TimeoutError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as s:
            await s.post(c.url + "/v1/completions", json=body)


def test_pd_vllm_client_disconnect_cancels_the_upstream_request_and_releases_load() -> None:
    async def scenario() -> None:
        async with Cluster(prefill=1, decode=1, pd_convention="vllm") as c:
            [p], [d] = c.prefill, c.decode
            p.cost_per_token = 1.0  # the prefill is still computing when the client gives up
            await _disconnect_before_first_byte(c, {"prompt": "slow prefill " * 30, "max_tokens": 5})
            await poll(lambda: p.cancelled == 1, what="the prefill request cancelled")
            assert d.requests == 0
            p.cost_per_token, d.token_delay = 0.0, 0.02
            await _disconnect_mid_stream(c, {"prompt": "long answer " * 30, "max_tokens": 500, "stream": True})
            await poll(lambda: d.cancelled == 1, what="the decode request cancelled mid-stream")
            await poll(lambda: c.in_flight() == 0, what="the gateway to release both requests")
            assert c.metrics.client_disconnects == 2 and p.completed == 1 and d.completed == 0
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


def test_pd_sglang_client_disconnect_cancels_both_requests_and_releases_load() -> None:
    async def scenario() -> None:
        async with Cluster(prefill=1, decode=1, pd_convention="sglang", rendezvous=Rendezvous()) as c:
            [p], [d] = c.prefill, c.decode
            # The prefill signals its room at once, then computes; the decode streams meanwhile.
            p.cost_per_token, d.token_delay = 1.0, 0.02
            await _disconnect_mid_stream(c, {"prompt": "both at once " * 30, "max_tokens": 500, "stream": True})
            await poll(lambda: (p.cancelled, d.cancelled) == (1, 1), what="both requests cancelled mid-stream")
            # Before any byte: both servers still computing.
            d.cost_per_token = 1.0
            await _disconnect_before_first_byte(c, {"prompt": "nothing yet " * 30, "max_tokens": 5, "stream": True})
            await poll(lambda: (p.cancelled, d.cancelled) == (2, 2), what="both requests cancelled before the first byte")
            await poll(lambda: c.in_flight() == 0, what="the gateway to release both requests")
            assert c.metrics.client_disconnects == 2 and p.completed == 0 and d.completed == 0
            assert_served_by_the_plane_in_front(c)
            assert_no_leak(c)

    run(scenario())


def test_pd_sglang_prefill_bootstrap_port_from_flag() -> None:
    from kvroute.gateway.cli import add_serve_parser, build_gateway

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    a = parser.parse_args(
        [
            "serve",
            "--prefill",
            "http://p0:30000",
            "9000",
            "--prefill",
            "http://p1:30000",
            "--decode",
            "http://d0:30000",
            "--pd-convention",
            "sglang",
        ]
    )
    gw = build_gateway(a)
    ports = {w.url: w.cfg.bootstrap_port for w in gw.workers.values()}
    assert {w["url"]: w["bootstrap_port"] for w in gw.plane.workers()} == ports
    assert ports == {"http://p0:30000": 9000, "http://p1:30000": 8998, "http://d0:30000": None}
    for bad in (["serve"], ["serve", "--prefill", "http://p:1"], ["serve", "--worker", "http://w:1", "--kv-events", "nonsense"]):
        with pytest.raises(argparse.ArgumentTypeError):
            build_gateway(parser.parse_args(bad))


def _build_tokenizer(tmp_path) -> str:  # type: ignore[no-untyped-def]
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = ["<s>", "</s>", "[UNK]", "<|user|>", "<|assistant|>", "<|system|>"] + [
        w for w in ["the", "sky", "is", "blue", "why", "be", "brief", "once", "upon", "a", "time"]
    ]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    return str(tmp_path)


def assert_served_by_data_plane(c: Cluster) -> None:
    """The data plane routed exact-mode completions."""
    dp = c.gw.plane
    m = dp.metrics()
    assert dp.exact and m["routing_count"] >= 1, m


def test_exact_mode_hashes_what_the_engine_sees(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = _build_tokenizer(tmp_path)
    ep = ExactPrompter(path, block_size=4, seed=1337)
    ref = ExactReference(path, block_size=4, seed=1337)  # Hugging Face tokenizers and jinja2, as the engine
    rendered = ref.render_chat(CHAT)
    assert rendered.startswith("<s><|system|> be brief") and rendered.endswith("<|assistant|>")
    assert ep.render_chat(CHAT) == rendered
    ids = ref.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ep.token_ids(CHAT, chat=True).tolist() == ids
    p = ep.prompt(CHAT, chat=True)
    assert p.exact and p.num_tokens == len(ids) and p.output_tokens == 6
    np.testing.assert_array_equal(p.hashes, kvroute.block_hashes(ids, 4, seed=1337))
    q = ep.prompt({"prompt": [5, 6, 7, 8, 9]}, chat=False)
    np.testing.assert_array_equal(q.hashes, kvroute.block_hashes([5, 6, 7, 8], 4))

    async def scenario() -> None:
        # KV events would fill the index; store the engine-side hashes directly in their place.
        async with Cluster(3, tokenizer=path, insert_decisions=False, router={"block_size": 4}) as c:
            target = c.mocks[2]
            c.router.index.store(c.worker_id(target), kvroute.block_hashes(ids, 4))
            status, headers, data = await c.post("/v1/chat/completions", CHAT)
            assert status == 200 and headers["X-Kvroute-Worker"] == target.url, data
            assert len(c.router.index) == len(p.hashes), "insert_decisions=False must leave the index to KV events"
            assert_served_by_data_plane(c)
            assert_no_leak(c)

    run(scenario())


def test_kv_events_feed_the_index_in_exact_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An engine's published KV events (vLLM wire format) reach the router's index through
    ``kv_events``; a request for the cached prompt goes to that engine, and the gateway inserts
    nothing of its own."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from fake_engine import FakeEngine, FakePublisher

    path = _build_tokenizer(tmp_path)
    ref = ExactReference(path, block_size=4, seed=1337)
    ids = ref.tokenizer.encode(ref.render_chat(CHAT), add_special_tokens=False).ids
    pub = FakePublisher()

    async def scenario() -> None:
        async with Cluster(3, tokenizer=path, router={"block_size": 4}, kv_events_for={1: pub.endpoint}) as c:
            await asyncio.get_running_loop().run_in_executor(None, pub.wait_for_subscriber, 10.0)
            engine = FakeEngine("vllm", block_size=4, capacity=10_000)
            pub.publish(engine.encode(engine.process(list(ids))))
            target = c.worker_id(c.mocks[1])
            await poll(lambda: c.router.index.num_blocks(target) == len(ids) // 4, what="KV events applied to the index")
            status, headers, data = await c.post("/v1/chat/completions", CHAT)
            assert status == 200 and headers["X-Kvroute-Worker"] == c.mocks[1].url, data
            assert not c.gw.plane.has_approx and len(c.router.index) == len(ids) // 4
            assert_served_by_data_plane(c)
            assert_no_leak(c)

    try:
        run(scenario())
    finally:
        pub.close()


def test_exact_mode_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        ExactPrompter(str(tmp_path / "missing"), 16, 1337)
    path = _build_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    ep = ExactPrompter(path, 16, 1337)
    from kvroute.gateway import BadRequest

    with pytest.raises(BadRequest, match="no chat_template"):
        ep.prompt(CHAT, chat=True)


def test_approx_prompter_blocks_and_ttl_cache() -> None:
    ap = ApproxPrompter(block_size=4, seed=1337)
    text = "abcdefghijklmnopqrstuvwxyz0123456789"  # 36 bytes = 9 pseudo-tokens = 2 full blocks
    p = ap.prompt({"prompt": text}, chat=False)
    assert p.num_tokens == 9 and len(p.hashes) == 2
    longer = ap.prompt({"prompt": text + "more text here, more"}, chat=False)
    np.testing.assert_array_equal(longer.hashes[:2], p.hashes)
    chat1 = ap.prompt({"messages": [{"role": "user", "content": "x" * 64}]}, chat=True)
    chat2 = ap.prompt({"messages": [{"role": "user", "content": "x" * 64}, {"role": "assistant", "content": "y" * 64}]}, chat=True)
    np.testing.assert_array_equal(chat2.hashes[: len(chat1.hashes) - 1], chat1.hashes[:-1])

    idx = kvroute.KvIndex()
    cache = ApproxCache(idx, ttl=10.0)
    cache.insert(0, longer.hashes, now=0.0)
    cache.insert(0, p.hashes, now=5.0)  # refreshes the shared first two blocks
    assert idx.num_blocks(0) == len(longer.hashes)
    assert cache.expire(9.0) == 0
    assert cache.expire(10.0) == len(longer.hashes) - 2  # only the blocks nobody touched since t=0
    assert idx.num_blocks(0) == 2
    assert cache.expire(15.0) == 2 and idx.num_blocks(0) == 0 and len(cache) == 0
    cache.insert(1, p.hashes, now=20.0)
    cache.drop_worker(1)
    assert idx.num_blocks(1) == 0 and len(cache) == 0
    with pytest.raises(ValueError, match="ttl"):
        ApproxCache(idx, ttl=0)


def test_kvroute_serve_process_end_to_end() -> None:
    """`kvroute serve` as a real process in front of a mock engine: health, a streamed request, admin refusal."""
    import os
    import socket
    import sys

    import aiohttp
    from kvroute.gateway.mock import MockWorker

    async def scenario() -> None:
        mock = MockWorker("solo")
        await mock.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvroute.cli",
            "serve",
            "--worker",
            mock.url,
            "--port",
            str(port),
            "--log-level",
            "warning",
            env={**os.environ, "KVROUTE_ADMIN_TOKEN": ""},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                for _ in range(400):  # bounded wait for the server to listen
                    try:
                        async with s.get(url + "/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    assert proc.returncode is None, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
                    await asyncio.sleep(0.025)
                else:
                    raise AssertionError("kvroute serve did not come up")
                async with s.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3, "stream": True}) as r:
                    assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
                async with s.get(url + "/admin/workers", headers={"Authorization": "Bearer x"}) as r:
                    assert r.status == 403
        finally:
            if proc.returncode is None:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)
            await mock.stop()

    run(scenario())

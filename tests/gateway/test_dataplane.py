"""The Rust data plane on its own: its approximate prompts (which ``kvroute.prompt`` calls, for the
integrations that share an index with it) hash as the Python reference (tests/support/prompt_reference.py) does, its 400s, its TTL cache, unparseable-exactly bodies routed
approximately, workers added at runtime, start/stop and bad configuration."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

pytest.importorskip("aiohttp")

import aiohttp
import kvroute
import numpy as np
from gateway_harness import Cluster, MockWorker, assert_no_leak, poll, run
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute._core import DataPlane, approx_prompt
from kvroute.prompt import ApproxPrompter, BadRequest
from prompt_reference import ApproxReference

BS, SEED = 4, 99

text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
ints = st.integers(min_value=-3, max_value=2**32 + 2)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False), text)
json_value = st.recursive(json_leaf, lambda v: st.lists(v, max_size=3) | st.dictionaries(text, v, max_size=3), max_leaves=6)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
part = st.one_of(
    text_part,
    text_part,
    st.fixed_dictionaries({"type": st.just("text"), "text": st.none() | st.integers(0, 3)}),
    st.dictionaries(text, json_value, max_size=3),
    text,
)
content = st.one_of(st.none(), text, text, st.lists(part, max_size=3), st.lists(text_part, max_size=2), st.integers(0, 3))
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": content})
message = st.one_of(valid_message, valid_message, valid_message, st.fixed_dictionaries({"role": st.integers(0, 2)}))
limits = st.dictionaries(st.sampled_from(["max_tokens", "max_completion_tokens"]), st.none() | st.booleans() | ints, max_size=2)
prompt = st.one_of(
    text, st.lists(ints, max_size=12), st.lists(text, max_size=2), st.lists(st.lists(ints, max_size=6), max_size=2), st.none()
)


def python_prompt(body: dict[str, Any], chat: bool) -> tuple[list[int], int, int | None] | None:
    """The Python reference's answer (None: a 400)."""
    try:
        p = ApproxReference(BS, SEED).prompt(body, chat)
    except (BadRequest, ValueError, TypeError, OverflowError):
        return None
    if p.output_tokens is not None and p.output_tokens > 2**63 - 1:
        return None  # the Router refuses it: the data plane answers 400 up front
    return p.hashes.tolist(), p.num_tokens, p.output_tokens


def rust_prompt(body: Any, chat: bool) -> tuple[list[int], int, int | None] | None:
    """The data plane's answer to the raw body (None: a 400), checked equal to ``kvroute.prompt``'s."""
    try:
        r = approx_prompt(json.dumps(body).encode(), chat, BS, seed=SEED)
    except ValueError:  # the client's 400
        with pytest.raises(BadRequest):
            ApproxPrompter(BS, SEED).prompt(body, chat)
        return None
    p = ApproxPrompter(BS, SEED).prompt(body, chat)
    assert (p.hashes.tolist(), p.num_tokens, p.output_tokens, p.exact) == (r[0].tolist(), r[1], r[2], True)
    return r[0].tolist(), r[1], r[2]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(prompt, limits)
def test_completion_prompts_hash_as_the_reference_does(p: Any, lim: dict[str, Any]) -> None:
    body = {"prompt": p, **lim} if p is not None else dict(lim)
    assert rust_prompt(body, False) == python_prompt(body, False)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(message, max_size=4), limits)
def test_chat_prompts_hash_as_the_reference_does(msgs: list[dict[str, Any]], lim: dict[str, Any]) -> None:
    body = {"messages": msgs, **lim}
    assert rust_prompt(body, True) == python_prompt(body, True)


def test_prompt_hashing_edge_cases() -> None:
    astral = {"messages": [{"role": "user", "content": [{"type": "image_url", "url": '\U0001f600\u00e9\x7f\n"\\'}]}]}
    assert rust_prompt(astral, True) == python_prompt(astral, True) is not None
    floats = {"messages": [{"role": "user", "content": [{"detail": 0.5, "big": 1e20, "tiny": -2.5e-7}]}]}
    assert rust_prompt(floats, True) == python_prompt(floats, True) is not None  # printed as Python's repr
    with pytest.raises(ValueError, match="not valid JSON"):
        approx_prompt(b"{not json", False)
    with pytest.raises(ValueError, match="JSON object"):
        approx_prompt(b"[1]", False)
    with pytest.raises(ValueError, match="block_size"):
        approx_prompt(b'{"prompt": "x"}', False, 0)


def test_one_ttl_cache_of_routing_decisions_expired_by_the_plane() -> None:
    async def scenario() -> None:
        async with Cluster(2, approx_ttl=30.0) as c:
            dp = c.gw.plane
            assert dp.running
            status, headers, _ = await c.post("/v1/completions", {"prompt": "shared system prompt " * 20, "max_tokens": 2})
            assert status == 200
            m = dp.metrics()
            assert m["requests"][("/v1/completions", "2xx")] == 1 and m["routing_count"] == 1
            served_by = c.worker_id(c.mock_by_url(headers["X-Kvroute-Worker"]))
            blocks = dp.approx_len()
            assert blocks > 0 and c.router.index.num_blocks(served_by) == blocks
            chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "q " * 200}, {"type": "x", "w": 0.5}]}]}
            status, _, _ = await c.post("/v1/chat/completions", chat)
            assert status == 200 and dp.approx_len() > blocks
            assert dp.approx_expire(dp.approx_clock() + 1.0) == 0
            removed = dp.approx_expire(dp.approx_clock() + 31.0)
            assert removed > blocks and dp.approx_len() == 0
            assert all(c.router.index.num_blocks(w) == 0 for w in c.router.workers())
            text = await (await c.client.get(c.url + "/metrics")).text()
            assert 'kvroute_requests_total{endpoint="/v1/completions",status="2xx"} 1' in text
            assert 'kvroute_requests_total{endpoint="/v1/chat/completions",status="2xx"} 1' in text
            assert "kvroute_routing_seconds_count 2" in text
            assert_no_leak(c)

    run(scenario())


def test_unknown_paths_and_methods_get_clear_errors() -> None:
    async def scenario() -> None:
        async with Cluster(1) as c:
            for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405), ("POST", "/health", 405)):
                async with c.client.request(method, c.url + path) as r:
                    assert r.status == status and path in (await r.json())["error"]["message"], (method, path)
            assert c.mocks[0].requests == 0

    run(scenario())


def test_pd_workers_added_at_runtime_are_served_on_the_hot_path() -> None:
    async def scenario() -> None:
        token = "an-admin-token"
        async with Cluster(1, admin_token=token) as c:
            dp = c.gw.plane
            auth = {"Authorization": f"Bearer {token}"}
            async with c.client.post(c.url + "/admin/workers", headers=auth, json={"url": "ftp://h:1"}) as r:
                assert r.status == 400 and "worker url" in (await r.json())["error"]["message"]
            assert len(c.gw.workers) == 1 and len(c.router.workers()) == 1
            prefill, decode = MockWorker("p", role="prefill"), MockWorker("d", role="decode")
            for m in (prefill, decode):
                await m.start()
                m.keep_bodies = True
            try:
                for m in (prefill, decode):
                    async with c.client.post(c.url + "/admin/workers", headers=auth, json={"url": m.url, "role": m.role}) as r:
                        assert r.status == 201
                async with c.client.delete(c.url + f"/admin/workers/{c.worker_id(c.mocks[0])}", headers=auth) as r:
                    assert r.status == 200
                assert [w["role"] for w in dp.workers()] == ["prefill", "decode"]
                status, headers, data = await c.post("/v1/completions", {"prompt": "hi there " * 20, "max_tokens": 2})
                assert status == 200 and headers["X-Kvroute-Worker"] == decode.url, data
                assert prefill.bodies[-1]["kv_transfer_params"]["do_remote_decode"] is True
                assert decode.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "p"
                m = dp.metrics()
                assert m["requests"][("/v1/completions", "2xx")] == 1  # the PD pair
                assert_no_leak(c)
            finally:
                for m in (prefill, decode):
                    await m.stop()

    run(scenario())


def test_stop_releases_requests_in_flight_and_start_reports_bind_errors() -> None:
    async def scenario() -> None:
        async with Cluster(1, mock={"cost_per_token": 1.0}) as c:
            dp = c.gw.plane
            task = asyncio.ensure_future(c.post("/v1/completions", {"prompt": "slow " * 40}))
            await poll(lambda: c.mocks[0].in_flight == 1, what="a request in flight on the engine")
            assert c.router.num_in_flight == 1
            await asyncio.get_running_loop().run_in_executor(None, dp.stop)
            assert not dp.running and c.router.num_in_flight == 0 and dp.in_flight == 0
            with pytest.raises(aiohttp.ClientError):  # the client sees its connection dropped
                await task
            await poll(lambda: c.mocks[0].cancelled == 1, what="the engine to see the request cancelled")
            dp.stop()  # idempotent

    run(scenario())
    router = kvroute.Router()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        dp = DataPlane(router)
        with pytest.raises(OSError, match="cannot listen"):
            dp.start("127.0.0.1", taken)
        assert not dp.running and dp.url is None


def test_bad_data_plane_configuration_is_refused() -> None:
    router = kvroute.Router()
    with pytest.raises(ValueError, match="threads"):
        DataPlane(router, threads=0)
    with pytest.raises(ValueError, match="read_timeout"):
        DataPlane(router, read_timeout=0.0)
    with pytest.raises(
        ValueError, match=r"approx_ttl must be a finite number of seconds > 0 \(and < 2\*\*64\), got 1000000000000000000000000000000"
    ):
        DataPlane(router, approx_ttl=1e30)  # once a panic in Duration::from_secs_f64
    with pytest.raises(ValueError, match="max_body_bytes"):
        DataPlane(router, max_body_bytes=0)
    with pytest.raises(ValueError, match="pd_convention must be 'vllm' or 'sglang', got \"nixl\""):
        DataPlane(router, pd_convention="nixl")
    dp = DataPlane(router)
    with pytest.raises(ValueError, match="expected http"):
        dp.add_worker(0, "ftp://h:1")
    with pytest.raises(ValueError, match=r"cannot read /nonexistent/ca\.pem"):
        DataPlane(router, ca_file="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="role"):
        dp.add_worker(0, "http://h:1", role="encode")
    for port in (0, 70000):
        with pytest.raises(ValueError, match="bootstrap_port must be a TCP port"):
            dp.add_worker(0, "http://h:1", role="prefill", bootstrap_port=port)
    dp.add_worker(0, "http://h:1")
    dp.add_worker(1, "http://P.example:2", role="prefill", bootstrap_port=8998)
    assert [(w["id"], w["role"]) for w in dp.workers()] == [(0, "both"), (1, "prefill")]
    with pytest.raises(ValueError, match="already registered"):
        dp.add_worker(0, "http://h:2")
    assert dp.remove_worker(0) and not dp.remove_worker(0)
    with pytest.raises(RuntimeError, match="approximate cache"):
        DataPlane(router, approx_ttl=None).approx_len()
    np.testing.assert_array_equal(approx_prompt(b'{"prompt": [1, 2, 3, 4]}', False, 2)[0], kvroute.block_hashes([1, 2, 3, 4], 2))  # type: ignore[index]


def test_kvroute_serve_local_prefill_max_tokens() -> None:
    """--local-prefill-max-tokens reaches the Router (conditional disaggregation); bad values are refused."""
    import argparse

    from kvroute.gateway.cli import add_serve_parser, build_gateway

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    pd = ["serve", "--prefill", "http://p:1", "--decode", "http://d:1"]

    def router_config(*argv: str) -> dict[str, object]:
        return dict(build_gateway(parser.parse_args([*pd, *argv])).router.config)

    assert router_config()["local_prefill_max_tokens"] == 0  # default: always disaggregate
    assert router_config("--local-prefill-max-tokens", "64")["local_prefill_max_tokens"] == 64
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        router_config("--local-prefill-max-tokens", "-1")
    with pytest.raises(argparse.ArgumentTypeError, match="vllm"):
        router_config("--local-prefill-max-tokens", "64", "--pd-convention", "sglang")


def test_kvroute_serve_no_pending_prefixes() -> None:
    """With KV events, pending prefixes are on in the gateway's Router unless --no-pending-prefixes;
    without KV events the gateway stores routed prefixes in the index itself, so they are off."""
    import argparse

    from kvroute.gateway.cli import add_serve_parser, build_gateway

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())

    def router_config(*argv: str) -> dict[str, object]:
        return dict(build_gateway(parser.parse_args(["serve", "--worker", "http://w:1", *argv])).router.config)

    events = ("--kv-events", "http://w:1=tcp://127.0.0.1:5557")
    assert router_config(*events)["pending_prefixes"] is True
    assert router_config(*events, "--no-pending-prefixes")["pending_prefixes"] is False
    assert router_config()["pending_prefixes"] is False
    # Stale-overlap corrections read the engines' removals: on with KV events, off without them.
    assert router_config(*events)["stale_overlaps"] is True
    assert router_config(*events, "--no-stale-overlaps")["stale_overlaps"] is False
    assert router_config()["stale_overlaps"] is False
    # The bounded token share: off unless asked; a bound below 1 is refused by the Router.
    assert router_config()["token_share_bound"] is None
    assert router_config("--token-share-bound", "1.3")["token_share_bound"] == 1.3
    with pytest.raises(ValueError, match="token_share_bound must be a finite number >= 1"):
        router_config("--token-share-bound", "0.5")


def test_kvroute_serve_registers_the_engines_prefix_cache_size() -> None:
    """--prefix-cache-blocks reaches every unified worker's registration (what the default policy,
    "capacity", charges evictions against); without it the size is unknown; negative is refused."""
    import argparse

    import pytest
    from kvroute.gateway.cli import add_serve_parser, build_gateway

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())

    def sizes(*argv: str) -> list[object]:
        gw = build_gateway(parser.parse_args(["serve", "--worker", "http://w:1", "--worker", "http://w:2", *argv]))
        assert gw.router.policy == "capacity"
        return [gw.router.load(w)["prefix_cache_blocks"] for w in gw.router.workers()]

    assert sizes("--prefix-cache-blocks", "8191") == [8191, 8191]
    assert sizes() == [None, None]
    with pytest.raises(SystemExit):  # argparse's own error: --prefix-cache-blocks expects an integer >= 0
        sizes("--prefix-cache-blocks", "-5")

"""Model pools, request identity and the self-check, through the gateway in front of mock engines:
requests go only to workers serving their model, an unknown model gets the engines' 404,
``/v1/models`` is the union, adapters and salts key the prompt, and the self-check compares each
answer's ``cached_tokens`` with the prediction."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import kvroute
import pytest
from exact_tokenizers import build_word_level
from gateway_harness import MockWorker, run
from kvroute.gateway.app import WorkerConfig, make_gateway


async def _start(mocks: list[MockWorker], **gateway: Any) -> tuple[Any, str, aiohttp.ClientSession]:
    for m in mocks:
        await m.start()
    gw = make_gateway(kvroute.Router(preset="gateway_approx"), [m.url for m in mocks], health_interval=0.05, **gateway)
    url = await gw.start("127.0.0.1", 0)
    return gw, url, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))


async def _stop(gw: Any, client: aiohttp.ClientSession, mocks: list[MockWorker]) -> None:
    await client.close()
    await gw.stop()
    for m in mocks:
        await m.stop()


async def _post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    async with client.post(url + "/v1/completions", json=body) as r:
        return r.status, r.headers.get("X-Kvroute-Worker", ""), await r.json()


def test_requests_go_to_the_workers_serving_their_model() -> None:
    async def scenario() -> None:
        llama = [MockWorker(f"l{i}", models=("llama",), adapters=("tenant-a",)) for i in range(2)]
        qwen = MockWorker("q", models=("qwen",))
        mocks = [*llama, qwen]
        gw, url, client = await _start(mocks)
        try:
            for i in range(12):
                status, served, _ = await _post(client, url, {"model": "qwen", "prompt": f"question {i} " * 40, "max_tokens": 1})
                assert (status, served) == (200, qwen.url)
                for model in ("llama", "tenant-a"):
                    status, served, _ = await _post(client, url, {"model": model, "prompt": f"question {i} " * 40, "max_tokens": 1})
                    assert status == 200 and served in {m.url for m in llama}, (model, served)
            status, _, body = await _post(client, url, {"model": "nosuch", "prompt": "hi", "max_tokens": 1})
            assert status == 404
            assert body["error"] == {
                "message": "The model `nosuch` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
            assert qwen.requests == 12 and sum(m.requests for m in llama) == 24
            # A body without a model goes anywhere (the engines pick their default).
            status, _, _ = await _post(client, url, {"prompt": "hi", "max_tokens": 1})
            assert status == 200
            async with client.get(url + "/v1/models") as r:
                listed = {m["id"]: m.get("parent") for m in (await r.json())["data"]}
            assert listed == {"llama": None, "tenant-a": "llama", "qwen": None}
            # A worker taken out of routing leaves the union; the pool routes around it. (Its /health
            # fails too, or the 50 ms probe would bring it back before the checks below.)
            qwen.healthy = False
            gw.mark_unhealthy(next(w for w in gw.workers.values() if w.url == qwen.url), "test")
            async with client.get(url + "/v1/models") as r:
                assert {m["id"] for m in (await r.json())["data"]} == {"llama", "tenant-a"}
            status, _, body = await _post(client, url, {"model": "qwen", "prompt": "hi", "max_tokens": 1})
            assert status == 503, body
        finally:
            await _stop(gw, client, mocks)

    run(scenario())


def test_model_lists_are_refreshed_and_configurable() -> None:
    async def scenario() -> None:
        a, b = MockWorker("a", models=("m1",)), MockWorker("b", models=("m1",), adapters=("ad",))
        mocks = [a, b]
        for m in mocks:
            await m.start()
        configured = WorkerConfig(b.url, models=("m1", "ad"), adapters=("ad",))
        gw = make_gateway(kvroute.Router(preset="gateway_approx"), [a.url, configured], health_interval=0.05, models_interval=0.05)
        url = await gw.start("127.0.0.1", 0)
        client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        try:
            assert (await _post(client, url, {"model": "m2", "prompt": "x", "max_tokens": 1}))[0] == 404
            a.models = ("m1", "m2")  # the engine loads another model: a refresh sees it
            for _ in range(400):
                async with client.get(url + "/v1/models") as r:
                    if "m2" in {m["id"] for m in (await r.json())["data"]}:
                        break
                await asyncio.sleep(0.01)
            status, served, _ = await _post(client, url, {"model": "m2", "prompt": "x", "max_tokens": 1})
            assert (status, served) == (200, a.url)
            # b's list is configured (never read from the engine): its adapter routes there only.
            for i in range(6):
                status, served, _ = await _post(client, url, {"model": "ad", "prompt": f"y{i} " * 100, "max_tokens": 1})
                assert (status, served) == (200, b.url)
            with pytest.raises(ValueError, match="adapters must be among its models"):
                WorkerConfig(b.url, models=("m1",), adapters=("ad",))
        finally:
            await _stop(gw, client, mocks)

    run(scenario())


def test_adapters_and_salts_key_the_prompt() -> None:
    """Repeats of a prompt under one identity stick to the worker that cached them; the same tokens
    under another adapter or salt are not credited with that worker's cache."""

    async def scenario() -> None:
        mocks = [MockWorker(f"w{i}", models=("base",), adapters=("a", "b")) for i in range(2)]
        gw, url, client = await _start(mocks)
        try:
            prompt = "shared system prompt " * 60
            variants = [
                {"model": "base"},
                {"model": "a"},
                {"model": "b"},
                {"model": "base", "cache_salt": "s1"},
                {"model": "a", "cache_salt": "s1"},
            ]
            keys = set()
            for v in variants:
                h, _, _ = gw.plane.prompt(json.dumps({**v, "prompt": prompt}).encode(), False)
                keys.add(tuple(h.tolist()))
            assert len(keys) == len(variants), "each identity keys the prompt apart"
            first: dict[int, str] = {}
            for round_ in range(3):
                for i, v in enumerate(variants):
                    status, served, body = await _post(client, url, {**v, "prompt": prompt, "max_tokens": 1})
                    assert status == 200, body
                    if round_ == 0:
                        first[i] = served
                    else:
                        assert served == first[i], (v, served)
                        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            # A repeat of each identity was a cache hit on its own worker.
            assert sum(m.cached_tokens for m in mocks) > 0
        finally:
            await _stop(gw, client, mocks)

    run(scenario())


def test_a_wrong_tokenizer_raises_the_self_check_alarm(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Exact mode: the engine reports other prompt lengths than the router counted (its tokenizer
    is not the router's); the alarm rises within 20 requests, once, and /metrics counts it."""

    tok = build_word_level(tmp_path)

    async def scenario() -> None:
        mocks = [MockWorker(f"w{i}") for i in range(2)]
        for m in mocks:
            m.usage = lambda body, prompt, cached: (prompt + 3, 0)
        gw, url, client = await _start(mocks, tokenizer=tok)
        try:
            for i in range(20):
                status, _, _ = await _post(client, url, {"model": "mock", "prompt": "the sky is blue " * (i + 2), "max_tokens": 1})
                assert status == 200
            check = gw.metrics()["prefix_check"]
            assert check["outcomes"]["prompt_length"] == 20 and check["alarms"] == 1 and check["alarmed"]
            async with client.get(url + "/metrics") as r:
                text = await r.text()
            assert 'kvroute_prefix_check_total{outcome="prompt_length"} 20' in text
            assert "kvroute_prefix_check_alarms_total 1" in text
        finally:
            await _stop(gw, client, mocks)

    run(scenario())
    err = capfd.readouterr().err
    assert len(re.findall(r"WARNING kvroute self-check", err)) == 1, err
    assert "tokenizer or the chat template" in err


def test_correct_predictions_raise_no_alarm(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The same, with the engine reporting exactly the router's prediction: every check matches."""
    tok = build_word_level(tmp_path)

    async def scenario() -> None:
        mocks = [MockWorker("w0")]
        gw, url, client = await _start(mocks, tokenizer=tok)
        predicted: list[int] = []
        bs = int(gw.router.config["block_size"])

        def usage(body: dict[str, Any], prompt: int, cached: int) -> tuple[int, int]:
            _, n, _ = gw.plane.prompt(json.dumps(body).encode(), False)
            return n, predicted[-1]

        mocks[0].usage = usage
        try:
            for i in range(30):
                body = {
                    "model": "mock",
                    "prompt": "the sky is blue " * 40,
                    "max_tokens": 1,
                    "stream": i % 2 == 1,
                    "stream_options": {"include_usage": True},
                }
                if i % 2 == 0:
                    body.pop("stream_options")
                # What the router will predict: the whole prompt's blocks once routed before (approximate inserts).
                h, n, _ = gw.plane.prompt(json.dumps(body).encode(), False)
                predicted.append(0 if i == 0 else min(len(h) * bs, (n - 1) // bs * bs))
                async with client.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
            check = gw.metrics()["prefix_check"]
            assert check["outcomes"]["match"] == 30 and check["alarms"] == 0, check
        finally:
            await _stop(gw, client, mocks)

    run(scenario())
    assert "self-check" not in capfd.readouterr().err

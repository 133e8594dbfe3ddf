"""kvroute.integrations.litellm on fake engines (kvroute.gateway.mock, real sockets on 127.0.0.1):
the Router strategy and the proxy callback route by prefix, fail over past a dead engine, release
each lease exactly once (success, failure, abandoned stream via TTL) and stay error-free under
concurrency. Skips without litellm (``pip install 'kvroute[litellm]'``)."""

# ruff: noqa: E402
from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import

import pytest

litellm = pytest.importorskip("litellm")
pytest.importorskip("aiohttp")

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from kvroute.gateway.mock import MockWorker
from kvroute.integrations.engine_router import EngineRouter
from kvroute.integrations.litellm import LEASES_KEY, KvrouteProxyHandler, KvrouteStrategy
from loop_thread import LoopThread


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 120))


async def _engines(n: int) -> list[MockWorker]:
    ws = [MockWorker(f"e{i}") for i in range(n)]
    for w in ws:
        await w.start()
    return ws


def _model_list(ws: list[MockWorker]) -> list[dict[str, Any]]:
    return [
        {
            "model_name": "m",
            "litellm_params": {"model": "openai/mock", "api_base": w.url + "/v1", "api_key": "unused"},
            "model_info": {"id": w.name},
        }
        for w in ws
    ]


def _conversation(conv: int, turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": f"You are assistant number {conv}. " * 40}]
    for t in range(turn + 1):
        msgs.append({"role": "user", "content": f"Turn {t} of conversation {conv}: tell me more."})
    return msgs


class Setup:
    def __init__(self, n: int, proxy: bool, **settings: Any) -> None:
        self.n, self.proxy, self.settings = n, proxy, settings

    async def __aenter__(self) -> Setup:
        self.ws = await _engines(self.n)
        self.clock = Clock()
        self.er = EngineRouter(block_size=16, clock=self.clock, **self.settings)
        self.router = litellm.Router(model_list=_model_list(self.ws), num_retries=2, retry_after=0)
        self.saved = list(litellm.callbacks)
        if self.proxy:
            self.cb = KvrouteProxyHandler(self.er)
            litellm.callbacks.append(self.cb)
        else:
            strategy = KvrouteStrategy(self.router, self.er)
            self.router.register_plugin(strategy)
            self.cb = strategy.callback
        return self

    async def __aexit__(self, *exc: object) -> None:
        litellm.callbacks[:] = self.saved
        self.er.close()
        for w in self.ws:
            await w.stop()

    def served_by(self) -> dict[str, int]:
        return {w.name: w.completed for w in self.ws}

    async def settled(self, opened: int) -> None:
        """Outcome callbacks run as tasks after the response: wait (bounded) until every lease is released."""
        for _ in range(3000):  # up to 30 s: LiteLLM runs its logging callbacks late on a loaded host
            if self.er.leases.counts["opened"] == opened and len(self.er.leases) == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"leases not released: {self.er.leases.counts}, {len(self.er.leases)} open")


MODES = [False, True]
IDS = ["strategy", "proxy-callback"]


@pytest.mark.parametrize("proxy", MODES, ids=IDS)
def test_routes_by_prefix_and_releases_on_success(proxy: bool) -> None:
    async def body() -> None:
        async with Setup(3, proxy) as s:
            homes: dict[int, str] = {}
            for conv in range(6):
                before = s.served_by()
                await s.router.acompletion(model="m", messages=_conversation(conv, 0), max_tokens=4)
                homes[conv] = next(k for k, v in s.served_by().items() if v > before[k])
            assert len(set(homes.values())) >= 2, f"six distinct prefixes on one engine: {homes}"
            for turn in (1, 2):
                for conv in range(6):
                    before = s.served_by()
                    if turn == 2:  # streamed: the success event fires once the stream is read to its end
                        stream = await s.router.acompletion(model="m", messages=_conversation(conv, turn), max_tokens=4, stream=True)
                        async for _ in stream:
                            pass
                    else:
                        await s.router.acompletion(model="m", messages=_conversation(conv, turn), max_tokens=4)
                    after = s.served_by()
                    got = [k for k in after if after[k] > before[k]]
                    assert got == [homes[conv]], f"conversation {conv} turn {turn} went to {got}, its prefix is on {homes[conv]}"
            await s.settled(18)
            assert s.er.leases.counts["finished"] == 18 and s.er.leases.counts["failed"] == 0
            assert s.er.router.num_in_flight == 0

    run(body)


@pytest.mark.parametrize("proxy", MODES, ids=IDS)
def test_fails_over_past_a_dead_engine(proxy: bool) -> None:
    async def body() -> None:
        async with Setup(2, proxy) as s:
            msgs = _conversation(7, 0)
            await s.router.acompletion(model="m", messages=msgs, max_tokens=4)
            home = next(w for w in s.ws if w.completed)
            other = next(w for w in s.ws if w is not home)
            await home.kill()
            for turn in range(1, 4):
                r = await s.router.acompletion(model="m", messages=_conversation(7, turn), max_tokens=4)
                assert r.choices[0].message.content
            assert other.completed == 3
            await s.settled(s.er.leases.counts["opened"])
            c = s.er.leases.counts
            assert c["failed"] >= 1 and c["finished"] == 4, c
            assert c["opened"] == c["failed"] + c["finished"], "every lease released exactly once"
            assert s.er.router.num_in_flight == 0

    run(body)


@pytest.mark.parametrize("proxy", MODES, ids=IDS)
def test_failure_releases_once_and_retries_elsewhere(proxy: bool) -> None:
    async def body() -> None:
        async with Setup(2, proxy) as s:
            msgs = _conversation(3, 0)
            await s.router.acompletion(model="m", messages=msgs, max_tokens=4)
            home = next(w for w in s.ws if w.completed)
            home.fail_next = 1  # one HTTP 500, then healthy again
            r = await s.router.acompletion(model="m", messages=_conversation(3, 1), max_tokens=4, metadata={"user": "u1"})
            assert r.choices[0].message.content
            await s.settled(3)
            c = s.er.leases.counts
            assert (c["failed"], c["finished"], c["opened"]) == (1, 2, 3), c
            assert sum(w.completed for w in s.ws) == 2 and home.requests == 2

    run(body)


def test_abandoned_stream_is_released_by_the_ttl() -> None:
    async def body() -> None:
        async with Setup(2, proxy=False, lease_ttl=30.0) as s:
            for w in s.ws:
                w.token_delay = 0.01
            stream = await s.router.acompletion(model="m", messages=_conversation(1, 0), max_tokens=50, stream=True)
            it: AsyncIterator[Any] = stream.__aiter__()
            await it.__anext__()
            del stream, it  # the client walks away mid-stream
            assert len(s.er.leases) == 1 and s.er.router.num_in_flight == 1, "nobody reported the abandoned stream"
            s.clock.t = 31.0
            assert s.er.leases.expire() == 1
            assert s.er.leases.counts["expired"] == 1 and s.er.router.num_in_flight == 0
            await s.router.acompletion(model="m", messages=_conversation(2, 0), max_tokens=4)
            await s.settled(2)
            assert s.er.leases.counts["duplicates"] <= 1  # a late event for the expired one is ignored

    run(body)


@pytest.mark.parametrize("proxy", MODES, ids=IDS)
def test_concurrent_requests_no_errors(proxy: bool) -> None:
    async def body() -> None:
        async with Setup(3, proxy) as s:
            for w in s.ws:
                w.token_delay = 0.001

            async def one(i: int) -> None:
                stream = i % 2 == 0
                r = await s.router.acompletion(model="m", messages=_conversation(i % 8, i // 8), max_tokens=4, stream=stream)
                if stream:
                    async for _ in r:
                        pass

            results = await asyncio.gather(*(one(i) for i in range(64)), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, errors[:3]
            await s.settled(64)
            assert s.er.leases.counts["finished"] == 64 and s.er.router.num_in_flight == 0
            assert sum(w.completed for w in s.ws) == 64

    run(body)


def test_ticket_rides_in_metadata() -> None:
    async def body() -> None:
        async with Setup(2, proxy=False) as s:
            kw: dict[str, Any] = {"messages": _conversation(0, 0), "metadata": {}}
            dep = s.cb.pick("m", _model_list(s.ws), kw["messages"], None, kw)
            held = kw["metadata"][LEASES_KEY]
            assert list(held) == [dep["model_info"]["id"]]
            # A second pick for the same request (LiteLLM's retry) fails the first lease and avoids it.
            dep2 = s.cb.pick("m", _model_list(s.ws), kw["messages"], None, kw)
            assert dep2["model_info"]["id"] != dep["model_info"]["id"]
            assert s.er.leases.counts["failed"] == 1 and len(s.er.leases) == 1

    run(body)


def test_sync_completion_path() -> None:
    async def start() -> list[MockWorker]:
        return await _engines(2)

    loop = LoopThread()
    ws = loop.run(start(), 10)
    saved = list(litellm.callbacks)
    er = EngineRouter(block_size=16)
    try:
        router = litellm.Router(model_list=_model_list(ws), num_retries=0)
        router.register_plugin(KvrouteStrategy(router, er))
        served = []
        for turn in range(3):
            before = [w.completed for w in ws]
            r = router.completion(model="m", messages=_conversation(4, turn), max_tokens=4)
            assert r.choices[0].message.content
            served += [w.name for w, b in zip(ws, before) if w.completed > b]
        assert len(set(served)) == 1, served
        for _ in range(3000):  # up to 30 s: the sync path's success callback runs on LiteLLM's thread pool
            if len(er.leases) == 0:
                break
            threading.Event().wait(0.01)
        assert er.leases.counts["opened"] == 3 and len(er.leases) == 0, er.leases.counts
    finally:
        litellm.callbacks[:] = saved
        er.close()
        for w in ws:
            loop.run(w.stop(), 10)
        loop.close()


def test_proxy_handler_reads_its_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvroute.integrations.litellm as mod

    monkeypatch.setenv("KVROUTE_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVROUTE_POLICY", "cache_aware")
    monkeypatch.delitem(mod.__dict__, "proxy_handler", raising=False)
    handler = mod.proxy_handler
    try:
        assert isinstance(handler, mod.KvrouteProxyHandler) and mod.proxy_handler is handler, "built once, on first access"
        assert handler.engines.block_size == 32 and handler.engines.router.policy == "cache_aware"
        assert handler.engines.router.config["token_share_bound"] == 1.25, "the integrations' default bound"
    finally:
        handler.engines.close()
    for text, bound in (("off", None), ("1.5", 1.5)):
        monkeypatch.delitem(mod.__dict__, "proxy_handler")
        monkeypatch.setenv("KVROUTE_TOKEN_SHARE_BOUND", text)
        handler = mod.proxy_handler
        try:
            assert handler.engines.router.config["token_share_bound"] == bound
        finally:
            handler.engines.close()
    monkeypatch.delitem(mod.__dict__, "proxy_handler")
    monkeypatch.setenv("KVROUTE_TOKEN_SHARE_BOUND", "lots")
    with pytest.raises(ValueError, match="KVROUTE_TOKEN_SHARE_BOUND='lots': expected number or off"):
        mod.proxy_handler  # noqa: B018
    monkeypatch.delenv("KVROUTE_TOKEN_SHARE_BOUND")
    monkeypatch.delitem(mod.__dict__, "proxy_handler", raising=False)
    monkeypatch.setenv("KVROUTE_BLOCK_SIZE", "sixteen")
    with pytest.raises(ValueError, match="KVROUTE_BLOCK_SIZE='sixteen': expected int"):
        mod.proxy_handler  # noqa: B018

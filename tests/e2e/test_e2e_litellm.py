"""kvroute inside LiteLLM on real vLLM engines: exact mode (the model's tokenizer.json and chat
template) with the engines' KV events, through ``litellm.Router`` with ``KvrouteStrategy`` and with
the proxy's ``KvrouteProxyHandler``. Routing by prefix (the engines' own prefix-cache counters), failover
past a killed engine, leases released exactly once (success, failure, an abandoned stream via the TTL),
and no error under concurrency."""

# ruff: noqa: E402
from __future__ import annotations

import os

import vllm_bed

vllm_bed.skip_unless_bed()
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import litellm
import pytest
from kvroute.integrations.engine_router import EngineRouter
from kvroute.integrations.litellm import KvrouteProxyHandler, KvrouteStrategy
from vllm_bed import BLOCK_SIZE, MODEL_NAME, chat_turns, poll

EVENT_WAIT = 15.0


def model_list(engines: list[vllm_bed.Engine]) -> list[dict[str, Any]]:
    return [
        {
            "model_name": "tiny",
            "litellm_params": {"model": f"hosted_vllm/{MODEL_NAME}", "api_base": e.url + "/v1", "api_key": "unused", "timeout": 60},
            "model_info": {"id": e.name, "kv_events": e.events, "kv_events_replay": e.replay},
        }
        for e in engines
    ]


class Host:
    """A litellm.Router with kvroute in it (strategy or proxy callback) over the bed's engines."""

    def __init__(self, engines: list[vllm_bed.Engine], proxy: bool, **settings: Any) -> None:
        self.engines = engines
        self.er = EngineRouter(tokenizer=str(engines[0].bed.model), block_size=BLOCK_SIZE, metrics_interval=0.5, **settings)
        self.router = litellm.Router(model_list=model_list(engines), num_retries=2, retry_after=0)
        self.saved = list(litellm.callbacks)
        if proxy:
            self.cb: Any = KvrouteProxyHandler(self.er)
            litellm.callbacks.append(self.cb)
        else:
            strategy = KvrouteStrategy(self.router, self.er)
            self.router.register_plugin(strategy)
            self.cb = strategy.callback

    def close(self) -> None:
        litellm.callbacks[:] = self.saved
        self.er.close()

    def engine(self, response: Any) -> vllm_bed.Engine:
        """The engine that served a response: LiteLLM names its deployment (our model_info.id)."""
        did = response._hidden_params["model_id"]
        return next(e for e in self.engines if e.name == did)

    async def settled(self) -> None:
        for _ in range(1000):
            if len(self.er.leases) == 0:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"leases still open: {self.er.leases.counts}")


@pytest.fixture(params=[False, True], ids=["strategy", "proxy-callback"])
def host(request: pytest.FixtureRequest, live_engines: list[vllm_bed.Engine]) -> Iterator[Host]:
    for e in live_engines:
        e.reset_prefix_cache()
    h = Host(live_engines, proxy=request.param)
    try:
        yield h
    finally:
        h.close()


async def held(host: Host, msgs: list[dict[str, str]], engine: vllm_bed.Engine) -> None:
    """Waits (bounded) until the engine's KV events put this prompt's full blocks in the index: the
    next turn is routed on them."""
    p = host.er.prompter.prompt({"messages": msgs}, True)
    worker = host.er.get(engine.name).worker  # type: ignore[union-attr]
    need = (p.num_tokens - 1) // BLOCK_SIZE
    await asyncio.to_thread(
        poll, lambda: host.er.router.index.match(p.hashes).get(worker, 0) >= need, EVENT_WAIT, f"{engine.name}'s KV events"
    )


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 300))


def test_routes_by_prefix(host: Host) -> None:
    async def body() -> None:
        homes: dict[int, vllm_bed.Engine] = {}
        for conv in range(4):
            r = await host.router.acompletion(model="tiny", messages=chat_turns(conv, 0), max_tokens=4, temperature=0)
            assert r.choices[0].message.content is not None
            homes[conv] = host.engine(r)
        assert len({e.name for e in homes.values()}) == 2, "four distinct prefixes spread over both engines"
        for conv in range(4):
            await held(host, chat_turns(conv, 0), homes[conv])
        hits0 = sum(e.metric("vllm:prefix_cache_hits_total") for e in host.engines)
        for turn in (1, 2):
            for conv in range(4):
                stream = await host.router.acompletion(
                    model="tiny", messages=chat_turns(conv, turn), max_tokens=4, temperature=0, stream=True
                )
                chunks = [c async for c in stream]
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
                assert host.engine(stream) is homes[conv], f"conversation {conv} turn {turn} left its prefix's engine"
                await held(host, chat_turns(conv, turn), homes[conv])
        hits = sum(e.metric("vllm:prefix_cache_hits_total") for e in host.engines) - hits0
        assert hits >= 8 * 2 * BLOCK_SIZE, f"engine-side prefix hits {hits} tokens: the follow-up turns missed their prefix"
        await host.settled()
        c = host.er.leases.counts
        assert (c["opened"], c["finished"], c["failed"]) == (12, 12, 0), c
        assert host.er.router.num_in_flight == 0
        # The router checked itself on the usage LiteLLM handed back (the unstreamed first turns; a
        # streamed answer's usage is LiteLLM's own count, without cached_tokens, so it is skipped).
        # The first requests after the fixture's reset_prefix_cache may be credited with the
        # previous test's blocks: the reset's AllBlocksCleared goes out on the engine's next step.
        check = host.er.check.snapshot()
        out = check["outcomes"]
        assert out["match"] + out["over"] == 4 and out["over"] <= 2, check
        assert out["under"] == out["prompt_length"] == 0 and check["alarms"] == 0, check

    _run(body())


def test_fails_over_past_a_dead_engine(host: Host) -> None:
    async def body() -> None:
        await host.router.acompletion(model="tiny", messages=chat_turns(9, 0), max_tokens=4, temperature=0)
        # The engine holding conversation 9's prefix, as the index (the engines' KV events) says.
        p = host.er.prompter.prompt({"messages": chat_turns(9, 1)}, True)
        await asyncio.to_thread(poll, lambda: len(host.er.router.index.match(p.hashes)) > 0, EVENT_WAIT, "the first turn's KV events")
        worker = max(host.er.router.index.match(p.hashes).items(), key=lambda kv: kv[1])[0]
        home = next(e for e in host.engines if host.er.get(e.name).worker == worker)  # type: ignore[union-attr]
        other = next(e for e in host.engines if e is not home)
        home.stop(signal.SIGKILL)
        for turn in range(1, 4):
            r = await host.router.acompletion(model="tiny", messages=chat_turns(9, turn), max_tokens=4, temperature=0)
            assert r.choices[0].message.content is not None
            assert host.engine(r) is other
        await host.settled()
        c = host.er.leases.counts
        assert c["failed"] >= 1 and c["finished"] == 4 and c["opened"] == c["failed"] + c["finished"], c
        assert host.er.router.num_in_flight == 0

    _run(body())


def test_abandoned_stream_expires(live_engines: list[vllm_bed.Engine]) -> None:
    h = Host(live_engines, proxy=False, lease_ttl=2.0)

    async def body() -> None:
        stream = await h.router.acompletion(model="tiny", messages=chat_turns(5, 0), max_tokens=200, temperature=0, stream=True)
        it = stream.__aiter__()
        await it.__anext__()
        del stream, it  # the client walks away mid-stream: LiteLLM reports nothing
        assert len(h.er.leases) == 1
        await asyncio.to_thread(poll, lambda: h.er.leases.expire() > 0 or len(h.er.leases) == 0, 10.0, "the lease TTL")
        c = h.er.leases.counts
        assert c["expired"] == 1 and c["finished"] == 0 and h.er.router.num_in_flight == 0

    try:
        _run(body())
    finally:
        h.close()


def test_concurrent_requests_no_errors(host: Host) -> None:
    async def body() -> None:
        async def one(i: int) -> None:
            msgs = chat_turns(i % 6, i // 6)
            if i % 2:
                stream = await host.router.acompletion(model="tiny", messages=msgs, max_tokens=4, temperature=0, stream=True)
                async for _ in stream:
                    pass
            else:
                await host.router.acompletion(model="tiny", messages=msgs, max_tokens=4, temperature=0)

        results = await asyncio.gather(*(one(i) for i in range(24)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        await host.settled()
        c = host.er.leases.counts
        assert (c["opened"], c["finished"]) == (24, 24), c
        assert host.er.router.num_in_flight == 0

    _run(body())

"""Bounded load test: 2,000 requests at 200 req/s (open loop) through the gateway onto 8 mock
engines, half of them streaming; every one must complete and no load may leak."""

from __future__ import annotations

import asyncio
import collections
import random

import pytest

pytest.importorskip("aiohttp")

from gateway_harness import (
    Cluster,
    assert_no_leak,
    run,
)

N, RATE = 2000, 200.0


def test_2000_requests_at_200_per_second_zero_lost() -> None:
    async def scenario() -> None:
        rng = random.Random(11)
        prefixes = [f"tenant {t} instructions. " * 60 for t in range(32)]
        async with Cluster(8, mock={"cost_per_token": 1e-7, "token_delay": 0.0005}) as c:
            loop = asyncio.get_running_loop()
            start = loop.time()
            results: collections.Counter[str] = collections.Counter()

            async def one(i: int, body: dict) -> None:
                await asyncio.sleep(max(0.0, start + i / RATE - loop.time()))  # open-loop arrival schedule
                status, _, data = await c.post("/v1/completions", body)
                ok = status == 200 and (data.endswith(b"data: [DONE]\n\n") if body["stream"] else data.startswith(b"{"))
                results["ok" if ok else f"{status}: {data[:100]!r}"] += 1

            bodies = [
                {
                    "prompt": rng.choice(prefixes) + f"request {i} " * rng.randrange(1, 30),
                    "max_tokens": rng.randrange(1, 12),
                    "stream": i % 2 == 0,
                }
                for i in range(N)
            ]
            await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
            assert results == {"ok": N}, results.most_common(5)
            served = [m.completed for m in c.mocks]
            assert sum(served) == N and min(served) > 0, served
            assert c.metrics.requests[("/v1/completions", "2xx")] == N
            assert_no_leak(c)

    run(scenario(), timeout=60)

"""kvroute.integrations.ray_serve on fake engines (kvroute.gateway.mock) in a local Ray cluster:
two ingress replicas, so two kvroute routers route at once; each conversation stays on one engine,
streamed and not, and every lease is released. Skips without Ray Serve (``pip install 'kvroute[ray]'``)."""

# ruff: noqa: E402
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("aiohttp")

import json
import threading
from collections.abc import Iterator

from kvroute.gateway.mock import MockWorker
from kvroute.integrations.ray_serve import build_app
from loop_thread import LoopThread
from serve_app import ServeApp


class Cluster(ServeApp):
    """Two mock engines on an event loop of their own, behind a two-ingress kvroute Serve app."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.engines = [MockWorker(f"e{i}") for i in range(2)]
        for e in self.engines:
            self.loop.run(e.start(), 10)
        # Serve's workers run this interpreter, so they import the kvroute installed here (never the
        # source tree: it has no built _core outside an editable install).
        # No engine /metrics polling after the first (an hour apart): the failover test needs the
        # routers to learn of a dead engine from a failed request, not from a refused poll.
        kwargs = {"block_size": 16, "metrics_interval": 3600.0}
        # Four replicas (two engines, two ingresses) at half a CPU each: the app places on a 2-CPU
        # cluster (with Serve's default of one CPU per replica it would need four).
        app = build_app([{"engine_url": e.url} for e in self.engines], request_router_kwargs=kwargs, ingress_replicas=2, num_cpus=0.5)
        super().__init__(app, timeout=60.0, num_cpus=2)

    def close(self) -> None:
        super().close()
        for e in self.engines:
            self.loop.run(e.stop(), 10)
        self.loop.close()


def wait_released(cluster: Cluster) -> None:
    """on_request_completed runs in the ingress once a response is done: poll (bounded) until no lease is open."""
    for _ in range(300):
        if all(rs and rs[0]["open"] == 0 for rs in cluster.routers().values()):
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"leases still open: {cluster.routers()}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def test_two_router_instances_keep_conversations_on_their_engine(cluster: Cluster) -> None:
    ingresses: set[str] = set()
    homes: dict[tuple[str, int], set[int]] = {}  # (ingress replica, conversation) -> engines that served it
    for turn in range(4):
        for conv in range(6):
            msgs = [{"role": "system", "content": f"system prompt {conv} " * 80}]
            msgs += [{"role": "user", "content": f"question {t}"} for t in range(turn + 1)]
            before = [e.completed for e in cluster.engines]
            ing, out = cluster.post({"messages": msgs, "max_tokens": 4, "stream": turn % 2 == 1})
            ingresses.add(ing)
            assert (b"[DONE]" in out) if turn % 2 else json.loads(out)["choices"][0]["finish_reason"] == "length"
            after = [e.completed for e in cluster.engines]
            homes.setdefault((ing, conv), set()).update(i for i in range(2) if after[i] > before[i])
    assert len(ingresses) == 2, "Serve's proxy spread the requests over both ingress replicas (two routers)"
    # Approximate mode: each router learns the cache from its own decisions only, so a conversation
    # may take one more engine when the other router first sees it (which router Serve's proxy picks
    # is random), but every router keeps each conversation on one engine.
    assert all(len(h) == 1 for h in homes.values()), homes
    per_conv = {conv: set().union(*(h for (_, c), h in homes.items() if c == conv)) for conv in range(6)}
    assert all(len(h) <= 2 for h in per_conv.values()), per_conv
    wait_released(cluster)
    ingress = cluster.ingresses()
    stats = {replica: out["routers"] for replica, out in ingress.items()}
    assert len(stats) == 2 and all(len(rs) == 1 for rs in stats.values()), stats
    leases = [rs[0]["leases"] for rs in stats.values()]
    assert sum(lz["opened"] for lz in leases) == 24
    assert all(lz["opened"] == lz["finished"] for lz in leases), leases
    # Every streamed request's first chunk reached its ingress, which reported it to the routers.
    assert sum(out["first_chunks"] for out in ingress.values()) == 12, ingress
    # Each lease's prefill end was measured (a first token reached the Router's load model while the
    # lease was open) or, for the 12 unstreamed ones and any stream so short that Serve reported it
    # complete before the ingress saw its first chunk (a race Serve's hooks leave open), bounded at release.
    measured = sum(rs[0]["counts"]["first_tokens"] for rs in stats.values())
    assert measured + sum(lz["no_first_token"] for lz in leases) == 24, stats
    assert 1 <= measured <= 12, stats
    assert all(rs[0]["open"] == 0 for rs in stats.values())


def test_concurrent_requests_no_errors(cluster: Cluster) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> bytes:
        msgs = [{"role": "system", "content": f"shared prompt {i % 3} " * 60}, {"role": "user", "content": f"q{i}"}]
        return cluster.post({"messages": msgs, "max_tokens": 4, "stream": i % 2 == 0})[1]

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(32)))
    assert all(b"[DONE]" in o if i % 2 == 0 else b'"finish_reason": "length"' in o for i, o in enumerate(outs))
    wait_released(cluster)


def test_a_dead_engine_is_failed_over(cluster: Cluster) -> None:
    """One engine stops: requests whose prefix lives there are routed to it, fail to connect
    (``EngineUnavailable``), and the ingress makes them again without it; every one succeeds, on the
    live engine, and every lease is released. Last in the module: it restarts the engine at the end."""
    dead, live = cluster.engines
    # New conversations until one lives on the engine that will stop (bounded): where a fresh
    # prompt goes depends on the engines' speeds the routers have learned, which the machine's
    # load moves; what the test needs is one conversation there and the others elsewhere.
    msgs_of: dict[int, list[dict[str, str]]] = {}
    homes = {}
    for conv in range(12):
        msgs = [{"role": "system", "content": f"failover prompt {conv} " * 80}]
        before = dead.completed
        cluster.post({"messages": [*msgs, {"role": "user", "content": "q0"}], "max_tokens": 4})
        msgs_of[conv], homes[conv] = msgs, dead if dead.completed > before else live
        if len(msgs_of) >= 4 and dead in homes.values():
            break
    assert dead in homes.values(), "some conversation lives on the engine that will stop"
    port = dead.port
    cluster.loop.run(dead.stop(), 10)
    try:
        served_before = live.completed
        for turn in (1, 2):
            for msgs in msgs_of.values():
                body = {"messages": [*msgs, {"role": "user", "content": f"q{turn}"}], "max_tokens": 4, "stream": turn == 2}
                out = cluster.post(body)[1]
                assert (b"[DONE]" in out) if turn == 2 else json.loads(out)["choices"][0]["finish_reason"] == "length"
        assert live.completed - served_before == 2 * len(msgs_of), "the live engine answered every request"
        wait_released(cluster)
        stats = cluster.routers()
        retried = sum(rs[0]["counts"]["retried"] for rs in stats.values())
        assert retried >= 1, f"requests whose prefix was on the dead engine went there first and were retried: {stats}"
        for rs in stats.values():
            lz = rs[0]["leases"]
            assert lz["opened"] == lz["finished"] + lz["failed"] + lz["cancelled"] and lz["expired"] == 0, lz
    finally:
        cluster.loop.run(dead.start(port), 10)


@pytest.mark.parametrize("num_cpus", [0, -1.0, float("nan")])
def test_build_app_refuses_a_cpu_reservation_that_is_not_positive(num_cpus: float) -> None:
    with pytest.raises(ValueError, match="num_cpus must be > 0"):
        build_app([{"engine_url": "http://127.0.0.1:1"}], num_cpus=num_cpus)

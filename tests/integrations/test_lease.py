"""kvroute.integrations.lease and kvroute.integrations.engine_router: leases released exactly once (finish, fail, cancel, TTL), from
many threads; candidate restriction; EngineRouter's prefix routing, cool-down and engine /metrics."""

from __future__ import annotations

import asyncio
import threading

import kvroute
import numpy as np
import pytest
from kvroute.integrations.engine_router import EngineRouter, NoCandidates
from kvroute.integrations.lease import LeaseTable, RequestRejected
from kvroute.prompt import BadRequest


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _router(n: int = 2) -> kvroute.Router:
    r = kvroute.Router(block_size=16)
    for w in range(n):
        r.add_worker(w)
    return r


def _hashes(seed: int, blocks: int = 8) -> np.ndarray:
    return kvroute.block_hashes(np.random.default_rng(seed).integers(0, 50_000, blocks * 16, dtype=np.uint32), 16)


def test_release_exactly_once_per_outcome() -> None:
    r = _router()
    leases = LeaseTable(r, ttl=30.0, clock=Clock())
    for outcome in ("finished", "failed", "cancelled"):
        lease = leases.open(_hashes(1), num_tokens=128)
        assert r.num_in_flight == 1 and len(leases) == 1
        assert leases.release(lease.ticket, outcome) is True
        assert lease.outcome == outcome and lease.released
        assert leases.release(lease.ticket, "finished") is False
        assert r.num_in_flight == 0 and len(leases) == 0
    # The finished one had no first token reported: its prefill end was bounded, not measured.
    assert leases.counts == {"opened": 3, "finished": 1, "failed": 1, "cancelled": 1, "expired": 0, "duplicates": 3, "no_first_token": 1}


def test_prefill_done_then_failure_frees_the_decode_side() -> None:
    r = _router(1)
    leases = LeaseTable(r, ttl=30.0)
    lease = leases.open(_hashes(2), num_tokens=128, output_tokens=64)
    assert leases.prefill_done(lease.ticket) and not leases.prefill_done(lease.ticket)
    assert r.load(0)["decoding"] == 1
    assert leases.fail(lease.ticket)
    assert r.load(0)["decoding"] == 0 and r.num_in_flight == 0
    assert leases.counts["no_first_token"] == 0


def test_finish_without_a_first_token_does_not_count_the_answer_as_prefill() -> None:
    """A host with no first-token signal (LiteLLM) reports only the end: the Router takes the prefill
    as done when it predicted, so a long answer does not push back the queue behind it."""
    r = kvroute.Router(block_size=16)
    r.add_worker(0, prefill_tokens_per_s=6400.0)  # 128 uncached tokens: 20 ms of prefill each
    leases = LeaseTable(r, ttl=30.0)
    a = leases.open(_hashes(20), num_tokens=128)
    b = leases.open(_hashes(21), num_tokens=128)
    assert b.first_token_due > a.first_token_due
    queued_until = r.load(0)["busy_until"]
    for _ in range(400):  # the time passes: A's answer ends well after its predicted first token
        if r.clock() > a.first_token_due + 0.05:
            break
        threading.Event().wait(0.005)
    assert r.clock() > a.first_token_due + 0.05
    assert leases.finish(a.ticket)
    # Unchanged: A is taken to have prefilled on time (it would have moved by ~50 ms as "late").
    assert r.load(0)["busy_until"] == pytest.approx(queued_until, abs=1e-6)
    assert leases.finish(b.ticket) and r.num_in_flight == 0
    # An answer that ends before its predicted first token bounds the prefill: the queue moves up.
    c = leases.open(_hashes(22, blocks=800), num_tokens=12_800)  # 2 s predicted
    d = leases.open(_hashes(23), num_tokens=128)
    before = r.load(0)["busy_until"]
    assert leases.finish(c.ticket)
    assert r.load(0)["busy_until"] < before - 1.5
    assert leases.finish(d.ticket) and r.num_in_flight == 0
    assert leases.counts["no_first_token"] == 4


def test_abandoned_lease_expires_after_ttl() -> None:
    clock = Clock()
    r = _router()
    leases = LeaseTable(r, ttl=10.0, clock=clock)
    old = leases.open(_hashes(3), num_tokens=128)
    clock.t = 5.0
    young = leases.open(_hashes(4), num_tokens=128)
    clock.t = 10.5
    assert leases.expire() == 1 and old.outcome == "expired" and young.outcome is None
    assert not leases.finish(old.ticket), "a late success after expiry is a duplicate, not a second release"
    clock.t = 16.0
    leases.open(_hashes(5), num_tokens=128)  # opening sweeps too
    assert young.outcome == "expired" and r.num_in_flight == 1
    assert leases.counts["expired"] == 2 and leases.counts["duplicates"] == 1


def test_allowed_restricts_the_routers_choice() -> None:
    r = _router(3)
    h = _hashes(6)
    r.index.store(0, h)
    r.index.store(1, h[:4])
    leases = LeaseTable(r)
    assert leases.open(h, num_tokens=128).worker == 0
    lease = leases.open(h, num_tokens=128, allowed={1, 2})
    assert lease.worker == 1, "the allowed worker with the longer prefix"
    with pytest.raises(kvroute.NoWorkersError):
        leases.open(h, num_tokens=128, allowed={7})
    assert r.num_in_flight == 2, "one decision per lease"


def test_rejection_leases_nothing() -> None:
    r = kvroute.Router(block_size=16, ttft_slo=0.001)
    r.add_worker(0, prefill_tokens_per_s=100.0)
    leases = LeaseTable(r)
    with pytest.raises(RequestRejected, match="rejected_ttft"):
        leases.open(_hashes(7), num_tokens=128)
    assert len(leases) == 0 and r.num_in_flight == 0


def test_duplicate_ticket_and_bad_ttl() -> None:
    leases = LeaseTable(_router())
    leases.open(_hashes(8), num_tokens=128, ticket="t")
    with pytest.raises(ValueError, match="already leased"):
        leases.open(_hashes(8), num_tokens=128, ticket="t")
    with pytest.raises(ValueError, match="ttl"):
        LeaseTable(_router(), ttl=0)


def test_threads_and_asyncio_release_each_lease_once() -> None:
    r = _router(4)
    leases = LeaseTable(r, ttl=60.0)
    tickets = [leases.open(_hashes(i), num_tokens=128).ticket for i in range(400)]
    wins: list[int] = []
    lock = threading.Lock()

    def settle(outcome: str) -> None:
        n = sum(leases.release(t, outcome) for t in tickets)  # type: ignore[arg-type]
        with lock:
            wins.append(n)

    async def settle_async() -> None:
        n = 0
        for t in tickets:
            n += leases.finish(t)
            await asyncio.sleep(0)
        with lock:
            wins.append(n)

    threads = [threading.Thread(target=settle, args=(o,)) for o in ("finished", "failed", "cancelled", "expired")]
    threads.append(threading.Thread(target=lambda: asyncio.run(settle_async())))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sum(wins) == 400 and leases.counts["duplicates"] == 4 * 400
    assert r.num_in_flight == 0 and len(leases) == 0


# ---- EngineRouter ----------------------------------------------------------------------------


def _chat(system: str, turns: int) -> dict[str, object]:
    msgs = [{"role": "system", "content": system}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i} " * 10})
    return {"messages": msgs, "max_tokens": 8}


def test_engine_router_routes_by_prefix_in_approximate_mode() -> None:
    er = EngineRouter(block_size=16)
    for k in ("a", "b", "c"):
        er.add(k, f"http://127.0.0.1:1/{k}")
    first: dict[int, str] = {}
    for conv in range(6):
        lease = er.lease(_chat(f"system prompt {conv} " * 60, 1), chat=True)
        first[conv] = er.engine_of(lease).key
        er.leases.finish(lease.ticket)
    assert len(set(first.values())) == 3, "distinct prefixes spread over the engines"
    for conv in range(6):
        lease = er.lease(_chat(f"system prompt {conv} " * 60, 2), chat=True)
        assert er.engine_of(lease).key == first[conv], "a conversation's next turn goes where its prefix is"
        assert lease.decision.overlap_blocks > 0
        er.leases.finish(lease.ticket)


def test_engine_router_candidates_exclusion_and_cooldown() -> None:
    clock = Clock()
    er = EngineRouter(block_size=16, failure_cooldown=5.0, clock=clock)
    er.add("a", "http://127.0.0.1:1")
    er.add("b", "http://127.0.0.1:2")
    body = {"prompt": "p" * 2000}
    lease = er.lease(body, chat=False)
    home = er.engine_of(lease).key
    other = "b" if home == "a" else "a"
    er.leases.finish(lease.ticket)
    assert er.engine_of(er.lease(body, chat=False, exclude=[home])).key == other
    assert er.engine_of(er.lease(body, chat=False, candidates=[other])).key == other
    er.mark_failed(home)
    assert er.engine_of(er.lease(body, chat=False)).key == other, "a failed engine cools down"
    assert er.engine_of(er.lease(body, chat=False, candidates=[home])).key == home, "unless it is the only candidate"
    clock.t = 6.0
    assert not er.cooling_down(home)
    with pytest.raises(NoCandidates):
        er.lease(body, chat=False, candidates=["a", "b"], exclude=["a", "b"])
    with pytest.raises(NoCandidates):
        er.lease(body, chat=False, candidates=["zz"])
    with pytest.raises(BadRequest):
        er.lease({"messages": []}, chat=True)


def test_engine_router_bad_engines() -> None:
    er = EngineRouter(block_size=16)
    with pytest.raises(ValueError, match="url"):
        er.add("a", "127.0.0.1:8000")
    with pytest.raises(ValueError, match="exact mode"):
        er.add("a", "http://127.0.0.1:8000", kv_events="tcp://127.0.0.1:5557")
    er.add("a", "http://127.0.0.1:8000")
    assert er.add("a", "http://127.0.0.1:8000/").worker == 0
    with pytest.raises(ValueError, match="already registered"):
        er.add("a", "http://127.0.0.1:9000")
    er.remove("a")
    assert er.get("a") is None and er.router.workers() == []
    with pytest.raises(ValueError, match="decode_tokens_per_s"):
        EngineRouter(decode_tokens_per_s=0.0)


def test_engine_router_decode_speed_charges_the_step_beside_running_requests() -> None:
    """Engines registered with a decode speed: a new prefill runs in a step with every request
    already on that engine, so a busier engine's cached prefix can lose to a recompute elsewhere."""
    er = EngineRouter(block_size=16, decode_tokens_per_s=200.0, decode_step_s=0.01, pending_prefixes=False)
    for key in ("a", "b"):
        er.add(key, f"http://127.0.0.1:{ord(key) + 8000}")
    assert [er.router.load(w)["decode_tokens_per_s"] for w in (0, 1)] == [200.0, 200.0]
    h = _hashes(30, blocks=36)  # 576 tokens; "a" will hold 512 of them
    er.router.index.store(0, h[:32])
    er.router.observe(0, running=8)  # step 0.01 + 8 / 200 = 50 ms against 10 ms: 40 ms > 25.6 ms of recompute
    d = er.router.route(hashes=h, num_tokens=576, explain=True)
    assert d.worker == 1 and [round(s["step_time"], 6) for s in d.explain] == [0.05, 0.01]
    er.router.observe(0, running=2)
    assert er.router.route(hashes=h, num_tokens=576).worker == 0


def test_engine_router_prefix_cache_size_lets_capacity_charge_evictions() -> None:
    """Engines registered with their prefix-cache size: ``capacity`` charges what a placement evicts
    from a full cache, and an engine's reported KV usage (vLLM's counts only blocks running requests
    hold; its cached blocks count as free) does not make a full cache look empty."""
    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="prefix_cache_blocks"):
            EngineRouter(prefix_cache_blocks=bad)  # type: ignore[arg-type]
    # 0 (prefix caching off) is accepted, as Router.add_worker accepts it, and charged nothing.
    assert EngineRouter(prefix_cache_blocks=0).prefix_cache_blocks == 0

    def make(policy: str) -> EngineRouter:
        er = EngineRouter(block_size=16, prefix_cache_blocks=32, policy=policy, ttft_slo=2.0, pending_prefixes=False)
        for key in ("a", "b"):
            er.add(key, f"http://127.0.0.1:{ord(key) + 8000}")
        # "b"'s engine evicted 4 blocks and a prompt asked for 3 of them again: capacity measures
        # that an evicted block comes back (p = 3/4), so an eviction costs recompute.
        back = _hashes(32)
        er.router.index.store(1, back[:4])
        er.router.index.remove(1, back[:4])
        er.router.route(hashes=back[:3], num_tokens=48)
        er.router.index.store(0, h[:24])  # "a" holds 24 of the prompt's 32 blocks and is busy
        er.router.index.store(1, _hashes(31, blocks=32))  # "b" is idle, its cache full of other blocks
        er.router.observe(0, queue_delay=0.4)
        er.router.observe(1, kv_usage=0.0)  # what vLLM reports for a full cache nobody is using
        return er

    h = _hashes(30, blocks=32)
    assert [make("slack").router.load(w)["prefix_cache_blocks"] for w in (0, 1)] == [32, 32]
    assert make("slack").router.route(hashes=h, num_tokens=512).worker == 1  # slack recomputes on the idle engine
    d = make("capacity").router.route(hashes=h, num_tokens=512, explain=True)
    assert d.worker == 0, d.explain  # storing 32 blocks on "b" would evict 32 cached ones


def test_engine_metrics_feed_the_router() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    del aiohttp
    from kvroute.gateway.mock import MockWorker

    async def run() -> None:
        w = MockWorker("m")
        url = await w.start()
        try:
            er = EngineRouter(block_size=16)
            e = er.add("m", url)
            w.in_flight = 5  # what other routers' requests look like from here
            seen = await asyncio.get_running_loop().run_in_executor(None, er.poll_metrics, e)
            assert seen is not None and seen["running"] == 5.0
            assert er.router.load(e.worker)["observed_running"] == 5
            w.in_flight = 0
        finally:
            await w.stop()
        assert not er.cooling_down("m")
        assert await asyncio.get_running_loop().run_in_executor(None, er.poll_metrics, e) is None, "a dead engine: no figures, no error"
        assert er.cooling_down("m"), "an engine that refuses connections cools down"

    asyncio.run(run())


def test_a_slow_metrics_endpoint_is_no_failure() -> None:
    import socket

    # A listener that accepts (the kernel's backlog) but never answers: the poll times out.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        er = EngineRouter(block_size=16)
        e = er.add("slow", f"http://127.0.0.1:{s.getsockname()[1]}")
        assert er.poll_metrics(e, timeout=0.2) is None
        assert not er.cooling_down("slow"), "only a refused connection says the engine is gone"


def test_engine_router_bounds_each_engines_token_share_by_default() -> None:
    """The integrations' engines are unified: EngineRouter holds each to 1.25x the mean share of the
    prompt tokens it routed (docs/router.md, bounded token share); None turns it off."""
    assert EngineRouter(block_size=16).router.config["token_share_bound"] == 1.25
    assert EngineRouter(block_size=16, token_share_bound=None).router.config["token_share_bound"] is None
    er = EngineRouter(block_size=16)
    er.add("a", "http://127.0.0.1:1")
    er.add("b", "http://127.0.0.1:2")
    picks = []
    for i in range(100):  # one conversation family: without the bound every turn would follow its prefix
        lease = er.lease(_chat("one shared system prompt " * 60, 1 + i % 3), chat=True)
        picks.append(er.engine_of(lease).key)
        er.leases.finish(lease.ticket)
    assert picks[:10] == picks[:1] * 10, "a short history is not split (8 requests of slack)"
    assert 0.35 <= picks.count("b") / len(picks) <= 0.65, picks

"""kvroute as Ray Serve's request router on real vLLM engines: two ingress replicas, so two kvroute
routers route at once, each fed by every engine's KV events (exact mode). Conversations stay on the
engine holding their prefix whichever router routes them (the engines' own prefix-cache counters
say so), every lease is released, and concurrent requests see no error."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvroute.integrations.ray_serve import build_app
from serve_app import ServeApp
from vllm_bed import BLOCK_SIZE, MODEL_NAME, chat_turns, poll


class App(ServeApp):
    """The bed's engines behind a two-ingress kvroute Serve app (exact mode, every engine's KV events)."""

    def __init__(self, engines: list[vllm_bed.Engine]) -> None:
        self.engines = engines
        specs = [{"engine_url": e.url, "kv_events": e.events, "kv_events_replay": e.replay} for e in engines]
        # SGLang's cache_aware rule: the best overlap unless loads differ by > 64 requests. The default
        # (capacity, on slack's cost) may move a conversation whose few cached blocks are cheap to recompute on this bed's
        # tiny model when an engine looks busier (a lease not yet released, a metrics poll from the
        # previous request), which depends on timing; this module checks the routers' shared view of
        # the KV events, so it routes on the cache alone.
        kwargs = {"tokenizer": str(engines[0].bed.model), "block_size": BLOCK_SIZE, "metrics_interval": 0.5, "policy": "cache_aware"}
        super().__init__(build_app(specs, request_router_kwargs=kwargs, ingress_replicas=2), env_vars={"OMP_NUM_THREADS": "1"})

    def chat(self, msgs: list[dict[str, str]], stream: bool) -> tuple[str, bytes]:
        return self.post({"model": MODEL_NAME, "messages": msgs, "max_tokens": 4, "temperature": 0, "stream": stream})


@pytest.fixture(scope="module")
def app(engines: list[vllm_bed.Engine]) -> Iterator[App]:
    a = App(engines)
    try:
        yield a
    finally:
        a.close()


def test_two_routers_keep_conversations_on_their_prefix(app: App) -> None:
    for e in app.engines:
        e.reset_prefix_cache()
    ingresses: set[str] = set()
    homes: dict[int, set[str]] = {}
    trail: list[tuple[int, int, str, list[str]]] = []  # (turn, conversation, ingress replica, engines that served it)
    hits0 = sum(e.metric("vllm:prefix_cache_hits_total") for e in app.engines)
    # Which ingress replica takes a request is Serve's proxy's choice (two replicas idle at once: a
    # coin toss); after the 3 turns, more turns until both routers have routed (bounded).
    turn = 0
    while turn < 3 or (len(ingresses) < 2 and turn < 12):
        for conv in range(4):
            before = [e.metric("vllm:request_success_total") for e in app.engines]
            ing, out = app.chat(chat_turns(conv, turn), stream=turn == 1)
            ingresses.add(ing)
            assert (b"[DONE]" in out) if turn == 1 else json.loads(out)["choices"][0]["finish_reason"] in ("length", "stop")
            # The engines count a finished request on their next metrics update: poll (bounded) for it.
            total = sum(before)
            poll(lambda t=total: sum(e.metric("vllm:request_success_total") for e in app.engines) > t, 10.0, "the request counted")
            after = [e.metric("vllm:request_success_total") for e in app.engines]
            served = [e.name for e, a, b in zip(app.engines, after, before) if a > b]
            homes.setdefault(conv, set()).update(served)
            trail.append((turn, conv, ing, served))
        turn += 1
    assert len(ingresses) == 2, "both ingress replicas (two kvroute routers) routed requests"
    assert len(set().union(*homes.values())) == 2, f"the conversations spread over both engines: {homes}"
    # Both routers read the same engines' KV events, so a conversation keeps its engine whichever routes it.
    assert sum(len(h) == 1 for h in homes.values()) >= 3, f"{homes}\n{trail}\n{app.routers()}"
    hits = sum(e.metric("vllm:prefix_cache_hits_total") for e in app.engines) - hits0
    assert hits >= 8 * 2 * BLOCK_SIZE, f"follow-up turns hit only {hits} cached tokens"
    poll(lambda: all(rs[0]["open"] == 0 for rs in app.routers().values()), 30.0, "every lease released")
    leases = [rs[0]["leases"] for rs in app.routers().values()]
    # Each request finished once. Serve may ask a router again for a request whose first pick
    # turned it away (a replica's queue probe timing out on a loaded host): that lease is cancelled.
    assert sum(lz["finished"] for lz in leases) == len(trail), leases
    assert all(lz["failed"] == 0 and lz["opened"] == lz["finished"] + lz["cancelled"] for lz in leases), leases


def test_concurrent_requests_no_errors(app: App) -> None:
    def one(i: int) -> bytes:
        return app.chat(chat_turns(i % 6, i // 6), stream=i % 2 == 0)[1]

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(24)))
    for i, o in enumerate(outs):
        assert (b"[DONE]" in o) if i % 2 == 0 else json.loads(o)["choices"][0]["finish_reason"] in ("length", "stop")
    # on_request_completed runs in the ingress once the response is done: wait (bounded) for it.
    poll(lambda: all(rs[0]["open"] == 0 for rs in app.routers().values()), 30.0, "every lease released")


def test_engine_killed_mid_run_requests_fail_over(app: App, live_engines: list[vllm_bed.Engine]) -> None:
    """Three clients run conversations through both routers; after 6 requests one engine is SIGKILLed
    (by its PID). Requests sent after the kill all succeed, on the live engine: a replica that cannot
    reach its engine raises EngineUnavailable and the ingress makes the call again without it, and
    every router cools the dead engine down (the failed request, or its refused /metrics poll). Those
    in flight at the kill end within the timeout, answered or with an error. Every lease is released
    exactly once. Last in the module (the app's replicas keep fronting the dead engine's URL until
    live_engines restarts it)."""
    for e in app.engines:
        e.reset_prefix_cache()
    victim, survivor = app.engines
    lock = threading.Lock()
    done = threading.Event()
    killed_at: list[float] = []
    results: list[tuple[float, bool, str]] = []  # (sent at, succeeded, error)

    def client(convs: list[int]) -> None:
        for turn in range(4):
            for conv in convs:
                t0 = time.monotonic()
                try:
                    _, out = app.chat(chat_turns(40 + conv, turn), stream=turn % 2 == 1)
                    ok = (b"[DONE]" in out) if turn % 2 else json.loads(out)["choices"][0]["finish_reason"] in ("length", "stop")
                    err = "" if ok else repr(out[-200:])
                except Exception as e:  # recorded: those in flight at the kill may fail
                    ok, err = False, f"{type(e).__name__}: {e}"
                with lock:
                    results.append((t0, ok, err))
                    if len(results) >= 6:
                        done.set()

    success0 = survivor.metric("vllm:request_success_total")
    threads = [threading.Thread(target=client, args=([c, c + 3],)) for c in range(3)]
    for t in threads:
        t.start()
    try:
        assert done.wait(120), "the first 6 requests did not finish"
        victim.stop(signal.SIGKILL)  # the API server and its engine core, by PID
        killed_at.append(time.monotonic())
    finally:
        for t in threads:
            t.join(300)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert len(results) == 24
    after = [(ok, err) for t0, ok, err in results if t0 > killed_at[0]]
    assert after, "requests were sent after the kill"
    assert all(ok for ok, _ in after), [err for ok, err in after if not ok]
    failed = [err for _, ok, err in results if not ok]
    assert len(failed) <= 3, f"only the requests in flight at the kill (one per client) may fail: {failed}"
    served = survivor.metric("vllm:request_success_total") - success0
    assert served >= len(after), f"the live engine answered {served} requests, fewer than the {len(after)} sent after the kill"
    poll(lambda: all(rs[0]["open"] == 0 for rs in app.routers().values()), 30.0, "every lease released")
    for rs in app.routers().values():
        lz = rs[0]["leases"]
        assert lz["opened"] == lz["finished"] + lz["cancelled"] + lz["failed"] and lz["expired"] == 0, lz

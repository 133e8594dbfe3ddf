"""KvEventSubscriber against fake engines over ZMQ on 127.0.0.1: after a bounded run with dropped
batches, replays (both framings), restarts and clears, the index equals the engines' caches exactly."""

import asyncio
import random
import threading

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import kvroute  # noqa: E402
from fake_engine import FakeEngine, FakePublisher  # noqa: E402
from kvroute.events import KvEventSubscriber, parse_replay_frames, rank_endpoint  # noqa: E402

BS = 4
TIMEOUT = 20.0


class _Ctx:
    """A zmq context that closes every fake publisher made from it, even when a test fails."""

    def __init__(self):
        self.pubs = []

    def publisher(self, **kw):
        p = FakePublisher(**kw)
        self.pubs.append(p)
        return p

    def close(self):
        for p in self.pubs:
            p.close()


@pytest.fixture
def ctx():
    c = _Ctx()
    yield c
    c.close()


def workload(seed, n, systems=4):
    """Requests sharing a few system prompts, with random continuations (seeded)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(2, 5) * BS)] for _ in range(systems)]
    for _ in range(n):
        base = list(rng.choice(prompts))
        yield base + [rng.randrange(50) for _ in range(rng.randrange(0, 4 * BS))]


def assert_mirrors(idx, worker, eng):
    """The index holds exactly the engine's cached blocks for `worker`: each cached block's full
    prefix matches to its depth, and the block counts agree (so nothing extra is held)."""
    prefixes = eng.cached_prefixes()
    assert idx.num_blocks(worker) == len(prefixes), (worker, idx.num_blocks(worker), len(prefixes))
    for prefix in prefixes:
        h = kvroute.block_hashes(list(prefix), BS)
        assert idx.match(h).get(worker) == len(h), (worker, len(h), idx.match(h).get(worker))


def caught_up(pubs):
    """Predicate: every stream's last applied seq is its publisher's last seq."""

    def pred(s):
        return all(s["workers"][w]["last_seq"] == p.seq - 1 for w, p in pubs.items())

    return pred


def test_index_mirrors_several_fake_engines_through_drops_and_replays(ctx):
    specs = {
        # worker: (flavor, hash form, dp rank, replay framing)
        0: ("vllm", "int", 0, "vllm"),
        1: ("vllm-legacy", "bytes", 0, "sglang"),
        10: ("sglang", "signed", 1, "sglang"),
    }
    engines = {w: FakeEngine(f, block_size=BS, capacity=40, hash_form=h, dp_rank=r) for w, (f, h, r, _) in specs.items()}
    pubs = {w: ctx.publisher(framing=fr, topic="kv@test") for w, (_, _, _, fr) in specs.items()}
    idx = kvroute.KvIndex()
    sub = KvEventSubscriber(
        idx,
        {w: p.endpoint for w, p in pubs.items()},
        replay_endpoints={w: p.replay_endpoint for w, p in pubs.items()},
        topic="kv@test",
        block_size=BS,
    )
    with sub:
        for p in pubs.values():
            p.wait_for_subscriber()
        # The start-up replay (nothing buffered yet) is over before the batches the test drops.
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        for w, eng in engines.items():
            reqs = list(workload(seed=w, n=120))
            for i, toks in enumerate(reqs):
                ev = eng.process(toks)
                if i == 60 and w == 1:
                    ev += eng.clear()
                if ev:
                    # Drop two batches on purpose (never the last one).
                    pubs[w].publish(eng.encode(ev), drop=pubs[w].seq in (10, 30))
            pubs[w].publish(eng.encode(eng.process(reqs[0])))
        # Stats are per stream, keyed as the endpoints were given.
        assert sub.wait_for(caught_up(pubs), TIMEOUT), sub.stats()
        st = sub.stats()
    assert st["decode_errors"] == 0 and st["resyncs"] == 0, st
    assert st["gaps"] == 6 and st["replays"] >= 6 and st["replayed_batches"] >= 6, st
    assert st["blocks_stored"] > 0 and st["blocks_removed"] > 0, st
    for w, eng in engines.items():
        assert_mirrors(idx, w + specs[w][2], eng)
    assert sorted(idx.workers()) == [0, 1, 11]


def test_resync_when_the_replay_buffer_no_longer_has_the_gap(ctx):
    eng = FakeEngine("vllm", block_size=BS, capacity=1000)
    pub = ctx.publisher(buffer_steps=2)
    idx = kvroute.KvIndex()
    old = list(range(100, 108))
    with KvEventSubscriber(idx, {5: pub.endpoint}, replay_endpoints={5: pub.replay_endpoint}, block_size=BS) as sub:
        pub.wait_for_subscriber()
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        pub.publish(eng.encode(eng.process(old)))
        assert sub.wait_for(caught_up({5: pub}), TIMEOUT)
        assert idx.match(kvroute.block_hashes(old, BS)) == {5: 2}
        # The engine drops `old` and stores more while 4 batches are lost; only 2 stay replayable.
        eng.blocks.clear()
        pub.publish(eng.encode(eng.clear()), drop=True)
        for k in range(3):
            pub.publish(eng.encode(eng.process([k] * 8)), drop=True)
        fresh = list(range(200, 212))
        pub.publish(eng.encode(eng.process(fresh)))
        assert sub.wait_for(caught_up({5: pub}), TIMEOUT), sub.stats()
        st = sub.stats()
    # Two replays: the start-up one (nothing buffered yet) and the gap's.
    assert st["gaps"] == 1 and st["resyncs"] == 1 and st["replays"] == 2, st
    # The stale blocks went with the resync; what the partial replay (the batch for [2] * 8) and the
    # live stream carried is there; the two batches gone from the buffer are not.
    assert idx.match(kvroute.block_hashes(old, BS)) == {}
    assert idx.match(kvroute.block_hashes([2] * 8, BS)) == {5: 2}
    assert idx.match(kvroute.block_hashes(fresh, BS)) == {5: 3}
    assert idx.match(kvroute.block_hashes([1] * 8, BS)) == {}
    assert idx.num_blocks(5) == 5


def test_publisher_restart_clears_and_reconnects(ctx):
    eng = FakeEngine("sglang", block_size=BS, capacity=50, hash_form="signed")
    pub = ctx.publisher(framing="sglang")
    idx = kvroute.KvIndex()
    with KvEventSubscriber(idx, {2: pub.endpoint}, replay_endpoints={2: pub.replay_endpoint}, block_size=BS) as sub:
        pub.wait_for_subscriber()
        for toks in workload(seed=3, n=20):
            ev = eng.process(toks)
            if ev:
                pub.publish(eng.encode(ev))
        assert sub.wait_for(caught_up({2: pub}), TIMEOUT)
        assert_mirrors(idx, 2, eng)
        # The engine restarts on the same port with an empty cache and a fresh sequence.
        port = pub.port
        pub.close()
        eng = FakeEngine("sglang", block_size=BS, capacity=50, hash_form="signed")
        pub = ctx.publisher(framing="sglang", port=port)
        pub.wait_for_subscriber()
        for toks in workload(seed=4, n=10):
            ev = eng.process(toks)
            if ev:
                pub.publish(eng.encode(ev))
        assert sub.wait_for(caught_up({2: pub}), TIMEOUT), sub.stats()
        st = sub.stats()
    assert st["restarts"] == 1, st
    assert_mirrors(idx, 2, eng)


def test_first_connect_replays_history_published_before_the_subscriber(ctx):
    eng = FakeEngine("vllm", block_size=BS, capacity=100)
    pub = ctx.publisher()
    reqs = list(workload(seed=9, n=15))
    for toks in reqs[:10]:
        ev = eng.process(toks)
        if ev:
            pub.publish(eng.encode(ev))  # nobody listens: lost on the PUB side, kept for replay
    idx = kvroute.KvIndex()
    with KvEventSubscriber(idx, {0: pub.endpoint}, replay_endpoints={0: pub.replay_endpoint}, block_size=BS) as sub:
        # The start-up replay alone brings the history: no live batch is needed to trigger it.
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        assert sub.synced and sub.stats()["workers"][0]["last_seq"] == pub.seq - 1
        assert_mirrors(idx, 0, eng)
        pub.wait_for_subscriber()
        for toks in reqs[10:]:
            ev = eng.process(toks)
            if ev:
                pub.publish(eng.encode(ev))
        assert sub.wait_for(caught_up({0: pub}), TIMEOUT), sub.stats()
        st = sub.stats()
    assert st["gaps"] == 0 and st["replays"] == 1 and st["resyncs"] == 0 and st["duplicates"] == 0, st
    assert_mirrors(idx, 0, eng)


def test_live_batches_the_startup_replay_covered_are_dropped_not_read_as_a_restart(ctx):
    eng = FakeEngine("vllm", block_size=BS, capacity=100)
    pub = ctx.publisher()
    reqs = list(workload(seed=21, n=12))
    for toks in reqs[:6]:
        pub.publish(eng.encode(eng.process(toks)))
    pub.replay_gate = gate = threading.Event()
    idx = kvroute.KvIndex()
    with KvEventSubscriber(idx, {0: pub.endpoint}, replay_endpoints={0: pub.replay_endpoint}, block_size=BS) as sub:
        pub.wait_for_subscriber()
        assert pub.replay_requested.wait(TIMEOUT)
        # Published while the replay request waits: these reach the live socket and the replay both.
        for toks in reqs[6:9]:
            pub.publish(eng.encode(eng.process(toks)))
        gate.set()
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        for toks in reqs[9:]:
            pub.publish(eng.encode(eng.process(toks)))
        assert sub.wait_for(caught_up({0: pub}), TIMEOUT), sub.stats()
        st = sub.stats()
    assert st["duplicates"] == 3 and st["restarts"] == 0 and st["gaps"] == 0 and st["resyncs"] == 0, st
    assert st["replayed_batches"] == 9 and st["batches"] == 12, st
    assert_mirrors(idx, 0, eng)


def test_resume_from_continues_a_stream_where_the_previous_subscriber_stopped(ctx):
    eng = FakeEngine("vllm", block_size=BS, capacity=60)
    pub = ctx.publisher(buffer_steps=8)
    reqs = list(workload(seed=5, n=30))
    idx = kvroute.KvIndex()
    with KvEventSubscriber(idx, {3: pub.endpoint}, replay_endpoints={3: pub.replay_endpoint}, block_size=BS) as sub:
        pub.wait_for_subscriber()
        # The start-up replay (nothing buffered yet) is over before publishing: a replay answered
        # after 10 batches would carry only the last 8, end at the last seq, and satisfy caught_up
        # before the live batches 0..9 are read (the stream is right once they are, via a clear).
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        for toks in reqs[:10]:
            pub.publish(eng.encode(eng.process(toks)))
        assert sub.wait_for(caught_up({3: pub}), TIMEOUT)
    last = sub.stats()["workers"][3]["last_seq"]
    # Published while no subscriber runs (as between an EngineRouter's old and new subscriber).
    for toks in reqs[10:15]:
        pub.publish(eng.encode(eng.process(toks)))
    with KvEventSubscriber(idx, {3: pub.endpoint}, replay_endpoints={3: pub.replay_endpoint}, block_size=BS, resume_from={3: last}) as sub:
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        st = sub.stats()
    # Only what it missed was read, nothing was cleared.
    assert st["replayed_batches"] == 5 and st["resyncs"] == 0 and st["workers"][3]["last_seq"] == pub.seq - 1, st
    assert_mirrors(idx, 3, eng)
    last = st["workers"][3]["last_seq"]
    # More than the engine buffers (8 batches) goes by: the resumed stream cannot be completed.
    for toks in reqs[15:30]:
        pub.publish(eng.encode(eng.process(toks)))
    with KvEventSubscriber(idx, {3: pub.endpoint}, replay_endpoints={3: pub.replay_endpoint}, block_size=BS, resume_from={3: last}) as sub:
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        st = sub.stats()
    assert st["gaps"] == 1 and st["resyncs"] == 1 and st["replayed_batches"] == 8, st
    # After the resync the worker holds exactly what the 8 buffered batches say, as a fresh index
    # fed only those batches does.
    ref = kvroute.KvIndex()
    for _, payload in pub.buffer:
        ref.apply_event_batch(3, payload, block_size=BS)
    assert idx.num_blocks(3) == ref.num_blocks(3) > 0
    for prefix in eng.cached_prefixes():
        h = kvroute.block_hashes(list(prefix), BS)
        assert idx.match(h) == ref.match(h), prefix


def test_startup_replay_of_a_silent_engine_times_out_and_still_syncs(ctx):
    pub = ctx.publisher()
    pub.replay_gate = threading.Event()  # never answers within the timeout
    idx = kvroute.KvIndex()
    with KvEventSubscriber(idx, {0: pub.endpoint}, replay_endpoints={0: pub.replay_endpoint}, block_size=BS, replay_timeout=0.2) as sub:
        assert sub.wait_for(lambda s: s["synced"], TIMEOUT), sub.stats()
        st = sub.stats()
        pub.replay_gate.set()
    assert st["replay_failures"] == 1 and st["replayed_batches"] == 0, st


def test_bad_frames_and_payloads_count_decode_errors_and_resync(ctx):
    eng = FakeEngine("vllm", block_size=BS, capacity=100)
    pub = ctx.publisher()
    idx = kvroute.KvIndex()
    with KvEventSubscriber(idx, {4: pub.endpoint}, block_size=BS) as sub:
        pub.wait_for_subscriber()
        pub.publish(eng.encode(eng.process(list(range(8)))))
        pub.publish(b"\x92\xcb garbage")
        pub.pub.send_multipart([b"", b"short"])  # not [topic, 8-byte seq, payload]
        assert sub.wait_for(lambda s: s["decode_errors"] >= 2, TIMEOUT), sub.stats()
        st = sub.stats()
    assert st["resyncs"] == 1, st  # the garbage payload; the short message only counts an error
    assert "frames" in st["last_error"], st["last_error"]
    assert idx.num_blocks(4) == 0  # the bad batch left the worker's state unknown: cleared


def test_idle_worker_is_expired(ctx):
    eng = FakeEngine("vllm", block_size=BS, capacity=100)
    pub = ctx.publisher()
    idx = kvroute.KvIndex()
    with KvEventSubscriber(idx, {6: pub.endpoint}, block_size=BS, idle_timeout=0.2) as sub:
        pub.wait_for_subscriber()
        pub.publish(eng.encode(eng.process(list(range(8)))))
        assert sub.wait_for(lambda s: s["batches"] == 1, TIMEOUT)
        assert sub.wait_for(lambda s: s["expired"] == 1, TIMEOUT), sub.stats()
        assert sub.stats()["workers"][6]["expired"]
    assert 6 not in idx.workers()


def test_asyncio_usage(ctx):
    eng = FakeEngine("vllm", block_size=BS, capacity=100)
    pub = ctx.publisher()
    idx = kvroute.KvIndex()
    toks = list(range(12))

    async def main():
        async with KvEventSubscriber(idx, {0: pub.endpoint}, block_size=BS) as sub:
            await asyncio.get_running_loop().run_in_executor(None, pub.wait_for_subscriber)
            pub.publish(eng.encode(eng.process(toks)))
            assert await sub.wait_for_async(lambda s: s["batches"] == 1, TIMEOUT)
            assert not await sub.wait_for_async(lambda s: s["batches"] == 2, 0.05)
        return sub

    sub = asyncio.run(main())
    assert not sub.running
    assert idx.match(kvroute.block_hashes(toks, BS)) == {0: 3}


def test_data_parallel_ranks_expand_endpoints_and_map_to_workers(ctx):
    pubs = [ctx.publisher() for _ in range(2)]
    # Random test ports can't sit at base+1, so check the engines' offset rule on its own and run
    # each rank's stream through an explicit endpoint.
    assert rank_endpoint("tcp://host:5557", 3) == "tcp://host:5560"
    assert rank_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    with pytest.raises(ValueError, match="space base worker ids"):
        KvEventSubscriber(kvroute.KvIndex(), {0: "tcp://127.0.0.1:1", 1: "tcp://127.0.0.1:9"}, data_parallel_size=2)
    engs = [FakeEngine("vllm", block_size=BS, capacity=100, dp_rank=r) for r in range(2)]
    idx = kvroute.KvIndex()
    # Rank r's events land on base + r: rank 0 under base 20 -> worker 20, rank 1 under base 30 -> 31.
    with KvEventSubscriber(idx, {20: pubs[0].endpoint, 30: pubs[1].endpoint}, block_size=BS) as sub:
        for p in pubs:
            p.wait_for_subscriber()
        for r, (p, e) in enumerate(zip(pubs, engs)):
            p.publish(e.encode(e.process(list(range(r, r + 8)))))
        assert sub.wait_for(lambda s: s["batches"] == 2, TIMEOUT)
    assert idx.match(kvroute.block_hashes(list(range(8)), BS)) == {20: 2}
    assert idx.match(kvroute.block_hashes(list(range(1, 9)), BS)) == {31: 2}


def test_parse_replay_frames_both_framings():
    seq = (7).to_bytes(8, "big")
    assert parse_replay_frames([b"", seq, b"p"]) == ("batch", 7, b"p")
    assert parse_replay_frames([b"", b"topic", seq, b"p"]) == ("batch", 7, b"p")
    assert parse_replay_frames([b"", b"\xff" * 8, b""])[0] == "end"
    assert parse_replay_frames([b"", b"", b"\xff" * 8, b""])[0] == "end"
    assert parse_replay_frames([b"x", seq, b"p"]) is None
    assert parse_replay_frames([b"", b"abc", b"p"]) is None


def test_constructor_validation():
    idx = kvroute.KvIndex()
    with pytest.raises(ValueError, match="at least one"):
        KvEventSubscriber(idx, {})
    with pytest.raises(ValueError, match="without an endpoint"):
        KvEventSubscriber(idx, {0: "tcp://127.0.0.1:1"}, replay_endpoints={1: "tcp://127.0.0.1:2"})
    with pytest.raises(TypeError, match="KvIndex"):
        KvEventSubscriber(object(), {0: "tcp://127.0.0.1:1"})
    with pytest.raises(ValueError, match="must be a ZMQ endpoint"):
        KvEventSubscriber(idx, {0: "localhost:5557"})
    with pytest.raises(ValueError, match="idle_timeout"):
        KvEventSubscriber(idx, {0: "tcp://127.0.0.1:1"}, idle_timeout=0)


def test_engine_router_syncs_history_and_resumes_followed_engines_when_it_meets_a_new_one(ctx, tmp_path):
    pytest.importorskip("tokenizers")
    from exact_tokenizers import build_word_level
    from kvroute.integrations.engine_router import EngineRouter

    engines = [FakeEngine("vllm", block_size=BS, capacity=60) for _ in range(2)]
    pubs = [ctx.publisher() for _ in range(2)]
    for i, (eng, pub) in enumerate(zip(engines, pubs)):
        for toks in workload(seed=40 + i, n=12):
            pub.publish(eng.encode(eng.process(toks)))  # history from before the router existed
    with EngineRouter(block_size=BS, tokenizer=build_word_level(tmp_path)) as er:
        e0 = er.add("e0", "http://127.0.0.1:1", kv_events=pubs[0].endpoint, kv_events_replay=pubs[0].replay_endpoint)
        assert er.wait_synced(TIMEOUT)
        assert_mirrors(er.router.index, e0.worker, engines[0])  # before e0 published anything live
        first = er.subscriber_stats()
        assert first["replayed_batches"] == 12, first
        # e0 goes on while the router rebuilds its subscriber for e1.
        pubs[0].wait_for_subscriber()
        for toks in workload(seed=50, n=4):
            pubs[0].publish(engines[0].encode(engines[0].process(toks)))
        assert er.fleet._subscriber.wait_for(caught_up({e0.worker: pubs[0]}), TIMEOUT)
        e1 = er.add("e1", "http://127.0.0.1:2", kv_events=pubs[1].endpoint, kv_events_replay=pubs[1].replay_endpoint)
        assert not er.synced() or er.subscriber_stats()["replayed_batches"] == 12
        assert asyncio.run(er.wait_synced_async(TIMEOUT))
        st = er.subscriber_stats()
        # e1's history in full; e0 resumed after its last batch (nothing new to read), not re-read.
        assert st["replayed_batches"] == 12 and st["resyncs"] == 0 and st["restarts"] == 0, st
        assert_mirrors(er.router.index, e0.worker, engines[0])
        assert_mirrors(er.router.index, e1.worker, engines[1])

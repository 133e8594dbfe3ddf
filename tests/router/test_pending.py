"""Pending prefixes: a routed request's blocks count as cached on its worker until the engine's KV
events can have reported them (docs/router.md, "Pending prefixes")."""

from __future__ import annotations

import numpy as np
import pytest
from kvroute import Router


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**31, size=n, dtype=np.uint32)


def make(n: int = 4, **kw) -> Router:
    r = Router(**kw)
    for w in range(n):
        r.add_worker(w)
    return r


def question(system: np.ndarray, seed: int) -> np.ndarray:
    return np.concatenate([system, prompt(seed, 200)])


@pytest.mark.parametrize("policy", ["slack", "cache_only", "cache_aware"])
def test_two_requests_with_a_new_prefix_back_to_back_share_a_worker(policy):
    system = prompt(1, 1024)  # 16 blocks of 64 nobody has cached, and no KV event yet
    r = make(policy=policy)
    a = r.route(question(system, 2), now=0.0, request_id=1)
    b = r.route(question(system, 3), now=0.001, request_id=2)
    assert (b.worker, b.overlap_blocks) == (a.worker, 16)
    off = make(policy=policy, pending_prefixes=False)
    a = off.route(question(system, 2), now=0.0, request_id=1)
    b = off.route(question(system, 3), now=0.001, request_id=2)
    assert b.overlap_blocks == 0
    assert off.num_pending_blocks(now=0.001) == 0


def test_pending_entries_go_away_after_prefill_done_plus_grace():
    r = make(1, pending_grace_s=0.5)
    for rid in (1, 2, 3):
        r.route(prompt(10 + rid, 640), now=0.0, request_id=rid)
    assert r.num_pending_blocks(now=0.0) == 30
    r.prefill_done(1, now=0.2)
    r.finished(2, now=0.3)
    r.cancel(3, now=0.3)
    assert r.num_pending_blocks(now=0.3) == 20
    assert r.num_pending_blocks(now=0.7) == 10
    assert r.num_pending_blocks(now=0.8) == 0
    assert r.route(prompt(11, 640), now=1.0).overlap_blocks == 0  # the index alone again
    assert r.config["pending_prefixes"] is True and r.config["pending_grace_s"] == 0.5


def test_callers_that_never_call_finished_stay_bounded():
    r = make(1, pending_ttl_s=2.0)
    most = 0
    for i in range(500):
        r.route(prompt(100 + i, 640), now=i * 0.1, request_id=i)
        most = max(most, r.num_pending_blocks(now=i * 0.1))
    assert most <= 21 * 10  # at most the prefixes routed within one TTL
    assert r.num_pending_blocks(now=50.0 + 2.0) == 0


def test_bad_pending_settings_are_rejected():
    with pytest.raises(ValueError, match="pending_ttl_s"):
        Router(pending_ttl_s=0.0)
    with pytest.raises(ValueError, match="pending_grace_s"):
        Router(pending_grace_s=-1.0)


def test_blocks_the_engine_evicted_stop_counting_at_once():
    """The real-engine test's sequence (tests/e2e/test_e2e_index.py), on fake vLLM engines of 32
    blocks: one request at a time over 6 shared prefixes, each one's KV events (its stores and the
    evictions its allocation caused) applied before the next is routed, every request within the
    grace of the earlier ones' ends. The Router's overlap must be what the engine holds: a block the
    engine evicted after its pending request was routed no longer counts there."""
    from fake_engine import FakeEngine

    bs = 32
    engines = [FakeEngine("vllm", block_size=bs, capacity=32) for _ in range(2)]
    r = Router(block_size=bs, policy="cache_only")
    for w in range(2):
        r.add_worker(w)
    rng = np.random.default_rng(7)
    prefixes = [prompt(500 + k, int(rng.integers(150, 260))) for k in range(6)]
    hits = 0
    for i in range(80):
        tokens = np.concatenate([prefixes[int(rng.integers(6))], prompt(600 + i, int(rng.integers(20, 120)))])
        now = i * 0.01
        d = r.route(tokens, now=now, request_id=i)
        e = engines[d.worker]
        held = sum(tuple(tokens[: len(p)].tolist()) == p for p in e.cached_prefixes())  # its leading cached blocks
        assert d.overlap_blocks == held, f"request {i} on worker {d.worker}: predicted {d.overlap_blocks}, engine holds {held}"
        hits += held > 0
        r.index.apply_event_batch(d.worker, e.encode(e.process(tokens.tolist())), block_size=bs)
        r.finished(i, now=now + 0.005)
    assert hits >= 20
    assert r.num_pending_blocks(now=0.8) > 0  # the grace had not ended for any of them

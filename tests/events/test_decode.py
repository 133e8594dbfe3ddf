"""KvIndex.apply_event_batch on engine-format payloads: both event shapes, hash forms, tiers, dp ranks,
and malformed input (typed EventError, nothing applied), plus hypothesis fuzzing of the decoder."""

import random

import pytest

msgspec = pytest.importorskip("msgspec")
import kvroute  # noqa: E402
from fake_engine import (  # noqa: E402
    FakeEngine,
    LegacyBlockStored,
    SglBlockRemoved,
    SglBlockStored,
    SglEventBatch,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BS = 4


def seq_hashes(tokens):
    return kvroute.block_hashes(tokens, BS)


def vstored(hashes, parent, tokens, medium="GPU", **kw):
    return VllmBlockStored(hashes, parent, tokens, BS, None, medium, None, **kw)


def vbatch(events, rank=0):
    return msgspec.msgpack.encode(VllmEventBatch(1.0, events, rank))


def test_map_events_build_the_chain_and_removal_resolves_by_engine_hash():
    idx = kvroute.KvIndex()
    toks = list(range(16))
    assert idx.apply_event_batch(3, vbatch([vstored([11, 12], None, toks[:8])]), block_size=BS) == 1
    assert idx.apply_event_batch(3, vbatch([vstored([13, 14], 12, toks[8:])]), block_size=BS) == 1
    assert idx.match(seq_hashes(toks)) == {3: 4}
    assert idx.apply_event_batch(3, vbatch([VllmBlockRemoved([13], "GPU")]), block_size=BS) == 1
    assert idx.match(seq_hashes(toks)) == {3: 2}
    assert idx.apply_event_batch(3, vbatch([VllmAllBlocksCleared()]), block_size=BS) == 1
    assert idx.num_blocks(3) == 0


def test_legacy_array_events_bytes_hashes_and_dp_rank():
    idx = kvroute.KvIndex()
    toks = list(range(100, 108))
    d1, d2 = bytes(range(32)), bytes(range(1, 33))
    payload = msgspec.msgpack.encode(VllmEventBatch(2.0, [LegacyBlockStored([d1, d2], None, toks, BS, None, "GPU", None)], 2))
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # really array-shaped
    idx.apply_event_batch(10, payload, block_size=BS)
    assert idx.match(seq_hashes(toks)) == {12: 2}
    # A 32-byte digest and vLLM's int form of it (last 8 bytes, big-endian) name the same block.
    as_int = int.from_bytes(d2, "big") & ((1 << 64) - 1)
    idx.apply_event_batch(10, vbatch([VllmBlockRemoved([as_int], "GPU")], rank=2), block_size=BS)
    assert idx.match(seq_hashes(toks)) == {12: 1}


def test_sglang_signed_hashes_and_media_map_to_tiers():
    idx = kvroute.KvIndex()
    toks = list(range(8))
    ev = [SglBlockStored([-(2**63), -1], None, toks, BS, None, "CPU_PINNED"), SglBlockStored([-(2**63), -1], None, toks, BS, None, "DISK")]
    idx.apply_event_batch(0, msgspec.msgpack.encode(SglEventBatch(1.0, ev, 1)), block_size=BS)
    tiers = idx.match_tiers(seq_hashes(toks))
    assert tiers["host"] == {1: 2} and tiers["disk"] == {1: 2} and tiers["device"] == {}
    idx.apply_event_batch(0, msgspec.msgpack.encode(SglEventBatch(1.0, [SglBlockRemoved([-1], "CPU_PINNED")], 1)), block_size=BS)
    tiers = idx.match_tiers(seq_hashes(toks))
    assert tiers["host"] == {1: 1} and tiers["disk"] == {1: 2}
    for medium, tier in [("GPU", "device"), ("CPU", "host"), ("STORAGE", "disk"), ("EXTERNAL", "disk")]:
        i2 = kvroute.KvIndex()
        i2.apply_event_batch(0, vbatch([vstored([1], None, toks[:4], medium=medium)]), block_size=BS)
        assert i2.match_tiers(seq_hashes(toks[:4]))[tier] == {0: 1}, medium


def test_map_shaped_batch_is_accepted():
    idx = kvroute.KvIndex()
    toks = list(range(4))
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [msgspec.to_builtins(vstored([5], None, toks))], "data_parallel_rank": 0})
    assert idx.apply_event_batch(0, payload, block_size=BS) == 1
    assert idx.match(seq_hashes(toks)) == {0: 1}


def test_blocks_of_another_size_are_skipped_not_failed():
    idx = kvroute.KvIndex()
    toks = list(range(16))
    chunk = VllmBlockStored([7], None, toks, 16, None, "CPU", None)  # e.g. a connector's 16-token chunk
    st = idx._apply_event_batch_stats(0, vbatch([chunk, vstored([8], None, toks[:4])]), block_size=BS)
    assert st[1:4] == (1, 1, 1)  # events, skipped, blocks_stored
    assert idx.match_tiers(seq_hashes(toks))["host"] == {}
    assert idx.match(seq_hashes(toks)) == {0: 1}


def test_unknown_parent_is_tracked_but_never_matches():
    idx = kvroute.KvIndex()
    toks = list(range(12))
    idx.apply_event_batch(1, vbatch([vstored([21], 999, toks[4:8]), vstored([22], 21, toks[8:12])]), block_size=BS)
    assert idx.num_blocks(1) == 2
    assert idx.match(seq_hashes(toks)) == {}
    idx.apply_event_batch(1, vbatch([VllmBlockRemoved([21, 22], "GPU")]), block_size=BS)
    assert idx.num_blocks(1) == 0


def _error_cases():
    toks = list(range(8))
    good = vstored([1, 2], None, toks)
    full = vbatch([good])
    return {
        "unknown event type": (msgspec.msgpack.encode([1.0, [msgspec.to_builtins(good), {"type": "BlockMoved"}], 0]), "BlockMoved"),
        "token count": (vbatch([good, vstored([3], 2, toks[:3])]), "3 token ids for 1 blocks of 4 tokens; expected 4"),
        "token count at its own block size": (
            msgspec.msgpack.encode(VllmEventBatch(1.0, [VllmBlockStored([3], None, toks[:4], 8, None, "GPU", None)], 0)),
            "4 token ids for 1 blocks of 8 tokens; expected 8",
        ),
        "truncated": (full[:-2], "truncated"),
        "garbage": (b"\xc1\x00\x01", "expected array or map"),
        "wrong type": (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}]]), "events[0].block_hashes"),
        "unknown medium": (vbatch([good, VllmBlockRemoved([1], "TAPE")]), "TAPE"),
        "trailing bytes": (full + b"\x00", "trailing"),
        "negative token": (
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-1, 0, 0, 0], "block_size": 4}]]),
            "token_ids[0]",
        ),
        "empty": (b"", "truncated"),
    }


@pytest.mark.parametrize("name", list(_error_cases()))
def test_malformed_batches_raise_event_error_and_apply_nothing(name):
    payload, needle = _error_cases()[name]
    idx = kvroute.KvIndex()
    other = list(range(50, 58))
    idx.apply_event_batch(7, vbatch([vstored([91, 92], None, other)]), block_size=BS)
    idx.store(8, seq_hashes(other))
    before = idx.dump()
    with pytest.raises(kvroute.EventError, match=None) as ei:
        idx.apply_event_batch(7, payload, block_size=BS)
    assert needle in str(ei.value), str(ei.value)
    assert isinstance(ei.value, kvroute.KvrouteError)
    assert idx.dump() == before
    # The worker's engine map is intact too: a removal by engine hash still resolves.
    idx.apply_event_batch(7, vbatch([VllmBlockRemoved([92], "GPU")]), block_size=BS)
    assert idx.match(seq_hashes(other)) == {7: 1, 8: 2}


def test_argument_errors():
    idx = kvroute.KvIndex()
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        idx.apply_event_batch(0, vbatch([]), block_size=0)
    with pytest.raises(TypeError):
        idx.apply_event_batch(0, "not bytes", block_size=4)
    assert idx.apply_event_batch(0, vbatch([]), block_size=4) == 0


# ---- fuzzing -------------------------------------------------------------------------------


def _valid_payloads():
    rng = random.Random(7)
    out = []
    for flavor, form in [("vllm", "int"), ("vllm-legacy", "bytes"), ("sglang", "signed")]:
        eng = FakeEngine(flavor, block_size=BS, capacity=6, hash_form=form)
        for _ in range(6):
            toks = [rng.randrange(3) for _ in range(rng.randrange(4, 20))]
            ev = eng.process(toks)
            if ev:
                out.append(eng.encode(ev))
    return out


VALID = _valid_payloads()


def _check_atomic(payload):
    idx = kvroute.KvIndex()
    idx.apply_event_batch(1, VALID[0], block_size=BS)
    before = idx.dump()
    try:
        n = idx.apply_event_batch(1, payload, block_size=BS)
    except kvroute.EventError as e:
        assert str(e)
        assert idx.dump() == before
    else:
        assert n >= 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    _check_atomic(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(VALID) - 1), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6), st.integers(0, 50))
def test_fuzz_mutated_engine_payloads(which, flips, cut):
    p = bytearray(VALID[which])
    for pos, val in flips:
        p[pos % len(p)] = val
    _check_atomic(bytes(p[: max(0, len(p) - cut)]))


@settings(max_examples=150, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats(allow_nan=False)
        | st.text(max_size=8)
        | st.binary(max_size=40),
        lambda inner: (
            st.lists(inner, max_size=5)
            | st.dictionaries(
                st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "medium", "parent_block_hash", "x"]), inner, max_size=5
            )
        ),
        max_leaves=30,
    )
)
def test_fuzz_structured_msgpack(obj):
    _check_atomic(msgspec.msgpack.encode([1.0, [obj], 0]))
    _check_atomic(msgspec.msgpack.encode(obj))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([("vllm", "int"), ("vllm", "bytes"), ("vllm-legacy", "int"), ("sglang", "signed")]),
    st.integers(2, 30),
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=40),
    st.sets(st.integers(0, 39), max_size=2),
)
def test_index_mirrors_the_engine_cache_for_random_workloads(flavor, capacity, prompts, clear_at):
    """Applying an engine's batches in order leaves the index holding exactly its cached blocks."""
    eng = FakeEngine(flavor[0], block_size=BS, capacity=capacity, hash_form=flavor[1], dp_rank=1)
    idx = kvroute.KvIndex()
    for i, toks in enumerate(prompts):
        ev = eng.process(toks)
        if i in clear_at:
            ev += eng.clear()
        idx.apply_event_batch(4, eng.encode(ev), block_size=BS)
    prefixes = eng.cached_prefixes()
    assert idx.num_blocks(5) == len(prefixes)
    for prefix in prefixes:
        h = seq_hashes(list(prefix))
        assert idx.match(h).get(5) == len(h)

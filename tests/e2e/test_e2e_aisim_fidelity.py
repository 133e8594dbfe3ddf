"""The realistic engine model against real vLLM: the same requests, one at a time, on an AISimulate
engine and on a vLLM CPU engine of the same block size and block count; every request's cached
prompt tokens in the model equal vLLM's ``usage.prompt_tokens_details.cached_tokens``, through a
workload whose prefixes overflow the cache (so both evict). Timing is not compared (a CPU engine's
is not a GPU's; docs/simulator.md says what differs)."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import random
from typing import Any

import pytest
from kvroute.sim.aisim import HAS_AISIM, EngineModel, replay
from vllm_bed import BLOCK_SIZE, VOCAB_SIZE

#: vLLM keeps one block of its pool as the null block; the model's pool is the rest.
NULL_BLOCKS = 1


def block_tokens(block: int) -> list[int]:
    """The tokens of shared block ``block``: distinct per block, inside the model's vocabulary."""
    rng = random.Random(block)
    return [rng.randrange(10, VOCAB_SIZE) for _ in range(BLOCK_SIZE)]


def workload(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` prompts as (block ids, token ids): one of 6 shared prefixes of 3-10 blocks, then 1-3
    blocks of their own and a 5-token tail; prefixes are revisited at random, so a 32-block cache
    overflows and evicts."""
    rng = random.Random(seed)
    prefixes = [list(range(100 * g, 100 * g + rng.randint(3, 10))) for g in range(6)]
    fresh = 10_000
    out = []
    for _ in range(n):
        ids = list(prefixes[rng.randrange(len(prefixes))])
        for _ in range(rng.randint(1, 3)):
            ids.append(fresh)
            fresh += 1
        tokens = [t for b in ids for t in block_tokens(b)]
        tail = random.Random(fresh).sample(range(10, VOCAB_SIZE), 5)
        ids.append(fresh)  # the partial last block, its own
        fresh += 1
        out.append((ids, tokens + tail))
    return out


def test_engine_model_caches_what_vllm_caches(live_engines: list[Any]) -> None:
    if not HAS_AISIM:
        pytest.fail("the bed's kvroute was built without the aisim feature (tests/e2e/build_bed.sh builds it with it)")
    eng = live_engines[0]
    eng.reset_prefix_cache()
    reqs = workload(40, seed=5)
    actual = []
    for _, tokens in reqs:
        out = eng.complete({"prompt": tokens, "max_tokens": 1, "temperature": 0.0})
        details = out["usage"].get("prompt_tokens_details") or {}
        actual.append(int(details.get("cached_tokens") or 0))
    rows = [
        {"timestamp": i * 10_000, "input_length": len(tokens), "output_length": 1, "hash_ids": ids} for i, (ids, tokens) in enumerate(reqs)
    ]
    model = EngineModel(block_size=BLOCK_SIZE, num_gpu_blocks=eng.num_blocks - NULL_BLOCKS, max_num_seqs=8, max_num_batched_tokens=2048)
    r = replay(rows, router=None, workers=1, engine=model, trace_block_size=BLOCK_SIZE)
    predicted = [rec["cached_tokens"] for rec in r.records]
    # What an infinite cache would give (vLLM always computes a prompt's last token): the workload
    # must both hit and, through eviction, miss some of what it saw before.
    seen: set[tuple[int, ...]] = set()
    unbounded = []
    for ids, tokens in reqs:
        full = ids[:-1]
        k = max((j for j in range(len(full) + 1) if tuple(full[:j]) in seen), default=0)
        unbounded.append(min(k, (len(tokens) - 1) // BLOCK_SIZE) * BLOCK_SIZE)
        seen.update(tuple(full[:j]) for j in range(1, len(full) + 1))
    assert sum(actual) > 0, f"nothing hit: {actual}"
    assert any(a < u for a, u in zip(actual, unbounded)), f"nothing was evicted: {actual} vs unbounded {unbounded}"
    mismatches = [(i, a, p) for i, (a, p) in enumerate(zip(actual, predicted)) if a != p]
    assert not mismatches, f"(request, vLLM cached, model cached): {mismatches}\nvLLM: {actual}\nmodel: {predicted}"

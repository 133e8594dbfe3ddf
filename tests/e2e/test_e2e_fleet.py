"""The engine fleet against real vLLM: what an engine's /metrics says of its KV cache is what it runs
with (its block size; its prefix cache, the engine's blocks less its null block), and reaches the Router."""

# ruff: noqa: E402

from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import logging

import kvroute
import pytest
from kvroute.fleet import CacheConfig, Fleet
from vllm_bed import BLOCK_SIZE


def test_the_fleet_learns_each_engines_cache_from_vllm(live_engines: list[vllm_bed.Engine], caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(kvroute.Router(block_size=BLOCK_SIZE))
    added = [fleet.add(f"e{i}", e.url) for i, e in enumerate(live_engines)]
    for fe, e in zip(added, live_engines, strict=True):
        assert fleet.router.load(fe.worker)["prefix_cache_blocks"] is None
        seen, refused = fleet.poll(fe, timeout=10.0)
        assert seen is not None and not refused
        assert fleet.cache_config(fe) == CacheConfig(block_size=BLOCK_SIZE, prefix_cache_blocks=e.num_blocks - 1)
        assert fleet.router.load(fe.worker)["prefix_cache_blocks"] == e.num_blocks - 1
    # A router hashing other blocks than the engines' is told so.
    wrong = Fleet(kvroute.Router(block_size=2 * BLOCK_SIZE))
    fe = wrong.add("e0", live_engines[0].url)
    with caplog.at_level(logging.ERROR, logger="kvroute.fleet"):
        wrong.poll(fe, timeout=10.0)
    assert any(f"uses {BLOCK_SIZE}-token KV blocks, the router {2 * BLOCK_SIZE}" in r.getMessage() for r in caplog.records)

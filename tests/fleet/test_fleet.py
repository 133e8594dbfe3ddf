"""The engine fleet: the worker table, and what an engine's /metrics teaches the Router (its load,
its prefix cache's size, a block size that differs from the Router's)."""

from __future__ import annotations

import asyncio
import logging

import kvroute
import pytest
from kvroute.fleet import CacheConfig, Fleet, parse_cache_config
from kvroute.integrations.engine_router import EngineRouter

# vLLM 0.32's own lines (two engine cores of a data-parallel engine; labels as CacheConfig.metrics_info gives them).
VLLM = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="32",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="40",prefix_caching_hash_algo="sha256"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
"""


def test_cache_config_is_read_as_vllm_publishes_it() -> None:
    # The smaller core's cache, less vLLM's null block.
    assert parse_cache_config(VLLM) == CacheConfig(block_size=16, prefix_cache_blocks=31)
    off = VLLM.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert parse_cache_config(off) == CacheConfig(block_size=16, prefix_cache_blocks=0)
    unsized = VLLM.replace('num_gpu_blocks="32"', 'num_gpu_blocks="None"').replace('num_gpu_blocks="40"', 'num_gpu_blocks="None"')
    assert parse_cache_config(unsized) == CacheConfig(block_size=16, prefix_cache_blocks=None)
    assert parse_cache_config("vllm:num_requests_running 1\n") is None
    assert parse_cache_config("") is None


def test_observe_folds_load_and_learns_the_cache_size() -> None:
    fleet = Fleet(kvroute.Router(block_size=16))
    a = fleet.add("a", "http://127.0.0.1:1/")
    given = fleet.add("b", "http://127.0.0.1:2", prefix_cache_blocks=100)
    assert a.url == "http://127.0.0.1:1" and fleet.add("a", "http://127.0.0.1:1") is a
    with pytest.raises(ValueError, match="already registered"):
        fleet.add("a", "http://127.0.0.1:9")
    assert fleet.router.load(a.worker)["prefix_cache_blocks"] is None
    assert fleet.observe(a, VLLM) == {"running": 3.0}
    assert fleet.router.load(a.worker)["observed_running"] == 3
    assert fleet.router.load(a.worker)["prefix_cache_blocks"] == 31
    fleet.observe(given, VLLM)
    assert fleet.router.load(given.worker)["prefix_cache_blocks"] == 100, "what the user gave wins"
    # Out of routing (a failure) and back: registered with what the engine said.
    fleet.unregister(a)
    fleet.observe(a, VLLM.replace('"32"', '"64"'))
    fleet.register(a)
    assert fleet.router.load(a.worker)["prefix_cache_blocks"] == 39  # min(64, 40) - 1
    assert fleet.remove("a") is a and fleet.get("a") is None and a.worker not in fleet.router.workers()
    assert fleet.remove("a") is None


def test_a_block_size_other_than_the_routers_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(kvroute.Router(block_size=64))
    e = fleet.add("a", "http://127.0.0.1:1", kv_events="tcp://127.0.0.1:5557")
    with caplog.at_level(logging.ERROR, logger="kvroute.fleet"):
        fleet.observe(e, VLLM)
        fleet.observe(e, VLLM.replace('"32"', '"33"'))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "engine a (http://127.0.0.1:1) uses 16-token KV blocks, the router 64: its KV events will never match a request; "
        "give the router block_size=16"
    ]


def test_the_gateway_and_engine_router_learn_a_mock_engines_cache() -> None:
    pytest.importorskip("aiohttp")
    from kvroute.gateway.app import make_gateway
    from kvroute.gateway.mock import MockWorker

    async def run() -> None:
        w = MockWorker("m", cache_config=(16, 257))
        url = await w.start()
        gw = make_gateway(kvroute.Router(preset="gateway"), [url])
        await gw.start()
        try:
            worker = next(iter(gw.workers.values()))
            assert gw.router.load(worker.id)["prefix_cache_blocks"] is None
            assert await gw.poll_metrics(worker) is not None
            assert gw.router.load(worker.id)["prefix_cache_blocks"] == 256
            er = EngineRouter()
            e = er.add("m", url)
            assert await asyncio.get_running_loop().run_in_executor(None, er.poll_metrics, e) is not None
            assert er.router.load(e.worker)["prefix_cache_blocks"] == 256
            assert er.fleet.cache_config(e) == CacheConfig(16, 256)
        finally:
            await gw.stop()
            await w.stop()

    asyncio.run(run())

"""Fixtures of the real-engine tests: the bed and two vLLM CPU engines started once per session,
stopped by PID at the end (also on failure). Each test module starts with ``vllm_bed.skip_unless_bed()``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import vllm_bed


@pytest.fixture(scope="session")
def bed() -> Iterator[vllm_bed.Bed]:
    b = vllm_bed.Bed()
    why = vllm_bed.unavailable(b)
    if why:
        pytest.fail(f"real-engine bed unavailable: {why}", pytrace=False)
    try:
        yield b
    finally:
        b.stop_all()


@pytest.fixture(scope="session")
def engines(bed: vllm_bed.Bed) -> Iterator[list[vllm_bed.Engine]]:
    """Two engines, 32 blocks of 32 tokens each (small, so a workload evicts), serving the base
    model and the bed's two LoRA adapters (``Bed.adapters``: tenant-a, tenant-b)."""
    with bed.running(2, num_blocks=32, loras=bed.adapters()) as es:
        yield es


@pytest.fixture
def live_engines(engines: list[vllm_bed.Engine]) -> Iterator[list[vllm_bed.Engine]]:
    """The session's engines, running; a test that stopped or broke one gets it restarted afterwards."""
    for e in engines:
        if not e.running:
            e.start().wait_ready()
    yield engines
    for e in engines:
        if not e.running or not e.healthy():
            e.stop(timeout=10)
            e.start().wait_ready()

"""The seed's four routing rules and early rejection in plain Python over a `KvIndex`,
with the Router's calling convention: a cross-check for `kvroute.Router` and the simulator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvroute import KvIndex

__all__ = ["SEED_POLICIES", "SeedDecision", "SeedRouter"]

SEED_POLICIES = ("random", "least_load", "cache_only", "ttft")


@dataclass
class SeedDecision:
    worker: int | None
    admitted: bool
    overlap_blocks: int
    predicted_ttft: float
    reason: str
    decode_worker: int | None = None


class SeedRouter:
    """The seed's ``simulate`` routing step, verbatim in its arithmetic and tie-breaking (lowest
    index first), reading overlaps from `index` like the Router does. Workers are 0..n-1.

    Its load model is the seed's virtual-time queue: routing a request to worker ``i`` sets
    ``busy[i] = max(busy[i], now) + uncached_tokens / speed``; "random" draws
    ``random.Random(seed).randrange(n)`` once per request, as the seed does.
    """

    def __init__(
        self,
        index: KvIndex,
        *,
        workers: int,
        speed: float,
        block_size: int,
        policy: str = "ttft",
        ttft_slo: float | None = None,
        seed: int = 1,
    ) -> None:
        if policy not in SEED_POLICIES:
            raise ValueError(f"unknown seed policy {policy!r}; expected one of {', '.join(SEED_POLICIES)}")
        if workers < 1:
            raise ValueError(f"need at least one worker, got {workers}")
        self.index, self.n, self.speed, self.block_size = index, workers, speed, block_size
        self.policy, self.ttft_slo = policy, ttft_slo
        self.rng = random.Random(seed)
        self.busy = [0.0] * workers

    def route(
        self,
        *,
        hashes: Any,
        num_tokens: int,
        now: float,
        request_id: Any = None,
        output_tokens: int | None = None,
        worker: int | None = None,
    ) -> SeedDecision:
        m = self.index.match(hashes)
        hit = [min(m.get(i, 0) * self.block_size, num_tokens) for i in range(self.n)]
        busy, t, speed = self.busy, now, self.speed

        def ttft(i: int) -> float:
            return max(busy[i] - t, 0) + (num_tokens - hit[i]) / speed

        r = range(self.n)
        if worker is not None:
            i = worker
        elif self.policy == "random":
            i = self.rng.randrange(self.n)
        elif self.policy == "least_load":
            i = min(r, key=lambda j: busy[j])
        elif self.policy == "cache_only":
            i = max(r, key=lambda j: (hit[j], -busy[j]))
        else:
            i = min(r, key=ttft)
        pred = ttft(i)
        if self.ttft_slo is not None and pred > self.ttft_slo:
            return SeedDecision(None, False, hit[i] // self.block_size, pred, "rejected_ttft")
        busy[i] = max(busy[i], t) + (num_tokens - hit[i]) / speed
        return SeedDecision(i, True, hit[i] // self.block_size, pred, self.policy)

    def finished(self, request_id: Any, now: float | None = None) -> None:
        """The seed's queue needs no completion signal; kept for the Router's interface."""

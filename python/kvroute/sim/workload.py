"""Workloads for the simulator: arrivals, prompt lengths and per-request block hashes.
Generates the seed's chat workload (bit-exact with its Python script) and holds traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute import _core

__all__ = ["Workload", "seed_chat"]


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, stored column-wise.

    Request ``i`` arrives at ``arrival[i]`` seconds with a ``num_tokens[i]``-token prompt whose
    block hashes (chained sequence hashes of ``block_size``-token blocks) are
    ``hashes[hash_offsets[i]:hash_offsets[i + 1]]``; ``output_tokens[i]`` is its output length
    (0 when the workload does not say, as in the seed's prefill-only experiment).
    """

    name: str
    block_size: int
    arrival: np.ndarray
    num_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_offsets: np.ndarray
    hashes: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if len(self.num_tokens) != n or len(self.output_tokens) != n or len(self.hash_offsets) != n + 1:
            raise ValueError(
                f"workload columns disagree: {n} arrivals, {len(self.num_tokens)} prompt lengths, "
                f"{len(self.output_tokens)} output lengths, {len(self.hash_offsets)} hash offsets (expected n + 1)"
            )
        if n and np.any(np.diff(self.arrival) < 0):
            raise ValueError("arrivals must be in non-decreasing time order")
        if n and np.any(self.num_tokens < 1):
            i = int(np.argmax(self.num_tokens < 1))
            raise ValueError(f"request {i} has an empty prompt (num_tokens = {int(self.num_tokens[i])})")
        if self.hash_offsets[0] != 0 or self.hash_offsets[-1] != len(self.hashes) or np.any(np.diff(self.hash_offsets) < 0):
            raise ValueError("hash_offsets must start at 0, never decrease, and end at len(hashes)")

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self.arrival) else 0.0

    def request_hashes(self, i: int) -> np.ndarray:
        return self.hashes[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    def ideal_hit_rate(self) -> float:
        """Fraction of block occurrences that repeat an earlier one (an infinite shared cache)."""
        _, counts = np.unique(self.hashes, return_counts=True)
        total = len(self.hashes)
        return float((total - len(counts)) / total) if total else 0.0


def seed_chat(
    rate: float,
    seconds: float = 120.0,
    seed: int = 0,
    *,
    systems: int = 20,
    system_tokens: int = 2048,
    conversations: int = 400,
    turn_tokens: int = 300,
    block_size: int = 64,
    with_tokens: bool = False,
) -> Workload:
    """The seed's ``workload(rate, seconds, seed)``: ``systems`` system prompts of
    ``system_tokens`` tokens, ``conversations`` conversations each starting from a random system
    prompt, every request appending ``turn_tokens`` tokens to a random conversation; Poisson
    arrivals at ``rate`` per second. Generated with CPython's ``random.Random(seed)`` in the seed's
    call order (in Rust), so the requests are the seed's own: 4814 at 40 req/s, 8456 at 70 req/s.

    With ``with_tokens``, ``meta["conversation_tokens"]`` and ``meta["conversation"]`` give each
    request's actual token ids (a prefix of its conversation's final tokens).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    d = _core.seed_chat_workload(
        float(rate),
        float(seconds),
        int(seed),
        systems=systems,
        system_tokens=system_tokens,
        conversations=conversations,
        turn_tokens=turn_tokens,
        block_size=block_size,
        with_tokens=with_tokens,
    )
    meta: dict[str, Any] = {"scenario": "seed-chat", "rate": rate, "seconds": seconds, "seed": seed, "conversation": d["conversation"]}
    if with_tokens:
        meta["conversation_tokens"] = d["conversation_tokens"]
    n = len(d["arrival"])
    return Workload(
        name=f"seed-chat@{rate:g}/s",
        block_size=block_size,
        arrival=d["arrival"],
        num_tokens=d["num_tokens"],
        output_tokens=np.zeros(n, dtype=np.int64),
        hash_offsets=d["hash_offsets"],
        hashes=d["hashes"],
        meta=meta,
    )

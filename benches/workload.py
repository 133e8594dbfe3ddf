"""The chat-like index workload shared by the index benchmarks: a few hundred system prompts,
sessions that extend them, spread over W workers; deterministic for a seed."""

from __future__ import annotations

from dataclasses import dataclass

import kvroute
import numpy as np


@dataclass
class Session:
    worker: int
    local: np.ndarray  # local block hashes (Dynamo's `tokens_hash`)
    seq: np.ndarray  # chained sequence hashes (Dynamo's `block_hash`)


def chat_workload(
    workers: int, target_entries: int = 1_000_000, prompts: int = 300, prompt_blocks: int = 32, seed: int = 0
) -> list[Session]:
    """Sessions of 128..1100 blocks (system prompt + turns), each cached on one worker, until
    about `target_entries` (block, worker) entries exist."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 2**63, size=prompt_blocks, dtype=np.uint64) for _ in range(prompts)]
    out: list[Session] = []
    entries = 0
    held: set[tuple[int, int]] = set()  # (prompt, worker) pairs already counted
    while entries < target_entries:
        p = int(rng.integers(prompts))
        w = int(rng.integers(workers))
        extra = int(rng.integers(96, 1068))
        local = np.concatenate([systems[p], rng.integers(0, 2**63, size=extra, dtype=np.uint64)])
        out.append(Session(w, local, kvroute.chain_hashes(local)))
        entries += extra + (0 if (p, w) in held else prompt_blocks)
        held.add((p, w))
    return out


def long_sessions(sessions: list[Session], blocks: int) -> list[Session]:
    return [s for s in sessions if len(s.seq) >= blocks]

"""A small pure-Python reference model of KvIndex, for property tests.

Holdings are per (worker, block, tier). Nodes follow the index's rules: a stored block is a node;
a node that loses its last holder stays (as a "ghost") while it has child nodes.
"""

from __future__ import annotations

from collections import defaultdict


class IndexModel:
    def __init__(self, parent_of: dict[int, int | None]) -> None:
        self.parent_of = parent_of  # the universe's structure: block -> block before it
        self.held: dict[int, dict[int, set[str]]] = defaultdict(dict)  # block -> worker -> tiers
        self.nodes: set[int] = set()
        self.workers: set[int] = set()

    def store(self, worker: int, hashes: list[int], tier: str) -> None:
        self.workers.add(worker)
        for h in hashes:
            self.nodes.add(h)
            self.held[h].setdefault(worker, set()).add(tier)

    def _children(self, h: int) -> bool:
        return any(self.parent_of[c] == h for c in self.nodes)

    def _prune(self, h: int | None) -> None:
        while h is not None and h in self.nodes and not self.held.get(h) and not self._children(h):
            self.nodes.discard(h)
            self.held.pop(h, None)
            h = self.parent_of[h]

    def remove(self, worker: int, hashes: list[int], tier: str | None) -> None:
        for h in hashes:
            tiers = self.held.get(h, {}).get(worker)
            if tiers is None:
                continue
            tiers -= {tier} if tier else set(tiers)
            if not tiers:
                del self.held[h][worker]
            self._prune(h)

    def clear(self, worker: int) -> None:
        for h in [h for h, ws in self.held.items() if worker in ws]:
            self.remove(worker, [h], None)

    def remove_worker(self, worker: int) -> None:
        self.clear(worker)
        self.workers.discard(worker)

    def match(self, hashes: list[int], tier: str | None = None) -> dict[int, int]:
        out: dict[int, int] = {}
        alive: set[int] | None = None
        for d, h in enumerate(hashes):
            holding = {w for w, ts in self.held.get(h, {}).items() if tier is None or tier in ts}
            alive = holding if alive is None else alive & holding
            if not alive:
                break
            for w in alive:
                out[w] = d + 1
        return out

    def entries(self) -> int:
        return sum(len(ws) for ws in self.held.values())

    def num_blocks(self, worker: int) -> int:
        return sum(worker in ws for ws in self.held.values())

"""Property test: KvIndex against the pure-Python reference model (tests/index_model.py)."""

from __future__ import annotations

import random

import kvroute
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from index_model import IndexModel

TIERS = ["device", "host", "disk"]


def make_universe(seed: int) -> tuple[list[list[int]], dict[int, int | None]]:
    """Chains of sequence hashes that share prefixes, as a small prefix tree of blocks."""
    rng = random.Random(seed)
    paths: list[list[int]] = []
    for _ in range(3):  # roots
        trunk = [rng.getrandbits(64) for _ in range(rng.randint(1, 4))]
        for _ in range(3):  # branches
            paths.append(trunk + [rng.getrandbits(64) for _ in range(rng.randint(0, 5))])
    parent_of: dict[int, int | None] = {}
    for p in paths:
        for i, h in enumerate(p):
            parent_of[h] = p[i - 1] if i else None
    return paths, parent_of


class IndexMachine(RuleBasedStateMachine):
    cap: int | None = None

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.paths, parent_of = make_universe(seed)
        self.model = IndexModel(parent_of)
        self.index = kvroute.KvIndex(max_nodes=self.cap)

    def _span(self, data: st.DataObject) -> tuple[list[int], int, int]:
        p = data.draw(st.sampled_from(self.paths))
        i = data.draw(st.integers(0, len(p) - 1))
        j = data.draw(st.integers(i + 1, len(p)))
        return p, i, j

    @rule(worker=st.integers(0, 4), tier=st.sampled_from(TIERS), data=st.data(), as_array=st.booleans())
    def store(self, worker: int, tier: str, data: st.DataObject, as_array: bool) -> None:
        p, i, j = self._span(data)
        hashes = p[i:j]
        arg = np.asarray(hashes, dtype=np.uint64) if as_array else hashes
        self.index.store(worker, arg, parent=p[i - 1] if i else None, tier=tier)
        self.model.store(worker, hashes, tier)

    @rule(worker=st.integers(0, 5), tier=st.sampled_from([None, *TIERS]), data=st.data())
    def remove(self, worker: int, tier: str | None, data: st.DataObject) -> None:
        p, i, j = self._span(data)
        self.index.remove(worker, p[i:j], tier=tier)
        self.model.remove(worker, p[i:j], tier)

    @rule(worker=st.integers(0, 5))
    def clear(self, worker: int) -> None:
        self.index.clear(worker)
        self.model.clear(worker)

    @rule(worker=st.integers(0, 5))
    def remove_worker(self, worker: int) -> None:
        self.index.remove_worker(worker)
        self.model.remove_worker(worker)

    @precondition(lambda self: self.cap is None)
    @rule()
    def dump_and_load(self) -> None:
        self.index = kvroute.KvIndex.load(self.index.dump())

    @rule(data=st.data(), tier=st.sampled_from([None, *TIERS]))
    def match(self, data: st.DataObject, tier: str | None) -> None:
        p = data.draw(st.sampled_from(self.paths))
        k = data.draw(st.integers(0, len(p)))
        got = dict(self.index.match(p[:k], tier=tier))
        want = self.model.match(p[:k], tier)
        if self.cap is None:
            assert got == want
        else:  # eviction may forget blocks, never invent them
            assert all(want.get(w, 0) >= d for w, d in got.items()), (got, want)

    @invariant()
    def counts_agree(self) -> None:
        if self.cap is not None:
            assert len(self.index) <= self.cap
            return
        st_ = self.index.stats()
        assert st_["entries"] == self.model.entries()
        assert len(self.index) == len(self.model.nodes) == st_["nodes"]
        for w in range(6):
            assert self.index.num_blocks(w) == self.model.num_blocks(w)
        for p in self.paths:
            assert dict(self.index.match(p)) == self.model.match(p)


class CappedIndexMachine(IndexMachine):
    cap = 12


TestIndexModel = IndexMachine.TestCase
TestIndexModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestCappedIndexModel = CappedIndexMachine.TestCase
TestCappedIndexModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

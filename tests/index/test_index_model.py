"""Property test: KvIndex against the pure-Python reference model (tests/support/index_model.py)."""

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


def make_sessions(seed: int) -> tuple[list[list[int]], dict[int, int | None]]:
    """Conversations as engines store them: one common block 0, two system prompts behind it,
    and sessions of 6-20 blocks on those prompts."""
    rng = random.Random(seed)
    zero = rng.getrandbits(64)
    prompts = [[zero] + [rng.getrandbits(64) for _ in range(rng.randint(1, 3))] for _ in range(2)]
    paths = [rng.choice(prompts) + [rng.getrandbits(64) for _ in range(rng.randint(4, 16))] for _ in range(4)]
    parent_of: dict[int, int | None] = {}
    for p in paths:
        for i, h in enumerate(p):
            parent_of[h] = p[i - 1] if i else None
    return paths, parent_of


class FragmentedIndexMachine(IndexMachine):
    """Event streams as real engines publish them: each session grows by small turns stored under
    their parent at any later time, interleaved with the other sessions' turns; a turn may go to
    another worker (which prefills the prefix it lacks), arrive before its parent (an orphan,
    adopted when the parent comes), lose a block in the middle, or be stored again."""

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.paths, parent_of = make_sessions(seed)
        self.model = IndexModel(parent_of)
        self.index = kvroute.KvIndex(max_nodes=self.cap)
        self.grown: dict[tuple[int, int], int] = {}  # (session, worker) -> blocks stored in turns

    def _store(self, worker: int, path: list[int], i: int, j: int, tier: str = "device") -> None:
        self.index.store(worker, path[i:j], parent=path[i - 1] if i else None, tier=tier)
        self.model.store(worker, path[i:j], tier)

    @rule(session=st.integers(0, 3), worker=st.integers(0, 3), size=st.integers(1, 4), data=st.data())
    def turn(self, session: int, worker: int, size: int, data: st.DataObject) -> None:
        p = self.paths[session]
        k = self.grown.get((session, worker), 0)
        if k >= len(p):
            return
        if k == 0 and data.draw(st.booleans()):
            # Another worker took the conversation over: it prefills what the session has so far.
            k = max((v for (s, _w), v in self.grown.items() if s == session), default=0)
            if k:
                self._store(worker, p, 0, k)
        self._store(worker, p, k, min(k + size, len(p)))
        self.grown[(session, worker)] = min(k + size, len(p))

    @rule(session=st.integers(0, 3), worker=st.integers(0, 3), data=st.data())
    def turn_before_parent(self, session: int, worker: int, data: st.DataObject) -> None:
        """A turn whose parent turn has not arrived yet."""
        p = self.paths[session]
        i = data.draw(st.integers(1, len(p) - 1))
        self._store(worker, p, i, min(i + data.draw(st.integers(1, 4)), len(p)))

    @rule(session=st.integers(0, 3), worker=st.integers(0, 4), tier=st.sampled_from([None, *TIERS]), data=st.data())
    def remove_middle(self, session: int, worker: int, tier: str | None, data: st.DataObject) -> None:
        p = self.paths[session]
        i = data.draw(st.integers(1, len(p) - 1))
        self.index.remove(worker, [p[i]], tier=tier)
        self.model.remove(worker, [p[i]], tier)

    @rule(session=st.integers(0, 3), worker=st.integers(0, 3), tier=st.sampled_from(TIERS), data=st.data())
    def restore(self, session: int, worker: int, tier: str, data: st.DataObject) -> None:
        """A block stored again (after a removal, or on another tier)."""
        p = self.paths[session]
        i = data.draw(st.integers(0, len(p) - 1))
        self._store(worker, p, i, i + 1, tier)


class CappedFragmentedIndexMachine(FragmentedIndexMachine):
    cap = 16


TestIndexModel = IndexMachine.TestCase
TestIndexModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestCappedIndexModel = CappedIndexMachine.TestCase
TestCappedIndexModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestFragmentedIndexModel = FragmentedIndexMachine.TestCase
TestFragmentedIndexModel.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestCappedFragmentedIndexModel = CappedFragmentedIndexMachine.TestCase
TestCappedFragmentedIndexModel.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)

"""Many threads at once on one KvIndex (long calls release the GIL; short matches and stores run under it): no crash, no deadlock,
and a final state equal to what each writer's own operations imply."""

from __future__ import annotations

import random
import threading

import kvroute
from index_model import IndexModel


def test_readers_and_writers_concurrently() -> None:
    rng = random.Random(5)
    chains = [kvroute.block_hashes([rng.randrange(1000) for _ in range(64)] * 1 + [k] * 64 * 12, 64).tolist() for k in range(40)]
    parent_of = {h: (c[i - 1] if i else None) for c in chains for i, h in enumerate(c)}
    idx = kvroute.KvIndex()
    n_writers, ops = 3, 600
    plans = []
    for w in range(n_writers):
        r = random.Random(100 + w)
        plan = []
        for _ in range(ops):
            c = r.choice(chains)
            k = r.randint(1, len(c))
            plan.append(("remove" if r.random() < 0.3 else "store", c[:k]))
        plans.append(plan)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        try:
            for op, hs in plans[w]:
                getattr(idx, op)(w, hs)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader() -> None:
        try:
            n = 0
            while not stop.is_set() and n < 200_000:
                m = idx.match(chains[n % len(chains)])
                assert all(1 <= d <= 13 for d in m.values())
                n += 1
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=writer, args=(w,)) for w in range(n_writers)]
    rs = [threading.Thread(target=reader) for _ in range(2)]
    for t in ts + rs:
        t.start()
    for t in ts:
        t.join(timeout=60)
    stop.set()
    for t in rs:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts + rs), "deadlock: a thread did not finish"
    assert not errors, errors

    model = IndexModel(parent_of)
    for w in range(n_writers):
        for op, hs in plans[w]:
            model.store(w, hs, "device") if op == "store" else model.remove(w, hs, None)
    assert idx.stats()["entries"] == model.entries()
    for w in range(n_writers):
        assert idx.num_blocks(w) == model.num_blocks(w)
    for c in chains:
        assert dict(idx.match(c)) == model.match(c)

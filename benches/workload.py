"""The index workloads shared by the index benchmarks, deterministic for a seed.

`chat_workload` (in-order): a few hundred system prompts, sessions that extend them, each stored
whole in fixed-size batches on one worker. `interleaved_workload`: the shape of a real engine's
event stream, many sessions open at once, each turn one small store under its parent; with a
`capacity`, each worker's cache is an LRU that evicts (one removal event per block, as vLLM
publishes them) to make room for what it stores (`churn_workload`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import kvroute
import numpy as np


@dataclass
class Session:
    worker: int
    local: np.ndarray  # local block hashes (Dynamo's `tokens_hash`)
    seq: np.ndarray  # chained sequence hashes (Dynamo's `block_hash`)


@dataclass
class Store:
    """One store event: `worker` stores `sessions[session].seq[start:end]` under block `start - 1`."""

    worker: int
    session: int
    start: int
    end: int
    #: Sequence hashes `worker` evicted to make room, just before this store (one removal event
    #: each, deepest block of a chain first, as an LRU of whole prefixes drops them).
    evicted: list[int] = field(default_factory=list)


@dataclass
class Stream:
    sessions: list[Session]
    stores: list[Store] = field(default_factory=list)


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


def in_order_stream(sessions: list[Session], batch: int) -> Stream:
    """`chat_workload` sessions stored one after another in `batch`-block stores."""
    stores = [Store(s.worker, k, i, min(i + batch, len(s.seq))) for k, s in enumerate(sessions) for i in range(0, len(s.seq), batch)]
    return Stream(sessions, stores)


def interleaved_workload(
    workers: int,
    target_entries: int = 1_000_000,
    seed: int = 0,
    open_sessions: int = 128,
    prompts: int = 256,
    switch: float = 0.05,
    chunk: int = 16,
    capacity: int | None = None,
    stored_total: int | None = None,
) -> Stream:
    """A live event stream: `open_sessions` conversations at a time, each on a system prompt drawn
    Zipf(1.1) from `prompts` prompts of 4-64 blocks, all behind one common block 0; a session
    grows to 16-1200 blocks in turns of 2-16 blocks, one store per turn under its parent (the
    session's previous last block), the turns of all open sessions interleaved at random.

    A fraction `switch` of turns go to another worker than the previous turn. That worker does what
    an engine does with a prompt it has not cached: it computes the whole prompt from the deepest
    block it holds (block 0 and the system prompt are usually there already) and stores the
    missing blocks, in stores of at most `chunk` blocks (chunked prefill), the first one under
    the deepest block it holds, one chunk each time the session comes up (so prefill chunks too
    are interleaved with the other sessions' turns). So every store's parent is held by the storing worker, as in a
    real engine's stream (which is also what Dynamo's per-worker tree requires).
    Stops once about `target_entries` (block, worker) entries have been stored.

    With `capacity` (blocks per worker), each worker's cache is an LRU over what it holds: a turn
    uses its session's blocks, its system prompt and block 0 (in that order, so a prefix is always
    used more recently than what extends it), and a store that would overflow the cache first
    evicts the least recently used blocks, the deepest of a chain first, one `evicted` hash per
    block, as vLLM's free-block queue and its `BlockRemoved` events do. A session whose blocks
    were evicted from its worker recomputes and stores them again when it comes back there. The
    stream then runs until `stored_total` blocks have been stored (default `target_entries`)."""
    rng = np.random.default_rng(seed)
    common = rng.integers(0, 2**63, size=1, dtype=np.uint64)
    sys_len = rng.integers(4, 65, size=prompts)
    systems = [np.concatenate([common, rng.integers(0, 2**63, size=int(n), dtype=np.uint64)]) for n in sys_len]
    zipf = 1.0 / np.arange(1, prompts + 1) ** 1.1
    zipf /= zipf.sum()
    sessions: list[Session] = []
    lengths: list[int] = []  # each session's final length
    stored: list[int] = []  # blocks of each session stored so far (by anyone)
    last_worker: list[int] = []
    depth: list[dict[int, int]] = []  # per session: worker -> blocks of the session it holds
    prompt_of: list[int] = []
    sys_held: dict[tuple[int, int], int] = {}  # (prompt, worker) -> blocks of the prompt held
    stream = Stream(sessions)
    entries = 0

    def open_one() -> int:
        p = int(rng.choice(prompts, p=zipf))
        n = max(int(rng.integers(16, 1201)), len(systems[p]) + 2)
        local = np.concatenate([systems[p], rng.integers(0, 2**63, size=n - len(systems[p]), dtype=np.uint64)])
        sessions.append(Session(int(rng.integers(workers)), local, kvroute.chain_hashes(local)))
        lengths.append(n)
        stored.append(0)
        last_worker.append(sessions[-1].worker)
        depth.append({})
        prompt_of.append(p)
        return len(sessions) - 1

    pending: dict[int, tuple[int, int]] = {}  # session -> (worker, turn end) of a turn in prefill
    sys_seq = [kvroute.chain_hashes(x) for x in systems]
    # Per worker with a capacity: what it holds as LRU units, oldest first: ("s", session) the
    # session's own blocks (past its system prompt), ("p", prompt) the prompt's blocks past block 0,
    # ("c", 0) block 0; and how many blocks it holds.
    lru: list[OrderedDict[tuple[str, int], None]] = [OrderedDict() for _ in range(workers)]
    used = [0] * workers

    def evict(w: int, need: int, keep: set[tuple[str, int]]) -> list[int]:
        """Drops `need` blocks from `w`'s least recently used units (not those in `keep`)."""
        gone: list[int] = []
        units = lru[w]
        while need > 0 and units:
            unit = next(iter(units))
            if unit in keep:
                break  # only the storing session's own prefix is left: the cache is too small
            kind, k = unit
            if kind == "s":
                sn = len(systems[prompt_of[k]])
                top = depth[k][w]
                n = min(need, top - sn)
                gone.extend(int(h) for h in sessions[k].seq[top - n : top][::-1])
                if top - n > sn:
                    depth[k][w] = top - n
                else:
                    del depth[k][w]
                    del units[unit]
            elif kind == "p":
                top = sys_held[(k, w)]
                n = min(need, top - 1)
                gone.extend(int(h) for h in sys_seq[k][top - n : top][::-1])
                sys_held[(k, w)] = top - n if top - n > 1 else 0  # block 0 is the ("c", 0) unit's
                if top - n <= 1:
                    del units[unit]
            else:
                n = 1
                gone.append(int(sys_seq[0][0]))
                sys_held[(-1, w)] = 0
                del units[unit]
            need -= n
            used[w] -= n
        return gone

    live = [open_one() for _ in range(open_sessions)]
    limit = target_entries if stored_total is None else stored_total
    while entries < limit:
        slot = int(rng.integers(len(live)))
        k = live[slot]
        p, sys_n = prompt_of[k], len(systems[prompt_of[k]])
        if k in pending:
            w, end = pending.pop(k)
        else:
            w = last_worker[k]
            if stored[k] and workers > 1 and rng.random() < switch:
                w = (w + 1 + int(rng.integers(workers - 1))) % workers
            # The first turn is the system prompt plus 2-16 blocks.
            end = min(max(stored[k], sys_n) + int(rng.integers(2, 17)), lengths[k])
        # The deepest block of this prompt the worker holds: its own turns, else the system prompt.
        have = depth[k].get(w, 0)
        if capacity is not None and have <= sys_n:
            # What the LRU units say is held: the session's blocks inside its prompt may have been
            # evicted with the prompt's (the session's own depth is kept only past the prompt).
            have = max(sys_held.get((p, w), 0), sys_held.get((-1, w), 0))
        elif have < sys_n:
            have = max(have, sys_held.get((p, w), 0), sys_held.get((-1, w), 0))
        j = min(have + chunk, end)
        gone: list[int] = []
        if capacity is not None:
            # The turn uses its prefix (the session's blocks, then its prompt, then block 0, so a
            # prefix is always the more recently used), then makes room for what it stores.
            mine = (("s", k), ("p", p), ("c", 0))
            for u in mine:
                if u in lru[w]:
                    lru[w].move_to_end(u)
            gone = evict(w, used[w] + (j - have) - capacity, set(mine))
            used[w] += j - have
            for u, held in zip(mine, (j > sys_n, min(j, sys_n) > 1, True)):
                if held:
                    lru[w][u] = None
                    lru[w].move_to_end(u)
        stream.stores.append(Store(w, k, have, j, gone))
        entries += j - have
        depth[k][w] = j
        if j >= sys_n:
            sys_held[(p, w)] = sys_n
        elif capacity is not None and j > sys_held.get((p, w), 0):
            sys_held[(p, w)] = j  # a prompt part-stored (chunked prefill), which LRU units count
        sys_held[(-1, w)] = 1  # block 0
        if j < end:  # still prefilling a prompt it had not cached: the next chunk on a later pick
            pending[k] = (w, end)
            continue
        stored[k] = end
        last_worker[k] = w
        if end >= lengths[k]:
            live[slot] = open_one()
    # Sessions are as long as what was stored of them (the stream stops mid-conversation).
    top = [0] * len(sessions)
    for st in stream.stores:
        top[st.session] = max(top[st.session], st.end)
    for k, s in enumerate(sessions):
        s.local, s.seq = s.local[: top[k]], s.seq[: top[k]]
        s.worker = last_worker[k]
    return stream


def churn_workload(workers: int, target_entries: int = 1_000_000, seed: int = 0, turnover: float = 2.0, **kw) -> Stream:
    """`interleaved_workload` with caches that overflow: each worker holds at most
    `target_entries / workers` blocks (an LRU, evicting with one removal event per block), and the
    stream stores `(1 + turnover) * target_entries` blocks, so the index ends near `target_entries`
    live entries after evicting about `turnover` times that many."""
    cap = -(-target_entries // workers)
    return interleaved_workload(workers, target_entries, seed, capacity=cap, stored_total=int((1 + turnover) * target_entries), **kw)


def long_sessions(sessions: list[Session], blocks: int) -> list[Session]:
    return [s for s in sessions if len(s.seq) >= blocks]

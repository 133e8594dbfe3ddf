"""What hit rate the integrations benchmark's workload allows: its requests (bench_real_engines.py's
seeded multi-turn chats, in the order its clients send them, tokenized exactly as the engines do) replayed
through 2 block-level LRU prefix caches of the engines' size, under fixed placements and kvroute's
Router, with no engine and no timing.

    .bed/venv/bin/python benches/replay_hit_rate.py [--num-blocks 192] [--seeds 0,1,2] [--json]

Each engine is an LRU of ``num_blocks - 1`` blocks (vLLM keeps one null block) of 32 tokens; a request
hits its leading cached full blocks (at most ``(tokens - 1) // 32``: vLLM always computes the last
token), then its prompt's full blocks become the most recent, evicting the least recent. Requests run
one at a time in the benchmark's send order (6 clients, each advancing its share of the conversations
round robin; client k's n-th request after client k-1's), so nothing is pinned by a running request
and no load moves a request: this is the cache side of the question alone. Hit rate = hit tokens /
prompt tokens, as vLLM's ``prefix_cache_hits / queries``; "max/mean" is the prompt tokens' balance.

Placements: ``random`` (seeded; LiteLLM's simple-shuffle), ``round_robin``, ``sticky-conversation``
(conversation i on engine i % 2: a conversation never moves), ``sticky-system`` (every conversation of
a system prompt on that prompt's engine, prompts dealt to balance tokens), ``best-prefix`` (an oracle
that sees the caches: the engine with the longest cached prefix, ties to the engine with fewer prompt
tokens so far), ``best-prefix<=X`` (the same oracle held to a prompt-token balance: it takes the
longest cached prefix unless that engine's prompt tokens would exceed X times the mean so far, then
the other engine if it stays within, else the lighter one; ``--caps``, default 1.3, the integrations
issue's bound), and ``kvroute:POLICY`` (a ``kvroute.Router`` whose index the replayed caches feed,
every request finished before the next).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from bench_real_engines import Conversation, vocabulary, workload
from vllm_bed import BLOCK_SIZE, Bed


class LruCache:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.lru: OrderedDict[int, None] = OrderedDict()

    def hit_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            n += 1
        return n

    def store(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Touches / inserts the blocks; returns (stored, evicted) hashes."""
        stored, evicted = [], []
        for h in hashes:
            if h in self.lru:
                self.lru.move_to_end(h)
            else:
                self.lru[h] = None
                stored.append(h)
        while len(self.lru) > self.blocks:
            evicted.append(self.lru.popitem(last=False)[0])
        return stored, evicted


def send_order(convs: list[Conversation], clients: int) -> list[tuple[int, int]]:
    """(conversation, turn) in the order the benchmark's clients send them, interleaved round robin."""
    per_client = []
    for c in range(clients):
        mine = list(range(len(convs)))[c::clients]
        per_client.append([(i, t) for t in range(len(convs[0].turns)) for i in mine])
    out = []
    for k in range(max(len(p) for p in per_client)):
        out += [p[k] for p in per_client if k < len(p)]
    return out


def replay(
    prompts: list[tuple[int, int, Any]], convs: list[Conversation], blocks: int, place: Callable[[int, Any, list[LruCache], list[int]], int]
) -> dict[str, Any]:
    caches = [LruCache(blocks - 1) for _ in range(2)]
    tokens = [0, 0]
    hits = queries = 0
    for conv, _turn, p in prompts:
        e = place(conv, p, caches, tokens)
        hashes = [int(h) for h in p.hashes]
        hit = min(caches[e].hit_blocks(hashes), (p.num_tokens - 1) // BLOCK_SIZE)
        hits += hit * BLOCK_SIZE
        queries += p.num_tokens
        tokens[e] += p.num_tokens
        _, evicted = caches[e].store(hashes)
        if isinstance(place, KvroutePlacement):
            place.events(e, hashes, evicted)
    mean = statistics.fmean(tokens)
    return {"hit_rate": round(hits / queries, 4), "imbalance": round(max(tokens) / mean, 3), "prompt_tokens": tokens}


def placements(convs: list[Conversation], seed: int, caps: Sequence[float] = (1.3,)) -> dict[str, Callable[..., int]]:
    rng = random.Random(seed)
    rr = iter(range(10**9))
    systems = sorted({c.system for c in convs})
    load = {s: sum(1 for c in convs if c.system == s) for s in systems}
    home_sys: dict[str, int] = {}
    per = [0, 0]
    for s in sorted(systems, key=lambda s: -load[s]):
        e = per.index(min(per))
        home_sys[s] = e
        per[e] += load[s]

    def best(conv: int, p: Any, caches: list[LruCache], tokens: list[int]) -> int:
        hashes = [int(h) for h in p.hashes]
        depth = [c.hit_blocks(hashes) for c in caches]
        return max(range(2), key=lambda e: (depth[e], -tokens[e]))

    def capped(cap: float) -> Callable[..., int]:
        def place(conv: int, p: Any, caches: list[LruCache], tokens: list[int]) -> int:
            hashes = [int(h) for h in p.hashes]
            depth = [c.hit_blocks(hashes) for c in caches]
            mean = (sum(tokens) + p.num_tokens) / 2
            for e in sorted(range(2), key=lambda e: (-depth[e], tokens[e])):
                if tokens[e] + p.num_tokens <= cap * mean:
                    return e
            return min(range(2), key=lambda e: tokens[e])

        return place

    out: dict[str, Callable[..., int]] = {
        "random": lambda conv, p, caches, tokens: rng.randrange(2),
        "round_robin": lambda conv, p, caches, tokens: next(rr) % 2,
        "sticky-conversation": lambda conv, p, caches, tokens: conv % 2,
        "sticky-system": lambda conv, p, caches, tokens: home_sys[convs[conv].system],
        "best-prefix": best,
    }
    for cap in caps:
        out[f"best-prefix<={cap:g}"] = capped(cap)
    return out


class KvroutePlacement:
    """A kvroute.Router fed by the replayed caches' stores and evictions (as the engines' KV events
    would), each request finished before the next one."""

    def __init__(self, policy: str) -> None:
        import kvroute

        self.router = kvroute.Router(block_size=BLOCK_SIZE, policy=policy)
        for w in range(2):
            self.router.add_worker(w)
        self.n = 0

    def __call__(self, conv: int, p: Any, caches: list[LruCache], tokens: list[int]) -> int:
        import numpy as np

        rid = f"r{self.n}"
        self.n += 1
        d = self.router.route(hashes=np.asarray(p.hashes, dtype=np.uint64), num_tokens=p.num_tokens, request_id=rid)
        self.router.finished(rid)
        return int(d.worker)

    def events(self, worker: int, prompt: list[int], evicted: list[int]) -> None:
        import numpy as np

        # The prompt's chain first (storing blocks already held is a no-op), then what it evicted
        # (which may be some of its own oldest blocks only if the prompt outgrew the cache).
        self.router.index.store(worker, np.asarray(prompt, dtype=np.uint64))
        if evicted:
            self.router.index.remove(worker, np.asarray(evicted, dtype=np.uint64))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-blocks", type=int, default=192)
    ap.add_argument("--systems", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--kvroute-policies", default="capacity,slack,cache_aware,cache_only")
    ap.add_argument("--caps", default="1.3", help="balance bounds for the capped oracle, comma-separated (default 1.3; '' for none)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        caps = [float(c) for c in a.caps.split(",") if c]
    except ValueError:
        ap.error(f"--caps must be comma-separated numbers, got {a.caps!r}")
    if any(c < 1.0 for c in caps):
        ap.error("--caps: a balance bound below 1 cannot be kept (max/mean >= 1)")
    from kvroute.prompt import ExactPrompter

    bed = Bed(logs=False)
    words = vocabulary(bed.model)
    prompter = ExactPrompter(str(bed.model), BLOCK_SIZE, 1337)
    rows = []
    for seed in (int(s) for s in a.seeds.split(",")):
        convs = workload(words, a.systems, a.conversations, a.turns, seed)
        prompts = [(c, t, prompter.prompt({"messages": convs[c].messages(t)}, True)) for c, t in send_order(convs, a.clients)]
        places: dict[str, Callable[..., int]] = placements(convs, seed, caps)
        for pol in filter(None, a.kvroute_policies.split(",")):
            places[f"kvroute:{pol}"] = KvroutePlacement(pol)
        for name, place in places.items():
            rows.append({"seed": seed, "placement": name, "num_blocks": a.num_blocks, **replay(prompts, convs, a.num_blocks, place)})
    print(f"{'seed':>4}  {'placement':<22}{'hit %':>8}{'max/mean':>10}")
    for r in rows:
        print(f"{r['seed']:>4}  {r['placement']:<22}{r['hit_rate'] * 100:>8.1f}{r['imbalance']:>10.3f}")
    if a.json:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The index mirrors real engines: for every request of a multi-prefix workload, the overlap kvroute
predicts before sending (Router over a KvIndex fed by KvEventSubscriber) equals vLLM's own
``usage.prompt_tokens_details.cached_tokens``, through evictions, reset_prefix_cache, an engine
restart, and subscribers that connect late or miss batches (replay)."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvroute
import numpy as np
from kvroute.events import KvEventSubscriber
from kvroute.prompt import ExactPrompter
from vllm_bed import BLOCK_SIZE, poll

EVENT_WAIT = 15.0  # seconds an engine's KV events may take to reach the index after its answer


def words() -> list[str]:
    """The workload's vocabulary: a fixed list (``words.txt``, the words of README.md at main
    b5f1eba). It used to be read from README.md itself, so every README edit changed every prompt
    and with them how often the workload hits (branch pol's README edit took it from 10 hits to 8
    under any Router; docs/e2e.md)."""
    text = (Path(__file__).parent / "words.txt").read_text(encoding="utf-8")
    return sorted(set(re.findall(r"[A-Za-z]{3,}", text)))


@dataclass
class Row:
    what: str
    worker: int
    num_tokens: int
    overlap_blocks: int
    predicted: int
    actual: int
    # Diagnostics, printed with a mismatch (every row with KVROUTE_E2E_DIAG=1, and the engine's
    # prefix-cache counters): the index's own overlap per worker before routing, the Router's
    # pending (block, worker) pairs then, seconds since the previous row.
    index_blocks: dict[int, int]
    pending: int
    dt: float
    engine: str = ""


def expected_cached(overlap_blocks: int, num_tokens: int) -> int:
    """What vLLM reports for a prompt whose first ``overlap_blocks`` blocks are cached: it always
    computes the prompt's last token, so a fully cached prompt reports one block less (vLLM
    ``KVCacheManager.get_computed_blocks``: the hit is capped at ``num_tokens - 1``)."""
    return min(overlap_blocks, (num_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE


class Mirror:
    """A Router whose index is fed only by the engines' KV events, sending one request at a time."""

    def __init__(self, engines: list[vllm_bed.Engine]) -> None:
        self.engines = engines
        self.prompter = ExactPrompter(str(engines[0].bed.model), BLOCK_SIZE, 1337)
        self.router = kvroute.Router(block_size=BLOCK_SIZE)
        for w in range(len(engines)):
            self.router.add_worker(w)
        self.sub = self.subscriber(self.router.index)
        self.rows: list[Row] = []
        self.seen: list[np.ndarray[Any, Any]] = []
        self._sync_n = 0
        self._last = time.monotonic()
        self.diag = bool(os.environ.get("KVROUTE_E2E_DIAG"))

    def subscriber(self, index: kvroute.KvIndex) -> KvEventSubscriber:
        return KvEventSubscriber(
            index,
            {w: e.events for w, e in enumerate(self.engines)},
            replay_endpoints={w: e.replay for w, e in enumerate(self.engines)},
            topic="kv-events",
            block_size=BLOCK_SIZE,
        )

    def send(self, what: str, body: dict[str, Any], worker: int | None = None, wait: bool = True) -> Row:
        p = self.prompter.prompt(body, "messages" in body)
        rid = len(self.rows)
        index_blocks = {int(w): int(n) for w, n in self.router.index.match(p.hashes).to_dict().items()}
        pending = self.router.num_pending_blocks()
        d = self.router.route(hashes=p.hashes, num_tokens=p.num_tokens, worker=worker, request_id=rid)
        predicted = expected_cached(d.overlap_blocks, p.num_tokens)
        out = self.engines[d.worker].complete({**body, "max_tokens": 1, "temperature": 0})
        self.router.finished(rid)
        usage = out["usage"]
        assert usage["prompt_tokens"] == p.num_tokens, (
            f"{what}: kvroute counted {p.num_tokens} prompt tokens, vLLM {usage['prompt_tokens']}"
        )
        now = time.monotonic()
        row = Row(
            what,
            d.worker,
            p.num_tokens,
            d.overlap_blocks,
            predicted,
            usage["prompt_tokens_details"]["cached_tokens"],
            index_blocks,
            pending,
            round(now - self._last, 3),
        )
        self._last = now
        if self.diag:
            e = self.engines[d.worker]
            row.engine = (
                f"hits={e.metric('vllm:prefix_cache_hits_total'):.0f} queries={e.metric('vllm:prefix_cache_queries_total'):.0f}"
                f" stored/removed={self.sub.stats()['blocks_stored']}/{self.sub.stats()['blocks_removed']}"
            )
            print(row, flush=True)
        self.rows.append(row)
        self.seen.append(p.hashes)
        # The engine publishes this prompt's stores (and the evictions they caused) on the step that
        # ran it: wait until the index holds all of the prompt's full blocks on that worker.
        index = self.router.index
        if wait:
            poll(lambda: index.match(p.hashes).get(d.worker, 0) >= len(p.hashes), EVENT_WAIT, f"{what}'s blocks on worker {d.worker}")
        return row

    def sync_request(self, worker: int, wait: bool = True) -> Row:
        """A request that shares nothing with the workload (two full blocks of its own), to make
        ``worker``'s engine run a scheduler step and so publish what it has queued."""
        self._sync_n += 1
        text = f"sync request {self._sync_n} for worker {worker}: " + " ".join(f"s{self._sync_n}x{i}" for i in range(40))
        return self.send(f"sync{self._sync_n}", {"prompt": text}, worker=worker, wait=wait)

    def until_received(self, sub: KvEventSubscriber, caught_up: Any, what: str, attempts: int = 10) -> None:
        """Sends sync requests to each worker until ``caught_up(stats, worker)`` holds (a SUB socket
        that just connected misses what was published before the connection was up)."""
        for w in range(len(self.engines)):
            for _ in range(attempts):
                if caught_up(sub.stats(), w):
                    break
                self.sync_request(w, wait=False)
                sub.wait_for(lambda s, w=w: caught_up(s, w), timeout=2.0)
            assert caught_up(sub.stats(), w), f"{what}: worker {w} never caught up: {sub.stats()}"

    @staticmethod
    def blocks_of(worker: int, rows: list[Row]) -> int:
        return sum(r.num_tokens // BLOCK_SIZE for r in rows if r.worker == worker)

    def mismatches(self) -> list[Row]:
        return [r for r in self.rows if r.predicted != r.actual]

    def same_index(self, other: kvroute.KvIndex) -> None:
        mine = self.router.index
        for w in range(len(self.engines)):
            assert other.num_blocks(w) == mine.num_blocks(w), f"worker {w}: {other.num_blocks(w)} blocks vs {mine.num_blocks(w)}"
        for h in self.seen:
            assert other.match(h).to_dict() == mine.match(h).to_dict()


def workload(rng: random.Random, vocab: list[str], n: int, prefixes: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``n`` requests over shared prefixes: chat (system prompt + question) and completions (prefix + suffix)."""
    out = []
    for i in range(n):
        k = rng.randrange(len(prefixes))
        tail = " ".join(rng.choice(vocab) for _ in range(rng.randint(8, 60)))
        if i % 2:
            body: dict[str, Any] = {"prompt": prefixes[k] + f"\nQuestion {i}: " + tail}
        else:
            body = {"messages": [{"role": "system", "content": prefixes[k]}, {"role": "user", "content": f"Question {i}: {tail}"}]}
        out.append((f"req{i}/prefix{k}/{'completion' if i % 2 else 'chat'}", body))
    return out


def test_exact_tokens_equal_vllm_tokenize(live_engines: list[vllm_bed.Engine]) -> None:
    e = live_engines[0]
    prompter = ExactPrompter(str(e.bed.model), BLOCK_SIZE, 1337)
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue? é 日本 😀"}]}
    ids = prompter.token_ids(chat, chat=True)
    assert ids is not None and ids.tolist() == e.tokenize(chat)
    assert prompter.prompt(chat, chat=True).exact
    text = {"prompt": "Once upon a time, in Paris: the weather tool\n\twas called."}
    ids = prompter.token_ids(text, chat=False)
    assert ids is not None and ids.tolist() == e.tokenize(text)


def test_index_mirrors_engines(live_engines: list[vllm_bed.Engine]) -> None:
    engines = live_engines
    for e in engines:
        e.reset_prefix_cache()
    rng = random.Random(20261201)
    vocab = words()
    prefixes = [f"System prompt {k}. " + " ".join(rng.choice(vocab) for _ in range(rng.randint(110, 190))) for k in range(6)]
    m = Mirror(engines)
    late = kvroute.KvIndex()
    late_sub = m.subscriber(late)
    with m.sub:
        # The start-up replay brings the earlier tests' history; the resets go out on each engine's
        # next step, so sync requests until each worker holds their blocks and nothing else.
        assert m.sub.wait_for(lambda s: s["synced"], 10.0), m.sub.stats()

        def only_sync_blocks(_: Any, w: int) -> bool:
            n = m.blocks_of(w, m.rows)
            return n > 0 and m.router.index.num_blocks(w) == n

        m.until_received(m.sub, only_sync_blocks, "main subscriber")

        # 1. A multi-prefix workload in a 32-block cache: hits and evictions.
        for what, body in workload(rng, vocab, 36, prefixes):
            m.send(what, body)
        stats = m.sub.stats()
        assert stats["blocks_removed"] > 0, f"the workload should evict (32 blocks per engine): {stats}"
        hits = sum(r.actual > 0 for r in m.rows)
        assert hits >= 10, f"the workload should hit the prefix cache: {hits} hits in {len(m.rows)} requests"

        # 2. A subscriber that connects late rebuilds the same index from the engines' replay buffers.
        late_sub.start()
        m.until_received(late_sub, lambda s, w: s["workers"][w]["last_seq"] == m.sub.stats()["workers"][w]["last_seq"], "late subscriber")
        m.same_index(late)
        assert late_sub.stats()["replayed_batches"] > 0

        # 3. ... and one that misses batches while stopped catches up by replay, without a resync:
        # restarted, it asks for what came after its last batch before reading live ones.
        late_sub.stop()
        replayed = late_sub.stats()["replayed_batches"]
        for what, body in workload(rng, vocab, 6, prefixes):
            m.send("missed/" + what, body)
        late_sub.start()
        m.until_received(late_sub, lambda s, w: s["workers"][w]["last_seq"] == m.sub.stats()["workers"][w]["last_seq"], "late subscriber")
        m.same_index(late)
        ls = late_sub.stats()
        assert ls["replayed_batches"] > replayed and ls["resyncs"] == 0 and ls["restarts"] == 0, ls
        late_sub.stop()

        # 4. reset_prefix_cache: AllBlocksCleared goes out on the engine's next step (the sync request).
        engines[0].reset_prefix_cache()
        row = m.sync_request(0)
        assert m.router.index.num_blocks(0) == m.blocks_of(0, [row]), "after reset + sync request worker 0 holds the sync request's blocks"
        for what, body in workload(rng, vocab, 10, prefixes):
            m.send("after-reset/" + what, body)

        # 5. An engine restart: its publisher's sequence starts over; the index drops the old cache.
        restarts = m.sub.stats()["restarts"]
        engines[1].restart()
        n = len(m.rows)
        m.until_received(m.sub, lambda s, w: w != 1 or s["restarts"] > restarts, "subscriber after the restart")
        assert m.sub.stats()["restarts"] == restarts + 1
        syncs = m.rows[n:]
        poll(lambda: m.router.index.num_blocks(1) == m.blocks_of(1, syncs), EVENT_WAIT, "the restarted engine's sync blocks")
        for what, body in workload(rng, vocab, 14, prefixes):
            m.send("after-restart/" + what, body)

        final = m.sub.stats()
    assert final["decode_errors"] == 0 and final["skipped_events"] == 0 and final["resyncs"] == 0, final
    bad = m.mismatches()
    assert not bad, f"{len(bad)} of {len(m.rows)} predictions differ from vLLM's cached_tokens:\n" + "\n".join(map(str, bad))
    assert any(r.what.startswith("after-restart/") and r.actual > 0 for r in m.rows), "the restarted engine should be hit again"

"""Live KV events: subscribe to vLLM / SGLang ZMQ publishers and mirror their caches in a KvIndex.

One background thread owns every socket; decoding and applying happen in Rust with the GIL released.
Needs ``pyzmq`` (``pip install kvroute[events]``). Wire format and engine flags: docs/events.md.

>>> import kvroute, kvroute.events
>>> idx = kvroute.KvIndex()
>>> with kvroute.events.KvEventSubscriber(idx, {0: "tcp://127.0.0.1:5557"}) as sub:  # doctest: +SKIP
...     sub.wait_for(lambda s: s["batches"] > 0, timeout=5.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute._core import KvIndex, KvrouteError

try:
    import zmq
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvroute.events needs pyzmq: pip install 'kvroute[events]'") from exc

__all__ = ["END_SEQ", "KvEventSubscriber", "parse_replay_frames", "rank_endpoint"]

log = logging.getLogger(__name__)

#: The engines' end-of-replay sequence frame: (-1).to_bytes(8, "big", signed=True).
END_SEQ = b"\xff" * 8

_ids = itertools.count()


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` publishes on, by the engines' own rule
    (``offset_endpoint_port`` in vLLM and SGLang): tcp port + rank, or an ``_dp{rank}`` suffix."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint or endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, port = endpoint.rsplit(":", 1)
        try:
            return f"{base}:{int(port) + rank}"
        except ValueError:
            pass
    raise ValueError(f"cannot offset endpoint {endpoint!r} by data-parallel rank {rank}: expected tcp://host:port, ipc:// or inproc://")


def parse_replay_frames(frames: list[bytes]) -> tuple[str, int, bytes] | None:
    """Parses one message a DEALER receives from an engine's replay ROUTER.

    Returns ("batch", seq, payload), ("end", -1, b"") or None when malformed. Both framings are
    accepted: ``["", seq, payload]`` (SGLang, vLLM before PR #45177) and
    ``["", topic, seq, payload]`` (vLLM since #45177); the end marker is ``END_SEQ`` in the seq slot.
    """
    if not frames or frames[0] != b"":
        return None
    rest = frames[1:]
    if len(rest) == 1 and rest[0] == b"":
        return ("end", -1, b"")
    if len(rest) == 2:
        seq, payload = rest
    elif len(rest) == 3:
        _topic, seq, payload = rest
    else:
        return None
    if len(seq) != 8:
        return None
    if seq == END_SEQ:
        return ("end", -1, b"")
    return ("batch", int.from_bytes(seq, "big"), payload)


@dataclass
class _Publisher:
    worker: int  # the worker id this stream's rank lands on (base + rank)
    base: int
    endpoint: str
    replay_endpoint: str | None
    sock: Any = None
    replay_sock: Any = None
    last_seq: int | None = None
    last_event: float | None = None
    expired: bool = False
    applied_to: set[int] = field(default_factory=set)
    batches: int = 0
    # After the start-up replay: the seqs it applied, and the last live duplicate dropped since.
    replayed_from: int = 0
    replayed_upto: int | None = None
    dup_last: int | None = None


_COUNTERS = (
    "batches",
    "events",
    "blocks_stored",
    "blocks_removed",
    "orphan_blocks",
    "skipped_events",
    "gaps",
    "replays",
    "replayed_batches",
    "replay_failures",
    "resyncs",
    "restarts",
    "decode_errors",
    "expired",
    "duplicates",
)


class KvEventSubscriber:
    """Subscribes to engines' KV-event streams and applies them to ``index``.

    ``endpoints`` maps a worker id to the PUB endpoint to connect to (e.g. ``tcp://host:5557``);
    ``replay_endpoints`` (same keys) names the engines' replay ROUTER endpoints. With
    ``data_parallel_size`` > 1 each endpoint expands to one stream per rank (port + rank, as the
    engines offset them) and rank r's events apply to worker ``worker + r``, so leave those ids free.

    Per stream it tracks the sequence number: a gap is filled from the replay endpoint (both
    replay framings); if the replay can't fill it the stream's workers are cleared (a resync) and
    it continues from there. A sequence that goes backwards means the engine restarted: its
    workers are cleared. A malformed batch counts a decode error and resyncs. With
    ``idle_timeout`` (seconds), a stream silent that long has its workers removed from the index.

    On start (``replay_on_connect``, the default) it asks every replay endpoint at once for the
    history the engine still buffers and applies it before any live batch, so the index knows what
    the engines cached before this subscriber existed without waiting for their next event; live
    batches that the replay already covered are dropped (``duplicates``). ``stats()["synced"]``
    turns true once every stream's start-up replay has finished or timed out (``replay_timeout``);
    routers wait for it (bounded) before their first decision. A stream whose start-up replay timed
    out falls back to replaying on its first live batch. ``resume_from`` (worker -> the last seq
    of that stream already applied to ``index``, e.g. a previous subscriber's
    ``stats()["workers"][w]["last_seq"]``) continues a stream instead of re-reading it: the replay
    starts after that seq, and a gap the engine no longer buffers resyncs the worker.
    """

    def __init__(
        self,
        index: KvIndex,
        endpoints: Mapping[int, str],
        *,
        replay_endpoints: Mapping[int, str] | None = None,
        topic: str = "",
        block_size: int = 16,
        seed: int = 1337,
        idle_timeout: float | None = None,
        data_parallel_size: int = 1,
        replay_timeout: float = 2.0,
        replay_on_connect: bool = True,
        max_replay_batches: int = 100_000,
        resume_from: Mapping[int, int] | None = None,
    ) -> None:
        if not isinstance(index, KvIndex):
            raise TypeError(f"index must be a kvroute.KvIndex, got {type(index).__name__}")
        if not endpoints:
            raise ValueError("endpoints must name at least one worker -> endpoint")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if idle_timeout is not None and idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be > 0 seconds or None, got {idle_timeout}")
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be > 0 seconds, got {replay_timeout}")
        replay_endpoints = dict(replay_endpoints or {})
        for what, eps in (("endpoints", endpoints), ("replay_endpoints", replay_endpoints)):
            for w, ep in eps.items():
                if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://", "inproc://")):
                    raise ValueError(f"{what}[{w}] must be a ZMQ endpoint like 'tcp://host:5557', got {ep!r}")
        unknown = set(replay_endpoints) - set(endpoints)
        if unknown:
            raise ValueError(f"replay_endpoints names workers without an endpoint: {sorted(unknown)}")
        resume_from = dict(resume_from or {})
        for w, seq in resume_from.items():
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < -1:
                raise ValueError(f"resume_from[{w}] must be a batch sequence number >= -1, got {seq!r}")
        self._index = index
        self._topic = topic.encode("utf-8")
        self._block_size = int(block_size)
        self._seed = int(seed)
        self._idle_timeout = idle_timeout
        self._replay_timeout = float(replay_timeout)
        self._replay_on_connect = replay_on_connect
        self._max_replay = int(max_replay_batches)
        self._pubs: list[_Publisher] = []
        owner: dict[int, int] = {}
        for base, ep in sorted(endpoints.items()):
            base = int(base)
            if base < 0:
                raise ValueError(f"worker ids must be >= 0, got {base}")
            rep = replay_endpoints.get(base)
            for r in range(data_parallel_size):
                w = base + r
                if w in owner:
                    raise ValueError(
                        f"worker {base}'s rank {r} lands on worker {w}, already used by worker {owner[w]}: "
                        f"space base worker ids at least data_parallel_size={data_parallel_size} apart"
                    )
                owner[w] = base
                self._pubs.append(_Publisher(w, base, rank_endpoint(ep, r), rank_endpoint(rep, r) if rep else None))
        streams = {p.worker: p for p in self._pubs}
        unknown = set(resume_from) - set(streams)
        if unknown:
            raise ValueError(f"resume_from names workers without a stream: {sorted(unknown)}")
        for w, seq in resume_from.items():
            streams[w].last_seq = seq
        self._synced = False
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._last_error: str | None = None
        self._thread_error: BaseException | None = None
        self._listeners: set[Callable[[], None]] = set()
        self._ctx: Any = None
        self._ctrl_send: Any = None
        self._ctrl_addr = f"inproc://kvroute-events-{id(self)}-{next(_ids)}"
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> KvEventSubscriber:
        """Connects and starts the background thread (idempotent while running)."""
        with self._state_lock:
            if self._thread is not None:
                return self
            self._ctx = zmq.Context()
            self._synced = False
            for p in self._pubs:
                p.replayed_upto = p.dup_last = None
            try:
                ctrl_recv = self._ctx.socket(zmq.PAIR)
                ctrl_recv.bind(self._ctrl_addr)
                self._ctrl_send = self._ctx.socket(zmq.PAIR)
                self._ctrl_send.connect(self._ctrl_addr)
                for p in self._pubs:
                    p.sock = self._sub_socket(p.endpoint)
            except BaseException:
                for p in self._pubs:
                    p.sock = None
                self._ctx.destroy(linger=0)
                self._ctx = None
                raise
            self._thread = threading.Thread(target=self._run, args=(ctrl_recv,), name="kvroute-events", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the thread and closes every socket. Raises if the thread died of an error."""
        with self._state_lock:
            t = self._thread
            if t is None:
                return
            # Non-blocking: if the thread already died its end is closed, and a PAIR send would wait.
            with contextlib.suppress(zmq.Again):
                self._ctrl_send.send(b"stop", zmq.NOBLOCK)
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"KvEventSubscriber thread did not stop within {timeout} s")
            self._thread = None
            self._ctrl_send.close(linger=0)
            self._ctx.term()
            self._ctx = None
        if self._thread_error is not None:
            raise RuntimeError("KvEventSubscriber thread failed") from self._thread_error

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    @property
    def synced(self) -> bool:
        """True once the start-up replay of every stream has finished or timed out."""
        return self._synced

    def __enter__(self) -> KvEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> KvEventSubscriber:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    # ---- observation -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters plus per-stream state: ``workers[w] = {endpoint, last_seq, last_event_age, batches}``."""
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict[str, Any]:
        now = time.monotonic()
        out: dict[str, Any] = dict(self._counts)
        out["blocks"] = out["blocks_stored"] + out["blocks_removed"]
        out["last_error"] = self._last_error
        out["workers"] = {
            p.worker: {
                "endpoint": p.endpoint,
                "last_seq": p.last_seq,
                "last_event_age": None if p.last_event is None else now - p.last_event,
                "batches": p.batches,
                "expired": p.expired,
            }
            for p in self._pubs
        }
        out["running"] = self.running
        out["synced"] = self._synced
        return out

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        """Blocks until ``predicate(self.stats())`` holds (re-checked after every batch); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if predicate(self._snapshot_locked()):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)

    async def wait_for_async(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
        """``wait_for`` for asyncio code: awaits without blocking the event loop."""
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(ev.set)

        deadline = loop.time() + timeout
        with self._lock:
            self._listeners.add(wake)
        try:
            while True:
                ev.clear()
                if predicate(self.stats()):
                    return True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ev.wait(), remaining)
        finally:
            with self._lock:
                self._listeners.discard(wake)

    # ---- the thread ------------------------------------------------------------------

    def _sub_socket(self, endpoint: str) -> Any:
        s = self._ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        s.setsockopt(zmq.SUBSCRIBE, self._topic)
        s.connect(endpoint)
        return s

    def _run(self, ctrl: Any) -> None:
        poller = zmq.Poller()
        poller.register(ctrl, zmq.POLLIN)
        by_sock = {}
        for p in self._pubs:
            poller.register(p.sock, zmq.POLLIN)
            by_sock[p.sock] = p
        try:
            if self._replay_on_connect:
                self._startup_replay(ctrl)
            with self._lock:
                self._synced = True
            self._notify()
            while True:
                ready = dict(poller.poll(self._poll_ms()))
                if ctrl in ready and ctrl.recv() == b"stop":
                    return
                for sock in ready:
                    pub = by_sock.get(sock)
                    if pub is None:
                        continue
                    # Drain what is queued, bounded so one busy stream cannot starve the others.
                    for _ in range(1024):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(pub, frames)
                self._expire_idle()
        except BaseException as exc:
            log.exception("kvroute KV-event subscriber thread failed")
            self._thread_error = exc
            with self._lock:
                self._last_error = f"thread failed: {exc!r}"
            self._notify()
        finally:
            ctrl.close(linger=0)
            for p in self._pubs:
                for s in (p.sock, p.replay_sock):
                    if s is not None:
                        s.close(linger=0)
                p.sock = p.replay_sock = None

    def _poll_ms(self) -> int:
        if self._idle_timeout is None:
            return 1000
        return max(10, min(1000, int(self._idle_timeout * 250)))

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._counts[k] += v

    def _error(self, msg: str) -> None:
        log.warning("kvroute KV events: %s", msg)
        with self._lock:
            self._counts["decode_errors"] += 1
            self._last_error = msg

    def _on_message(self, p: _Publisher, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._error(f"worker {p.worker}: expected [topic, 8-byte seq, payload], got {len(frames)} frames")
            self._notify()
            return
        seq = int.from_bytes(frames[1], "big")
        self._on_batch(p, seq, frames[2])
        self._notify()

    def _startup_replay(self, ctrl: Any) -> None:
        """Asks every replay endpoint at once for what its engine buffers (after ``last_seq`` when
        resuming) and applies each stream's answer in order; bounded by ``replay_timeout``."""
        pending: dict[Any, tuple[_Publisher, int, dict[int, bytes]]] = {}
        for p in self._pubs:
            if p.replay_endpoint is None:
                continue
            start = 0 if p.last_seq is None else p.last_seq + 1
            s = self._replay_socket(p)
            s.send_multipart([b"", start.to_bytes(8, "big")])
            pending[s] = (p, start, {})
            self._count(replays=1)
        poller = zmq.Poller()
        for s in pending:
            poller.register(s, zmq.POLLIN)
        poller.register(ctrl, zmq.POLLIN)
        deadline = time.monotonic() + self._replay_timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for s, _ in poller.poll(max(1, int(remaining * 1000))):
                if s is ctrl:
                    return  # stop() asked: the main loop reads the message
                p, start, got = pending[s]
                parsed = parse_replay_frames(s.recv_multipart())
                if parsed is None:
                    self._error(f"worker {p.worker}: malformed replay reply from {p.replay_endpoint}")
                elif parsed[0] == "end":
                    del pending[s]
                    poller.unregister(s)
                    self._apply_startup(p, start, sorted(got.items()))
                    continue
                elif parsed[1] >= start:
                    got[parsed[1]] = parsed[2]
                if parsed is None or len(got) > self._max_replay:
                    del pending[s]
                    poller.unregister(s)
                    self._replay_failed(p)
        for p, _, _ in pending.values():
            self._replay_failed(p)

    def _apply_startup(self, p: _Publisher, start: int, batches: list[tuple[int, bytes]]) -> None:
        self._count(replayed_batches=len(batches))
        for seq, payload in batches:
            if p.last_seq is not None and seq != p.last_seq + 1:
                # Resuming, and the engine no longer buffers what came after our last batch (or
                # its buffer has a hole): what this worker holds is unknown, start over.
                self._count(gaps=1, resyncs=1)
                self._clear(p)
            self._apply(p, seq, payload)
        if batches:
            p.replayed_from, p.replayed_upto = batches[0][0], p.last_seq
        p.dup_last = None

    def _replay_socket(self, p: _Publisher) -> Any:
        if p.replay_sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            assert p.replay_endpoint is not None
            s.connect(p.replay_endpoint)
            p.replay_sock = s
        return p.replay_sock

    def _replay_failed(self, p: _Publisher) -> None:
        # Late replies must not be read as answers to the next request: start a fresh socket.
        if p.replay_sock is not None:
            p.replay_sock.close(linger=0)
            p.replay_sock = None
        self._count(replay_failures=1)

    def _on_batch(self, p: _Publisher, seq: int, payload: bytes) -> None:
        if p.replayed_upto is not None:
            # Live batches queued while the start-up replay ran repeat what it applied; they arrive
            # in increasing order, so one at or below the last dropped is a new stream (a restart).
            if p.replayed_from <= seq <= p.replayed_upto and (p.dup_last is None or seq > p.dup_last):
                p.dup_last = seq
                self._count(duplicates=1)
                return
            p.replayed_upto = p.dup_last = None
        if p.last_seq is not None and seq <= p.last_seq:
            # ZMQ neither reorders nor repeats a connection's messages, and replay only fetches
            # what live delivery skipped: a sequence that does not advance is a new publisher
            # (an engine restart) with an empty cache.
            self._count(restarts=1)
            self._clear(p)
            p.last_seq = -1
        first = p.last_seq is None
        # After a restart last_seq is -1: the new stream's history is missing, but nothing we
        # hold is stale, so that is neither a gap nor a reason to resync.
        had_state = p.last_seq is not None and p.last_seq >= 0
        expected = 0 if p.last_seq is None else p.last_seq + 1
        if seq > expected and (not first or (self._replay_on_connect and p.replay_endpoint)):
            if had_state:
                self._count(gaps=1)
            complete, batches = self._replay(p, expected, seq)
            if not complete and had_state:
                # The missing batches are gone: what this worker holds is unknown, start over.
                self._count(resyncs=1)
                self._clear(p)
            for s, pl in batches:
                self._apply(p, s, pl)
        self._apply(p, seq, payload)

    def _replay(self, p: _Publisher, start: int, upto: int) -> tuple[bool, list[tuple[int, bytes]]]:
        """Fetches batches start..upto-1; returns (whether all of them came, those that did)."""
        if p.replay_endpoint is None:
            return False, []
        self._count(replays=1)
        s = self._replay_socket(p)
        got: dict[int, bytes] = {}
        ended = False
        deadline = time.monotonic() + self._replay_timeout
        s.send_multipart([b"", start.to_bytes(8, "big")])
        while len(got) <= self._max_replay:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not s.poll(max(1, int(remaining * 1000))):
                break
            parsed = parse_replay_frames(s.recv_multipart())
            if parsed is None:
                self._error(f"worker {p.worker}: malformed replay reply from {p.replay_endpoint}")
                break
            kind, seq, payload = parsed
            if kind == "end":
                ended = True
                break
            if start <= seq < upto:
                got[seq] = payload
        if not ended:
            self._replay_failed(p)
        batches = sorted(got.items())
        self._count(replayed_batches=len(batches))
        complete = ended and len(batches) == upto - start
        return complete, batches

    def _apply(self, p: _Publisher, seq: int, payload: bytes) -> None:
        try:
            w, ev, skipped, stored, removed, orphans, _unknown = self._index._apply_event_batch_stats(
                p.base, payload, block_size=self._block_size, seed=self._seed
            )
        except KvrouteError as exc:  # EventError, or IndexCapacityError after a partial apply
            self._error(f"worker {p.worker} seq {seq}: {exc}")
            self._count(resyncs=1)
            self._clear(p)
        else:
            p.applied_to.add(w)
            self._count(batches=1, events=ev, skipped_events=skipped, blocks_stored=stored, blocks_removed=removed, orphan_blocks=orphans)
        with self._lock:
            p.last_seq = seq
            p.last_event = time.monotonic()
            p.batches += 1
            p.expired = False

    def _clear(self, p: _Publisher) -> None:
        for w in p.applied_to | {p.worker}:
            self._index.clear(w)

    def _expire_idle(self) -> None:
        if self._idle_timeout is None:
            return
        now = time.monotonic()
        for p in self._pubs:
            if p.expired or p.last_event is None or now - p.last_event <= self._idle_timeout:
                continue
            for w in p.applied_to | {p.worker}:
                self._index.remove_worker(w)
            with self._lock:
                p.expired = True
                self._counts["expired"] += 1
            self._notify()

"""A fake inference engine for the KV-event tests: a real prefix cache and an engine-format publisher.
The cache is an LRU over chained blocks; batches are msgspec structs declared as vLLM/SGLang declare them.

Struct declarations follow the engines' sources (vLLM ``vllm/distributed/kv_events.py``, SGLang
``python/sglang/srt/disaggregation/kv_events.py``); the publisher mirrors their ZmqEventPublisher:
PUB frames ``[topic, seq (8-byte big-endian), payload]`` and a ROUTER replay socket answering
``["", start_seq]`` with buffered batches and an END_SEQ marker, in either framing.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---- vLLM, current: positional batch, tagged-map events (PR #42892) -------------------------


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


# ---- vLLM, legacy: tagged-array events (before PR #42892) ----------------------------------


class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


# ---- SGLang: positional batch with attn_dp_rank, tagged-array events, signed hashes --------


class SglEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SglKVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class SglBlockStored(SglKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SglBlockRemoved(SglKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglAllBlocksCleared(SglKVCacheEvent, tag="AllBlocksCleared"):
    pass


FLAVORS = ("vllm", "vllm-legacy", "sglang")


class _Block:
    __slots__ = ("children", "key", "parent", "prefix", "tokens", "used")

    def __init__(self, key: bytes, parent: bytes | None, tokens: tuple[int, ...], prefix: tuple[int, ...], used: int):
        self.key, self.parent, self.tokens, self.prefix = key, parent, tokens, prefix
        self.children = 0
        self.used = used


class FakeEngine:
    """A prefix cache of ``capacity`` blocks that reports its changes as engine-format event batches.

    Blocks are keyed by sha256(parent key + token bytes), like vLLM's chained block hashes;
    ``hash_form`` says how they go on the wire: "int" (vLLM's default: last 8 bytes as u64),
    "bytes" (the 32-byte digest, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) or "signed" (SGLang's i64).
    Only leaves are evicted (least recently used first), so every cached block's parent is cached.
    """

    def __init__(self, flavor: str, *, block_size: int, capacity: int, hash_form: str = "int", dp_rank: int = 0):
        assert flavor in FLAVORS, flavor
        assert hash_form in ("int", "bytes", "signed")
        self.flavor, self.block_size, self.capacity, self.hash_form, self.dp_rank = flavor, block_size, capacity, hash_form, dp_rank
        self.blocks: dict[bytes, _Block] = {}
        self.tick = 0

    def wire_hash(self, key: bytes) -> int | bytes:
        if self.hash_form == "bytes":
            return key
        u = int.from_bytes(key, "big") & ((1 << 64) - 1)
        if self.hash_form == "signed":
            return u - (1 << 64) if u >= 1 << 63 else u
        return u

    def cached_prefixes(self) -> list[tuple[int, ...]]:
        """The full token prefix of every cached block (one entry per block)."""
        return [b.prefix for b in self.blocks.values()]

    def _evict_one(self, protected: set[bytes]) -> bytes | None:
        leaves = [b for b in self.blocks.values() if b.children == 0 and b.key not in protected]
        if not leaves:
            return None
        victim = min(leaves, key=lambda b: b.used)
        del self.blocks[victim.key]
        if victim.parent is not None:
            self.blocks[victim.parent].children -= 1
        return victim.key

    def process(self, tokens: list[int]) -> list[Any]:
        """Runs one request's prompt through the cache; returns the events it caused."""
        bs = self.block_size
        path: list[bytes] = []
        parent: bytes | None = None
        new: list[tuple[bytes, tuple[int, ...]]] = []
        for i in range(len(tokens) // bs):
            blk = tuple(tokens[i * bs : (i + 1) * bs])
            key = hashlib.sha256((parent or b"") + b"".join(t.to_bytes(4, "little") for t in blk)).digest()
            if not new and key in self.blocks:
                self.tick += 1
                self.blocks[key].used = self.tick
                path.append(key)
            else:
                new.append((key, blk))
            parent = key
        protected = set(path) | {k for k, _ in new}
        evicted: list[bytes] = []
        while len(self.blocks) + len(new) > self.capacity:
            k = self._evict_one(protected)
            if k is None:
                break
            evicted.append(k)
        room = max(0, self.capacity - len(self.blocks))
        new = new[:room]
        events: list[Any] = []
        if evicted:
            events.append(self._removed([self.wire_hash(k) for k in evicted]))
        if new:
            parent_key = path[-1] if path else None
            prefix = tuple(tokens[: len(path) * bs])
            p = parent_key
            for key, blk in new:
                prefix = prefix + blk
                self.tick += 1
                self.blocks[key] = _Block(key, p, blk, prefix, self.tick)
                if p is not None:
                    self.blocks[p].children += 1
                p = key
            events.append(
                self._stored(
                    [self.wire_hash(k) for k, _ in new],
                    None if parent_key is None else self.wire_hash(parent_key),
                    [t for _, blk in new for t in blk],
                )
            )
        return events

    def clear(self) -> list[Any]:
        self.blocks.clear()
        return [{"vllm": VllmAllBlocksCleared, "vllm-legacy": LegacyAllBlocksCleared, "sglang": SglAllBlocksCleared}[self.flavor]()]

    def _stored(self, hashes: list, parent: Any, tokens: list[int]) -> Any:
        bs = self.block_size
        if self.flavor == "vllm":
            return VllmBlockStored(
                hashes,
                parent,
                tokens,
                bs,
                None,
                "GPU",
                None,
                extra_keys=[None] * len(hashes),
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        if self.flavor == "vllm-legacy":
            return LegacyBlockStored(hashes, parent, tokens, bs, None, "GPU", None)
        return SglBlockStored(hashes, parent, tokens, bs, None, "GPU")

    def _removed(self, hashes: list) -> Any:
        if self.flavor == "vllm":
            return VllmBlockRemoved(hashes, "GPU", group_idx=0)
        if self.flavor == "vllm-legacy":
            return LegacyBlockRemoved(hashes, "GPU")
        return SglBlockRemoved(hashes, "GPU")

    def encode(self, events: list[Any], ts: float = 0.0) -> bytes:
        if self.flavor == "sglang":
            return msgspec.msgpack.encode(SglEventBatch(ts, events, self.dp_rank))
        return msgspec.msgpack.encode(VllmEventBatch(ts, events, self.dp_rank))


class FakePublisher:
    """The engines' ZmqEventPublisher on 127.0.0.1: XPUB (so a test can wait for its subscriber
    instead of sleeping) plus a ROUTER replay socket served from a thread.

    ``framing`` "vllm" replies ``[topic, seq, payload]`` and ends with ``["", END_SEQ, ""]`` after the
    delimiter (vLLM since PR #45177); "sglang" replies ``[seq, payload]`` and ``[END_SEQ, ""]``.
    """

    def __init__(self, *, framing: str = "vllm", topic: str = "", buffer_steps: int = 10_000, port: int | None = None):
        assert framing in ("vllm", "sglang")
        self.framing, self.topic = framing, topic.encode()
        # A context of its own: close() terminates it, which returns only once the sockets are
        # really closed, so a restarted publisher can bind the same port at once.
        self.ctx = ctx = zmq.Context()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        try:
            if port is None:
                self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.pub.bind(f"tcp://127.0.0.1:{port}")
                self.port = port
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        except zmq.ZMQError:
            self.pub.close(linger=0)
            self.router.close(linger=0)
            ctx.term()
            raise
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replays_served = 0
        # A test may hold replay answers back: ``replay_requested`` is set when a request arrives,
        # and the answer waits (bounded) for ``replay_gate`` when one is set up.
        self.replay_requested = threading.Event()
        self.replay_gate: threading.Event | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_for_subscriber(self, timeout: float = 10.0) -> None:
        """Blocks until a subscription reaches the XPUB (first byte 1), bounded by ``timeout``."""
        if not self.pub.poll(int(timeout * 1000)):
            raise TimeoutError("no subscriber connected to the fake publisher")
        msg = self.pub.recv()
        assert msg[:1] == b"\x01", msg

    def publish(self, payload: bytes, *, drop: bool = False) -> int:
        """Publishes one batch (or, with ``drop``, only buffers it, as a lost message); returns its seq."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requested.set()
            if self.replay_gate is not None:
                self.replay_gate.wait(10.0)
            with self._lock:
                items = [(s, b) for s, b in self.buffer if s >= start_seq]
            for s, b in items:
                if self.framing == "vllm":
                    self.router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), b])
                else:
                    self.router.send_multipart([client, b"", s.to_bytes(8, "big"), b])
            if self.framing == "vllm":
                self.router.send_multipart([client, b"", b"", END_SEQ, b""])
            else:
                self.router.send_multipart([client, b"", END_SEQ, b""])
            self.replays_served += 1

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()

"""Cache identity on real vLLM events: the batches a vLLM 0.32 engine published for one prompt under
five identities (base model, two LoRA adapters, a cache salt, an adapter with a salt; recorded in
tests/data/identity/) key five different chains in the index, and a request matches exactly the
chain of its own identity (``identity_root`` of its adapter and salt)."""

from __future__ import annotations

import json
from pathlib import Path

import kvroute
from kvroute import KvIndex, block_hashes, identity_root

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "identity" / "events_lora_salt.jsonl"
BLOCK = 32


def _batches() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def _identity(body: dict) -> int | None:
    lora = body["model"] if body["model"] != "tiny-llama" else None
    return identity_root(lora=lora, cache_salt=body.get("cache_salt"))


def test_each_identity_keys_its_own_chain() -> None:
    batches = _batches()
    assert len(batches) == 5
    idx = KvIndex()
    for worker, b in enumerate(batches):
        idx.apply_event_batch(worker, bytes.fromhex(b["payload_hex"]), block_size=BLOCK)
    roots = [_identity(b["body"]) for b in batches]
    assert roots[0] is None and len(set(roots)) == 5
    for worker, b in enumerate(batches):
        prompt = b["body"]["prompt"]
        m = idx.match(block_hashes(prompt, BLOCK, identity=roots[worker]))
        # Only the worker that stored it under this identity holds it, all three full blocks.
        assert dict(m) == {worker: 3}, (b["request"], dict(m))


def test_a_router_credits_only_the_requests_identity() -> None:
    b = _batches()[1]  # tenant-a
    r = kvroute.Router(block_size=BLOCK)
    r.add_worker(0)
    r.add_worker(1)
    r.index.apply_event_batch(1, bytes.fromhex(b["payload_hex"]), block_size=BLOCK)
    prompt = b["body"]["prompt"]
    d = r.route(prompt, now=0.0, identity=identity_root(lora="tenant-a"))
    assert (d.worker, d.overlap_blocks) == (1, 3)
    for other in (None, identity_root(lora="tenant-b"), identity_root(lora="tenant-a", cache_salt="s1")):
        assert r.route(prompt, now=0.0, identity=other).overlap_blocks == 0

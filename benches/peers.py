"""Adapters for the peer implementations we benchmark against, loaded only when installed.

Dynamo (`ai-dynamo-runtime` on PyPI): `dynamo._core.RadixTree` takes JSON KV events
(`{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}}`);
`find_matches` takes the *local* block hashes (`compute_block_hash_for_seq` output) and returns
`OverlapScores.scores: {(worker_id, dp_rank): blocks}`.
"""

from __future__ import annotations

import json
from typing import Any

try:
    from dynamo import _core as dynamo_core  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - optional benchmark dependency
    dynamo_core = None


def dynamo_available() -> bool:
    return dynamo_core is not None


def dynamo_stored_event(event_id: int, seq: list[int], local: list[int], parent: int | None) -> bytes:
    blocks = [{"block_hash": b, "tokens_hash": t} for b, t in zip(seq, local)]
    return json.dumps({"event_id": event_id, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}).encode()


def dynamo_tree() -> Any:
    assert dynamo_core is not None, "ai-dynamo-runtime is not installed"
    return dynamo_core.RadixTree()


def dynamo_scores(tree: Any, local: list[int]) -> dict[int, int]:
    return {w: s for (w, _dp), s in tree.find_matches(local).scores.items()}

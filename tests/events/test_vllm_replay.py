"""The vLLM event-stream replay of `benches/compare_index.py --workload vllm-replay`: a recording
(gzipped JSON of msgpack batches, as `benches/record_vllm_events.py` writes it) replayed through
`KvIndex.apply_event_batch` leaves exactly the blocks the stream stored and did not remove, so every
recorded prompt matches as deep as its leading live blocks. Run on a synthetic recording in vLLM's
wire format, and on the recorded real-engine stream in `benches/data/` when it is there."""

from __future__ import annotations

import base64
import gzip
import json
import random
import sys
from pathlib import Path

import pytest

msgspec = pytest.importorskip("msgspec")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))
from compare_index import DEFAULT_EVENTS, Recording, replay_kvroute  # noqa: E402
from fake_engine import VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, VllmEventBatch  # noqa: E402


def synthetic_recording(path: Path, seed: int = 0, batches: int = 40) -> Path:
    """Chains grown by small stores under their leaves, leaf-first removals, now and then a cleared
    cache; bytes block hashes."""
    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    chains: list[list[bytes]] = []
    out = []
    for _ in range(batches):
        events: list[object] = []
        for _ in range(3):
            live = [c for c in chains if c]
            if rng.random() < 0.03:
                events.append(VllmAllBlocksCleared())
                chains.clear()
                continue
            if live and rng.random() < 0.25:
                c = rng.choice(live)
                events.append(VllmBlockRemoved([c.pop() for _ in range(min(len(c), rng.randrange(1, 3)))], "GPU"))
                continue
            chain = rng.choice(live) if live and rng.random() < 0.7 else None
            parent = chain[-1] if chain else None
            if chain is None:
                chain = []
                chains.append(chain)
            n = rng.randrange(1, 5)
            hashes = [rng.randbytes(32) for _ in range(n)]
            events.append(VllmBlockStored(hashes, parent, [rng.randrange(4096) for _ in range(n * 32)], 32, None, "GPU", None))
            chain.extend(hashes)
        out.append(base64.b64encode(enc.encode(VllmEventBatch(ts=1.0, events=events))).decode())
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"block_size": 32, "batches": out}, f)
    return path


def expected(rec: Recording) -> tuple[list[int], int]:
    """Per query, its leading blocks still cached at the end of the stream; and how many are."""
    live: set[int] = set()
    for e in rec.dynamo:
        data = json.loads(e)["data"]
        if data == "cleared":
            live.clear()
        elif "stored" in data:
            live.update(b["block_hash"] for b in data["stored"]["blocks"])
        else:
            live.difference_update(data["removed"]["block_hashes"])
    depths = []
    for blocks in rec.query_blocks:
        d = 0
        while d < len(blocks) and blocks[d] in live:
            d += 1
        depths.append(d)
    return depths, len(live)


def recordings(tmp: Path) -> list[Path]:
    paths = [synthetic_recording(tmp / f"synthetic{seed}.json.gz", seed) for seed in range(3)]
    return paths + ([DEFAULT_EVENTS] if DEFAULT_EVENTS.exists() else [])


def test_replay_leaves_what_the_stream_left(tmp_path: Path) -> None:
    for path in recordings(tmp_path):
        rec = Recording(path)
        assert rec.q_seq and rec.stored > 0
        idx, _ = replay_kvroute(rec)
        depths, cached = expected(rec)
        assert [dict(idx.match(q)).get(0, 0) for q in rec.q_seq] == depths, path
        assert idx.stats()["entries"] == cached, path

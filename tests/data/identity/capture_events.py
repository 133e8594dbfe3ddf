"""Writes events_lora_salt.jsonl: the KV-event batches a fresh vLLM engine of the bed (two LoRA
adapters, ``Bed.adapters()``) publishes for one 100-token prompt sent five times, as the base model,
tenant-a, tenant-b, the base model with ``cache_salt`` "s1" and tenant-a with "s1".

    KVROUTE_E2E_BED=/work/main/.e2e flock /work/e2e.lock .e2e/venv/bin/python tests/data/identity/capture_events.py

The batches are read back from the engine's replay endpoint (sequence 0 on) once all five requests
are answered, so the file holds exactly the engine's history: one batch per request, each payload
the exact bytes vLLM published (the third frame of [topic, seq, payload]).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "support"))

from vllm_bed import BLOCK_SIZE, MODEL_NAME, Bed, http_json  # noqa: E402

PROMPT = [(i * 37 + 11) % 4000 + 50 for i in range(100)]  # 100 token ids: 3 full blocks of 32, then 4
REQUESTS = [
    ("completions, base model", {"model": MODEL_NAME}),
    ("completions, tenant-a", {"model": "tenant-a"}),
    ("completions, tenant-b", {"model": "tenant-b"}),
    ("completions, base model, cache_salt s1", {"model": MODEL_NAME, "cache_salt": "s1"}),
    ("completions, tenant-a, cache_salt s1", {"model": "tenant-a", "cache_salt": "s1"}),
]


def readable(x: Any) -> Any:
    """msgpack-decoded value -> JSON (bytes as hex)."""
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, (list, tuple)):
        return [readable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): readable(v) for k, v in x.items()}
    return x


def main() -> int:
    import msgpack
    import zmq

    bed = Bed()
    why = bed.missing()
    if why:
        print(f"capture_events: {why}", file=sys.stderr)
        return 2
    import vllm

    rows = []
    with bed.running(1, num_blocks=64, loras=bed.adapters()) as (engine,):
        for label, extra in REQUESTS:
            body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, **extra}
            status, out = http_json("POST", engine.url + "/v1/completions", body, 60)
            if status != 200:
                raise RuntimeError(f"{label}: {status} {out}")
            details = out["usage"].get("prompt_tokens_details") or {}
            rows.append({"request": label, "body": body, "cached_tokens": details.get("cached_tokens")})
            time.sleep(0.5)  # one scheduler step per request: its own batch
        ctx = zmq.Context()
        try:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(engine.replay)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            batches = []
            while True:
                if not dealer.poll(10_000):
                    raise RuntimeError("the replay endpoint did not answer within 10 s")
                _, topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                batches.append((topic.decode(), int.from_bytes(seq, "big"), payload))
            dealer.close(0)
        finally:
            ctx.term()
    if len(batches) != len(rows):
        raise RuntimeError(f"{len(batches)} batches for {len(rows)} requests")
    out_path = HERE / "events_lora_salt.jsonl"
    with open(out_path, "w") as f:
        for row, (topic, seq, payload) in zip(rows, batches):
            decoded = readable(msgpack.unpackb(payload, raw=False))
            rec = {**row, "vllm": vllm.__version__, "block_size": BLOCK_SIZE, "topic": topic, "seq": seq}
            f.write(json.dumps({**rec, "payload_hex": payload.hex(), "decoded": decoded}) + "\n")
    print(f"{out_path}: {len(batches)} batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

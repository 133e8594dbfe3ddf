"""Records a real vLLM engine's KV-event stream for `compare_index.py --workload vllm-replay`.

One vLLM CPU engine of the real-engine bed (docs/e2e.md: vLLM 0.32, the tiny local model, block size
32, a 256-block cache) serves multi-turn chat sessions over a few shared system prompts, several at
once, so that turns of different sessions interleave in its scheduler steps as they do in production.
Every frame its ZMQ publisher sends ([topic, seq, msgpack batch]) is kept; the batches are written,
in order, to a gzipped JSON file (`benches/data/vllm_events.json.gz` by default).

Run it in the bed's interpreter, under the e2e lock (it starts one ~3.8 GB engine):
    flock /work/e2e.lock .bed/venv/bin/python benches/record_vllm_events.py
"""

from __future__ import annotations

import argparse
import base64
import gzip
import itertools
import json
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
import vllm_bed  # noqa: E402
import zmq  # noqa: E402

MAX_CONTEXT = 1024  # the bed's --max-model-len for a 256-block cache
DEFAULT_OUT = ROOT / "benches" / "data" / "vllm_events.json.gz"


def words() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return sorted(set(re.findall(r"[A-Za-z]{3,}", text)))


class Recorder:
    """A SUB socket on the engine's event endpoint, keeping every frame until `stop()`."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.frames: list[tuple[int, bytes]] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            parts = self.sock.recv_multipart()
            if len(parts) != 3:
                raise RuntimeError(f"expected [topic, seq, payload] frames, got {len(parts)} parts")
            self.frames.append((int.from_bytes(parts[1], "big"), parts[2]))
            self.last = time.monotonic()

    def quiet_for(self, seconds: float, timeout: float) -> None:
        """Waits until no frame has arrived for `seconds` (the engine published what it had)."""
        vllm_bed.poll(lambda: time.monotonic() - self.last >= seconds, timeout, "the event stream to go quiet", interval=0.1)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--sessions", type=int, default=24, help="chat sessions (default 24)")
    ap.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    ap.add_argument("--prompts", type=int, default=4, help="shared system prompts (default 4)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    ap.add_argument("--num-blocks", type=int, default=256, help="the engine's KV cache in blocks (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    bed = vllm_bed.Bed()
    why = bed.missing()
    if why:
        print(f"record_vllm_events: {why}", file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    vocab = words()
    systems = [" ".join(rng.choice(vocab) for _ in range(rng.randrange(60, 160))) for _ in range(a.prompts)]
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": rng.choice(systems)}] for _ in range(a.sessions)]
    # Every turn of every session, shuffled so that sessions interleave, each turn after its previous one.
    order = [s for s in range(a.sessions) for _ in range(a.turns)]
    rng.shuffle(order)
    locks = [threading.Lock() for _ in range(a.sessions)]
    with bed.running(1, num_blocks=a.num_blocks) as (engine,):
        rec = Recorder(engine.events)
        try:
            # A SUB socket misses what is published before its subscription lands: warm up until a
            # frame arrives, then empty the cache and keep only what follows (a self-contained stream).
            poll_n = 0

            def warmed() -> bool:
                nonlocal poll_n
                poll_n += 1
                engine.complete({"messages": [{"role": "user", "content": f"warm-up {poll_n} " * 40}], "max_tokens": 1})
                return bool(rec.frames)

            vllm_bed.poll(warmed, 120, "the first KV event", interval=0.5)
            rec.quiet_for(1.0, timeout=30)
            engine.reset_prefix_cache()
            rec.quiet_for(1.0, timeout=30)
            rec.frames.clear()

            def turn(s: int, k: int) -> None:
                with locks[s]:
                    r = random.Random(a.seed * 1_000_003 + k)
                    chats[s].append({"role": "user", "content": " ".join(r.choice(vocab) for _ in range(r.randrange(10, 60)))})
                    max_tokens = r.randrange(8, 48)
                    if len(engine.tokenize({"messages": chats[s], "add_generation_prompt": True})) + max_tokens > MAX_CONTEXT:
                        # The conversation outgrew the engine's context: a new one over the same system prompt.
                        chats[s][1:-1] = []
                    body: dict[str, Any] = {"messages": chats[s], "max_tokens": max_tokens, "temperature": 0}
                    out = engine.complete(body, timeout=120)
                    chats[s].append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or "ok"})

            with ThreadPoolExecutor(a.concurrency) as pool:
                for f in [pool.submit(turn, s, k) for k, s in enumerate(order)]:
                    f.result()
            rec.quiet_for(2.0, timeout=60)
        finally:
            rec.stop()
    frames = sorted(rec.frames)
    if not frames:
        print("record_vllm_events: the engine published no KV events", file=sys.stderr)
        return 1
    seqs = [s for s, _ in frames]
    gaps = sum(b - a_ - 1 for a_, b in itertools.pairwise(seqs))
    doc = {
        "source": "vLLM 0.32 CPU engine (kvroute's real-engine bed, tests/support/vllm_bed.py), recorded by benches/record_vllm_events.py",
        "block_size": vllm_bed.BLOCK_SIZE,
        "num_blocks": a.num_blocks,
        "requests": len(order),
        "sessions": a.sessions,
        "system_prompts": a.prompts,
        "concurrency": a.concurrency,
        "seq_gaps": gaps,
        "batches": [base64.b64encode(p).decode() for _, p in frames],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(a.out, "wt", encoding="utf-8") as f:
        json.dump(doc, f)
    print(f"recorded {len(frames)} batches ({gaps} missing seqs) from {len(order)} requests -> {a.out} ({a.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Engine faults behind ``kvroute serve`` (exact mode, KV events): one engine SIGKILLed and
then the other stopped with SIGTERM while 4 client threads stream chats through the ``openai`` client.
Every request ends within BOUND seconds with a complete answer or a clear error, none hangs; requests
after the fault go to the live engine; the restarted engine is routed to again."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import signal
import threading
import time
from dataclasses import dataclass

import openai
from vllm_bed import MODEL_NAME, Gateway, poll

BOUND = 10.0  # seconds: the longest any request may take, fault or not (the client's own timeout is 60 s)
THREADS = 4


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    detail: str


class Load:
    """THREADS client threads streaming chats through the gateway until stopped."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(THREADS)]

    def run(self, k: int) -> None:
        c = openai.OpenAI(base_url=self.gw.url + "/v1", api_key="unused", timeout=60.0, max_retries=0)
        n = 0
        while not self.stop.is_set():
            n += 1
            msgs = [
                {"role": "system", "content": f"Conversation {k % 2}: " + "a shared system prompt " * 30},
                {"role": "user", "content": f"thread {k} question {n}"},
            ]
            t0 = time.monotonic()
            try:
                chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=48, stream=True))  # type: ignore[arg-type]
                finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
                # One finish_reason ends a complete answer (random weights may sample EOS: "stop").
                ok, detail = len(finish) == 1 and finish[0] in ("length", "stop"), f"finish={finish}"
            except openai.APIError as e:
                ok, detail = False, f"{type(e).__name__}: {e}"
            with self.lock:
                self.outcomes.append(Outcome(t0, time.monotonic(), ok, detail))

    def count(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def count_since(self, t: float) -> int:
        with self.lock:
            return sum(o.start > t for o in self.outcomes)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(BOUND + 60)
        assert not any(t.is_alive() for t in self.threads), "a client thread hung"


def healthy(gw: Gateway, url: str) -> float:
    return next((v for k, v in gw.metrics().items() if k.startswith("kvroute_worker_healthy{") and f'worker="{url}"' in k), -1.0)


def fault_while_streaming(gw: Gateway, victim: vllm_bed.Engine, survivor: vllm_bed.Engine, sig: int) -> list[Outcome]:
    with Load(gw) as load:
        poll(lambda: load.count() >= 12, 120, "12 requests before the fault")
        t_fault = time.monotonic()
        victim.stop(sig, timeout=30)
        poll(lambda: load.count_since(t_fault + 2.0) >= 16, 120, "16 requests started 2 s after the fault")
    outcomes = load.outcomes
    slow = [o for o in outcomes if o.end - o.start > BOUND]
    assert not slow, f"{len(slow)} requests took over {BOUND} s: {slow[:5]}"
    for o in outcomes:
        # A complete answer (one finish_reason), a clear error, or vLLM's own abort: on SIGTERM the
        # engine shuts down gracefully and ends each running stream with finish_reason "abort".
        assert o.ok or "Error" in o.detail or (sig == signal.SIGTERM and o.detail == "finish=['abort']"), o
    after = [o for o in outcomes if o.start > t_fault + 2.0]
    assert after and all(o.ok for o in after), f"requests after the fault must go to the live engine: {[o for o in after if not o.ok]}"
    assert healthy(gw, victim.url) == 0.0, "the stopped engine is out of routing"
    assert healthy(gw, survivor.url) == 1.0
    return outcomes


def test_engine_killed_and_terminated_while_streaming(live_engines: list[vllm_bed.Engine]) -> None:
    e0, e1 = live_engines
    gw = Gateway(e0.bed, live_engines, ["--tokenizer", str(e0.bed.model)], name="gateway-faults")
    gw.start()
    try:
        for victim, survivor, sig in ((e1, e0, signal.SIGKILL), (e0, e1, signal.SIGTERM)):
            if not victim.running:
                victim.start().wait_ready()
            poll(lambda v=victim: healthy(gw, v.url) == 1.0, 30, f"{victim.name} routed to")
            fault_while_streaming(gw, victim, survivor, sig)
            # The engine comes back (same ports): the gateway's probe routes to it again, and its KV
            # events (a new publisher, sequence from 0) rebuild its part of the index.
            victim.start().wait_ready()
            poll(lambda v=victim: healthy(gw, v.url) == 1.0, 30, f"the gateway to route to the restarted {victim.name}")
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=60.0, max_retries=0)
            for i in range(40):
                msgs = [{"role": "user", "content": f"after restart {victim.name} {i}: " + "fresh prefix " * 20}]
                c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=2)  # type: ignore[arg-type]
                if victim.metric("vllm:request_success_total") > 0:
                    break
            assert victim.metric("vllm:request_success_total") > 0, f"no request reached the restarted {victim.name}"
    finally:
        gw.stop()

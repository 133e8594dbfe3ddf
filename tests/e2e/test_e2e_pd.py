"""PD on real engines: 1 prefill + 1 decode vLLM engine with vLLM's ``ExampleConnector`` on one shared
directory, behind ``kvroute serve --prefill P --decode D --pd-convention vllm`` (exact mode, KV events
from both), with the official ``openai`` client. The engines' own counters say who computed what: the
decode engine loads the prompt's full blocks the prefill engine computed (``external_kv_transfer``), and
with conditional disaggregation a short prompt is prefilled on the decode engine alone."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import json
import random
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from vllm_bed import BLOCK_SIZE, MODEL_NAME, Gateway

LOCAL_PREFILL_MAX_TOKENS = 64  # the conditional gateway prefills prompts with at most this many uncached tokens locally
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@pytest.fixture(scope="module")
def pd_engines(bed: vllm_bed.Bed) -> Iterator[tuple[vllm_bed.Engine, vllm_bed.Engine]]:
    """A prefill and a decode engine (64 blocks each) sharing one ExampleConnector directory."""
    with tempfile.TemporaryDirectory(prefix="kvroute-e2e-pd-") as kvdir:
        cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": kvdir}}
        prefill = bed.engine("prefill", num_blocks=64, extra_args=["--kv-transfer-config", json.dumps(cfg)])
        decode = bed.engine("decode", num_blocks=64, extra_args=["--kv-transfer-config", json.dumps(cfg)])
        try:
            for e in (prefill, decode):
                e.start()
            for e in (prefill, decode):
                e.wait_ready()
            yield prefill, decode
        finally:
            for e in (prefill, decode):
                e.stop(timeout=20)


def pd_gateway(engines: tuple[vllm_bed.Engine, vllm_bed.Engine], name: str, *extra: str) -> Gateway:
    prefill, decode = engines
    args = ["--pd-convention", "vllm", "--tokenizer", str(prefill.bed.model), "--log-level", "warning", *extra]
    return Gateway(prefill.bed, [prefill, decode], args, name=name, prefill=[prefill]).start()


@pytest.fixture(scope="module")
def gateway(pd_engines: tuple[vllm_bed.Engine, vllm_bed.Engine]) -> Iterator[Gateway]:
    gw = pd_gateway(pd_engines, "gateway-pd")
    try:
        yield gw
    finally:
        gw.stop()


@dataclass
class Counts:
    """One engine's prompt-token counters: the total and by source (vLLM 0.32's names)."""

    total: float
    by_source: dict[str, float]

    @classmethod
    def of(cls, e: vllm_bed.Engine) -> Counts:
        m = e.metrics()
        by: dict[str, float] = dict.fromkeys(SOURCES, 0.0)
        total = 0.0
        for key, v in m.items():
            s = re.fullmatch(r'vllm:prompt_tokens_by_source_total\{.*source="([^"]+)".*\}', key)
            if s:
                by[s.group(1)] = by.get(s.group(1), 0.0) + v
            elif key.partition("{")[0] == "vllm:prompt_tokens_total":
                total += v
        return cls(total, by)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.total - other.total, {k: v - other.by_source.get(k, 0.0) for k, v in self.by_source.items()})


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=60.0, max_retries=0)


def long_messages(rng: random.Random, words: int) -> list[dict[str, str]]:
    """A chat prompt of its own (nothing cached anywhere, no file in the shared directory)."""
    vocab = ["prefill", "decode", "block", "cache", "token", "engine", "router", "transfer", "prompt", "shared", "storage", "connector"]
    text = " ".join(rng.choice(vocab) + str(rng.randrange(1000)) for _ in range(words))
    return [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": text}]


def chat(gw: Gateway, msgs: list[dict[str, str]], stream: bool) -> tuple[int, str | None]:
    """One chat request through the gateway: (prompt tokens by the engine's usage, X-Kvroute-Worker)."""
    c = client(gw)
    if stream:
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(raw.parse())
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finish == ["length"], finish
        usage = chunks[-1].usage
        worker = raw.headers.get("x-kvroute-worker")
    else:
        raw = c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=msgs, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        r = raw.parse()
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
        usage = r.usage
        worker = raw.headers.get("x-kvroute-worker")
    assert usage is not None
    return usage.prompt_tokens, worker


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_decode_loads_what_prefill_computed(gateway: Gateway, pd_engines: tuple[vllm_bed.Engine, vllm_bed.Engine], stream: bool) -> None:
    prefill, decode = pd_engines
    rng = random.Random(1100 + stream)
    for i in range(3):
        msgs = long_messages(rng, 120 + 40 * i)
        n = len(prefill.tokenize({"messages": msgs}))
        assert n > 4 * BLOCK_SIZE
        p0, d0 = Counts.of(prefill), Counts.of(decode)
        prompt_tokens, worker = chat(gateway, msgs, stream)
        dp, dd = Counts.of(prefill) - p0, Counts.of(decode) - d0
        assert prompt_tokens == n, "exact mode: the engines' prompt is the one kvroute tokenized"
        assert worker == decode.url, f"the decode engine produced the answer: {worker}"
        assert dp.total == n and dp.by_source["local_compute"] == n, f"the prefill engine computed the whole prompt: {dp}"
        # The decode engine loads every full block but the one holding the prompt's last token, which
        # vLLM always computes (ExampleConnector matches the prompt cut to whole blocks of n - 1 tokens).
        full = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert dd.by_source["external_kv_transfer"] == full, f"request {i} ({n} tokens): decode {dd}, expected {full} by transfer"
        assert dd.total == n and dd.by_source["local_compute"] == n - full, dd


def test_conditional_disaggregation(pd_engines: tuple[vllm_bed.Engine, vllm_bed.Engine]) -> None:
    """A prompt with few uncached tokens is prefilled on the decode engine (path local: the prefill
    engine sees nothing); a long one is disaggregated, in the same gateway."""
    prefill, decode = pd_engines
    gw = pd_gateway(pd_engines, "gateway-pd-conditional", "--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX_TOKENS))
    try:
        rng = random.Random(1200)
        for stream in (False, True):
            # (about 30 tokens: on this bed a first request of a few tokens has killed an engine's worker with SIGILL)
            short = [
                {"role": "user", "content": f"Short question {rng.randrange(10**6)}: why is the sky blue, and why would a router care?"}
            ]
            n = len(decode.tokenize({"messages": short}))
            assert n <= LOCAL_PREFILL_MAX_TOKENS
            p0, d0 = Counts.of(prefill), Counts.of(decode)
            prompt_tokens, worker = chat(gw, short, stream)
            dp, dd = Counts.of(prefill) - p0, Counts.of(decode) - d0
            assert prompt_tokens == n and worker == decode.url
            assert dp.total == 0, f"a short prompt never reaches the prefill engine: {dp}"
            assert dd.total == n and dd.by_source["external_kv_transfer"] == 0 and dd.by_source["local_compute"] == n, dd

            long = long_messages(rng, 150)
            n = len(prefill.tokenize({"messages": long}))
            p0, d0 = Counts.of(prefill), Counts.of(decode)
            prompt_tokens, worker = chat(gw, long, stream)
            dp, dd = Counts.of(prefill) - p0, Counts.of(decode) - d0
            assert prompt_tokens == n and worker == decode.url
            assert dp.total == n, f"a long prompt is prefilled by the prefill engine: {dp}"
            assert dd.by_source["external_kv_transfer"] == (n - 1) // BLOCK_SIZE * BLOCK_SIZE, dd
    finally:
        gw.stop()


KILL_BOUND = 20.0  # seconds: every request in flight when the prefill engine dies ends within this


def test_prefill_engine_killed_mid_request(gateway: Gateway, pd_engines: tuple[vllm_bed.Engine, vllm_bed.Engine]) -> None:
    """The prefill engine SIGKILLed while 3 client threads stream PD chats: every request ends within
    KILL_BOUND with a complete answer or a clear API error (none hangs, none times out); afterwards,
    with no prefill engine left, requests get a prompt 5xx and /health says the deployment is down.
    (Runs last in this module: the prefill engine stays down.)"""
    prefill, _ = pd_engines
    outcomes: list[tuple[float, bool, str]] = []
    lock, stop = threading.Lock(), threading.Event()

    def run(k: int) -> None:
        c = client(gateway)
        rng = random.Random(1300 + k)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                stream = c.chat.completions.create(model=MODEL_NAME, messages=long_messages(rng, 150), max_tokens=32, stream=True)  # type: ignore[arg-type]
                finish = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
                ok, detail = len(finish) == 1 and finish[0] in ("length", "stop"), f"finish={finish}"
            except openai.APIConnectionError as e:  # timeouts included: no answer at all is not a clear error
                ok, detail = False, f"{type(e).__name__}: {e}"
            except openai.APIError as e:
                ok, detail = True, f"clear error {type(e).__name__}: {e}"
            with lock:
                outcomes.append((time.monotonic() - t0, ok, detail))

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    try:
        vllm_bed.poll(lambda: len(outcomes) >= 3, timeout=60, what="3 PD requests answered before the fault")
        prefill.stop(sig=signal.SIGKILL, timeout=10)
        killed = len(outcomes)
        vllm_bed.poll(lambda: len(outcomes) >= killed + 6, timeout=60, what="6 requests ended after the prefill engine died")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=KILL_BOUND + 30)
    assert not any(t.is_alive() for t in threads), "a client request hung"
    slow_or_bad = [o for o in outcomes if o[0] > KILL_BOUND or not o[1]]
    assert not slow_or_bad, f"requests that hung, timed out or ended incomplete without an error: {slow_or_bad}"
    vllm_bed.poll(lambda: vllm_bed.http_json("GET", gateway.url + "/health", timeout=10)[0] == 503, timeout=30, what="/health 503")
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client(gateway).chat.completions.create(model=MODEL_NAME, messages=long_messages(random.Random(1399), 100), max_tokens=4)  # type: ignore[arg-type]
    assert 500 <= err.value.status_code < 600 and time.monotonic() - t0 < KILL_BOUND, (err.value.status_code, err.value.message)

"""``kvroute serve`` on real engines with the official ``openai`` client: completions and chat, streamed
and not, exact mode (the engine's own tokenizer.json and chat template) and approximate mode; every
request the client read to its end counts as a 2xx in ``kvroute_requests_total``."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import re
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from kvroute.fleet.engine_metrics import parse_engine_metrics
from vllm_bed import MODEL_NAME, Gateway

MODES = ["exact", "approximate"]
STREAMED_CHATS = 20  # the Rust plane counted 5 of 20 finished streams as "disconnected" (issue #11)


@pytest.fixture(scope="module", params=MODES)
def gateway(request: pytest.FixtureRequest, engines: list[vllm_bed.Engine]) -> Iterator[Gateway]:
    mode = request.param
    args = ["--metrics-interval", "0.5"]
    if mode == "exact":
        args += ["--tokenizer", str(engines[0].bed.model)]
    gw = Gateway(engines[0].bed, engines, args, name=f"gateway-{mode}")
    gw.start()
    try:
        yield gw
    finally:
        gw.stop()


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=60.0, max_retries=0)


def requests_by_status(gw: Gateway, endpoint: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, v in gw.metrics().items():
        m = re.fullmatch(r'kvroute_requests_total\{endpoint="([^"]+)",status="([^"]+)"\}', key)
        if m and m.group(1) == endpoint:
            out[m.group(2)] = v
    return out


def test_completions_and_chat(gateway: Gateway) -> None:
    c = client(gateway)
    before_chat = requests_by_status(gateway, "/v1/chat/completions")
    before_cmpl = requests_by_status(gateway, "/v1/completions")
    prompt = "Once upon a time, the router sent every request to the engine that had its prefix. " * 4

    r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 8

    parts = list(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text == r.choices[0].text, "greedy decoding: the streamed text equals the unstreamed one"
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"

    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]
    chat = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None and chat.usage.completion_tokens == 6

    for i in range(STREAMED_CHATS):
        turn = [*msgs, {"role": "user", "content": f"Follow-up question number {i}?"}]
        stream = c.chat.completions.create(model=MODEL_NAME, messages=turn, max_tokens=6, temperature=0, stream=True)  # type: ignore[arg-type]
        chunks = list(stream)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finish == ["length"], f"stream {i} did not end with one finish_reason: {finish}"

    chat_counts = requests_by_status(gateway, "/v1/chat/completions")
    cmpl_counts = requests_by_status(gateway, "/v1/completions")
    delta_chat = {k: v - before_chat.get(k, 0) for k, v in chat_counts.items() if v - before_chat.get(k, 0)}
    delta_cmpl = {k: v - before_cmpl.get(k, 0) for k, v in cmpl_counts.items() if v - before_cmpl.get(k, 0)}
    assert delta_chat == {"2xx": 1 + STREAMED_CHATS}, f"every chat request the client read to its end is a 2xx: {delta_chat}"
    assert delta_cmpl == {"2xx": 2}, delta_cmpl


@pytest.mark.parametrize("gateway", ["exact"], indirect=True)
def test_exact_mode_routes_on_the_engines_tokens(gateway: Gateway, engines: list[vllm_bed.Engine]) -> None:
    """The gateway's prompt-token count is the engine's (exact mode) and repeated prefixes are hits."""
    assert "--tokenizer" in gateway.args
    c = client(gateway)
    m0 = gateway.metrics()
    system = "Shared system prompt for the cache test. " * 20
    used = 0
    for i in range(4):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}"}]
        r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=1)  # type: ignore[arg-type]
        assert r.usage is not None
        used += r.usage.prompt_tokens
        assert r.usage.prompt_tokens == len(engines[0].tokenize({"messages": msgs}))
    m1 = gateway.metrics()
    assert m1["kvroute_prompt_tokens_total"] - m0["kvroute_prompt_tokens_total"] == used
    assert m1["kvroute_cached_tokens_total"] > m0["kvroute_cached_tokens_total"], "the repeats should be routed to the cached prefix"


def test_engine_metrics_feed_router_observe(engines: list[vllm_bed.Engine]) -> None:
    """vLLM 0.32's /metrics names the gauges the gateway folds into Router.observe."""
    import urllib.request

    with urllib.request.urlopen(engines[0].url + "/metrics", timeout=10) as r:
        seen = parse_engine_metrics(r.read().decode())
    assert set(seen) == {"waiting", "running", "kv_usage"}, seen
    assert seen["waiting"] == 0 and seen["running"] == 0 and 0.0 <= seen["kv_usage"] <= 1.0


def observed(gw: Gateway) -> dict[str, dict[str, object]]:
    """The engines' last reports as the gateway's Router holds them (``/health``), by engine URL."""
    _, body = vllm_bed.http_json("GET", gw.url + "/health", timeout=10)
    return {w["url"]: w for w in body["workers"]}


def test_engine_load_reaches_router_observe(gateway: Gateway, engines: list[vllm_bed.Engine]) -> None:
    """While a long stream runs, the polled engine's running count (vLLM's own gauge) reaches the Router
    through ``--metrics-interval`` polling, and falls back to 0 once it ends."""
    c = client(gateway)
    done = threading.Event()
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            msgs = [{"role": "user", "content": "Tell a long story about routers."}]
            s = c.chat.completions.create(
                model=MODEL_NAME,
                messages=msgs,
                max_tokens=600,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},  # type: ignore[arg-type]
            )
            for _ in s:
                pass
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    seen_running: set[str] = set()
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline and not seen_running:
        seen_running = {u for u, w in observed(gateway).items() if (w.get("observed_running") or 0) >= 1}
        time.sleep(0.1)
    t.join(timeout=60)
    assert not t.is_alive() and not errors, errors
    assert len(seen_running) == 1 and seen_running <= {e.url for e in engines}, (
        f"no engine reported the running stream: {observed(gateway)}"
    )
    (url,) = seen_running
    vllm_bed.poll(lambda: observed(gateway)[url].get("observed_running") == 0, timeout=15, what="the engine's running count back to 0")

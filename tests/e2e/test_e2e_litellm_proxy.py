"""kvroute inside the real LiteLLM proxy process (``litellm --config config.yaml``, LiteLLM 1.110),
loaded the documented way (``litellm_settings.callbacks: kvroute.integrations.litellm.proxy_handler``,
settings in ``KVROUTE_*``), in front of the bed's vLLM engines with their KV events: conversations stay
on the engine holding their prefix (the engines' own prefix-cache counters say they hit), streamed
and not, and with one engine SIGKILLed every request still succeeds, on the other engine (LiteLLM's
retry, with kvroute excluding the engine that failed)."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import json
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_bed import BLOCK_SIZE, MODEL_NAME, chat_turns

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def documented_config() -> dict[str, Any]:
    """The proxy config of docs/integrations.md ("LiteLLM proxy"), as a user pastes it."""
    text = DOCS.read_text()
    section = text[text.index("### LiteLLM proxy") :]
    start = section.index("```yaml\n") + len("```yaml\n")
    return dict(yaml.safe_load(section[start : section.index("```", start)]))


def write_config(path: Path, engines: list[vllm_bed.Engine]) -> tuple[Path, str]:
    """The documented config with the bed's engines in place of the example's: same keys, same
    router and LiteLLM settings. Returns its path and its model group name."""
    cfg = documented_config()
    models = cfg["model_list"]
    assert len(models) == len(engines) and len({m["model_name"] for m in models}) == 1, models
    for m, e in zip(models, engines):
        assert set(m) == {"model_name", "litellm_params", "model_info"}, m
        assert set(m["litellm_params"]) == {"model", "api_base"} and set(m["model_info"]) == {"id", "kv_events", "kv_events_replay"}, m
        m["litellm_params"].update(model=f"hosted_vllm/{MODEL_NAME}", api_base=e.url + "/v1")
        m["model_info"].update(id=e.name, kv_events=e.events, kv_events_replay=e.replay)
    assert cfg["litellm_settings"] == {"callbacks": "kvroute.integrations.litellm.proxy_handler"}, cfg
    path.write_text(yaml.safe_dump(cfg))
    return path, str(models[0]["model_name"])


@dataclass
class Proxy:
    server: vllm_bed.LiteLLMProxy
    group: str  # the config's model group name


@pytest.fixture(scope="module")
def proxy(engines: list[vllm_bed.Engine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    config, group = write_config(tmp_path_factory.mktemp("litellm-proxy") / "config.yaml", engines)
    env = {
        "KVROUTE_TOKENIZER": str(engines[0].bed.model),
        "KVROUTE_BLOCK_SIZE": str(BLOCK_SIZE),
        "KVROUTE_METRICS_INTERVAL": "0.5",
        # SGLang's cache_aware rule (the best overlap unless loads differ by > 64 requests), as in
        # test_e2e_ray.py: LiteLLM reports a request's success after the client has its answer, so
        # the default (capacity, on slack's cost) may see the previous turn still in flight and, on this bed's tiny model
        # where a miss is cheap, move a conversation; this module checks the proxy wiring, not the policy.
        "KVROUTE_POLICY": "cache_aware",
    }
    server = vllm_bed.LiteLLMProxy(engines[0].bed, config, env=env).start()
    try:
        yield Proxy(server, group)
    finally:
        server.stop()


def chat(proxy: Proxy, msgs: list[dict[str, str]], stream: bool) -> tuple[str, dict[str, object] | bytes]:
    """One chat completion through the proxy: the deployment that served it (LiteLLM's
    ``x-litellm-model-id``, our ``model_info.id``) and the answer (JSON, or the raw SSE stream)."""
    body = {"model": proxy.group, "messages": msgs, "max_tokens": 4, "temperature": 0, "stream": stream}
    req = urllib.request.Request(
        proxy.server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **proxy.server.auth},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        served = r.headers["x-litellm-model-id"]
        raw = r.read()
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
        finishes = [
            c["choices"][0]["finish_reason"]
            for line in raw.splitlines()
            if line.startswith(b"data: {") and (c := json.loads(line[6:]))["choices"] and c["choices"][0].get("finish_reason")
        ]
        assert finishes and finishes[-1] in ("length", "stop"), raw[-300:]
        return served, raw
    out = json.loads(raw)
    assert out["choices"][0]["finish_reason"] in ("length", "stop"), out
    return served, out


def test_proxy_routes_by_prefix(proxy: Proxy, live_engines: list[vllm_bed.Engine]) -> None:
    by_name = {e.name: e for e in live_engines}
    homes = {conv: chat(proxy, chat_turns(conv, 0), stream=False)[0] for conv in range(30, 34)}
    assert set(homes.values()) == set(by_name), f"four distinct prefixes spread over both engines: {homes}"
    hits0 = sum(e.metric("vllm:prefix_cache_hits_total") for e in live_engines)
    for turn in (1, 2):
        for conv in homes:
            served, _ = chat(proxy, chat_turns(conv, turn), stream=turn == 1)
            assert served == homes[conv], f"conversation {conv} turn {turn} left its prefix's engine {homes[conv]} for {served}"
    hits = sum(e.metric("vllm:prefix_cache_hits_total") for e in live_engines) - hits0
    # Each follow-up turn reuses at least its conversation's system prompt (several blocks).
    assert hits >= 8 * 2 * BLOCK_SIZE, f"engine-side prefix hits {hits} tokens: the follow-up turns missed their prefix"


def test_proxy_fails_over_past_a_dead_engine(proxy: Proxy, live_engines: list[vllm_bed.Engine]) -> None:
    by_name = {e.name: e for e in live_engines}
    home_name, _ = chat(proxy, chat_turns(39, 0), stream=False)
    home = by_name[home_name]
    other = next(e for e in live_engines if e is not home)
    done0 = other.metric("vllm:request_success_total")
    home.stop(signal.SIGKILL)  # by its PID (and its engine core's); live_engines restarts it afterwards
    for turn in range(1, 5):
        served, _ = chat(proxy, chat_turns(39, turn), stream=turn % 2 == 0)
        assert served == other.name, f"turn {turn} was answered by {served}, not the live engine {other.name}"
    vllm_bed.poll(lambda: other.metric("vllm:request_success_total") >= done0 + 4, 10.0, "the live engine counting the 4 requests")

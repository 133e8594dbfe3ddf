"""EngineRouter and cache identity: engines serve sets of models (given, or read from their
/v1/models), a request goes only to engines serving its model, an adapter's or salted prompt is
keyed apart, and the router checks itself against the usage a host hands back."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from exact_tokenizers import build_word_level
from kvroute.integrations.engine_router import EngineRouter, NoCandidates


def test_requests_go_to_engines_serving_their_model_and_adapters_key_the_prompt() -> None:
    er = EngineRouter(block_size=16)
    er.add("a", "http://127.0.0.1:1", models=["base", "ad"], adapters=["ad"])
    er.add("b", "http://127.0.0.1:2", models=["base"])
    er.add("c", "http://127.0.0.1:3", models=["other"])
    prompt = "shared prefix " * 80
    for _ in range(5):
        lease = er.lease({"model": "ad", "prompt": prompt}, chat=False)
        assert er.engine_of(lease).key == "a"
        er.leases.finish(lease.ticket)
        lease = er.lease({"model": "other", "prompt": prompt}, chat=False)
        assert er.engine_of(lease).key == "c"
        er.leases.finish(lease.ticket)
    # The adapter's blocks were stored under its identity: the base model is not credited with them.
    lease = er.lease({"model": "base", "prompt": prompt}, chat=False, candidates=["a"])
    assert lease.decision.overlap_blocks == 0
    er.leases.finish(lease.ticket)
    lease = er.lease({"model": "ad", "prompt": prompt, "cache_salt": "t1"}, chat=False)
    assert lease.decision.overlap_blocks == 0, "a salt is another identity"
    er.leases.finish(lease.ticket)
    lease = er.lease({"model": "ad", "prompt": prompt}, chat=False)
    assert lease.decision.overlap_blocks > 0
    er.leases.finish(lease.ticket)
    # The host's own name for the model wins over the body's (LiteLLM renames them).
    lease = er.lease({"model": "my-group", "prompt": prompt}, chat=False, model="other")
    assert er.engine_of(lease).key == "c"
    with pytest.raises(NoCandidates, match="serves model 'nosuch'"):
        er.lease({"model": "nosuch", "prompt": prompt}, chat=False)
    with pytest.raises(ValueError, match="not among its models"):
        er.set_models("b", ["base"], ["ad"])
    with pytest.raises(ValueError, match="non-empty"):
        er.set_models("b", [])


@pytest.fixture
def models_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A /v1/models endpoint answering what ``state["data"]`` holds (vLLM's shape)."""
    state: dict[str, Any] = {"data": [{"id": "base", "object": "model", "parent": None}]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"object": "list", "data": state["data"]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", state
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_models_are_read_from_the_engine(models_server: tuple[str, dict[str, Any]]) -> None:
    url, state = models_server
    er = EngineRouter(block_size=16)
    e = er.add("a", url)
    assert er.refresh_models(e)
    assert er.models("a") == (frozenset({"base"}), frozenset())
    state["data"] = [*state["data"], {"id": "tenant-a", "object": "model", "parent": "base"}]
    assert er.refresh_models(e)
    assert er.models("a") == (frozenset({"base", "tenant-a"}), frozenset({"tenant-a"}))
    state["data"] = "not a list"
    assert not er.refresh_models(e), "a bad answer leaves the last list"
    assert er.models("a") is not None
    er.remove("a")
    assert er.models("a") is None


def test_check_usage_compares_predictions_with_the_engines_usage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tok = build_word_level(tmp_path)
    er = EngineRouter(block_size=4, tokenizer=tok)
    er.add("a", "http://127.0.0.1:1", models=["m"])
    body = {"model": "m", "prompt": "the sky is blue " * 8}
    first = er.lease(body, chat=False)
    n = first.routed_tokens
    assert n is not None and first.decision.overlap_blocks == 0
    assert er.check_usage(first, {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}) == "match"
    er.leases.finish(first.ticket)
    again = er.lease(body, chat=False)
    predicted = min(again.decision.overlap_blocks * 4, (n - 1) // 4 * 4)
    assert predicted > 0
    assert er.check_usage(again, {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": predicted}}) == "match"
    assert er.check_usage(again, {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}) == "over"
    assert er.check_usage(again, {"prompt_tokens": n}) is None, "no cached_tokens: nothing to compare"
    assert er.check_usage(again, None) is None

    class Usage:  # LiteLLM hands back objects, not dicts
        prompt_tokens = n + 1
        prompt_tokens_details = type("D", (), {"cached_tokens": 0})()

    with caplog.at_level(logging.WARNING, logger="kvroute.integrations.engine_router"):
        outcomes = [er.check_usage(again, Usage()) for _ in range(8)]
    assert outcomes == ["prompt_length"] * 8
    alarms = [r for r in caplog.records if "kvroute self-check" in r.getMessage()]
    assert len(alarms) == 1 and "tokenizer or the chat template" in alarms[0].getMessage()
    assert er.check.snapshot()["alarms"] == 1

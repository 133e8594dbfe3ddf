"""docs/integrations.md's Python examples run as written, on mock engines (kvroute.gateway.mock) and
fake KV-event publishers on 127.0.0.1 in place of the guide's 10.0.0.x engines, and a local tokenizer
in place of /models/...: the LiteLLM Router example prints the engine's answer; the Ray Serve app from
``build_app`` and the one wired from its public pieces serve a chat through kvroute's router. Skips
without LiteLLM / Ray Serve (the real-engine bed has both: ``make e2e``)."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import

import contextlib
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("zmq")

from exact_tokenizers import build_word_level
from fake_engine import FakePublisher
from kvroute.gateway.mock import MockWorker
from loop_thread import LoopThread
from test_guides import python_block

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def mock_answer(messages: list[dict[str, str]], max_tokens: int = 16) -> str:
    """What a mock engine answers a chat: ``max_tokens`` words derived from the prompt's text."""
    text = "".join(f"{m['role']}:{m['content']}\n" for m in messages)
    seed = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    return "".join(f" {seed}-{i}" for i in range(max_tokens))


class Engines:
    """Two mock engines serving the guide's model, on an event loop of their own, each with a KV-event
    publisher (PUB + replay) as vLLM's ``--kv-events-config`` gives it. ``fill(code)`` puts their
    addresses, and a local tokenizer, where the guide has 10.0.0.1 / 10.0.0.2 and /models/..."""

    def __init__(self, tmp: Path) -> None:
        self.loop = LoopThread()
        self.workers = [MockWorker(f"engine-{i}", models=(MODEL,)) for i in (1, 2)]
        for w in self.workers:
            self.loop.run(w.start(), 10)
        self.publishers = [FakePublisher() for _ in self.workers]
        self.tokenizer = build_word_level(tmp / "tokenizer")

    def fill(self, code: str) -> str:
        for i, (w, p) in enumerate(zip(self.workers, self.publishers), start=1):
            code = code.replace(f"http://10.0.0.{i}:8000", w.url)
            code = code.replace(f"tcp://10.0.0.{i}:5557", p.endpoint).replace(f"tcp://10.0.0.{i}:5558", p.replay_endpoint)
        # The LiteLLM example builds its engines in a comprehension over (1, 2).
        code = code.replace('f"http://10.0.0.{i}:8000/v1"', 'ENGINE_URL[i] + "/v1"')
        code = code.replace('f"tcp://10.0.0.{i}:5557"', "KV_EVENTS[i]").replace('f"tcp://10.0.0.{i}:5558"', "KV_REPLAY[i]")
        code = code.replace("/models/Llama-3.1-8B-Instruct", self.tokenizer)
        assert "10.0.0." not in code and "/models/" not in code, code
        return code

    def scope(self) -> dict[str, Any]:
        return {
            "__name__": "guide_example",
            "ENGINE_URL": {i: w.url for i, w in enumerate(self.workers, start=1)},
            "KV_EVENTS": {i: p.endpoint for i, p in enumerate(self.publishers, start=1)},
            "KV_REPLAY": {i: p.replay_endpoint for i, p in enumerate(self.publishers, start=1)},
        }

    def served(self) -> int:
        return sum(w.requests for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            self.loop.run(w.stop(), 10)
        self.loop.close()
        for p in self.publishers:
            p.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Engines]:
    e = Engines(tmp_path)
    try:
        yield e
    finally:
        e.close()


def test_litellm_router_example_prints_the_engines_answer(engines: Engines) -> None:
    litellm = pytest.importorskip("litellm")
    pytest.importorskip("tokenizers")
    code = python_block("integrations.md", "### Python `litellm.Router`")
    from kvroute.integrations.litellm import KvrouteCallback

    scope = engines.scope()
    saved = list(litellm.callbacks)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(engines.fill(code), "docs/integrations.md", "exec"), scope)
        # What the example prints: the engine's answer.
        assert out.getvalue() == mock_answer([{"role": "user", "content": "Hello"}]) + "\n", out.getvalue()
        assert engines.served() == 1
        (callback,) = [c for c in litellm.callbacks if isinstance(c, KvrouteCallback)]
        try:
            # kvroute made the pick, in exact mode (the local tokenizer), over the two engines of the model list.
            assert callback.picks == 1 and callback.fallbacks == 0
            assert callback.engines.prompter.mode == "exact"
            assert sorted(e.key for e in callback.engines.engines()) == ["engine-1", "engine-2"]
            # And subscribed to both engines' KV events: a subscription reached each publisher.
            for p in engines.publishers:
                p.wait_for_subscriber(timeout=10)
        finally:
            callback.engines.close()
    finally:
        litellm.callbacks[:] = saved


def _chat(port: int) -> dict[str, Any]:
    import urllib.request

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("which", ["build_app", "pieces"])
def test_ray_serve_examples_serve_a_chat_through_kvroute(engines: Engines, which: str) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    from serve_app import ServeApp

    build_app_code = python_block("integrations.md", "## Ray Serve")
    pieces_code = python_block("integrations.md", "`build_app` is a convenience")
    scope = engines.scope()
    # The pieces example continues the first: it uses its `engines` list.
    exec(compile(engines.fill(build_app_code), "docs/integrations.md", "exec"), scope)
    if which == "pieces":
        exec(compile(engines.fill(pieces_code), "docs/integrations.md", "exec"), scope)
    replicas = len(scope["engines"]) + 2  # both examples: one per engine, two ingress replicas
    # Serve's default of one CPU per replica, as the guide says: the cluster is told it has one per replica.
    app = ServeApp(scope["app"], num_cpus=replicas, timeout=60.0)
    try:
        answer = _chat(app.port)
        assert answer["choices"][0]["message"]["content"] == mock_answer([{"role": "user", "content": "Hello"}])
        assert engines.served() == 1
        routers = [r for rs in app.routers().values() for r in rs]
        assert routers, "no kvroute router in the ingress replicas"
    finally:
        app.close()

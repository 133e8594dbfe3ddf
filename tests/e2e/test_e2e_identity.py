"""Cache identity on real engines: two vLLM engines serving the base model and two LoRA adapters
(tenant-a, tenant-b; ``Bed.adapters``), a gateway in exact mode fed by their KV events, and requests
to each model with and without ``cache_salt``, interleaved. For every request the gateway's
prediction equals vLLM's ``cached_tokens`` (its self-check counts every one a match), through
evictions; a request is never credited with another identity's KV. A deliberately wrong block size
or chat template raises the self-check's alarm within 20 requests."""

# ruff: noqa: E402
from __future__ import annotations

import vllm_bed

vllm_bed.skip_unless_bed()

import json
import random
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import kvroute
from kvroute.gateway.app import Gateway, make_gateway
from loop_thread import LoopThread
from test_e2e_index import EVENT_WAIT, expected_cached, words
from vllm_bed import ADAPTER_NAMES, BLOCK_SIZE, MODEL_NAME, http_json, poll

MODELS = (MODEL_NAME, *ADAPTER_NAMES)


class LiveGateway:
    """The gateway in this process (its control plane's event loop on a thread of its own), so a
    test can read its index and self-check between requests."""

    def __init__(self, engines: list[vllm_bed.Engine], *, tokenizer: Path, block_size: int = BLOCK_SIZE) -> None:
        self.loop = LoopThread("gateway-loop")
        self.router = kvroute.Router(preset="gateway", block_size=block_size)
        self.gw: Gateway = make_gateway(
            self.router,
            [e.url for e in engines],
            tokenizer=str(tokenizer),
            kv_events={e.url: e.events for e in engines},
            kv_events_replay={e.url: e.replay for e in engines},
            health_interval=0.5,
        )
        self.url = self.loop.run(self.gw.start("127.0.0.1", 0), 60)
        self.ids = {w.url: w.id for w in self.gw.workers.values()}

    def close(self) -> None:
        try:
            self.loop.run(self.gw.stop(), 30)
        finally:
            self.loop.close()

    @property
    def check(self) -> dict[str, Any]:
        return dict(self.gw.metrics()["prefix_check"])


def _send(g: LiveGateway, what: str, body: dict[str, Any], rows: list[str], wait: bool = True) -> tuple[int, int, int]:
    """One request through the gateway: (predicted, actual, worker). ``wait``: until the index holds its blocks."""
    chat = "messages" in body
    full = {**body, "max_tokens": 1, "temperature": 0}
    hashes, num_tokens, _ = g.gw.plane.prompt(json.dumps(full).encode(), chat)
    before = g.router.index.match(hashes).to_dict()
    req = urllib.request.Request(
        g.url + ("/v1/chat/completions" if chat else "/v1/completions"),
        data=json.dumps(full).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        worker = g.ids[r.headers["X-Kvroute-Worker"]]
        usage = json.loads(r.read())["usage"]
    predicted = expected_cached(before.get(worker, 0), num_tokens)
    actual = usage["prompt_tokens_details"]["cached_tokens"]
    rows.append(f"{what}: worker {worker}, {num_tokens} tokens, predicted {predicted}, vLLM cached {actual}, index {before}")
    if wait:
        index = g.router.index
        poll(lambda: index.match(hashes).get(worker, 0) >= len(hashes), EVENT_WAIT, f"{what}'s blocks on worker {worker}")
    return predicted, actual, worker


def _workload(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` requests over 2 shared prefixes, each to a model (base or an adapter) and with or
    without a salt, chat and completions: the same tokens recur under every identity."""
    rng = random.Random(seed)
    vocab = words()
    prefixes = [f"Shared prompt {k}. " + " ".join(rng.choice(vocab) for _ in range(rng.randint(90, 140))) for k in range(2)]
    out = []
    for i in range(n):
        k = rng.randrange(len(prefixes))
        model = rng.choice(MODELS)
        salt = rng.choice([None, None, "tenant-1"])
        tail = " ".join(rng.choice(vocab) for _ in range(rng.randint(6, 30)))
        if i % 2:
            body: dict[str, Any] = {"prompt": prefixes[k] + f"\nQ{i}: " + tail}
        else:
            body = {"messages": [{"role": "system", "content": prefixes[k]}, {"role": "user", "content": f"Q{i}: {tail}"}]}
        body["model"] = model
        if salt:
            body["cache_salt"] = salt
        out.append((f"req{i}/p{k}/{model}/{salt or '-'}/{'completion' if i % 2 else 'chat'}", body))
    return out


def test_predictions_equal_vllm_cached_tokens_under_every_identity(live_engines: list[vllm_bed.Engine]) -> None:
    for e in live_engines:
        e.reset_prefix_cache()
    g = LiveGateway(live_engines, tokenizer=live_engines[0].bed.model)
    rows: list[str] = []
    try:
        # /v1/models: the union of what the engines serve, adapters with their parent.
        status, models = http_json("GET", g.url + "/v1/models")
        assert status == 200 and {m["id"]: m["parent"] for m in models["data"]} == {
            MODEL_NAME: None,
            "tenant-a": MODEL_NAME,
            "tenant-b": MODEL_NAME,
        }
        status, out = http_json("POST", g.url + "/v1/completions", {"model": "tenant-z", "prompt": "hi", "max_tokens": 1})
        assert status == 404 and out["error"]["code"] == 404, out
        # The resets went out on each engine's next step: a request per engine publishes them.
        for w, e in enumerate(live_engines):
            e.complete({"prompt": f"sync {w} " + "x " * 40})
        before_check = g.check
        mismatches = []
        cross = 0
        for what, body in _workload(60, 20261205):
            predicted, actual, _ = _send(g, what, body, rows)
            if predicted != actual:
                mismatches.append(rows[-1])
            cross += actual > 0
        check = g.check
        n = check["outcomes"]["match"] - before_check["outcomes"]["match"]
        assert not mismatches, "\n".join(mismatches)
        assert n == 60 and check["outcomes"]["over"] == check["outcomes"]["under"] == check["outcomes"]["prompt_length"] == 0, check
        assert check["alarms"] == 0
        # The workload hits (each identity reuses its own KV) and overflows the 2 x 31-block caches.
        stats = g.gw.fleet.subscriber_stats() or {}
        assert cross >= 12, "\n".join(rows)
        assert stats.get("blocks_removed", 0) > 0, stats
    finally:
        g.close()


def test_same_tokens_under_another_identity_are_not_credited(live_engines: list[vllm_bed.Engine]) -> None:
    """One prompt under five identities, sent to the engine that holds it under the first: only a
    repeat of the same identity is credited, and vLLM agrees (0 cached for the others)."""
    for e in live_engines:
        e.reset_prefix_cache()
    g = LiveGateway(live_engines, tokenizer=live_engines[0].bed.model)
    rows: list[str] = []
    try:
        for w, e in enumerate(live_engines):
            e.complete({"prompt": f"sync {w} " + "y " * 40})
        prompt = "Identity check. " + " ".join(words()[:120])
        ids = [{"model": MODEL_NAME}, {"model": "tenant-a"}, {"model": "tenant-b"}, {"model": MODEL_NAME, "cache_salt": "s1"}]
        ids.append({"model": "tenant-a", "cache_salt": "s1"})
        for body in ids:
            p1, a1, w1 = _send(g, f"first {body}", {**body, "prompt": prompt}, rows)
            assert (p1, a1) == (0, 0), rows[-1]
            p2, a2, w2 = _send(g, f"repeat {body}", {**body, "prompt": prompt}, rows)
            assert p2 == a2 > 0 and w2 == w1, rows[-1]
        assert g.check["outcomes"]["over"] == 0 and g.check["alarms"] == 0, g.check
    finally:
        g.close()


def _alarm_within(g: LiveGateway, bodies: list[dict[str, Any]], limit: int = 20) -> int:
    rows: list[str] = []
    for i, body in enumerate(bodies[:limit]):
        _send(g, f"misconfigured {i}", body, rows, wait=False)
        if g.check["alarms"]:
            return i + 1
    raise AssertionError(f"no alarm within {limit} requests: {g.check}\n" + "\n".join(rows))


def _repeats(n: int) -> list[dict[str, Any]]:
    """One long prefix with a new question each time: every request after the first is a real cache hit."""
    prefix = "Repeat. " + " ".join(words()[:150])
    return [{"model": MODEL_NAME, "prompt": prefix + f" q{i}"} for i in range(n)]


def test_a_wrong_block_size_raises_the_alarm(live_engines: list[vllm_bed.Engine]) -> None:
    g = LiveGateway(live_engines, tokenizer=live_engines[0].bed.model, block_size=16)
    try:
        n = _alarm_within(g, _repeats(20))
        alarm = g.check["last_alarm"]
    finally:
        g.close()
    assert "block size is not the engines'" in alarm, alarm
    print(f"alarm after {n} requests: {alarm}")


def test_a_wrong_chat_template_raises_the_alarm(live_engines: list[vllm_bed.Engine], tmp_path: Path) -> None:
    model = live_engines[0].bed.model
    wrong = tmp_path / "tokenizer"
    wrong.mkdir()
    shutil.copy(model / "tokenizer.json", wrong / "tokenizer.json")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}" + cfg["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    (wrong / "tokenizer_config.json").write_text(json.dumps(cfg))
    g = LiveGateway(live_engines, tokenizer=wrong)
    try:
        bodies = [
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Question {i}: " + " ".join(words()[i : i + 60])}]}
            for i in range(20)
        ]
        n = _alarm_within(g, bodies)
        alarm = g.check["last_alarm"]
    finally:
        g.close()
    assert "tokenizer or the chat template" in alarm, alarm
    print(f"alarm after {n} requests: {alarm}")

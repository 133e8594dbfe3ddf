"""Gateway PD mode in both handshakes (vLLM's kv_transfer_params, SGLang's bootstrap), exact-token
mode with a tokenizer built here, and the ``kvroute serve`` argument handling."""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("aiohttp")

import kvroute
from gateway_harness import (
    Cluster,
    Rendezvous,
    assert_no_leak,
    http_server,  # noqa: F401  (the fixture: each test runs on both HTTP servers)
    poll,
    run,
)
from kvroute.gateway.prompt import ApproxCache, ApproxPrompter, ExactPrompter

pytestmark = pytest.mark.usefixtures("http_server")

CHAT = {"messages": [{"role": "system", "content": "be brief " * 50}, {"role": "user", "content": "why is the sky blue?"}], "max_tokens": 6}


def test_pd_vllm_convention_two_steps() -> None:
    async def scenario() -> None:
        async with Cluster(prefill=2, decode=2, pd_convention="vllm") as c:
            for m in c.mocks:
                m.keep_bodies = True
            for path, body in (
                ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
                ("/v1/completions", {"prompt": "once upon a time " * 30, "max_tokens": 5, "max_completion_tokens": 5}),
            ):
                status, headers, data = await c.post(path, body)
                assert status == 200, data
                decode = c.mock_by_url(headers["X-Kvroute-Worker"])
                assert decode in c.decode
                assert data == decode.outputs[-1]
                [prefill] = [m for m in c.prefill if m.bodies and m.bodies[-1].get("kv_transfer_params", {}).get("do_remote_decode")]
                pb = prefill.bodies.pop()
                assert pb["max_tokens"] == 1 and pb["stream"] is False and "stream_options" not in pb
                assert pb.get("max_completion_tokens", 1) == 1
                assert pb["kv_transfer_params"] == {
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "remote_host": None,
                    "remote_port": None,
                }
                returned = json.loads(prefill.outputs[-1])["kv_transfer_params"]
                db = decode.bodies[-1]
                assert db["kv_transfer_params"] == returned and returned["remote_engine_id"] == prefill.name
                assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == body
                assert decode.prompt_tokens == 0, "the decode worker recomputed the prompt instead of receiving its KV"
            assert_no_leak(c)

    run(scenario())


def test_pd_sglang_convention_bootstrap_to_both() -> None:
    async def scenario() -> None:
        rv = Rendezvous()
        async with Cluster(prefill=2, decode=1, pd_convention="sglang", rendezvous=rv) as c:
            for m in c.mocks:
                m.keep_bodies = True
            status, headers, data = await c.post("/v1/chat/completions", {**CHAT, "stream": True})
            assert status == 200, data
            [decode] = c.decode
            assert headers["X-Kvroute-Worker"] == decode.url and data == decode.outputs[-1]
            [prefill] = [m for m in c.prefill if m.bodies]
            pb, db = prefill.bodies[-1], decode.bodies[-1]
            assert pb == db, "prefill and decode must get the same tagged request"
            assert pb["bootstrap_host"] == "127.0.0.1" and pb["bootstrap_port"] == 8998
            assert 0 <= pb["bootstrap_room"] < 2**63
            assert rv.owners[pb["bootstrap_room"]] == ("127.0.0.1", 8998)
            assert {k: v for k, v in pb.items() if not k.startswith("bootstrap_")} == {**CHAT, "stream": True}

            # A failing prefill is retried with a fresh room on the other prefill server.
            body = {"prompt": "pd retry " * 40, "max_tokens": 3}
            p = c.gw.prompter.prompt(body, False)
            c.router.index.store(c.worker_id(prefill), p.hashes)
            prefill.fail_next, prefill.healthy = 1, False
            status, headers, data = await c.post("/v1/completions", body)
            assert status == 200, data
            other = next(m for m in c.prefill if m is not prefill)
            assert other.bodies[-1]["bootstrap_room"] != pb["bootstrap_room"]
            assert c.metrics.retries == 1
            assert_no_leak(c)

    run(scenario())


def test_pd_sglang_prefill_bootstrap_port_from_flag() -> None:
    from kvroute.gateway.cli import add_serve_parser, build_app

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    a = parser.parse_args(
        [
            "serve",
            "--prefill",
            "http://p0:30000",
            "9000",
            "--prefill",
            "http://p1:30000",
            "--decode",
            "http://d0:30000",
            "--pd-convention",
            "sglang",
        ]
    )
    app = build_app(a)
    from kvroute.gateway import GATEWAY_KEY

    ports = {w.url: w.cfg.bootstrap_port for w in app[GATEWAY_KEY].workers.values()}
    assert ports == {"http://p0:30000": 9000, "http://p1:30000": 8998, "http://d0:30000": None}
    for bad in (["serve"], ["serve", "--prefill", "http://p:1"], ["serve", "--worker", "http://w:1", "--kv-events", "nonsense"]):
        with pytest.raises(argparse.ArgumentTypeError):
            build_app(parser.parse_args(bad))


def _build_tokenizer(tmp_path) -> str:  # type: ignore[no-untyped-def]
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    words = ["<s>", "</s>", "[UNK]", "<|user|>", "<|assistant|>", "<|system|>"] + [
        w for w in ["the", "sky", "is", "blue", "why", "be", "brief", "once", "upon", "a", "time"]
    ]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    return str(tmp_path)


def test_exact_mode_hashes_what_the_engine_sees(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = _build_tokenizer(tmp_path)
    ep = ExactPrompter(path, block_size=4, seed=1337)
    rendered = ep.render_chat(CHAT)
    assert rendered.startswith("<s><|system|> be brief") and rendered.endswith("<|assistant|>")
    ids = ep.tokenizer.encode(rendered, add_special_tokens=False).ids
    p = ep.prompt(CHAT, chat=True)
    assert p.num_tokens == len(ids) and p.output_tokens == 6
    np.testing.assert_array_equal(p.hashes, kvroute.block_hashes(ids, 4, seed=1337))
    q = ep.prompt({"prompt": [5, 6, 7, 8, 9]}, chat=False)
    np.testing.assert_array_equal(q.hashes, kvroute.block_hashes([5, 6, 7, 8], 4))

    async def scenario() -> None:
        # KV events would fill the index; store the engine-side hashes directly in their place.
        async with Cluster(3, tokenizer=path, insert_decisions=False, router={"block_size": 4}) as c:
            target = c.mocks[2]
            c.router.index.store(c.worker_id(target), kvroute.block_hashes(ids, 4))
            status, headers, data = await c.post("/v1/chat/completions", CHAT)
            assert status == 200 and headers["X-Kvroute-Worker"] == target.url, data
            assert len(c.router.index) == len(p.hashes), "insert_decisions=False must leave the index to KV events"
            assert_no_leak(c)

    run(scenario())


def test_kv_events_feed_the_index_in_exact_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An engine's published KV events (vLLM wire format) reach the router's index through
    ``kv_events``; a request for the cached prompt goes to that engine, and the gateway inserts
    nothing of its own."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from fake_engine import FakeEngine, FakePublisher

    path = _build_tokenizer(tmp_path)
    ep = ExactPrompter(path, block_size=4, seed=1337)
    ids = ep.tokenizer.encode(ep.render_chat(CHAT), add_special_tokens=False).ids
    pub = FakePublisher()

    async def scenario() -> None:
        async with Cluster(3, tokenizer=path, router={"block_size": 4}, kv_events_for={1: pub.endpoint}) as c:
            await asyncio.get_running_loop().run_in_executor(None, pub.wait_for_subscriber, 10.0)
            engine = FakeEngine("vllm", block_size=4, capacity=10_000)
            pub.publish(engine.encode(engine.process(list(ids))))
            target = c.worker_id(c.mocks[1])
            await poll(lambda: c.router.index.num_blocks(target) == len(ids) // 4, what="KV events applied to the index")
            status, headers, data = await c.post("/v1/chat/completions", CHAT)
            assert status == 200 and headers["X-Kvroute-Worker"] == c.mocks[1].url, data
            assert c.gw.approx is None and len(c.router.index) == len(ids) // 4
            assert_no_leak(c)

    try:
        run(scenario())
    finally:
        pub.close()


def test_exact_mode_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        ExactPrompter(str(tmp_path / "missing"), 16, 1337)
    path = _build_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    ep = ExactPrompter(path, 16, 1337)
    from kvroute.gateway import BadRequest

    with pytest.raises(BadRequest, match="no chat_template"):
        ep.prompt(CHAT, chat=True)


def test_approx_prompter_blocks_and_ttl_cache() -> None:
    ap = ApproxPrompter(block_size=4, seed=1337)
    text = "abcdefghijklmnopqrstuvwxyz0123456789"  # 36 bytes = 9 pseudo-tokens = 2 full blocks
    p = ap.prompt({"prompt": text}, chat=False)
    assert p.num_tokens == 9 and len(p.hashes) == 2
    longer = ap.prompt({"prompt": text + "more text here, more"}, chat=False)
    np.testing.assert_array_equal(longer.hashes[:2], p.hashes)
    chat1 = ap.prompt({"messages": [{"role": "user", "content": "x" * 64}]}, chat=True)
    chat2 = ap.prompt({"messages": [{"role": "user", "content": "x" * 64}, {"role": "assistant", "content": "y" * 64}]}, chat=True)
    np.testing.assert_array_equal(chat2.hashes[: len(chat1.hashes) - 1], chat1.hashes[:-1])

    idx = kvroute.KvIndex()
    cache = ApproxCache(idx, ttl=10.0)
    cache.insert(0, longer.hashes, now=0.0)
    cache.insert(0, p.hashes, now=5.0)  # refreshes the shared first two blocks
    assert idx.num_blocks(0) == len(longer.hashes)
    assert cache.expire(9.0) == 0
    assert cache.expire(10.0) == len(longer.hashes) - 2  # only the blocks nobody touched since t=0
    assert idx.num_blocks(0) == 2
    assert cache.expire(15.0) == 2 and idx.num_blocks(0) == 0 and len(cache) == 0
    cache.insert(1, p.hashes, now=20.0)
    cache.drop_worker(1)
    assert idx.num_blocks(1) == 0 and len(cache) == 0
    with pytest.raises(ValueError, match="ttl"):
        ApproxCache(idx, ttl=0)


def test_kvroute_serve_process_end_to_end() -> None:
    """`kvroute serve` as a real process in front of a mock engine: health, a streamed request, admin refusal."""
    import os
    import socket
    import sys

    import aiohttp
    from kvroute.gateway.mock import MockWorker

    async def scenario() -> None:
        mock = MockWorker("solo")
        await mock.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvroute.cli",
            "serve",
            "--worker",
            mock.url,
            "--port",
            str(port),
            "--log-level",
            "warning",
            env={**os.environ, "KVROUTE_ADMIN_TOKEN": ""},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                for _ in range(400):  # bounded wait for the server to listen
                    try:
                        async with s.get(url + "/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    assert proc.returncode is None, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
                    await asyncio.sleep(0.025)
                else:
                    raise AssertionError("kvroute serve did not come up")
                async with s.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3, "stream": True}) as r:
                    assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
                async with s.get(url + "/admin/workers", headers={"Authorization": "Bearer x"}) as r:
                    assert r.status == 403
        finally:
            if proc.returncode is None:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)
            await mock.stop()

    run(scenario())

"""A mock OpenAI-compatible engine for tests and benchmarks: keeps a prefix cache, charges a delay
per uncached prompt token, streams SSE, and speaks vLLM's and SGLang's PD handshakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from aiohttp import web

__all__ = ["VLLM_PREFILL_KV_TRANSFER_PARAMS", "MockWorker", "Rendezvous"]

# What vLLM's P/D proxy asks of the prefill engine: compute the prompt's KV and keep it for a remote decode.
VLLM_PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Rendezvous:
    """SGLang's bootstrap meeting point, shared by mock prefill and decode servers in one process:
    a decode waits (bounded) for the prefill with the same bootstrap room."""

    rooms: dict[int, asyncio.Event] = field(default_factory=dict)
    owners: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # room -> (prefill host, bootstrap port)

    def event(self, room: int) -> asyncio.Event:
        return self.rooms.setdefault(room, asyncio.Event())


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"{m.get('role')}:{m.get('content')}\n" for m in body["messages"])
    p = body.get("prompt", "")
    return p if isinstance(p, str) else json.dumps(p)


class MockWorker:
    """One mock engine on 127.0.0.1. ``cost_per_token``: seconds of prefill per uncached prompt token
    (4 bytes of text); ``token_delay``: seconds per streamed output token. ``fail_next`` > 0 answers
    that many requests with HTTP ``fail_status`` (500); ``healthy = False`` makes /health answer 503."""

    def __init__(
        self,
        name: str,
        *,
        role: str = "both",
        cost_per_token: float = 0.0,
        token_delay: float = 0.0,
        block_bytes: int = 256,
        cache_blocks: int = 1_000_000,
        rendezvous: Rendezvous | None = None,
        bootstrap_port: int = 8998,
        ssl_context: Any = None,
        cache_config: tuple[int, int] | None = None,
        models: tuple[str, ...] = ("mock",),
        adapters: tuple[str, ...] = (),
    ) -> None:
        #: The base model(s) it serves and its LoRA adapters (served too) (listed with ``parent``, as vLLM lists
        #: them); a request naming another model gets vLLM's 404. Its prefix cache is keyed by the
        #: adapter and the request's ``cache_salt``, as vLLM's is.
        self.models = tuple(models)
        self.adapters = tuple(adapters)
        #: ``usage(body, prompt_tokens, cached_tokens) -> (prompt_tokens, cached_tokens)``: what the
        #: answer's usage reports (tests of the gateway's self-check); None: the mock's own figures.
        self.usage: Callable[[dict[str, Any], int, int], tuple[int, int]] | None = None
        #: (block_size, num_gpu_blocks) published as vLLM's ``vllm:cache_config_info`` on /metrics (None: not published).
        self.cache_config = cache_config
        self.name = name
        self.ssl_context = ssl_context  # an ssl.SSLContext: serve https
        self.role = role
        self.cost_per_token = cost_per_token
        self.token_delay = token_delay
        self.block_bytes = block_bytes
        self.cache_blocks = cache_blocks
        self.rendezvous = rendezvous
        self.bootstrap_port = bootstrap_port
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.fail_next = 0
        self.fail_status = 500
        self.end_delay = 0.0  # seconds between a stream's ``data: [DONE]`` and its end (a real engine's end trails it)
        #: When set, requests wait for it before they are served (tests that need many requests in
        #: flight at once, whatever the machine's speed).
        self.gate: asyncio.Event | None = None
        self.healthy = True
        self.requests = 0
        self.completed = 0
        self.cancelled = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.bodies: list[dict[str, Any]] = []
        self.keep_bodies = False  # record request bodies in .bodies and response bytes in .outputs
        self.outputs: list[bytes] = []
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=self.ssl_context)
        await self._site.start()
        server = self._site._server
        assert server is not None
        self.port = cast(Any, server).sockets[0].getsockname()[1]
        self.url = f"{'https' if self.ssl_context is not None else 'http'}://127.0.0.1:{self.port}"
        return self.url

    async def kill(self) -> None:
        """Dies abruptly: stops listening and resets every open connection mid-response."""
        if self._site is not None and self._site._server is not None:
            self._site._server.close()
        if self._runner is not None and self._runner.server is not None:
            for conn in list(self._runner.server.connections):
                if conn.transport is not None:
                    conn.transport.abort()
        await self.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- engine behaviour --------------------------------------------------------------

    def _prefill(self, text: str, identity: str = "") -> tuple[int, int]:
        """Looks the prompt's blocks up in the prefix cache (under its identity: adapter and salt),
        inserts them; returns (prompt tokens, cached tokens)."""
        raw = text.encode()
        h = hashlib.blake2b(identity.encode(), digest_size=16)
        hit = 0
        missed = False
        n_blocks = len(raw) // self.block_bytes
        for i in range(n_blocks):
            h.update(raw[i * self.block_bytes : (i + 1) * self.block_bytes])
            key = h.digest()
            if not missed and key in self.cache:
                self.cache.move_to_end(key)
                hit += 1
            else:
                missed = True
                self.cache[key] = None
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)
        tokens = max(1, len(raw) // 4)
        cached = min(tokens, hit * self.block_bytes // 4)
        self.prompt_tokens += tokens
        self.cached_tokens += cached
        return tokens, cached

    def _words(self, text: str, n: int) -> list[str]:
        seed = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
        return [f" {seed}-{i}" for i in range(n)]

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.json()
            if self.keep_bodies:
                self.bodies.append(body)
            if self.fail_next > 0:
                self.fail_next -= 1
                return web.json_response({"error": {"message": f"{self.name}: injected failure"}}, status=self.fail_status)
            if "prompt" not in body and "messages" not in body:
                return web.json_response({"error": {"message": "prompt or messages required"}}, status=400)
            model = body.get("model")
            if model is not None and model not in self.models + self.adapters:
                err = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
                return web.json_response({"error": err}, status=404)
            resp = await self._serve(request, body)
            self.completed += 1
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def _serve(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.gate is not None:
            await self.gate.wait()
        text = _prompt_text(body)
        chat = "messages" in body
        ktp = body.get("kv_transfer_params") or {}
        room = body.get("bootstrap_room")
        if room is not None and self.rendezvous is not None:
            if self.role == "prefill":
                self.rendezvous.owners[room] = (body.get("bootstrap_host"), body.get("bootstrap_port"))
                self.rendezvous.event(room).set()
            elif self.role == "decode":
                try:
                    await asyncio.wait_for(self.rendezvous.event(room).wait(), 2.0)
                except asyncio.TimeoutError:
                    return web.json_response({"error": {"message": f"bootstrap room {room}: no prefill arrived"}}, status=500)
        # With do_remote_prefill the KV arrives from the prefill worker: nothing to compute here.
        lora = body.get("model") if body.get("model") in self.adapters else None
        identity = f"{lora or ''}\0{body.get('cache_salt') or ''}"
        prompt_tokens, cached = (max(1, len(text) // 4), 0) if ktp.get("do_remote_prefill") else self._prefill(text, identity)
        uncached = 0 if ktp.get("do_remote_prefill") else prompt_tokens - cached
        if self.usage is not None:
            prompt_tokens, cached = self.usage(body, prompt_tokens, cached)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.cost_per_token and uncached:
            await asyncio.sleep(uncached * self.cost_per_token)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        words = self._words(text, n)
        created = int(time.time())
        rid = f"cmpl-{self.name}-{self.requests}"
        extra: dict[str, Any] = {}
        if ktp.get("do_remote_decode"):
            extra["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.name,
                "remote_block_ids": list(range(len(text) // self.block_bytes + 1)),
                "remote_host": "127.0.0.1",
                "remote_port": self.port,
            }
        if not body.get("stream"):
            content = "".join(words)
            choice = {"index": 0, "message": {"role": "assistant", "content": content}} if chat else {"index": 0, "text": content}
            out = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": "mock",
                "choices": [{**choice, "finish_reason": "length"}],
                "usage": {**usage, "completion_tokens": n, "total_tokens": prompt_tokens + n},
                "served_by": self.name,
                **extra,
            }
            data = json.dumps(out).encode()
            if self.keep_bodies:
                self.outputs.append(data)
            return web.Response(body=data, content_type="application/json")
        sent: list[bytes] = []
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        # Every stream ends with a finish_reason on its last chunk, as engines send it (strict clients
        # such as LiteLLM's reject a stream without one); an empty answer is one empty chunk.
        for i, word in enumerate(words or [""]):
            if self.token_delay and i:
                await asyncio.sleep(self.token_delay)
            delta = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
            delta["finish_reason"] = "length" if i == max(len(words), 1) - 1 else None
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": "mock",
                "choices": [delta],
            }
            sent.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(sent[-1])
        if (body.get("stream_options") or {}).get("include_usage"):
            last: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": "mock",
                "choices": [],
            }
            last["usage"] = {**usage, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            sent.append(b"data: " + json.dumps(last).encode() + b"\n\n")
            await resp.write(sent[-1])
        sent.append(b"data: [DONE]\n\n")
        await resp.write(sent[-1])
        if self.end_delay:
            await asyncio.sleep(self.end_delay)
        await resp.write_eof()
        if self.keep_bodies:
            self.outputs.append(b"".join(sent))
        return resp

    async def _health(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.healthy else 503, text="ok" if self.healthy else "unhealthy")

    async def _metrics(self, _request: web.Request) -> web.StreamResponse:
        usage = min(1.0, len(self.cache) / self.cache_blocks)
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="mock",engine="0"}} {float(self.in_flight)}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="mock",engine="0"}} 0.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="mock",engine="0"}} {usage}\n'
        )
        if self.cache_config is not None:
            bs, blocks = self.cache_config
            text += (
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{bs}",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
                f'num_gpu_blocks="{blocks}",prefix_caching_hash_algo="sha256"}} 1.0\n'
            )
        return web.Response(text=text)

    async def _models(self, _request: web.Request) -> web.StreamResponse:
        data = [{"id": m, "object": "model", "owned_by": self.name, "root": m, "parent": None} for m in self.models]
        base = data[0]["id"] if data else None
        data += [{"id": a, "object": "model", "owned_by": self.name, "root": f"/adapters/{a}", "parent": base} for a in self.adapters]
        return web.json_response({"object": "list", "data": data})


async def _main(argv: list[str] | None = None) -> None:  # pragma: no cover - used by benches/bench_gateway.py
    """``python -m kvroute.gateway.mock --workers N``: serves N mock engines, prints one URL per line.
    ``--prefill P --decode D`` serves a PD deployment instead (prefill URLs first), its SGLang
    bootstrap rooms shared in this process."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvroute.gateway.mock")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--prefill", type=int, default=0, help="PD: prefill engines (with --decode; replaces --workers)")
    p.add_argument("--decode", type=int, default=0, help="PD: decode engines")
    p.add_argument("--port", type=int, default=0, help="first port (0: ephemeral ports)")
    p.add_argument("--cost-per-token", type=float, default=0.0)
    p.add_argument("--token-delay", type=float, default=0.0)
    a = p.parse_args(argv)
    kw: dict[str, Any] = {"cost_per_token": a.cost_per_token, "token_delay": a.token_delay}
    if a.prefill or a.decode:
        if not (a.prefill and a.decode):
            p.error("PD mode needs both --prefill and --decode engines")
        rv = Rendezvous()
        workers = [MockWorker(f"prefill{i}", role="prefill", rendezvous=rv, **kw) for i in range(a.prefill)]
        workers += [MockWorker(f"decode{i}", role="decode", rendezvous=rv, **kw) for i in range(a.decode)]
    else:
        workers = [MockWorker(f"mock{i}", **kw) for i in range(a.workers)]
    for i, w in enumerate(workers):
        print(await w.start(a.port + i if a.port else 0), flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()


if __name__ == "__main__":  # pragma: no cover
    try:
        import uvloop  # type: ignore[import-not-found, unused-ignore]

        uvloop.run(_main())
    except ImportError:
        asyncio.run(_main())

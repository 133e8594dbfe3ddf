"""A fake OpenAI chat engine for the integration tests, strict where LiteLLM's client is: every stream
ends with a ``finish_reason`` chunk and ``data: [DONE]`` (kvroute.gateway.mock's streams carry no
finish_reason, which LiteLLM rejects). Counts requests, completions and in-flight; can fail or die."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from aiohttp import web


class ChatEngine:
    def __init__(self, name: str, token_delay: float = 0.0) -> None:
        self.name = name
        self.token_delay = token_delay
        self.fail_next = 0
        self.requests = 0
        self.completed = 0
        self.in_flight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await self._site.start()
        port = cast(Any, self._site._server).sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def kill(self) -> None:
        """Dies abruptly: stops listening and resets open connections."""
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

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            text=f'vllm:num_requests_running{{engine="0"}} {float(self.in_flight)}\nvllm:num_requests_waiting{{engine="0"}} 0.0\n'
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.in_flight += 1
        try:
            body = await request.json()
            if self.fail_next > 0:
                self.fail_next -= 1
                return web.json_response({"error": {"message": f"{self.name}: injected failure"}}, status=500)
            n = int(body.get("max_tokens") or 4)
            words = [f"w{i} " for i in range(n)]
            base = {"id": f"chatcmpl-{self.name}-{self.requests}", "created": 1, "model": "fake"}
            if not body.get("stream"):
                msg = {"role": "assistant", "content": "".join(words)}
                out = {**base, "object": "chat.completion", "choices": [{"index": 0, "message": msg, "finish_reason": "length"}]}
                out["usage"] = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
                self.completed += 1
                return web.json_response(out)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, w in enumerate(words):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                last = i == len(words) - 1
                choice = {"index": 0, "delta": {"content": w}, "finish_reason": "length" if last else None}
                await resp.write(
                    b"data: " + json.dumps({**base, "object": "chat.completion.chunk", "choices": [choice]}).encode() + b"\n\n"
                )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed += 1
            return resp
        finally:
            self.in_flight -= 1

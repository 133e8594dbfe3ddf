"""Runs the Python gateway behind kvroute's Rust data plane (``kvroute._core.DataPlane``): the Rust
front door serves completions itself (unified and PD, exact or approximate mode) and forwards everything else here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvroute._core import DataPlane
from kvroute.gateway.app import Gateway
from kvroute.prompt import ApproxPrompter, ExactPrompter

__all__ = ["CLIENT_HEADER", "PlaneApprox", "can_front", "hot_path_applies", "make_data_plane", "serve_with_data_plane"]

# The data plane tells the Python gateway who the client is in this header (it replaces any a client sent).
CLIENT_HEADER = "X-Kvroute-Client"

log = logging.getLogger("kvroute.gateway")


def hot_path_applies(gw: Gateway) -> bool:
    """Whether the Rust plane can serve completions itself: approximate or exact prompts (it loads
    the same tokenizer), with unified workers or PD pairs in either convention."""
    return isinstance(gw.prompter, (ApproxPrompter, ExactPrompter))


def can_front(gw: Gateway) -> bool:
    """Whether the Rust plane can reach every worker (it speaks plain http:// only)."""
    return all(w.url.startswith("http://") for w in gw.workers.values())


class PlaneApprox:
    """The Python gateway's ApproxCache interface over the data plane's cache, so the decisions of
    both planes live in one place with one TTL, expired by the data plane."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def __len__(self) -> int:
        return int(self.plane.approx_len())

    def insert(self, worker: int, hashes: npt.NDArray[np.uint64], now: float) -> None:
        del now  # the data plane stamps insertions on its own clock
        if len(hashes):
            self.plane.approx_insert(worker, hashes)

    def expire(self, now: float) -> int:
        del now
        return int(self.plane.approx_expire())

    def drop_worker(self, worker: int) -> None:
        self.plane.approx_drop_worker(worker)


def make_data_plane(gw: Gateway, backend_port: int, host: str, port: int, *, hot_path: bool | None = None, threads: int = 1) -> DataPlane:
    """A DataPlane in front of ``gw`` (whose internal server listens on 127.0.0.1:``backend_port``),
    attached to it: same Router, same workers, one approximate cache, failures reported back."""
    cfg = gw.config
    loop = asyncio.get_running_loop()

    def on_unhealthy(worker: int, reason: str) -> None:
        # Called on the data plane's thread: hand over to the gateway's event loop.
        with contextlib.suppress(RuntimeError):  # the loop already closed: nothing left to probe
            loop.call_soon_threadsafe(gw.plane_marked_unhealthy, worker, reason)

    options: dict[str, Any] = dict(
        backend_port=backend_port,
        host=host,
        port=port,
        hot_path=hot_path_applies(gw) if hot_path is None else hot_path,
        pd_convention=cfg.pd_convention,
        max_body_bytes=cfg.max_body_bytes,
        max_client_concurrency=cfg.max_client_concurrency,
        max_in_flight=cfg.max_in_flight,
        client_key_header=cfg.client_key_header,
        max_retries=cfg.max_retries,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        client_timeout=cfg.client_timeout,
        approx_ttl=cfg.approx_ttl if gw.approx is not None else None,
        threads=threads,
        on_unhealthy=on_unhealthy,
    )
    tokenizer = cfg.tokenizer if isinstance(gw.prompter, ExactPrompter) else None
    try:
        dp = DataPlane(gw.router, tokenizer=tokenizer, **options)
    except ValueError as e:
        if tokenizer is None:
            raise
        # Python loaded this tokenizer but the Rust one cannot: exact mode stays correct in Python alone.
        log.warning("the data plane cannot load the tokenizer (%s); exact-mode completions are forwarded to the Python gateway", e)
        dp = DataPlane(gw.router, **{**options, "hot_path": False})
    if dp.template_unsupported is not None:
        log.warning(
            "the data plane cannot compile the chat template (%s); chat completions are forwarded to Python", dp.template_unsupported
        )
    gw.attach_data_plane(dp)
    return dp


async def serve_with_data_plane(
    gw: Gateway, host: str, port: int, ready: Callable[[str], None] | None = None, *, threads: int = 1, hot_path: bool | None = None
) -> None:
    """Serves ``gw`` on ``host:port`` through the Rust data plane until cancelled: the Python gateway
    runs on the lean server at an internal 127.0.0.1 port behind it. Bind errors raise OSError."""
    from kvroute.gateway.server import serve_lean

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    backend_port = sock.getsockname()[1]
    loop = asyncio.get_running_loop()
    internal: asyncio.Future[str] = loop.create_future()
    dp: Any = None
    lean: asyncio.Future[None] | None = None
    try:
        dp = make_data_plane(gw, backend_port, host, port, hot_path=hot_path, threads=threads)
        lean = asyncio.ensure_future(serve_lean(gw, "127.0.0.1", 0, internal.set_result, sock=sock))
        done, _ = await asyncio.wait((internal, lean), return_when=asyncio.FIRST_COMPLETED)
        if lean in done:
            lean.result()  # raises the startup error
        bound_host, bound_port = dp.start()
        if ready is not None:
            ready(f"http://{bound_host}:{bound_port}")
        await lean
    finally:
        if dp is not None:
            dp.stop()  # first: no new requests reach the Python gateway while it stops
        if lean is not None and not lean.done():
            lean.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lean
        sock.close()

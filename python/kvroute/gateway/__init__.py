"""kvroute's OpenAI-compatible gateway: ``kvroute serve``, or ``kvroute.gateway.run(router, workers)``.

The Rust data plane (``kvroute._core.DataPlane``) serves every client request; this package is the
control plane around it. Needs the ``gateway`` extra (aiohttp). Usage and semantics: docs/gateway.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.gateway.app import Gateway, GatewayConfig, WorkerConfig, make_gateway, run, serve
    from kvroute.prompt import ApproxPrompter, BadRequest, ExactPrompter, Prompt

__all__ = [
    "ApproxPrompter",
    "BadRequest",
    "ExactPrompter",
    "Gateway",
    "GatewayConfig",
    "Prompt",
    "WorkerConfig",
    "make_gateway",
    "run",
    "serve",
]

_FROM = {"ApproxPrompter": "prompt", "BadRequest": "prompt", "ExactPrompter": "prompt", "Prompt": "prompt"}
# Removed with the Python request path (docs/gateway.md, "Migrating from create_app").
_REMOVED = {
    "create_app": "kvroute.gateway.run(router, workers, host=..., port=..., **options) (or make_gateway(...).serve(host, port))",
    "gateway_app": "make_gateway(...).serve(host, port)",
    "GATEWAY_KEY": "the Gateway returned by make_gateway(...)",
}


def __getattr__(name: str) -> Any:
    # Imported lazily so `kvroute.gateway.cli` (the `serve` argument parser) loads without aiohttp.
    if name in _REMOVED:
        raise AttributeError(
            f"kvroute.gateway.{name} was removed: the Rust data plane serves every request now and there is no "
            f"aiohttp application any more; use {_REMOVED[name]} (see docs/gateway.md, 'Migrating from create_app')"
        )
    if name not in __all__:
        raise AttributeError(f"module 'kvroute.gateway' has no attribute {name!r}")
    import importlib

    module = "kvroute.prompt" if name in _FROM else "kvroute.gateway.app"
    return getattr(importlib.import_module(module), name)

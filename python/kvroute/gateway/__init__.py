"""kvroute's OpenAI-compatible gateway: ``kvroute serve`` and ``create_app(router, ...)``.

Needs the ``gateway`` extra (aiohttp; tokenizers and jinja2 for exact mode). Usage and semantics: docs/gateway.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.gateway.app import GATEWAY_KEY, Gateway, GatewayConfig, WorkerConfig, create_app, gateway_app, make_gateway
    from kvroute.prompt import ApproxPrompter, BadRequest, ExactPrompter, Prompt

__all__ = [
    "GATEWAY_KEY",
    "ApproxPrompter",
    "BadRequest",
    "ExactPrompter",
    "Gateway",
    "GatewayConfig",
    "Prompt",
    "WorkerConfig",
    "create_app",
    "gateway_app",
    "make_gateway",
]

_FROM = {"ApproxPrompter": "prompt", "BadRequest": "prompt", "ExactPrompter": "prompt", "Prompt": "prompt"}


def __getattr__(name: str) -> Any:
    # Imported lazily so `kvroute.gateway.cli` (the `serve` argument parser) loads without aiohttp.
    if name not in __all__:
        raise AttributeError(f"module 'kvroute.gateway' has no attribute {name!r}")
    import importlib

    module = "kvroute.prompt" if name in _FROM else "kvroute.gateway.app"
    return getattr(importlib.import_module(module), name)

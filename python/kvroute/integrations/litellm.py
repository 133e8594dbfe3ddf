"""kvroute inside LiteLLM: a Router routing strategy and a proxy callback that pick, among the
healthy deployments, the engine holding the longest prefix of the prompt unless its load says otherwise.

Python ``litellm.Router``::

    strategy = KvrouteStrategy(router, tokenizer="/models/llama")   # registers itself as a callback
    router.register_plugin(strategy)

Proxy (``litellm --config config.yaml``), ``litellm_settings.callbacks: kvroute.integrations.litellm.proxy_handler``
with the settings in ``KVROUTE_*`` environment variables. Examples: docs/integrations.md.

Deployments are engines keyed by ``model_info.id`` at ``litellm_params.api_base``; a deployment's
``model_info`` may name its KV-event endpoints (``kv_events``, ``kv_events_replay``). Each pick is a
lease (``kvroute.integrations.lease``) whose ticket rides in the request's metadata to the outcome callbacks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvroute.integrations.engine_router import EngineRouter, NoCandidates
from kvroute.prompt import BadRequest

try:
    import litellm
    from litellm.integrations.custom_logger import CustomLogger
    from litellm.router import CustomRoutingStrategyBase
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvroute.integrations.litellm needs litellm: pip install 'kvroute[litellm]'") from exc

__all__ = ["KvrouteCallback", "KvrouteProxyHandler", "KvrouteStrategy"]  # and `proxy_handler`, built on first access

log = logging.getLogger(__name__)

#: Where a request's leases ride: ``metadata[LEASES_KEY] = {deployment id: ticket}``.
LEASES_KEY = "kvroute_leases"
#: How long a pick waits, at most, for the KV-event history of engines it has just registered.
SYNC_TIMEOUT = 5.0


def _deployment_id(d: Mapping[str, Any]) -> str:
    info = d.get("model_info") or {}
    did = info.get("id") if isinstance(info, Mapping) else None
    if not isinstance(did, str) or not did:
        raise ValueError(f"deployment {d.get('model_name')!r} has no model_info.id")
    return did


#: LiteLLM provider prefixes of OpenAI-compatible engines: ``hosted_vllm/tenant-a`` is served as ``tenant-a``.
_PROVIDERS = ("hosted_vllm", "openai", "text-completion-openai", "custom_openai", "vllm", "sglang")


def _served_model(candidates: Mapping[str, Any]) -> str | None:
    """The model name the candidates' engines serve the request under (their ``litellm_params.model``
    without the provider prefix), when they agree; None otherwise (routed without a model pool)."""
    names = set()
    for d in candidates.values():
        params = d.get("litellm_params") or {}
        m = params.get("model") if isinstance(params, Mapping) else None
        if not isinstance(m, str):
            return None
        prefix, sep, rest = m.partition("/")
        names.add(rest if sep and prefix in _PROVIDERS else m)
    return names.pop() if len(names) == 1 else None


def _engine_url(api_base: str) -> str:
    """An OpenAI ``api_base`` (``http://host:port/v1``) to the engine's root, where /metrics lives."""
    base = api_base.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _body(messages: Any, input: Any, request_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The OpenAI body kvroute.prompt reads, and whether it is a chat request."""
    out = {k: request_kwargs[k] for k in ("max_tokens", "max_completion_tokens", "tools", "chat_template_kwargs") if k in request_kwargs}
    msgs = messages if messages is not None else request_kwargs.get("messages")
    if msgs:
        return {**out, "messages": list(msgs)}, True
    prompt = request_kwargs.get("prompt", input)
    if prompt is None:
        raise BadRequest("the request has neither messages nor a prompt")
    return {**out, "prompt": prompt}, False


class KvrouteCallback(CustomLogger):  # type: ignore[misc,unused-ignore]
    """The routing logic, its lease bookkeeping and LiteLLM's outcome events, in one callback.

    ``pick`` chooses one of ``healthy`` deployments. The outcome events release the lease of the
    attempt they report (success: ``finished``; failure: ``failed`` and a short cool-down of that
    engine); a retry's pick releases what the request's earlier attempt still held and excludes
    that deployment. A stream the client abandons reports nothing: ``lease_ttl`` releases it.
    Keyword arguments go to ``kvroute.integrations.engine_router.EngineRouter`` (``tokenizer``, ``block_size``,
    ``lease_ttl``, ``metrics_interval``, ``failure_cooldown``, Router settings such as ``policy``).
    """

    def __init__(self, engine_router: EngineRouter | None = None, **settings: Any) -> None:
        super().__init__()
        if engine_router is not None and settings:
            raise ValueError("pass either an EngineRouter or its settings, not both")
        self.engines = engine_router if engine_router is not None else EngineRouter(**settings)
        self.engines.start()
        self.picks = 0
        self.fallbacks = 0

    # ---- the pick ------------------------------------------------------------------------

    def pick(self, model: str, healthy: Iterable[Mapping[str, Any]], messages: Any, input: Any, request_kwargs: dict[str, Any]) -> Any:
        candidates = self._candidates(model, healthy)
        self.engines.wait_synced(SYNC_TIMEOUT)
        return self._pick(candidates, messages, input, request_kwargs)

    async def apick(
        self, model: str, healthy: Iterable[Mapping[str, Any]], messages: Any, input: Any, request_kwargs: dict[str, Any]
    ) -> Any:
        """``pick`` for the async hooks: the wait for a new engine's KV-event history does not block the loop."""
        candidates = self._candidates(model, healthy)
        await self.engines.wait_synced_async(SYNC_TIMEOUT)
        return self._pick(candidates, messages, input, request_kwargs)

    def _candidates(self, model: str, healthy: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        candidates = {_deployment_id(d): d for d in healthy}
        if not candidates:
            raise NoCandidates(f"no healthy deployment for model {model!r}")
        for did, d in candidates.items():
            self._register(did, d)
        return candidates

    def _pick(self, candidates: dict[str, Any], messages: Any, input: Any, request_kwargs: dict[str, Any]) -> Any:
        metadata = request_kwargs.get("metadata")
        if not isinstance(metadata, dict):
            metadata = request_kwargs["metadata"] = {}
        held = metadata.setdefault(LEASES_KEY, {})
        # A pick for a request that already holds a lease is a retry or fallback: that attempt failed.
        tried = set(held)
        for did, ticket in list(held.items()):
            if self.engines.leases.fail(ticket):
                self.engines.mark_failed(did)
        for prev in metadata.get("previous_models") or ():
            if isinstance(prev, Mapping) and isinstance(prev.get("deployment_id"), str):
                tried.add(prev["deployment_id"])
        for key in ("_retry_skipped_deployment_ids", "_excluded_deployment_ids"):
            tried.update(str(x) for x in request_kwargs.get(key) or ())
        served = _served_model(candidates)
        try:
            body, chat = _body(messages, input, request_kwargs)
            lease = self.engines.lease(body, chat, candidates=candidates, exclude=tried, model=served)
        except NoCandidates:
            # Every healthy deployment was tried: LiteLLM keeps retrying, so may we (fresh engines first).
            lease = self.engines.lease(body, chat, candidates=candidates, model=served)
        except BadRequest as e:
            # Not a prompt kvroute can read (an embedding, an image): leave the choice to load alone.
            log.debug("kvroute cannot read this request (%s); routing on load only", e)
            self.fallbacks += 1
            lease = self.engines.lease({"prompt": [0]}, False, candidates=candidates, exclude=tried & set(candidates) or ())
        self.picks += 1
        did = self.engines.engine_of(lease).key
        held[did] = lease.ticket
        return candidates[did]

    def _register(self, did: str, d: Mapping[str, Any]) -> None:
        if self.engines.get(did) is not None:
            return
        params = d.get("litellm_params") or {}
        api_base = params.get("api_base") if isinstance(params, Mapping) else None
        if not isinstance(api_base, str):
            raise ValueError(f"deployment {did!r} has no litellm_params.api_base: kvroute routes to engines it can address")
        info = d.get("model_info") or {}
        self.engines.add(did, _engine_url(api_base), kv_events=info.get("kv_events"), kv_events_replay=info.get("kv_events_replay"))

    # ---- outcomes --------------------------------------------------------------------------

    def _settle(self, kwargs: Mapping[str, Any], success: bool, response_obj: Any = None) -> None:
        params = kwargs.get("litellm_params") or {}
        metadata = params.get("metadata") or {}
        held = metadata.get(LEASES_KEY) if isinstance(metadata, Mapping) else None
        if not held:
            return
        info = params.get("model_info") or {}
        did = info.get("id") if isinstance(info, Mapping) else None
        ticket = held.get(did) if isinstance(did, str) else None
        if ticket is None or not isinstance(did, str):
            return
        if success:
            lease = self.engines.leases.get(ticket)
            if lease is not None:
                # The router checks itself against what the engine reported reusing.
                self.engines.check_usage(lease, getattr(response_obj, "usage", None) if response_obj is not None else None)
            self.engines.leases.finish(ticket)
        elif self.engines.leases.fail(ticket):
            self.engines.mark_failed(did)

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._settle(kwargs, success=True, response_obj=response_obj)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._settle(kwargs, success=False)

    def log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._settle(kwargs, success=True, response_obj=response_obj)

    def log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._settle(kwargs, success=False)


class KvrouteProxyHandler(KvrouteCallback):
    """The proxy's callback (``litellm_settings.callbacks``): LiteLLM runs every callback's
    ``async_filter_deployments`` on the healthy deployments before it picks; this one keeps the one
    kvroute chooses. Do not also register it with a Router that uses ``KvrouteStrategy`` (that would
    pick twice); the strategy brings its own plain ``KvrouteCallback``."""

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: Any,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[Any]:
        if not healthy_deployments:
            return healthy_deployments
        return [await self.apick(model, healthy_deployments, messages, None, request_kwargs if request_kwargs is not None else {})]


class KvrouteStrategy(CustomRoutingStrategyBase):  # type: ignore[misc,unused-ignore]
    """A ``litellm.Router`` routing strategy: ``router.register_plugin(KvrouteStrategy(router, ...))``.

    It adds its ``KvrouteCallback`` to ``litellm.callbacks`` (the outcome events) unless already there.
    Settings as ``KvrouteCallback``.
    """

    def __init__(self, router: Any, engine_router: EngineRouter | None = None, **settings: Any) -> None:
        self.router = router
        self.callback = KvrouteCallback(engine_router, **settings)
        if self.callback not in litellm.callbacks:
            litellm.callbacks.append(self.callback)

    @property
    def engines(self) -> EngineRouter:
        return self.callback.engines

    async def async_get_available_deployment(
        self,
        model: str,
        messages: list[dict[str, str]] | None = None,
        input: str | list[object] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, object] | None = None,
    ) -> Any:
        kw: dict[str, Any] = request_kwargs if request_kwargs is not None else {}
        healthy = await self.router.select(model, kw, kind="healthy", messages=messages)
        return await self.callback.apick(model, healthy, messages, input, kw)

    def get_available_deployment(
        self,
        model: str,
        messages: list[dict[str, str]] | None = None,
        input: str | list[object] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, object] | None = None,
    ) -> Any:
        # The sync path has no healthy-list call: every deployment of the group, minus kvroute's own cool-downs.
        kw: dict[str, Any] = request_kwargs if request_kwargs is not None else {}
        # LiteLLM 1.110 deprecates get_model_list for registry().deployments (same list); older ones lack registry().
        registry = getattr(self.router, "registry", None)
        deployments = (registry().deployments(model) if registry is not None else self.router.get_model_list(model_name=model)) or []
        return self.callback.pick(model, deployments, messages, input, kw)


def _number_or_off(text: str) -> float | None:
    return None if text.strip().lower() == "off" else float(text)


def _env_settings() -> dict[str, Any]:
    """The proxy's settings: ``KVROUTE_TOKENIZER``, ``KVROUTE_BLOCK_SIZE``, ``KVROUTE_POLICY``,
    ``KVROUTE_LEASE_TTL``, ``KVROUTE_METRICS_INTERVAL``, ``KVROUTE_PREFILL_TOKENS_PER_S``,
    ``KVROUTE_TOKEN_SHARE_BOUND`` (a number, or ``off``)."""
    env = os.environ
    out: dict[str, Any] = {}
    conv: dict[str, tuple[str, Callable[[str], Any]]] = {
        "KVROUTE_TOKENIZER": ("tokenizer", str),
        "KVROUTE_BLOCK_SIZE": ("block_size", int),
        "KVROUTE_POLICY": ("policy", str),
        "KVROUTE_LEASE_TTL": ("lease_ttl", float),
        "KVROUTE_METRICS_INTERVAL": ("metrics_interval", float),
        "KVROUTE_PREFILL_TOKENS_PER_S": ("prefill_tokens_per_s", float),
        "KVROUTE_TOKEN_SHARE_BOUND": ("token_share_bound", _number_or_off),
    }
    for var, (name, typ) in conv.items():
        if env.get(var):
            try:
                out[name] = typ(env[var])
            except ValueError as e:
                raise ValueError(f"{var}={env[var]!r}: expected {typ.__name__.strip('_').replace('_', ' ')}") from e
    return out


def __getattr__(name: str) -> Any:
    # ``proxy_handler`` is built on first use, so importing this module configures nothing.
    if name == "proxy_handler":
        handler = KvrouteProxyHandler(**_env_settings())
        globals()["proxy_handler"] = handler
        return handler
    raise AttributeError(name)

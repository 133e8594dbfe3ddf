"""Turns an OpenAI request body into the block hashes the router matches on (``kvroute.prompt``).

One implementation for the gateway and the integrations (LiteLLM, Ray Serve): these classes call
the data plane's own Rust prompters (``kvroute._core``), so a prompt hashes the same whether the
gateway or an integration routes it. Exact mode tokenizes with the engines' own ``tokenizer.json``
and chat template (the Rust ``tokenizers`` crate, minijinja configured as jinja2's sandbox), so the
hashes equal the engines' KV events; approximate mode hashes the prompt text in fixed-size byte blocks.

>>> from kvroute.prompt import ApproxPrompter
>>> p = ApproxPrompter(block_size=16, seed=0).prompt({"prompt": "x" * 200, "max_tokens": 8}, chat=False)
>>> len(p.hashes), p.num_tokens, p.output_tokens
(3, 50, 8)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvroute._core import ApproxCache, approx_prompt
from kvroute._core import ExactPrompter as _RustExactPrompter

__all__ = ["ApproxCache", "ApproxPrompter", "BadRequest", "ExactPrompter", "Prompt", "Prompter", "load_prompter"]

#: Bytes of UTF-8 prompt text per approximate token (the data plane's ``BYTES_PER_TOKEN``).
BYTES_PER_TOKEN = 4


class BadRequest(ValueError):
    """The request body is not a valid OpenAI completions / chat request; the message says why."""


@dataclass(frozen=True)
class Prompt:
    """What routing needs from one request: sequence hashes, prompt length and expected output.
    ``exact`` is False when exact mode could not derive the engine's tokens for a valid body (a chat
    template minijinja cannot run, a value it would print differently) and routed it on approximate
    hashes, as the gateway does."""

    hashes: npt.NDArray[np.uint64]
    num_tokens: int
    output_tokens: int | None
    exact: bool = True


def _raw(body: Any) -> bytes:
    """The body as the JSON bytes the Rust prompters read (what a client would have sent)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as e:  # (UnicodeEncodeError, for lone surrogates, is a ValueError)
        raise BadRequest(f"request body is not JSON-serialisable: {e}") from e


def _bad(e: ValueError) -> BadRequest:
    return e if isinstance(e, BadRequest) else BadRequest(str(e))


class Prompter:
    """Base: subclasses map a parsed body to a Prompt. ``chat`` selects /v1/chat/completions."""

    mode = "base"

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.seed = seed

    def prompt(self, body: dict[str, Any], chat: bool, *, lora: str | None = None) -> Prompt:
        """``lora``: the LoRA adapter serving the request (its ``model`` when that names an adapter);
        with the body's ``cache_salt`` it keys the blocks, as the engine keys them."""
        raise NotImplementedError


class ApproxPrompter(Prompter):
    """Approximate mode: every 4 bytes of UTF-8 prompt text count as one token, so a block is
    ``4 * block_size`` bytes (chat: ``<|role|>content\\n`` per message, so a conversation's earlier turns
    are a byte prefix of its later ones); token-id prompts are used as they are."""

    mode = "approximate"

    def __init__(self, block_size: int, seed: int, bytes_per_token: int = BYTES_PER_TOKEN) -> None:
        super().__init__(block_size, seed)
        if bytes_per_token != BYTES_PER_TOKEN:
            raise ValueError(f"bytes_per_token must be {BYTES_PER_TOKEN} (the gateway's), got {bytes_per_token}")
        self.bytes_per_token = bytes_per_token

    def prompt(self, body: dict[str, Any], chat: bool, *, lora: str | None = None) -> Prompt:
        try:
            hashes, num_tokens, output_tokens = approx_prompt(_raw(body), chat, self.block_size, seed=self.seed, lora=lora)
        except ValueError as e:
            raise _bad(e) from None
        return Prompt(hashes, num_tokens, output_tokens)


class ExactPrompter(Prompter):
    """Exact mode: the engines' Hugging Face tokenizer (``tokenizer.json``, or a directory holding it)
    and the chat template of the ``tokenizer_config.json`` beside it, so the hashes equal the
    engines' KV events. FileNotFoundError without a tokenizer file, ValueError when it cannot be read.
    A chat template minijinja cannot compile is reported in ``template_unsupported``; chat requests
    then route on approximate hashes (``Prompt.exact`` False), completions stay exact."""

    mode = "exact"

    def __init__(self, path: str, block_size: int, seed: int) -> None:
        super().__init__(block_size, seed)
        self.path = path
        self._rust = _RustExactPrompter(path, block_size, seed=seed)

    @property
    def template_unsupported(self) -> str | None:
        return self._rust.template_unsupported

    @property
    def prefix_reuse(self) -> dict[str, int] | None:
        """The prefix store's counters (``hits``, ``misses``, ``entries``, ``tokens``): long chat prompts
        encode only what follows the longest earlier prefix it holds (docs/gateway.md, "Prefix
        reuse"). None when this tokenizer has no store (``prefix_reuse_unavailable`` says why)."""
        return self._rust.prefix_reuse

    @property
    def prefix_reuse_unavailable(self) -> str | None:
        return self._rust.prefix_reuse_unavailable

    def prompt(self, body: dict[str, Any], chat: bool, *, lora: str | None = None) -> Prompt:
        try:
            hashes, num_tokens, output_tokens, exact = self._rust.prompt(_raw(body), chat, lora=lora)
        except ValueError as e:
            raise _bad(e) from None
        return Prompt(hashes, num_tokens, output_tokens, exact)

    def token_ids(self, body: dict[str, Any], chat: bool) -> npt.NDArray[np.uint32] | None:
        """The token ids the engine sees for this body (None: not derivable exactly here)."""
        try:
            return self._rust.token_ids(_raw(body), chat)
        except ValueError as e:
            raise _bad(e) from None

    def render_chat(self, body: dict[str, Any]) -> str | None:
        """The chat template applied to a chat body (None: not renderable exactly here)."""
        try:
            return self._rust.render_chat(_raw(body))
        except ValueError as e:
            raise _bad(e) from None


def load_prompter(tokenizer: str | None, block_size: int, seed: int) -> Prompter:
    """Exact mode when a tokenizer path is given, else approximate mode."""
    return ExactPrompter(tokenizer, block_size, seed) if tokenizer else ApproxPrompter(block_size, seed)

"""Turns an OpenAI request body into the block hashes the router matches on (``kvroute.prompt``).

One implementation for the gateway and the integrations (LiteLLM, Ray Serve). Exact mode tokenizes
with the engines' own tokenizer (and chat template), so the hashes equal the engines' KV events;
approximate mode hashes the prompt text in fixed-size byte blocks.

>>> from kvroute.prompt import ApproxPrompter
>>> p = ApproxPrompter(block_size=16, seed=0).prompt({"prompt": "x" * 200, "max_tokens": 8}, chat=False)
>>> len(p.hashes), p.num_tokens, p.output_tokens
(3, 50, 8)
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvroute._core import KvIndex, block_hashes

__all__ = ["ApproxCache", "ApproxPrompter", "BadRequest", "ExactPrompter", "Prompt", "Prompter", "load_prompter"]


class BadRequest(ValueError):
    """The request body is not a valid OpenAI completions / chat request; the message says why."""


@dataclass(frozen=True)
class Prompt:
    """What routing needs from one request: sequence hashes, prompt length and expected output."""

    hashes: npt.NDArray[np.uint64]
    num_tokens: int
    output_tokens: int | None


def _output_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadRequest(f"{key} must be a non-negative integer, got {v!r}")
            return v
    return None


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI content parts; non-text parts (images) contribute their JSON so they still key the cache.
        return "".join(
            p.get("text", "") if isinstance(p, dict) and p.get("type") == "text" else json.dumps(p, sort_keys=True) for p in content
        )
    raise BadRequest(f"message content must be a string or a list of content parts, got {type(content).__name__}")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("chat request needs 'messages': a non-empty list of {role, content} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
    return msgs


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The (first) prompt of a completions request: text or token ids. Batched prompts route on the first."""
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        first = p[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list) and first and all(isinstance(t, int) and not isinstance(t, bool) for t in first):
            return first
    raise BadRequest("completions request needs 'prompt': a string, a list of token ids, or a non-empty list of those")


class Prompter:
    """Base: subclasses map a parsed body to a Prompt. ``chat`` selects /v1/chat/completions."""

    mode = "base"

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.seed = seed

    def prompt(self, body: dict[str, Any], chat: bool) -> Prompt:
        raise NotImplementedError

    def _hash(self, tokens: npt.NDArray[np.uint32] | list[int]) -> npt.NDArray[np.uint64]:
        return block_hashes(tokens, self.block_size, seed=self.seed)


class ApproxPrompter(Prompter):
    """Approximate mode: every ``bytes_per_token`` bytes of UTF-8 prompt text count as one token, so a
    block is ``block_size * bytes_per_token`` bytes; token-id prompts are used as they are."""

    mode = "approximate"

    def __init__(self, block_size: int, seed: int, bytes_per_token: int = 4) -> None:
        super().__init__(block_size, seed)
        if bytes_per_token not in (1, 2, 4):
            raise ValueError(f"bytes_per_token must be 1, 2 or 4, got {bytes_per_token}")
        self.bytes_per_token = bytes_per_token
        self._dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[bytes_per_token]

    def text_tokens(self, text: str) -> npt.NDArray[np.uint32]:
        raw = text.encode("utf-8", "surrogatepass")
        pad = -len(raw) % self.bytes_per_token
        if pad:
            raw += b"\0" * pad
        return np.frombuffer(raw, dtype=self._dtype).astype(np.uint32, copy=False)

    def prompt(self, body: dict[str, Any], chat: bool) -> Prompt:
        if chat:
            # Role and content, in order: a conversation's earlier turns are a byte prefix of its later ones.
            text = "".join(f"<|{m['role']}|>{_message_text(m.get('content'))}\n" for m in _messages(body))
            toks: Any = self.text_tokens(text)
        else:
            p = _completion_prompt(body)
            toks = self.text_tokens(p) if isinstance(p, str) else np.asarray(p, dtype=np.uint64)
            if not isinstance(p, str) and (toks.size and int(toks.max()) > 0xFFFFFFFF):
                raise BadRequest("token ids must be in 0..2**32")
        if len(toks) == 0:
            raise BadRequest("empty prompt")
        return Prompt(self._hash(toks), len(toks), _output_tokens(body))


class ExactPrompter(Prompter):
    """Exact mode: the engines' Hugging Face tokenizer (``tokenizer.json``) and chat template
    (``tokenizer_config.json``, rendered with jinja2), so the hashes equal the engines' KV events."""

    mode = "exact"

    def __init__(self, path: str, block_size: int, seed: int) -> None:
        super().__init__(block_size, seed)
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - needs the extra
            raise ImportError("exact mode needs the tokenizers package: pip install 'kvroute[gateway]'") from exc
        tok_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"tokenizer file not found: {tok_file} (expected a tokenizer.json or a directory holding one)")
        self.tokenizer = Tokenizer.from_file(tok_file)
        cfg_file = os.path.join(os.path.dirname(tok_file), "tokenizer_config.json")
        self.config: dict[str, Any] = {}
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                self.config = json.load(f)
        self._template = self._compile_template(self.config.get("chat_template"))

    @staticmethod
    def _special(cfg: dict[str, Any], key: str) -> str:
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v if isinstance(v, str) else ""

    def _compile_template(self, tmpl: Any) -> Any:
        if tmpl is None:
            return None
        if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if not isinstance(tmpl, str):
            raise ValueError("tokenizer_config.json: chat_template must be a string or a list of {name, template}")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:  # pragma: no cover - needs the extra
            raise ImportError("chat templates need jinja2: pip install 'kvroute[gateway]'") from exc

        def raise_exception(msg: str) -> None:
            raise BadRequest(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(tmpl)

    def render_chat(self, body: dict[str, Any]) -> str:
        msgs = _messages(body)
        if self._template is None:
            raise BadRequest("this tokenizer has no chat_template in tokenizer_config.json; use /v1/completions")
        return str(
            self._template.render(
                messages=msgs,
                add_generation_prompt=body.get("add_generation_prompt", True),
                tools=body.get("tools"),
                bos_token=self._special(self.config, "bos_token"),
                eos_token=self._special(self.config, "eos_token"),
                **(body.get("chat_template_kwargs") or {}),
            )
        )

    def encode(self, text: str, add_special_tokens: bool) -> npt.NDArray[np.uint32]:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.uint32)

    def prompt(self, body: dict[str, Any], chat: bool) -> Prompt:
        if chat:
            # The template already carries the special tokens (vLLM and SGLang encode without adding them).
            toks: Any = self.encode(self.render_chat(body), add_special_tokens=False)
        else:
            p = _completion_prompt(body)
            toks = self.encode(p, add_special_tokens=True) if isinstance(p, str) else np.asarray(p, dtype=np.uint64)
        if len(toks) == 0:
            raise BadRequest("empty prompt")
        return Prompt(self._hash(toks), len(toks), _output_tokens(body))


def load_prompter(tokenizer: str | None, block_size: int, seed: int) -> Prompter:
    """Exact mode when a tokenizer path is given, else approximate mode."""
    return ExactPrompter(tokenizer, block_size, seed) if tokenizer else ApproxPrompter(block_size, seed)


class ApproxCache:
    """The router's own decisions as cache state, for when no KV events arrive: each routed
    prompt's blocks are stored for its worker and removed ``ttl`` seconds after last use."""

    def __init__(self, index: KvIndex, ttl: float) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        self.index = index
        self.ttl = ttl
        self._touched: dict[tuple[int, int], float] = {}
        self._log: deque[tuple[float, int, npt.NDArray[np.uint64]]] = deque()

    def __len__(self) -> int:
        return len(self._touched)

    def insert(self, worker: int, hashes: npt.NDArray[np.uint64], now: float) -> None:
        if not len(hashes):
            return
        self.index.store(worker, hashes)
        touched = self._touched
        for h in hashes.tolist():
            touched[(worker, h)] = now
        self._log.append((now, worker, hashes))

    def expire(self, now: float) -> int:
        """Removes blocks untouched for ``ttl``; returns how many."""
        removed = 0
        log, touched, cutoff = self._log, self._touched, now - self.ttl
        while log and log[0][0] <= cutoff:
            t, worker, hashes = log.popleft()
            stale = [h for h in hashes.tolist() if touched.get((worker, h), now) <= t]
            if stale:
                for h in stale:
                    del touched[(worker, h)]
                self.index.remove(worker, np.asarray(stale, dtype=np.uint64))
                removed += len(stale)
        return removed

    def drop_worker(self, worker: int) -> None:
        """Forgets a worker's blocks (it failed: its cache is presumed gone)."""
        self._touched = {k: v for k, v in self._touched.items() if k[0] != worker}
        self._log = deque(r for r in self._log if r[1] != worker)
        self.index.clear(worker)

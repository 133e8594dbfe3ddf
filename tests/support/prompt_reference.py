"""The Python reference of ``kvroute.prompt``: how a request body becomes routing hashes, written
with Hugging Face ``tokenizers`` and ``jinja2`` (the libraries the engines themselves use), as
``kvroute.prompt`` did before it called the data plane's Rust prompters. The tests check the Rust
implementation (``kvroute.prompt``, ``kvroute._core``) against it; nothing in the package uses it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import numpy.typing as npt
from kvroute._core import block_hashes, identity_root
from kvroute.prompt import BadRequest, Prompt, Prompter

__all__ = ["ApproxReference", "ExactReference"]


def _output_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadRequest(f"{key} must be a non-negative integer, got {v!r}")
            return v
    return None


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI content parts; non-text parts (media) are written as their JSON (they count in the
        # prompt's length; the hashes stop where the first one begins, see ApproxReference.prompt).
        return "".join(p.get("text", "") if _is_text(p) else json.dumps(p, sort_keys=True) for p in content)
    raise BadRequest(f"message content must be a string or a list of content parts, got {type(content).__name__}")


def _media_at(msgs: list[dict[str, Any]]) -> int | None:
    """Where in the approximate chat text the first media part (a non-text content part) begins."""
    at = 0
    for m in msgs:
        at += len(f"<|{m['role']}|>".encode())
        content = m.get("content")
        if isinstance(content, list):
            for p in content:
                if not _is_text(p):
                    return at
                at += len(_message_text([p]).encode("utf-8", "surrogatepass"))
        else:
            at += len(_message_text(content).encode("utf-8", "surrogatepass"))
        at += 1
    return None


def _identity(body: dict[str, Any], lora: str | None) -> int | None:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest(f"cache_salt must be a string, got {type(salt).__name__}")
    return identity_root(lora=lora, cache_salt=salt)


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


class ReferencePrompter(Prompter):
    """kvroute.prompt's base, hashing the reference's token ids with kvroute's block hashes."""

    def _hash(self, tokens: npt.NDArray[np.uint32] | list[int], identity: int | None = None) -> npt.NDArray[np.uint64]:
        return block_hashes(tokens, self.block_size, seed=self.seed, identity=identity)


class ApproxReference(ReferencePrompter):
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

    def prompt(self, body: dict[str, Any], chat: bool, *, lora: str | None = None) -> Prompt:
        keyed = None
        if chat:
            # Role and content, in order: a conversation's earlier turns are a byte prefix of its later ones.
            msgs = _messages(body)
            text = "".join(f"<|{m['role']}|>{_message_text(m.get('content'))}\n" for m in msgs)
            toks: Any = self.text_tokens(text)
            cut = _media_at(msgs)
            keyed = None if cut is None else cut // self.bytes_per_token
        else:
            p = _completion_prompt(body)
            toks = self.text_tokens(p) if isinstance(p, str) else np.asarray(p, dtype=np.uint64)
            if not isinstance(p, str) and (toks.size and int(toks.max()) > 0xFFFFFFFF):
                raise BadRequest("token ids must be in 0..2**32")
        if len(toks) == 0:
            raise BadRequest("empty prompt")
        out = _output_tokens(body)
        return Prompt(self._hash(toks[:keyed], _identity(body, lora)), len(toks), out)


class ExactReference(ReferencePrompter):
    """Exact mode: the engines' Hugging Face tokenizer (``tokenizer.json``) and chat template
    (``tokenizer_config.json``, rendered with jinja2), so the hashes equal the engines' KV events."""

    mode = "exact"

    def __init__(self, path: str, block_size: int, seed: int) -> None:
        super().__init__(block_size, seed)
        self.path = path
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - needs the extra
            raise ImportError("the reference needs the tokenizers package") from exc
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
            raise ImportError("the reference needs jinja2") from exc

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

    def prompt(self, body: dict[str, Any], chat: bool, *, lora: str | None = None) -> Prompt:
        if chat:
            # The template already carries the special tokens (vLLM and SGLang encode without adding them).
            text = self.render_chat(body)
            msgs = _messages(body)
            media = [i for i, m in enumerate(msgs) if isinstance(m.get("content"), list) and not all(_is_text(p) for p in m["content"])]
            if media:
                # Media: the conversation before the message holding it, rendered without a
                # generation prompt (its placeholders only the engine expands); the approximate
                # prompt when that is nothing. Not exact either way (the length is an estimate).
                approx = ApproxReference(self.block_size, self.seed).prompt(body, chat, lora=lora)
                if media[0] > 0:
                    prefix = {**body, "messages": msgs[: media[0]], "add_generation_prompt": False}
                    ids = self.encode(self.render_chat(prefix), add_special_tokens=False)
                    if len(ids):
                        hashes = self._hash(ids, _identity(body, lora))
                        return Prompt(hashes, max(len(ids), approx.num_tokens), approx.output_tokens, exact=False)
                return Prompt(approx.hashes, approx.num_tokens, approx.output_tokens, exact=False)
            toks: Any = self.encode(text, add_special_tokens=False)
        else:
            p = _completion_prompt(body)
            toks = self.encode(p, add_special_tokens=True) if isinstance(p, str) else np.asarray(p, dtype=np.uint64)
        if len(toks) == 0:
            raise BadRequest("empty prompt")
        out = _output_tokens(body)
        return Prompt(self._hash(toks, _identity(body, lora)), len(toks), out)

"""Exact mode in the Rust data plane: its token ids and block hashes equal the Python prompter's for
the same bodies (tokenizers and chat templates built here), and it serves exact mode on its hot path,
leaving to the Python gateway only what it cannot reproduce (whose answers, 400s included, are Python's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import kvroute
from exact_tokenizers import CHATML, LLAMA2, SIMPLE, WORDS, build_byte_level_bpe, build_word_level
from gateway_harness import Cluster, Rendezvous, assert_no_leak, run
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute._core import DataPlane
from kvroute.prompt import ExactPrompter, _completion_prompt

BS = 4
SEED = 1337

SETUPS = {
    "word-level/simple": (build_word_level, SIMPLE),
    "word-level/named-chatml": (build_word_level, [{"name": "tool_use", "template": SIMPLE}, {"name": "default", "template": CHATML}]),
    "bpe/chatml": (build_byte_level_bpe, CHATML),
    "bpe/llama2": (build_byte_level_bpe, LLAMA2),
}


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[DataPlane, ExactPrompter, str]]:
    """Per setup: a (never started) data plane in exact mode, the Python prompter, the tokenizer path."""
    out = {}
    for name, (build, template) in SETUPS.items():
        path = build(tmp_path_factory.mktemp(name.replace("/", "-")), template)
        dp = DataPlane(kvroute.Router(block_size=BS, hash_seed=SEED), backend_port=1, tokenizer=path)
        assert dp.exact and dp.template_unsupported is None, name
        out[name] = (dp, ExactPrompter(path, BS, SEED), path)
    return out


def python_side(ep: ExactPrompter, body: dict[str, Any], chat: bool) -> tuple[list[int], list[int], int, int | None] | None:
    """(token ids, hashes, num_tokens, output_tokens) as the Python gateway derives them, or None
    when it answers 400 (or fails otherwise)."""
    try:
        p = ep.prompt(body, chat)
        if chat:
            ids = ep.encode(ep.render_chat(body), add_special_tokens=False).tolist()
        else:
            first = _completion_prompt(body)
            ids = ep.encode(first, add_special_tokens=True).tolist() if isinstance(first, str) else list(first)
    except Exception:  # BadRequest, jinja2's errors, TypeError: all mean "not this body"
        return None
    if p.output_tokens is not None and p.output_tokens > 2**63 - 1:
        return None  # the Router refuses it: Python's 400 at route time
    return ids, p.hashes.tolist(), p.num_tokens, p.output_tokens


def left_to_python(body: dict[str, Any]) -> bool:
    """Bodies the data plane forwards by design: a template may print a non-text content (Python's repr is not reproduced)."""
    return any(not isinstance(m.get("content"), (str, type(None))) for m in body.get("messages", []) if isinstance(m, dict))


def check(dp: DataPlane, ep: ExactPrompter, body: dict[str, Any], chat: bool) -> bool:
    """Both planes agree on ``body``; returns whether the data plane served it itself."""
    raw = json.dumps(body).encode()
    py = python_side(ep, body, chat)
    rs = dp.prompt(raw, chat)
    if rs is None:
        assert py is None or left_to_python(body), f"the data plane forwards a body Python serves: {body}"
        return False
    assert py is not None, f"the data plane serves a body Python refuses: {body}"
    ids = dp.exact_tokens(raw, chat)
    assert ids is not None
    assert ids.tolist() == py[0], body
    assert (rs[0].tolist(), rs[1], rs[2]) == py[1:], body
    return True


vocab_text = st.lists(
    st.one_of(
        st.sampled_from(WORDS),
        st.sampled_from([" ", "  ", "\n", "\t", ",", "?", "é", "日本", "😀", "<s>", "</s>", "<|im_start|>", "[INST]", "'", '"', "<x>"]),
        st.text(st.characters(exclude_categories=("Cs",)), max_size=4),
    ),
    max_size=12,
).map(" ".join)
content = st.one_of(
    vocab_text,
    vocab_text,
    vocab_text,
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": vocab_text}), max_size=2),
)
tool_call = st.fixed_dictionaries(
    {
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(WORDS), "arguments": st.dictionaries(st.sampled_from(WORDS), vocab_text, max_size=2)}
        )
    }
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "user"]), "content": content},
    optional={"tool_calls": st.lists(tool_call, max_size=2)},
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(WORDS),
                    "parameters": st.dictionaries(st.sampled_from(WORDS), st.integers(-5, 5) | st.booleans() | vocab_text, max_size=3),
                }
            ),
        }
    ),
    max_size=2,
)
chat_extras = st.fixed_dictionaries(
    {},
    optional={
        "tools": tools | st.none(),
        "add_generation_prompt": st.booleans() | st.none(),
        "chat_template_kwargs": st.sampled_from(
            [{}, {"enable_thinking": True}, {"enable_thinking": False}, {"messages": []}, [1], None, 0]
        ),
        "max_tokens": st.integers(-1, 2**64) | st.none() | st.booleans(),
        "max_completion_tokens": st.integers(0, 100),
    },
)
token_ids = st.lists(st.integers(-1, 2**32 + 1) | st.integers(0, 600), max_size=14)
prompt = st.one_of(vocab_text, vocab_text, token_ids, st.lists(vocab_text, max_size=2), st.lists(token_ids, max_size=2))


@pytest.mark.parametrize("setup", list(SETUPS))
@settings(max_examples=150, deadline=None, derandomize=True)
@given(msgs=st.lists(message, max_size=4), extras=chat_extras)
def test_chat_token_ids_and_hashes_equal_pythons(planes: Any, setup: str, msgs: list[dict[str, Any]], extras: dict[str, Any]) -> None:
    dp, ep, _ = planes[setup]
    check(dp, ep, {"messages": msgs, **extras}, chat=True)


@pytest.mark.parametrize("setup", ["word-level/simple", "bpe/chatml"])
@settings(max_examples=200, deadline=None, derandomize=True)
@given(p=prompt, max_tokens=st.none() | st.integers(0, 50))
def test_completion_token_ids_and_hashes_equal_pythons(planes: Any, setup: str, p: Any, max_tokens: int | None) -> None:
    dp, ep, _ = planes[setup]
    check(dp, ep, {"prompt": p, "max_tokens": max_tokens}, chat=False)


CHATS = [
    {
        "messages": [{"role": "system", "content": " be brief "}, {"role": "user", "content": "why is the sky blue? é 日本 😀"}],
        "max_tokens": 6,
    },
    {
        "messages": [
            {"role": "user", "content": "the weather in paris"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "paris"}}}]},
            {"role": "user", "content": "once upon a time"},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"city": "<string>", "days": 3, "metric": True}}}],
        "chat_template_kwargs": {"enable_thinking": True},
    },
    {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False},
]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_plain_requests_are_served_by_the_data_plane(planes: Any, setup: str) -> None:
    """The common shapes never fall back to Python (the property tests allow forwarding)."""
    dp, ep, _ = planes[setup]
    for body in CHATS:
        assert check(dp, ep, body, chat=True), body
    for body in [
        {"prompt": "once upon a time, the sky 😀"},
        {"prompt": [5, 6, 7, 8, 9]},
        {"prompt": [[1, 2, 3, 4, 5]]},
        {"prompt": ["the sky", "x"]},
    ]:
        assert check(dp, ep, body, chat=False), body


def test_data_plane_tokenizer_errors_are_clear(tmp_path: Path) -> None:
    router = kvroute.Router()
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        DataPlane(router, backend_port=1, tokenizer=str(tmp_path / "missing"))
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        DataPlane(router, backend_port=1, tokenizer=str(tmp_path))
    path = build_word_level(tmp_path / "ok", template="{% for m in messages %}{{ m.content }")  # jinja2 refuses it too
    with pytest.raises(Exception, match="unexpected"):
        ExactPrompter(path, 4, 1337)
    dp = DataPlane(router, backend_port=1, tokenizer=path)
    assert dp.template_unsupported is not None  # chat requests would be forwarded, completions served
    assert dp.prompt(b'{"prompt": "the sky"}', False) is not None
    assert dp.prompt(b'{"messages": [{"role": "user", "content": "x"}]}', True) is None
    with pytest.raises(RuntimeError, match="not in exact mode"):
        DataPlane(router, backend_port=1).exact_tokens(b'{"prompt": "x"}', False)


def test_exact_mode_on_the_hot_path_answers_as_python_does(tmp_path: Path) -> None:
    """Served in Rust (nothing forwarded, load released, decisions inserted as Python does without
    KV events); what it cannot render goes to Python, whose answer the client gets, the same as
    from the Python gateway alone."""
    path = build_byte_level_bpe(tmp_path / "llama2", LLAMA2)
    no_template = build_word_level(tmp_path / "none", template=None)
    alternating = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}

    async def answers(server: str) -> list[tuple[int, Any]]:
        out = []
        async with Cluster(3, server=server, tokenizer=path, router={"block_size": BS}) as c:
            dp = c.gw.data_plane
            for body in [CHATS[0], {"messages": [{"role": "user", "content": "the sky " * 40}], "stream": True}]:
                status, _, data = await c.post("/v1/chat/completions", body)
                assert status == 200, data
            for body in [{"prompt": "once upon a time " * 300, "max_tokens": 3}, {"prompt": list(range(40))}]:  # 5 KB: the blocking pool
                status, _, data = await c.post("/v1/completions", body)
                assert status == 200, data
            if dp is not None:
                m = dp.metrics()
                assert dp.exact and m["forwarded"] == 0, m
                assert m["requests"][("/v1/chat/completions", "2xx")] == 2 and m["requests"][("/v1/completions", "2xx")] == 2
                assert m["routing_count"] == 4 and dp.approx_len() > 0  # no KV events: decisions inserted, as in Python
            assert len(c.router.index) > 0
            for path_, body in [
                ("/v1/chat/completions", alternating),
                ("/v1/chat/completions", {"messages": []}),
                ("/v1/completions", {"prompt": [1, -1]}),
                ("/v1/completions", {"prompt": "the sky", "max_tokens": -1}),
            ]:
                status, _, data = await c.post(path_, body)
                out.append((status, json.loads(data)))
            if dp is not None:
                assert dp.metrics()["forwarded"] == 4  # Python answered those
            assert_no_leak(c)
        async with Cluster(1, server=server, tokenizer=no_template) as c:
            status, _, data = await c.post("/v1/chat/completions", CHATS[0])
            out.append((status, json.loads(data)))
            status, _, _ = await c.post("/v1/completions", {"prompt": "the sky"})
            assert status == 200
            if c.gw.data_plane is not None:
                assert c.gw.data_plane.metrics()["forwarded"] == 1
        return out

    rust, python = run(answers("rust")), run(answers("lean"))
    assert rust == python
    assert [s for s, _ in rust] == [400] * 5
    assert "must alternate" in rust[0][1]["error"]["message"] and "no chat_template" in rust[-1][1]["error"]["message"]


def test_a_tokenizer_only_python_loads_falls_back_to_forwarding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the Rust side cannot load a tokenizer the Python package loads, the data plane forwards
    every completion (exact mode stays correct, in Python) instead of failing to start."""
    import kvroute.gateway.dataplane as dataplane

    real = dataplane.DataPlane

    def rust_refuses_tokenizers(router: kvroute.Router, *, tokenizer: str | None = None, **kw: Any) -> DataPlane:
        if tokenizer is not None:
            raise ValueError(f"cannot load the tokenizer {tokenizer}: unsupported here")
        return real(router, **kw)

    monkeypatch.setattr(dataplane, "DataPlane", rust_refuses_tokenizers)
    path = build_word_level(tmp_path)

    async def scenario() -> None:
        async with Cluster(2, server="rust", tokenizer=path, router={"block_size": BS}) as c:
            dp = c.gw.data_plane
            assert dp is not None and not dp.exact
            status, _, data = await c.post("/v1/chat/completions", CHATS[0])
            assert status == 200, data
            assert dp.metrics()["forwarded"] == 1 and dp.metrics()["routing_count"] == 0
            assert_no_leak(c)

    run(scenario())


@pytest.mark.parametrize("convention", ["vllm", "sglang"])
def test_exact_mode_pd_is_served_by_the_data_plane(tmp_path: Path, convention: str) -> None:
    """Exact prompts route PD pairs on the data plane as well, in both conventions."""
    path = build_byte_level_bpe(tmp_path / "bpe", CHATML)

    async def scenario() -> None:
        rv = Rendezvous() if convention == "sglang" else None
        async with Cluster(prefill=1, decode=1, server="rust", tokenizer=path, pd_convention=convention, rendezvous=rv) as c:
            dp = c.gw.data_plane
            assert dp is not None and dp.exact
            status, headers, data = await c.post("/v1/chat/completions", {**CHATS[0], "stream": True})
            assert status == 200 and headers["X-Kvroute-Worker"] == c.decode[0].url, data
            status, _, data = await c.post("/v1/completions", {"prompt": "once upon a time", "max_tokens": 2})
            assert status == 200, data
            m = dp.metrics()
            assert m["forwarded"] == 0 and m["routing_count"] == 2, m
            assert_no_leak(c)

    run(scenario())

"""Exact mode in the Rust data plane: its token ids and block hashes equal the Python reference's
(tests/support/prompt_reference.py: Hugging Face tokenizers and jinja2, as the engines render) for the same
bodies (tokenizers and chat templates built here), ``kvroute.prompt.ExactPrompter`` (what the
integrations call) answers as the plane does, invalid bodies get its 400s, and a valid body it
cannot render exactly routes on approximate hashes."""

from __future__ import annotations

import functools
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
from kvroute.prompt import BadRequest, ExactPrompter
from prompt_reference import ExactReference, _completion_prompt

BS = 4
SEED = 1337

SETUPS = {
    "word-level/simple": (build_word_level, SIMPLE),
    "word-level/named-chatml": (build_word_level, [{"name": "tool_use", "template": SIMPLE}, {"name": "default", "template": CHATML}]),
    "bpe/chatml": (build_byte_level_bpe, CHATML),
    "bpe/llama2": (build_byte_level_bpe, LLAMA2),
}


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[DataPlane, ExactReference, str]]:
    """Per setup: a (never started) data plane in exact mode, the Python reference, the tokenizer path."""
    out = {}
    for name, (build, template) in SETUPS.items():
        path = build(tmp_path_factory.mktemp(name.replace("/", "-")), template)
        dp = DataPlane(kvroute.Router(block_size=BS, hash_seed=SEED), tokenizer=path)
        assert dp.exact and dp.template_unsupported is None, name
        out[name] = (dp, ExactReference(path, BS, SEED), path)
    return out


def python_side(ep: ExactReference, body: dict[str, Any], chat: bool) -> tuple[list[int], list[int], int, int | None] | None:
    """(token ids, hashes, num_tokens, output_tokens) as the Python reference derives them, or None
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


def printed_non_text(body: dict[str, Any]) -> bool:
    """Bodies whose exact rendering is not reproduced by design: a template may print a non-text content."""
    return any(not isinstance(m.get("content"), (str, type(None))) for m in body.get("messages", []) if isinstance(m, dict))


@functools.cache
def library_prompter(path: str) -> ExactPrompter:
    return ExactPrompter(path, BS, SEED)


def check(dp: DataPlane, ep: ExactReference, body: dict[str, Any], chat: bool) -> bool:
    """The plane agrees with the Python reference on ``body``, and ``kvroute.prompt`` with the plane;
    returns whether it routed it exactly."""
    raw = json.dumps(body).encode()
    py = python_side(ep, body, chat)
    lib = library_prompter(ep.path)
    try:
        ids = dp.exact_tokens(raw, chat)
        rs = dp.prompt(raw, chat)  # exact, or the approximate fallback
    except ValueError:  # the client's 400
        assert py is None, f"the data plane refuses a body Python serves: {body}"
        with pytest.raises(BadRequest):
            lib.prompt(body, chat)
        return False
    got = lib.prompt(body, chat)
    assert (got.hashes.tolist(), got.num_tokens, got.output_tokens, got.exact) == (rs[0].tolist(), rs[1], rs[2], ids is not None)
    if ids is None:
        assert py is None or printed_non_text(body), f"the data plane routes approximately a body Python renders: {body}"
        return False
    assert py is not None, f"the data plane serves a body Python refuses: {body}"
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
    """The common shapes are always routed exactly (the property tests allow the approximate fallback)."""
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
        DataPlane(router, tokenizer=str(tmp_path / "missing"))
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        DataPlane(router, tokenizer=str(tmp_path))
    path = build_word_level(tmp_path / "ok", template="{% for m in messages %}{{ m.content }")  # jinja2 refuses it too
    with pytest.raises(Exception, match="unexpected"):
        ExactReference(path, 4, 1337)
    lib = ExactPrompter(path, 4, 1337)  # as the plane: chat routes approximately, completions exactly
    assert lib.template_unsupported is not None
    assert lib.prompt({"messages": [{"role": "user", "content": "x"}]}, True).exact is False
    assert lib.prompt({"prompt": "the sky"}, False).exact is True
    dp = DataPlane(router, tokenizer=path)
    assert dp.template_unsupported is not None  # chat requests route approximately, completions exactly
    assert dp.exact_tokens(b'{"prompt": "the sky"}', False) is not None
    chat = b'{"messages": [{"role": "user", "content": "x"}]}'
    assert dp.exact_tokens(chat, True) is None
    approx = DataPlane(kvroute.Router()).prompt(chat, True)
    assert approx[0].tolist() == dp.prompt(chat, True)[0].tolist()
    with pytest.raises(RuntimeError, match="not in exact mode"):
        DataPlane(router).exact_tokens(b'{"prompt": "x"}', False)


def test_exact_mode_on_the_plane_answers_as_python_does(tmp_path: Path) -> None:
    """Routed in Rust (load released, decisions inserted as without KV events); invalid bodies get
    the 400s kvroute.prompt raises; a body the template cannot print exactly is routed approximately and
    the engine still gets it unchanged."""
    path = build_byte_level_bpe(tmp_path / "llama2", LLAMA2)
    no_template = build_word_level(tmp_path / "none", template=None)
    printing = build_word_level(tmp_path / "printing", template="{% for m in messages %}{{ m.content }}{% endfor %}")
    alternating = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    ep = ExactPrompter(path, BS, SEED)

    async def scenario() -> None:
        async with Cluster(3, tokenizer=path, router={"block_size": BS}) as c:
            dp = c.gw.plane
            for body in [CHATS[0], {"messages": [{"role": "user", "content": "the sky " * 40}], "stream": True}]:
                status, _, data = await c.post("/v1/chat/completions", body)
                assert status == 200, data
            for body in [{"prompt": "once upon a time " * 300, "max_tokens": 3}, {"prompt": list(range(40))}]:  # 5 KB: the blocking pool
                status, _, data = await c.post("/v1/completions", body)
                assert status == 200, data
            m = dp.metrics()
            assert dp.exact and m["requests"][("/v1/chat/completions", "2xx")] == 2 and m["requests"][("/v1/completions", "2xx")] == 2
            assert m["routing_count"] == 4 and dp.approx_len() > 0  # no KV events: decisions inserted
            messages = []
            for path_, body in [
                ("/v1/chat/completions", alternating),
                ("/v1/chat/completions", {"messages": []}),
                ("/v1/completions", {"prompt": [1, -1]}),
                ("/v1/completions", {"prompt": "the sky", "max_tokens": -1}),
            ]:
                status, _, data = await c.post(path_, body)
                assert status == 400, (body, data)
                with pytest.raises(BadRequest):  # kvroute.prompt (the integrations') refuses it too
                    ep.prompt(body, path_ == "/v1/chat/completions")
                messages.append(json.loads(data)["error"]["message"])
            assert "must alternate" in messages[0] and "messages" in messages[1], messages
            assert "token ids" in messages[2] and "max_tokens" in messages[3], messages
            assert_no_leak(c)
        async with Cluster(1, tokenizer=no_template) as c:
            status, _, data = await c.post("/v1/chat/completions", CHATS[0])
            assert status == 400 and "no chat_template" in json.loads(data)["error"]["message"]
            status, _, _ = await c.post("/v1/completions", {"prompt": "the sky"})
            assert status == 200
        async with Cluster(1, tokenizer=printing, router={"block_size": BS}) as c:
            c.mocks[0].keep_bodies = True
            body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "the sky"}]}], "max_tokens": 2}
            assert c.gw.plane.exact_tokens(json.dumps(body).encode(), True) is None  # printing a list: not reproduced
            status, _, data = await c.post("/v1/chat/completions", body)
            assert status == 200 and c.mocks[0].bodies[-1] == body, data
            assert c.gw.plane.metrics()["routing_count"] == 1
            assert_no_leak(c)

    run(scenario())


@pytest.mark.parametrize("convention", ["vllm", "sglang"])
def test_exact_mode_pd_is_served_by_the_data_plane(tmp_path: Path, convention: str) -> None:
    """Exact prompts route PD pairs on the data plane as well, in both conventions."""
    path = build_byte_level_bpe(tmp_path / "bpe", CHATML)

    async def scenario() -> None:
        rv = Rendezvous() if convention == "sglang" else None
        async with Cluster(prefill=1, decode=1, tokenizer=path, pd_convention=convention, rendezvous=rv) as c:
            dp = c.gw.plane
            assert dp.exact
            status, headers, data = await c.post("/v1/chat/completions", {**CHATS[0], "stream": True})
            assert status == 200 and headers["X-Kvroute-Worker"] == c.decode[0].url, data
            status, _, data = await c.post("/v1/completions", {"prompt": "once upon a time", "max_tokens": 2})
            assert status == 200, data
            m = dp.metrics()
            assert m["routing_count"] == 2, m
            assert_no_leak(c)

    run(scenario())


@pytest.mark.parametrize("setup", ["bpe/chatml", "bpe/llama2"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(system=vocab_text, turns=st.lists(st.tuples(vocab_text, vocab_text), min_size=2, max_size=6))
def test_long_conversations_reuse_their_prefix_with_the_same_tokens(
    planes: Any, setup: str, system: str, turns: list[tuple[str, str]]
) -> None:
    """A conversation long enough for the prefix store, extended turn by turn: every turn's token ids
    are the Hugging Face reference's whole encode, while later turns reuse the earlier turns' prefix."""
    dp, ep, _ = planes[setup]
    before = dp.prefix_reuse
    assert before is not None, "this tokenizer should have a prefix store"
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "A long shared system prompt, past the store's minimum. " * 45 + system}]
    for question, answer in turns:
        msgs.append({"role": "user", "content": question})
        check(dp, ep, {"messages": msgs}, chat=True)
        msgs.append({"role": "assistant", "content": answer})
    after = dp.prefix_reuse
    assert after is not None and after["hits"] + after["misses"] > before["hits"] + before["misses"]
    if setup == "bpe/chatml":  # each turn starts with the last one's text up to its generation prompt
        assert after["hits"] >= before["hits"] + len(turns) - 1


def test_a_tokenizer_without_split_tokens_encodes_whole(planes: Any) -> None:
    dp, _, path = planes["word-level/simple"]
    assert dp.prefix_reuse is None
    ep = ExactPrompter(path, BS, SEED)
    assert ep.prefix_reuse is None and "splits at" in str(ep.prefix_reuse_unavailable)

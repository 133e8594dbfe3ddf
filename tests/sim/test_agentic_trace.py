"""Closed-loop agentic traces (`agentic_trace`, `AGENT_FAMILIES`): sessions whose later turns wait
for the previous turn's answer plus a tool/think delay, in AISimulate's session form of Mooncake rows."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import pytest
from kvroute.sim import write_trace
from kvroute.sim.aisim import HAS_AISIM, replay
from kvroute.sim.trace import AGENT_FAMILIES, MOONCAKE_BLOCK, agentic_trace, trace_stats

FAMILIES = list(AGENT_FAMILIES)
BS = MOONCAKE_BLOCK

needs_aisim = pytest.mark.skipif(
    not HAS_AISIM and not os.environ.get("KVROUTE_REQUIRE_AISIM"), reason="kvroute built without the aisim feature"
)

_CACHE: dict[tuple[str, int, int], list[dict[str, Any]]] = {}


def trace(family: str, sessions: int = 400, seed: int = 0) -> list[dict[str, Any]]:
    """400 sessions at 1/s (memoised: the tests only read the rows)."""
    key = (family, sessions, seed)
    if key not in _CACHE:
        _CACHE[key] = agentic_trace(family, sessions=sessions, rate=1.0, seed=seed)
    return _CACHE[key]


def by_session(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["session_id"], []).append(r)
    return out


def full_blocks(row: dict[str, Any]) -> list[int]:
    ids: list[int] = row["hash_ids"][: row["input_length"] // BS]
    return ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_deterministic(family: str) -> None:
    a = agentic_trace(family, sessions=50, rate=2.0, seed=7)
    assert a == agentic_trace(family, sessions=50, rate=2.0, seed=7)
    assert a != agentic_trace(family, sessions=50, rate=2.0, seed=8)


@pytest.mark.parametrize("family", FAMILIES)
def test_session_rows_are_in_the_form_aisimulate_loads(family: str) -> None:
    p = AGENT_FAMILIES[family]
    rows = trace(family)
    sessions = by_session(rows)
    assert len(sessions) == 400
    # Grouped by session, sessions in order of first arrival, each turn right after the previous.
    order = [r["session_id"] for r in rows]
    assert order == [sid for sid, rs in sessions.items() for _ in rs]
    starts = [rs[0]["timestamp"] for rs in sessions.values()]
    assert starts == sorted(starts)
    for rs in sessions.values():
        assert 1 <= len(rs) <= p["steps"][1]
        first, later = rs[0], rs[1:]
        assert isinstance(first["session_id"], str)  # AISimulate reads session_id as a string
        assert isinstance(first["timestamp"], int) and first["timestamp"] >= 0 and "delay" not in first
        for r in later:
            assert "timestamp" not in r and isinstance(r["delay"], int)
        for r in rs:
            assert p["output"][0] <= r["output_length"] <= p["output"][1]
            assert 1 <= r["input_length"] <= p["max_tokens"]
            assert r["agent"] == first["agent"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hash_ids_are_prefix_chained_and_cover_the_prompt(family: str) -> None:
    p = AGENT_FAMILIES[family]
    for rs in by_session(trace(family)).values():
        for r in rs:
            assert math.ceil(r["input_length"] / BS) == len(r["hash_ids"])
        for prev, cur in itertools.pairwise(rs):
            full = full_blocks(prev)
            assert cur["hash_ids"][: len(full)] == full
            # The context grows by the model's answer plus the tools' output.
            grown = cur["input_length"] - prev["input_length"] - prev["output_length"]
            assert p["append_blocks"][0] * BS <= grown <= p["append_blocks"][1] * BS
    # A partial last block is fresh each time: no two rows share it.
    partial = [r["hash_ids"][-1] for r in trace(family) if r["input_length"] % BS]
    assert len(partial) == len(set(partial))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_sessions_arrive_as_poisson_at_rate(family: str, rate: float) -> None:
    rows = agentic_trace(family, sessions=400, rate=rate, seed=1)
    starts = [r["timestamp"] for r in rows if "timestamp" in r]
    assert len(starts) == 400
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1000.0 / rate, rel=0.25)


@pytest.mark.parametrize("family", FAMILIES)
def test_delays_are_clipped_think_times(family: str) -> None:
    p = AGENT_FAMILIES[family]
    lo, hi = p["think"]
    delays = [r["delay"] for r in trace(family) if "delay" in r]
    assert len(delays) > 300
    assert all(int(lo * 1000) <= d <= int(hi * 1000) for d in delays)
    assert sum(delays) / len(delays) == pytest.approx(p["think_mean"] * 1000, rel=0.2)


@pytest.mark.parametrize("family", FAMILIES)
def test_agent_types_share_their_prefix_and_differ_from_each_other(family: str) -> None:
    p = AGENT_FAMILIES[family]
    firsts: dict[int, list[list[int]]] = {}
    for rs in by_session(trace(family)).values():
        firsts.setdefault(rs[0]["agent"], []).append(full_blocks(rs[0]))
    assert set(firsts) <= set(range(p["agent_types"]))
    heads = set()
    for agent, ids in firsts.items():
        # Every session of a type opens on the same prefix of at least the family's shortest.
        shared = min(common_prefix(ids[0], other) for other in ids)
        if len(ids) > 1:
            assert p["prefix_blocks"][0] <= shared, (agent, shared)
        heads.add(ids[0][0])
    assert len(heads) == len(firsts)  # types do not share a first block
    # Zipf skew: the most popular type's share of sessions.
    top = max(len(v) for v in firsts.values()) / 400
    assert {"tools": 0.3 < top < 0.55, "swarm": top < 0.15, "research": top > 0.7}[family], top


def forks(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(child, parent) pairs: sessions whose first prompt holds an earlier session's whole prompt
    and answer, reaching past their agent type's shared prefix (which every session of the type has)."""
    sessions = by_session(rows)
    type_prefix: dict[int, int] = {}
    heads: dict[int, list[int]] = {}
    for rs in sessions.values():
        ids = full_blocks(rs[0])
        head = heads.setdefault(rs[0]["agent"], ids)
        type_prefix[rs[0]["agent"]] = min(type_prefix.get(rs[0]["agent"], len(ids)), common_prefix(head, ids))
    seen: list[tuple[str, dict[str, Any]]] = []
    out = []
    for sid, rs in sessions.items():
        first = rs[0]
        for psid, r in seen:
            full = full_blocks(r)
            if (
                len(full) > type_prefix[first["agent"]]
                and first["hash_ids"][: len(full)] == full
                and first["input_length"] >= r["input_length"] + r["output_length"]
            ):
                out.append((sid, psid))
                break
        seen.extend((sid, r) for r in rs)
    return out


def test_research_sub_agents_fork_from_running_sessions() -> None:
    rows = trace("research")
    pairs = forks(rows)
    assert 0.35 * 400 <= len(pairs) <= 0.6 * 400  # about half the sessions fork
    first = {sid: rs[0] for sid, rs in by_session(rows).items()}
    for child, parent in pairs:
        assert first[child]["agent"] == first[parent]["agent"]
        assert first[child]["timestamp"] >= first[parent]["timestamp"]
    # Forks make long prefixes shared across sessions, beyond the agents' system prompts.
    assert max(len(full_blocks(first[c])) for c, _ in pairs) > 64
    for family in ("tools", "swarm"):
        assert forks(trace(family)) == []


def test_context_cap_ends_sessions_early() -> None:
    for family in FAMILIES:
        cap = AGENT_FAMILIES[family]["max_tokens"]
        assert max(r["input_length"] for r in trace(family)) <= cap
    # Long research contexts run into the cap: some sessions stop before a next step would overflow.
    near = [r for r in trace("research") if r["input_length"] > AGENT_FAMILIES["research"]["max_tokens"] * 0.75]
    assert near


def test_families_differ() -> None:
    stats = {f: trace_stats(trace(f)) for f in FAMILIES}
    assert stats["swarm"]["mean_steps"] > stats["tools"]["mean_steps"] > stats["research"]["mean_steps"]
    assert stats["research"]["mean_delay_ms"] > stats["tools"]["mean_delay_ms"] > stats["swarm"]["mean_delay_ms"]
    assert stats["research"]["mean_prompt_tokens"] > stats["tools"]["mean_prompt_tokens"] > stats["swarm"]["mean_prompt_tokens"]
    assert stats["research"]["mean_output_tokens"] > 2 * stats["tools"]["mean_output_tokens"]
    # Swarm prompts are mostly the sessions' own context; tools' long shared prefixes dominate theirs.
    assert stats["tools"]["cross_session_share"] > stats["swarm"]["cross_session_share"] + 0.3
    for s in stats.values():
        assert s["sessions"] == 400


def test_block_size_changes_the_ids_not_the_workload() -> None:
    a = agentic_trace("tools", sessions=40, rate=1.0, seed=3)
    b = agentic_trace("tools", sessions=40, rate=1.0, seed=3, block_size=64)
    keys = ("session_id", "timestamp", "delay", "input_length", "output_length", "agent")
    assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / 64) for r in b)


def test_trace_stats_counts() -> None:
    rows = [
        {"session_id": "a", "timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"session_id": "a", "delay": 300, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]},
        {"session_id": "b", "timestamp": 5, "input_length": 600, "output_length": 30, "hash_ids": [1, 4]},
    ]
    s = trace_stats(rows)
    assert (s["rows"], s["sessions"], s["mean_steps"]) == (3, 2, 1.5)
    assert s["mean_prompt_tokens"] == pytest.approx(2724 / 3)
    assert s["mean_output_tokens"] == 20 and s["mean_delay_ms"] == 300
    assert s["cross_session_share"] == pytest.approx(3 / 7)  # id 1, in both sessions, three times
    assert s["reuse_share"] == pytest.approx(1 - 4 / 7)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(family="chat"), "unknown agentic family 'chat'"),
        (dict(sessions=0), "sessions must be"),
        (dict(rate=0.0), "rate must be"),
        (dict(rate=-1.0), "rate must be"),
        (dict(rate=float("nan")), "rate must be"),
        (dict(rate=float("inf")), "rate must be"),
        (dict(block_size=0), "block_size must be"),
    ],
)
def test_bad_arguments_are_refused(kw: dict[str, Any], msg: str) -> None:
    args: dict[str, Any] = dict(family="tools", sessions=10, rate=1.0)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        agentic_trace(args.pop("family"), **args)


@needs_aisim
@pytest.mark.parametrize("family", FAMILIES)
def test_aisimulate_replays_every_turn(family: str, tmp_path: os.PathLike[str]) -> None:
    """AISimulate loads the session/delay rows and serves every turn, each released after its
    session's previous turn has finished plus its delay (closed loop)."""
    rows = agentic_trace(family, sessions=20, rate=1.0, seed=5)
    path = os.path.join(str(tmp_path), f"{family}.jsonl")
    assert write_trace(rows, path) == len(rows)
    r = replay(path, router=None, workers=2)
    assert r.summary["requests"] == len(rows)
    assert r.summary["completed"] == len(rows)
    assert len(r.records) == len(rows)
    assert not any(rec["rejected"] for rec in r.records)
    assert sorted(rec["input_tokens"] for rec in r.records) == sorted(row["input_length"] for row in rows)
    # Records carry no session: match them to rows by (prompt, output) tokens where that is unique.
    found: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for rec in r.records:
        found.setdefault((rec["input_tokens"], rec["output_tokens"]), []).append(rec)
    checked = 0
    for rs in by_session(rows).values():
        runs = [found.get((row["input_length"], row["output_length"]), []) for row in rs]
        if len(runs[0]) == 1:
            assert runs[0][0]["arrival_ms"] == pytest.approx(rs[0]["timestamp"])
        for prev, cur, row in zip(runs, runs[1:], rs[1:]):
            if len(prev) == len(cur) == 1:  # released its delay after the previous turn's last token
                assert cur[0]["arrival_ms"] == pytest.approx(prev[0]["last_token_ms"] + row["delay"], abs=1e-3)
                checked += 1
    assert checked >= 0.9 * (len(rows) - 20)

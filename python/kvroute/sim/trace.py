"""Request traces in the Mooncake format (timestamp ms, input_length, output_length, hash_ids of
512-token blocks): loading, writing, and generating synthetic traces of other shapes.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from kvroute import _core
from kvroute.sim.workload import Workload

#: Where the project keeps the public Mooncake trace, relative to its shared data folder.
MOONCAKE_TRACE = os.path.join("traces", "mooncake_conversation_trace.jsonl")


def find_shared_dir(start: str | os.PathLike[str]) -> str | None:
    """``$KVROUTE_SHARED``, else the nearest ``shared/`` folder holding ``traces/`` beside ``start``
    or one of its parents; ``None`` where there is none (a fresh clone has no shared data)."""
    if "KVROUTE_SHARED" in os.environ:
        return os.environ["KVROUTE_SHARED"]
    d = os.path.abspath(start)
    while True:
        cand = os.path.join(os.path.dirname(d), "shared")
        if os.path.isdir(os.path.join(cand, "traces")):
            return cand
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)


__all__ = [
    "AGENT_FAMILIES",
    "MOONCAKE_BLOCK",
    "SHAPES",
    "agentic_trace",
    "load_trace",
    "phase_trace",
    "records_to_workload",
    "synthetic_trace",
    "trace_stats",
    "write_trace",
]

#: Tokens per hash id in Mooncake's released traces.
MOONCAKE_BLOCK = 512


class TraceFormatError(ValueError):
    """A trace line is not a valid Mooncake-format record."""


def _check_record(rec: Any, where: str) -> tuple[float, int, int, list[int]]:
    if not isinstance(rec, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in ("timestamp", "input_length", "hash_ids") if k not in rec]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}; expected timestamp, input_length, output_length, hash_ids")
    ts, n, out, ids = rec["timestamp"], rec["input_length"], rec.get("output_length", 0), rec["hash_ids"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise TraceFormatError(f"{where}: timestamp must be a finite number of milliseconds >= 0, got {ts!r}")
    for name, v in (("input_length", n), ("output_length", out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise TraceFormatError(f"{where}: {name} must be an int >= 0, got {v!r}")
    if n < 1:
        raise TraceFormatError(f"{where}: input_length must be >= 1 (an empty prompt), got {n}")
    if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64 for x in ids):
        raise TraceFormatError(f"{where}: hash_ids must be a list of ints in 0..2**64")
    return float(ts), n, out, ids


def records_to_workload(
    records: Iterable[dict[str, Any]], *, name: str = "trace", block_size: int = MOONCAKE_BLOCK, speedup: float = 1.0
) -> Workload:
    """Builds a `Workload` from Mooncake-format records (already parsed JSON objects).

    Arrivals are ``timestamp / 1000 / speedup`` seconds; ``hash_ids`` are chained into sequence
    hashes so that equal hashes mean equal prefixes. A last hash id covering a partial block is
    kept (it is a distinct block in the trace) and counted as cached only up to ``input_length``.
    """
    if not (isinstance(speedup, (int, float)) and math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"speedup must be a finite number > 0, got {speedup!r}")
    times: list[float] = []
    lens: list[int] = []
    outs: list[int] = []
    offsets = [0]
    ids: list[int] = []
    for i, rec in enumerate(records):
        ts, n, out, hs = _check_record(rec, f"{name} record {i}")
        if len(hs) > math.ceil(n / block_size):
            raise TraceFormatError(f"{name} record {i}: {len(hs)} hash_ids for {n} tokens; at most ceil({n}/{block_size}) expected")
        times.append(ts / 1000.0 / speedup)
        lens.append(n)
        outs.append(out)
        ids.extend(hs)
        offsets.append(len(ids))
    arrival = np.asarray(times, dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    off = np.asarray(offsets, dtype=np.uint64)
    chained = _core.chain_block_ids(np.asarray(ids, dtype=np.uint64), off)
    if np.any(order != np.arange(len(order))):
        # Traces are usually sorted; if not, reorder requests by arrival, keeping ties stable.
        parts = [chained[offsets[i] : offsets[i + 1]] for i in order]
        chained = np.concatenate(parts) if parts else chained
        lens = [lens[i] for i in order]
        outs = [outs[i] for i in order]
        arrival = arrival[order]
        off = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.uint64)
    return Workload(
        name=name,
        block_size=block_size,
        arrival=arrival,
        num_tokens=np.asarray(lens, dtype=np.int64),
        output_tokens=np.asarray(outs, dtype=np.int64),
        hash_offsets=off.astype(np.int64),
        hashes=chained,
        meta={"scenario": "trace", "speedup": speedup},
    )


def _read_lines(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def load_trace(
    path: str | os.PathLike[str], *, speedup: float = 1.0, limit: int | None = None, block_size: int = MOONCAKE_BLOCK
) -> Workload:
    """Loads a Mooncake-format JSONL trace (e.g. ``mooncake_conversation_trace.jsonl``).

    ``speedup`` > 1 compresses arrival times (more load); ``limit`` keeps the first requests.
    """
    recs: Iterable[dict[str, Any]] = _read_lines(path)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        recs = (r for i, r in zip(range(limit), recs))
    w = records_to_workload(recs, name=os.path.basename(os.fspath(path)), block_size=block_size, speedup=speedup)
    if len(w) == 0:
        raise TraceFormatError(f"{path}: the trace has no requests")
    return w


def write_trace(records: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> int:
    """Writes records as Mooncake-format JSONL; returns the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
            n += 1
    return n


# ---- synthetic traces ------------------------------------------------------------------------

#: Built-in synthetic shapes: name -> (description, parameters).
SHAPES: dict[str, dict[str, Any]] = {
    # Multi-turn chat like the seed's, in 512-token blocks: shared system prompts, short turns.
    "chat": dict(
        prefixes=20,
        prefix_tokens=2048,
        sessions=400,
        turn_tokens=(150, 450),
        output=(50, 400),
        doc_tokens=(0, 0),
        burst=0.0,
        max_tokens=16384,
    ),
    # Agents: few very long tool/system prefixes, sessions whose context grows fast, long outputs,
    # turns of a session arriving in quick bursts.
    "agent": dict(
        prefixes=4,
        prefix_tokens=8192,
        sessions=64,
        turn_tokens=(500, 3000),
        output=(200, 1500),
        doc_tokens=(0, 0),
        burst=0.6,
        max_tokens=65536,
    ),
    # Long documents (Zipf-popular) with short questions: long prompts, little cross-session reuse.
    "docs": dict(
        prefixes=2,
        prefix_tokens=512,
        sessions=1500,
        turn_tokens=(50, 200),
        output=(100, 400),
        doc_tokens=(8000, 32000),
        burst=0.0,
        max_tokens=40000,
    ),
    # Long-context conversations (the suite's tuning half): each session opens on a shared
    # system prompt plus its own 6-16k-token document, so every prompt is 10k+ tokens, and grows
    # by a turn per request (multi-turn order kept); a few sessions run agent-like bursts.
    "long": dict(
        prefixes=8,
        prefix_tokens=4096,
        sessions=300,
        turn_tokens=(200, 1000),
        output=(100, 500),
        doc_tokens=(6144, 16384),
        burst=0.3,
        max_tokens=65536,
    ),
    # Long-context retrieval chat (the suite's held-out half, not used to choose any constant):
    # many sessions over 10-24k-token documents, short questions, little cross-session reuse.
    "long_rag": dict(
        prefixes=2,
        prefix_tokens=2048,
        sessions=800,
        turn_tokens=(100, 600),
        output=(50, 300),
        doc_tokens=(10240, 24576),
        burst=0.0,
        max_tokens=49152,
    ),
}


def synthetic_trace(
    shape: str = "chat", *, requests: int = 2000, rate: float = 10.0, seed: int = 0, block_size: int = MOONCAKE_BLOCK
) -> list[dict[str, Any]]:
    """Generates a trace in the Mooncake format with the given ``shape`` (see `SHAPES`).

    Sessions start from one of a few shared prefixes (plus, for "docs", their own document) and
    grow by a turn per request; hash ids are prefix-chained like Mooncake's (a full block keeps
    its id for the session's life; a partial last block gets a fresh id each time). Arrivals
    are Poisson at ``rate`` per second, with ``burst`` the chance a request continues the previous
    request's session right away (agent loops).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; expected one of {', '.join(SHAPES)}")
    if requests < 1 or not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"need requests >= 1 and a finite rate > 0, got requests={requests}, rate={rate}")
    p = SHAPES[shape]
    rng = random.Random(seed)
    next_id = 0

    def fresh() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    prefix_blocks = p["prefix_tokens"] // block_size
    prefixes = [[fresh() for _ in range(prefix_blocks)] for _ in range(p["prefixes"])]
    sessions: list[tuple[list[int], int]] = []  # (full-block ids, tokens)
    starts: list[tuple[list[int], int]] = []
    for _ in range(p["sessions"]):
        base = list(prefixes[rng.randrange(len(prefixes))])
        tokens = prefix_blocks * block_size
        lo, hi = p["doc_tokens"]
        if hi:
            doc = rng.randint(lo, hi) // block_size * block_size
            base += [fresh() for _ in range(doc // block_size)]
            tokens += doc
        sessions.append((base, tokens))
        starts.append((list(base), tokens))
    # Zipf-like popularity over sessions so some are revisited often.
    weights = [1.0 / (k + 1) ** 0.8 for k in range(len(sessions))]
    cum = np.cumsum(weights)
    t = 0.0
    out = []
    last = rng.randrange(len(sessions))
    for _ in range(requests):
        t += rng.expovariate(rate)
        if p["burst"] and rng.random() < p["burst"]:
            s = last
        else:
            s = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
            s = min(s, len(sessions) - 1)
        last = s
        ids, tokens = sessions[s]
        turn = rng.randint(*p["turn_tokens"])
        if tokens + turn > p["max_tokens"]:
            # The context is full: the session starts over from its prefix (a new conversation).
            ids, tokens = list(starts[s][0]), starts[s][1]
        tokens += turn
        while len(ids) < tokens // block_size:
            ids.append(fresh())
        sessions[s] = (ids, tokens)
        hash_ids = list(ids) + ([fresh()] if tokens % block_size else [])
        out.append({"timestamp": int(t * 1000), "input_length": tokens, "output_length": rng.randint(*p["output"]), "hash_ids": hash_ids})
    return out


def phase_trace(
    rate: float, isl: int, osl: int, hit: float, *, seconds: float, seed: int = 0, block_size: int = MOONCAKE_BLOCK
) -> list[dict[str, Any]]:
    """A steady phase in the Mooncake format, as the planner describes one: Poisson arrivals at
    ``rate`` per second for ``seconds``, every prompt ``isl`` tokens whose first ``hit`` share
    (whole blocks) is one prefix all requests share and the rest its own, ``osl`` output tokens."""
    if not (rate > 0 and math.isfinite(rate)) or isl < 1 or osl < 1 or not (0 <= hit <= 1) or not seconds > 0:
        raise ValueError(f"need rate > 0, isl >= 1, osl >= 1, hit in [0, 1], seconds > 0; got {rate}, {isl}, {osl}, {hit}, {seconds}")
    rng = random.Random(seed)
    shared = round(hit * isl / block_size)
    blocks = -(-isl // block_size)
    out: list[dict[str, Any]] = []
    t, fresh = 0.0, shared
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        ids = list(range(shared)) + list(range(fresh, fresh + blocks - shared))
        fresh += blocks - shared
        out.append({"timestamp": int(t * 1000), "input_length": isl, "output_length": osl, "hash_ids": ids})


# ---- closed-loop agentic traces --------------------------------------------------------------

#: Agentic / tool-use workload families for `agentic_trace`: name -> parameters. Ranges are
#: inclusive; token counts are tokens, ``*_blocks`` count Mooncake's 512-token blocks (the same
#: workload whatever ``block_size`` the hash ids use); times are seconds.
#:
#: ``agent_types`` agents, picked per session with Zipf(``zipf``) weights; each has a fixed
#: system + tool-definition prefix of ``prefix_blocks`` blocks (drawn once per trace). A session
#: opens on its agent's prefix plus a ``task`` and runs ``steps`` model calls; between calls the
#: agent runs its tools for ``think_mean`` seconds on average (exponential, clipped to ``think``),
#: and the next prompt is the previous one plus the model's answer plus ``append_blocks`` of tool
#: output. ``output`` is the tokens the model writes per call; ``fork`` the chance that a new
#: session is a sub-agent forked from a session still running (it starts from that session's whole
#: context); ``max_tokens`` the context cap at which a session ends.
AGENT_FAMILIES: dict[str, dict[str, Any]] = {
    # Tool-calling assistants (coding / ops agents): a handful of agent types, a few very popular,
    # each with a long system prompt and tool schemas; 3-12 tool calls per task, each returning a
    # few blocks (file contents, command output), a human-scale pause for the tools to run.
    "tools": dict(
        agent_types=6,
        zipf=1.0,
        prefix_blocks=(16, 48),
        task=(100, 1000),
        steps=(3, 12),
        append_blocks=(1, 6),
        think_mean=4.0,
        think=(0.2, 30.0),
        output=(20, 400),
        fork=0.0,
        max_tokens=65536,
    ),
    # A swarm of many small, cheap agents (multi-agent frameworks, simulations): 32 near-equally
    # popular types with short prompts, long chatty loops of 10-40 steps with fast tools and small
    # observations, so many short requests per session arrive back to back.
    "swarm": dict(
        agent_types=32,
        zipf=0.3,
        prefix_blocks=(4, 8),
        task=(50, 300),
        steps=(10, 40),
        append_blocks=(0, 2),
        think_mean=0.8,
        think=(0.05, 10.0),
        output=(50, 300),
        fork=0.0,
        max_tokens=65536,
    ),
    # Deep-research agents: two agent types, one dominant; slow web fetches returning whole pages,
    # long reasoning outputs, and sub-agents: half the sessions fork from a research session still
    # running and carry its whole context, so sessions share long session-specific prefixes.
    "research": dict(
        agent_types=2,
        zipf=2.0,
        prefix_blocks=(24, 40),
        task=(200, 1500),
        steps=(2, 6),
        append_blocks=(4, 16),
        think_mean=12.0,
        think=(1.0, 120.0),
        output=(200, 1500),
        fork=0.5,
        max_tokens=65536,
    ),
}

# A rough service time per model call (ms per output token, plus a fixed part), used only to guess
# how far a parent session has got when a sub-agent forks from it; the replay's timing decides.
_EST_DECODE_MS = 20.0
_EST_CALL_MS = 100.0


def agentic_trace(family: str, *, sessions: int, rate: float, seed: int = 0, block_size: int = MOONCAKE_BLOCK) -> list[dict[str, Any]]:
    """Generates a closed-loop agentic trace of ``sessions`` sessions of ``family`` (see
    `AGENT_FAMILIES`) in AISimulate's session form of the Mooncake format.

    Sessions start as a Poisson process at ``rate`` per second: a session's first row carries
    ``timestamp`` (ms). Each later row is the session's next model call and carries ``delay``
    instead (ms the agent's tools take after the previous call *completes*), so the replay
    releases it then: agents wait for the model. Rows carry ``session_id`` (a string),
    ``input_length``, ``output_length``, prefix-chained ``hash_ids`` of ``block_size``-token
    blocks (a step's ids extend the previous step's full-block ids; a partial last block gets a
    fresh id each time), and ``agent`` (the agent type; the loaders ignore it). Rows are grouped by
    session in order of first arrival, turns in order.

    Replay these with `kvroute.sim.aisim.replay`; kvroute's open-loop `records_to_workload` needs
    a timestamp on every row and refuses them.
    """
    if family not in AGENT_FAMILIES:
        raise ValueError(f"unknown agentic family {family!r}; expected one of {', '.join(AGENT_FAMILIES)}")
    if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
        raise ValueError(f"sessions must be an int >= 1, got {sessions!r}")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of sessions per second > 0, got {rate!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    p = AGENT_FAMILIES[family]
    rng = random.Random(seed)
    next_id = 0

    def fresh() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    def tokens_of(blocks: tuple[int, int]) -> int:
        return rng.randint(blocks[0] * MOONCAKE_BLOCK, blocks[1] * MOONCAKE_BLOCK)

    def think_ms() -> int:
        lo, hi = p["think"]
        return int(min(max(rng.expovariate(1.0 / p["think_mean"]), lo), hi) * 1000)

    # Each agent type's prefix, in whole hash blocks so that sessions of a type share all of it.
    prefixes = [[fresh() for _ in range(rng.randint(*p["prefix_blocks"]) * MOONCAKE_BLOCK // block_size)] for _ in range(p["agent_types"])]
    weights = [1.0 / (k + 1) ** p["zipf"] for k in range(p["agent_types"])]
    cap = p["max_tokens"]
    # Per session: its full-block ids (they only grow) and, per turn, (estimated release ms,
    # input tokens, full blocks, output tokens) -- for sub-agents to fork from.
    ids_of: list[list[int]] = []
    turns_of: list[list[tuple[float, int, int, int]]] = []
    end_of: list[float] = []
    agent_of: list[int] = []
    running: list[int] = []  # sessions still running (by the estimate) at the latest arrival
    out: list[dict[str, Any]] = []
    t = 0.0
    for s in range(sessions):
        t += rng.expovariate(rate)
        now = t * 1000.0
        running = [r for r in running if end_of[r] >= now]
        task = rng.randint(*p["task"])
        parent = None
        if p["fork"] and rng.random() < p["fork"]:
            # The parent's state now: its last call released by the estimate, plus its answer.
            fits = []
            for r in running:
                last = [x for x in turns_of[r] if x[0] <= now][-1]
                if last[1] + last[3] + task <= cap:
                    fits.append((r, last))
            if fits:
                parent = fits[rng.randrange(len(fits))]
        if parent is not None:
            (r, (_, ptokens, pfull, pout)) = parent
            agent = agent_of[r]
            ids = list(ids_of[r][:pfull])
            tokens = ptokens + pout + task
        else:
            agent = rng.choices(range(p["agent_types"]), weights=weights)[0]
            ids = list(prefixes[agent])
            tokens = len(ids) * block_size + task
        agent_of.append(agent)
        sid = f"{family}-{s}"
        turns: list[tuple[float, int, int, int]] = []
        release = now
        for step in range(rng.randint(*p["steps"])):
            row: dict[str, Any] = {"session_id": sid}
            if step == 0:
                row["timestamp"] = int(now)
            else:
                prev = turns[-1]
                grown = prev[1] + prev[3] + tokens_of(p["append_blocks"])
                delay = think_ms()
                if grown > cap:
                    break  # the context is full: the agent gives up (no restart)
                tokens = grown
                release += _EST_CALL_MS + _EST_DECODE_MS * prev[3] + delay
                row["delay"] = delay
            while len(ids) < tokens // block_size:
                ids.append(fresh())
            output = rng.randint(*p["output"])
            turns.append((release, tokens, len(ids), output))
            row.update(
                input_length=tokens,
                output_length=output,
                hash_ids=ids + ([fresh()] if tokens % block_size else []),
                agent=agent,
            )
            out.append(row)
        ids_of.append(ids)
        turns_of.append(turns)
        end_of.append(release + _EST_CALL_MS + _EST_DECODE_MS * turns[-1][3])
        running.append(s)
    return out


def trace_stats(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Summary of a Mooncake-format trace (open-loop or session form): rows, sessions (rows
    without ``session_id`` are one-row sessions), mean steps per session, mean prompt and output
    tokens, mean ``delay`` (ms, over the rows that have one), ``cross_session_share`` (the share of
    prompt blocks whose hash id also occurs in another session's prompts) and ``reuse_share`` (the
    share of prompt blocks seen earlier in the trace: an unbounded prefix cache's hit rate)."""
    rows = list(rows)
    sessions_of: dict[int, set[str]] = {}
    sessions: dict[str, int] = {}
    delays: list[float] = []
    for i, r in enumerate(rows):
        sid = str(r["session_id"]) if r.get("session_id") is not None else f"\0row-{i}"
        sessions[sid] = sessions.get(sid, 0) + 1
        if r.get("delay") is not None:
            delays.append(float(r["delay"]))
        for h in r["hash_ids"]:
            sessions_of.setdefault(h, set()).add(sid)
    blocks = sum(len(r["hash_ids"]) for r in rows)
    shared = sum(1 for r in rows for h in r["hash_ids"] if len(sessions_of[h]) > 1)
    n = max(len(rows), 1)
    return {
        "rows": len(rows),
        "sessions": len(sessions),
        "mean_steps": len(rows) / max(len(sessions), 1),
        "mean_prompt_tokens": sum(r["input_length"] for r in rows) / n,
        "mean_output_tokens": sum(r.get("output_length", 0) for r in rows) / n,
        "mean_delay_ms": sum(delays) / len(delays) if delays else 0.0,
        "cross_session_share": shared / blocks if blocks else 0.0,
        "reuse_share": 1.0 - len(sessions_of) / blocks if blocks else 0.0,
    }

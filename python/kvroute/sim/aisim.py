"""The realistic engine model: NVIDIA AISimulate's engines (continuous batching with chunked prefill,
decode steps sharing the GPU with prefills, one KV pool for running requests and the prefix cache,
preemption, a GPU timing model), with kvroute's `Router` as the placement policy, fed by the
simulated engines' KV events through its index.

Needs a wheel built with the ``aisim`` feature (``HAS_AISIM``); see docs/simulator.md.

>>> from kvroute.sim.aisim import EngineModel, HAS_AISIM, replay, router_for
>>> if HAS_AISIM:
...     trace = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]}]
...     r = replay(trace, router=router_for(EngineModel(), policy="capacity"), workers=2)
...     assert r.summary["completed"] == 1
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvroute import _core
from kvroute._core import Router

if TYPE_CHECKING:
    from kvroute.planner import EngineCaps, Phase

__all__ = [
    "BUILTIN_FIT",
    "HAS_AISIM",
    "AisimResult",
    "EngineModel",
    "PolyFit",
    "engine_caps",
    "format_aisim_table",
    "plan_check",
    "replay",
    "router_for",
]

#: Whether this build of kvroute carries the realistic engine model.
HAS_AISIM: bool = bool(getattr(_core, "HAS_AISIM", False))


@dataclass(frozen=True)
class PolyFit:
    """Pass times of one engine, ms: prefill of ``t`` new tokens in a step ``prefill_a t^2 +
    prefill_b t + prefill_c``; a decode step ``max(decode_min_ms, decode_a u^2 + decode_b u +
    decode_c)`` with ``u`` the share of the KV pool held by running requests. Fit it to your
    hardware from a few measured prefill and decode steps (docs/simulator.md)."""

    prefill_a: float
    prefill_b: float
    prefill_c: float
    decode_a: float
    decode_b: float
    decode_c: float
    decode_min_ms: float = 1.0


#: AISimulate 0.13's built-in polynomial (the default timing), written out.
BUILTIN_FIT = PolyFit(4.209989e-07, 1.518344e-02, 1.650142e01, -25.74, 54.01, 5.74, 1.0)


@dataclass(frozen=True)
class EngineModel:
    """One simulated vLLM-style engine; every worker of a cluster is alike.

    ``timing``: "builtin" (AISimulate's polynomial), a `PolyFit`, or ``("fixed", prefill_ms,
    decode_ms)``.
    """

    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    timing: Literal["builtin"] | PolyFit | tuple[str, float, float] = "builtin"
    #: Disaggregated runs: KV bytes per token moved prefill -> decode (Llama-3-70B: 327,680) ...
    kv_bytes_per_token: int = 327_680
    #: ... over this link, GB/s (200 Gb/s RDMA).
    kv_transfer_gb_s: float = 25.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        t = self.timing
        if t == "builtin":
            d["timing"] = {"kind": "builtin"}
        elif isinstance(t, PolyFit):
            d["timing"] = {"kind": "polynomial", **asdict(t)}
        elif isinstance(t, tuple) and len(t) == 3 and t[0] == "fixed":
            d["timing"] = {"kind": "fixed", "prefill_ms": float(t[1]), "decode_ms": float(t[2])}
        else:
            raise ValueError(f"timing must be 'builtin', a PolyFit or ('fixed', prefill_ms, decode_ms), got {t!r}")
        return d


@dataclass
class AisimResult:
    """One replay: ``summary`` (requests, completed, rejected, TTFT/ITL percentiles in ms,
    goodput, throughput, prefix hit rate, preemptions) and per-request ``records``."""

    placement: str
    summary: dict[str, Any]
    records: list[dict[str, Any]] = field(repr=False)
    wall_s: float


def _fit(engine: EngineModel) -> PolyFit | None:
    t = engine.timing
    return BUILTIN_FIT if t == "builtin" else (t if isinstance(t, PolyFit) else None)


def _decode_ms(engine: EngineModel, u: float) -> float:
    """One decode step with share ``u`` of the KV pool held by running requests, ms."""
    f = _fit(engine)
    if f is None:  # fixed timing
        assert isinstance(engine.timing, tuple)
        return float(engine.timing[2])
    return max(f.decode_a * u * u + f.decode_b * u + f.decode_c, f.decode_min_ms)


def engine_caps(engine: EngineModel, isl: float, osl: float, *, itl_slo: float | None = 0.2) -> EngineCaps:
    """What one engine of ``engine`` can do for `kvroute.planner.need_for_slo`, at prompts of
    ``isl`` and outputs of ``osl`` tokens: the prefill speed of its best pass under the step budget
    (and one pass's fixed cost per request), and a decode instance's slots (its ``max_num_seqs``
    seats, or fewer when their KV does not fit the pool or a step would break ``itl_slo``) with its
    step time at that batch."""
    from kvroute.planner import EngineCaps

    f = _fit(engine)
    budget = engine.max_num_batched_tokens
    if f is None:  # fixed timing
        assert isinstance(engine.timing, tuple)
        prefill_ms = float(engine.timing[1])
        p_cap, p_pass = budget * 1000.0 / prefill_ms, prefill_ms / 1000.0
    else:
        p_cap = max(t * 1000.0 / (f.prefill_a * t * t + f.prefill_b * t + f.prefill_c) for t in range(1, budget + 1, max(1, budget // 512)))
        p_pass = f.prefill_c / 1000.0

    pool = engine.num_gpu_blocks * engine.block_size
    # A request's KV at its end. Requests that share a prefix are still counted whole: the decode
    # step's time grows with every running request's context, and a transferred KV is the request's own.
    held = max(1.0, isl + osl)
    # The requests an instance decodes at once: its sequence seats, or fewer when their KV does not fit.
    slots = max(1, min(engine.max_num_seqs, int(pool // held)))
    ctx = isl + osl / 2  # on average over its decode

    def step_at(n: int) -> float:
        return _decode_ms(engine, min(1.0, n * ctx / pool))

    while slots > 1 and itl_slo is not None and step_at(slots) > itl_slo * 1000:
        slots -= 1
    return EngineCaps(p_cap=p_cap, p_pass_s=p_pass, d_slots=slots, d_step_s=step_at(slots) / 1000.0)


#: What the Router is told about the simulated engines (`replay`'s and `router_for`'s ``knowledge``):
#: "deployed", what a deployment knows (KV pool, seats, PD link; prefill speed learned from the
#: prefills it sees finish, as `kvroute serve` does), or "oracle", the simulator's own timing fit
#: and each request's true output length (an ablation no deployment can run).
Knowledge = Literal["deployed", "oracle"]


def router_for(
    engine: EngineModel, *, policy: str | None = None, ttft_slo: float | None = 2.0, knowledge: Knowledge = "deployed", **options: Any
) -> Router:
    """A fresh `Router` for a `replay` on ``engine``s with the same ``knowledge``: deployed, the
    Router `kvroute serve` builds (its "gateway" preset: prefill speed learned) at the engines'
    block size and KV transfer; oracle, the simulator preset told the engines' decode step as well.
    Plus ``policy``, ``ttft_slo`` (seconds) and any other `Router` option."""
    kw: dict[str, Any] = dict(
        block_size=engine.block_size,
        kv_bytes_per_token=float(engine.kv_bytes_per_token),
        link_bytes_per_s=engine.kv_transfer_gb_s * 1e9,
        link_latency_s=0.0,
        ttft_slo=ttft_slo,
    )
    if knowledge == "oracle":
        kw["decode_step_s"] = _decode_ms(engine, 0.0) / 1000.0
    elif knowledge == "deployed":
        kw["preset"] = "gateway"
    else:
        raise ValueError(f"knowledge must be 'deployed' or 'oracle', got {knowledge!r}")
    if policy is not None:
        kw["policy"] = policy
    kw.update(options)
    return Router(**kw)


def replay(
    trace: str | os.PathLike[str] | Iterable[dict[str, Any]],
    *,
    router: Router | None,
    workers: int = 8,
    prefill: int = 0,
    decode: int = 0,
    engine: EngineModel | None = None,
    ttft_slo: float | None = 2.0,
    itl_slo: float | None = 0.2,
    speedup: float = 1.0,
    trace_block_size: int = 512,
    knowledge: Knowledge = "deployed",
    max_tokens: int | None = None,
) -> AisimResult:
    """Replays a Mooncake-format ``trace`` (a path, or its rows) on ``workers`` unified engines (or
    ``prefill`` + ``decode`` disaggregated ones), placed by ``router`` (a fresh `Router`, which the
    run registers the workers with; build it with `router_for` and the same ``knowledge``) or by
    round robin when ``router`` is None. SLOs in seconds. ``max_tokens``: what every client sends
    as its max_tokens, the output length a deployed Router sees (None: none)."""
    if knowledge not in ("deployed", "oracle"):
        raise ValueError(f"knowledge must be 'deployed' or 'oracle', got {knowledge!r}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    if not HAS_AISIM:
        raise RuntimeError(
            "this kvroute build has no realistic engine model; rebuild with the aisim feature: "
            'MATURIN_PEP517_ARGS="--features aisim" pip install .  (docs/simulator.md)'
        )
    engine = engine or EngineModel()
    if prefill or decode:
        if prefill < 1 or decode < 1:
            raise ValueError(f"a disaggregated cluster needs prefill >= 1 and decode >= 1, got {prefill}P{decode}D")
        topology: dict[str, Any] = {"kind": "disaggregated", "prefill": prefill, "decode": decode}
    else:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        topology = {"kind": "aggregated", "workers": workers}
    for name, v in (("ttft_slo", ttft_slo), ("itl_slo", itl_slo)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0 seconds or None, got {v}")
    spec = {
        "engine": engine.to_json(),
        "topology": topology,
        "slo": {"ttft_ms": None if ttft_slo is None else ttft_slo * 1000, "itl_ms": None if itl_slo is None else itl_slo * 1000},
        "knowledge": knowledge,
        "max_tokens": max_tokens,
    }
    kw: dict[str, Any] = {"router": router, "speedup": float(speedup)}
    if isinstance(trace, (str, os.PathLike)):
        kw["trace_path"] = os.fspath(trace)
    else:
        kw["trace_jsonl"] = "\n".join(json.dumps(r) for r in trace)
        kw["trace_block_size"] = int(trace_block_size)
    out = json.loads(_core.aisim_replay(json.dumps(spec), **kw))
    return AisimResult(
        placement="round_robin" if router is None else router.policy,
        summary=out["summary"],
        records=out["records"],
        wall_s=out["wall_s"],
    )


def format_aisim_table(title: str, results: list[AisimResult]) -> str:
    """One row per placement: TTFT (s), ITL (ms), goodput, prefix hits, preemptions, rejections."""

    def f(v: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v * scale, fmt)

    head = f"{'placement':<14}{'TTFT mean':>10}{'p50':>8}{'p99':>8}{'ITL p50':>9}{'p99':>7}{'goodput':>9}{'hits':>7}{'preempt':>9}{'rejected':>10}"
    lines = [title, head, "-" * len(head)]
    for r in results:
        s = r.summary
        lines.append(
            f"{r.placement:<14}{f(s['ttft_mean_ms'], 1e-3):>10}{f(s['ttft_p50_ms'], 1e-3):>8}{f(s['ttft_p99_ms'], 1e-3):>8}"
            f"{f(s['itl_p50_ms'], 1, '.1f'):>9}{f(s['itl_p99_ms'], 1, '.1f'):>7}{s['goodput_share'] * 100:>8.1f}%"
            f"{s['prefix_hit_rate'] * 100:>6.1f}%{s['preemptions']:>9}{s['rejected_share'] * 100:>9.1f}%"
        )
    return "\n".join(lines)


def plan_check(
    phase: Phase,
    *,
    engine: EngineModel | None = None,
    ttft_slo: float = 2.0,
    itl_slo: float = 0.2,
    target: float = 0.99,
    simulate: bool = True,
    seconds: float = 120.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The planner on these engines: ``phase`` sized to the SLOs (`kvroute.planner.need_for_slo` on
    `engine_caps`), and, with ``simulate``, that plan and one instance fewer on each side replayed
    as a disaggregated cluster (``seconds`` of the phase, `kvroute.sim.trace.phase_trace`, routed by
    kvroute's default policy with early rejection): goodput per split."""
    from kvroute.planner import need_for_slo
    from kvroute.sim.trace import phase_trace

    engine = engine or EngineModel()
    caps = engine_caps(engine, phase.isl, phase.osl, itl_slo=itl_slo)
    transfer = phase.isl * engine.kv_bytes_per_token / (engine.kv_transfer_gb_s * 1e9)
    p, d = need_for_slo(phase, caps, ttft_slo=ttft_slo, target=target, transfer_s=transfer)
    out: dict[str, Any] = {"phase": phase.name, "p": p, "d": d, "caps": asdict(caps)}
    if simulate:
        bs = engine.block_size
        rows = phase_trace(phase.rate, int(phase.isl), int(phase.osl), phase.hit, seconds=seconds, seed=seed, block_size=bs)
        goodput = {}
        for pp, dd in ((p, d), (p - 1, d), (p, d - 1)):
            if pp >= 1 and dd >= 1:
                r = replay(
                    rows,
                    router=router_for(engine, ttft_slo=ttft_slo),
                    prefill=pp,
                    decode=dd,
                    engine=engine,
                    ttft_slo=ttft_slo,
                    itl_slo=itl_slo,
                    trace_block_size=bs,
                )
                goodput[f"{pp}P{dd}D"] = r.summary["goodput_share"]
        out["goodput"] = goodput
    return out

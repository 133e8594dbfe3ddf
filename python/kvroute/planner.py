"""xPyD sizing: how many prefill (P) and decode (D) instances a load needs, the seed's
static comparison against a fixed split, and a dynamic planner over time windows.

The capacity model is the seed's: a prefill instance prefills ``p_cap`` uncached prompt tokens
per second, a decode instance produces ``d_cap`` output tokens per second within its TPOT target,
so a window with ``rate`` requests/s of ``isl`` prompt and ``osl`` output tokens and prefix-cache
hit rate ``hit`` needs ``ceil(rate * isl * (1 - hit) / p_cap)`` P and ``ceil(rate * osl / d_cap)`` D.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SEED_PHASES",
    "EngineCaps",
    "Phase",
    "PlanStep",
    "PlannerConfig",
    "erlang_c",
    "expand_phases",
    "format_schedule",
    "load_phases",
    "loads",
    "need",
    "need_for_slo",
    "phases_from_workload",
    "plan_dynamic",
    "plot_schedule",
    "seed_static_table",
    "static_rows",
]


@dataclass(frozen=True)
class Phase:
    """A stretch of steady load: requests/s, mean prompt (ISL) and output (OSL) lengths, hit rate."""

    name: str
    rate: float
    isl: float
    osl: float
    hit: float
    duration: float = 3600.0

    def __post_init__(self) -> None:
        for k in ("rate", "isl", "osl", "duration"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"phase {self.name!r}: {k} must be a finite number >= 0, got {v!r}")
        if not (0.0 <= self.hit <= 1.0):
            raise ValueError(f"phase {self.name!r}: hit must be a fraction in [0, 1], got {self.hit!r}")


#: The seed's three phases: (name, req/s, mean ISL, mean OSL, prefix-cache hit rate).
SEED_PHASES = (
    Phase("day: chat", 100, 2000, 500, 0.6),
    Phase("evening: long-document summaries", 30, 16000, 300, 0.2),
    Phase("night: coding agents", 25, 6000, 2000, 0.8),
)
SEED_P_CAP, SEED_D_CAP, SEED_TOTAL, SEED_STATIC = 20000, 3000, 24, (12, 12)


def need(rate: float, isl: float, osl: float, hit: float, *, p_cap: float = SEED_P_CAP, d_cap: float = SEED_D_CAP) -> tuple[int, int]:
    """Instances needed: the seed's ``ceil(rate*isl*(1-hit)/P_CAP), ceil(rate*osl/D_CAP)``."""
    if not (p_cap > 0 and d_cap > 0):
        raise ValueError(f"capacities must be > 0, got p_cap={p_cap}, d_cap={d_cap}")
    return math.ceil(rate * isl * (1 - hit) / p_cap), math.ceil(rate * osl / d_cap)


@dataclass(frozen=True)
class EngineCaps:
    """What one instance can do, for SLO-aware sizing (`need_for_slo`): prefill ``p_cap`` uncached
    prompt tokens/s plus ``p_pass_s`` fixed per request; a decode instance holds ``d_slots``
    requests at once (KV pool or sequence limit) and emits one token per request every
    ``d_step_s`` seconds at that batch. `kvroute.sim.aisim.engine_caps` derives them from an
    engine model; for real engines, measure them."""

    p_cap: float
    p_pass_s: float
    d_slots: int
    d_step_s: float

    def __post_init__(self) -> None:
        if not (self.p_cap > 0 and self.p_pass_s >= 0 and self.d_slots >= 1 and self.d_step_s > 0):
            raise ValueError(f"engine caps must be positive (p_cap, d_slots, d_step_s) and p_pass_s >= 0, got {self}")


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with ``servers`` and ``offered`` load
    (Erlangs); 1 when the queue is unstable."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0  # Erlang B by the stable recursion
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


def need_for_slo(
    phase: Phase, caps: EngineCaps, *, ttft_slo: float, target: float = 0.99, transfer_s: float = 0.0, max_instances: int = 10_000
) -> tuple[int, int]:
    """The fewest P and D that serve ``phase`` with at most ``1 - target`` of requests missing:

    - prefill: the P instances are the servers of an M/M/c queue (a load-aware router sends each
      request where the queue is shortest, so the pool serves as one queue; exponential service as a
      conservative stand-in for the mix of prompt lengths) with service ``s = isl * (1 - hit) /
      p_cap`` (``p_cap`` is the best pass's throughput: passes batch several prompts, so the fixed
      cost of a pass is shared); a request misses the TTFT SLO when its wait exceeds
      ``t = ttft_slo - s - p_pass_s - transfer_s``, which happens with probability
      ``erlang_c(P, a) * exp(-(P - a) t / s)``, ``a = rate * s``;
    - decode: the D instances' ``D * d_slots`` slots are the servers of an M/M/c queue whose service
      is a request's decode, ``osl * d_step_s`` seconds; an arrival that finds every slot taken
      waits for KV room (a router with early rejection turns it away), with the Erlang C probability.

    The seed's `need` sizes to 100% utilisation, where queues grow without bound; this sizes to
    the SLO."""
    if not (0 < target < 1):
        raise ValueError(f"target must be in (0, 1), got {target}")
    if not ttft_slo > 0:
        raise ValueError(f"ttft_slo must be > 0 seconds, got {ttft_slo}")
    miss = 1 - target
    s = phase.isl * (1 - phase.hit) / caps.p_cap
    slack = ttft_slo - s - caps.p_pass_s - transfer_s
    p = 0
    if phase.rate > 0:
        if slack <= 0:
            raise ValueError(
                f"phase {phase.name!r}: a prefill alone ({s + caps.p_pass_s:.3f} s + transfer {transfer_s:.3f} s) exceeds the TTFT SLO {ttft_slo} s"
            )
        a = phase.rate * s
        if s == 0:
            a, s = 0.0, 1.0  # everything cached: any instance keeps up
        for p in range(1, max_instances + 1):
            if p > a and erlang_c(p, a) * math.exp(-(p - a) * slack / s) <= miss:
                break
        else:
            raise ValueError(f"phase {phase.name!r}: more than {max_instances} prefill instances needed")
    offered = phase.rate * phase.osl * caps.d_step_s
    d = 0
    if offered > 0:
        for d in range(1, max_instances + 1):
            if erlang_c(d * caps.d_slots, offered) <= miss:
                break
        else:
            raise ValueError(f"phase {phase.name!r}: more than {max_instances} decode instances needed")
    return p, d


def loads(phase: Phase, p: int, d: int, *, p_cap: float = SEED_P_CAP, d_cap: float = SEED_D_CAP) -> tuple[float, float]:
    """Utilisation of ``p`` prefill and ``d`` decode instances (> 1: overloaded; inf: none there)."""
    pw = phase.rate * phase.isl * (1 - phase.hit)
    dw = phase.rate * phase.osl
    return (pw / (p * p_cap) if p else (math.inf if pw else 0.0), dw / (d * d_cap) if d else (math.inf if dw else 0.0))


def static_rows(
    phases: Sequence[Phase] = SEED_PHASES,
    static: tuple[int, int] = SEED_STATIC,
    total: int = SEED_TOTAL,
    *,
    p_cap: float = SEED_P_CAP,
    d_cap: float = SEED_D_CAP,
) -> list[dict[str, Any]]:
    """Per phase: the xPyD it needs, whether ``total`` instances suffice, and the fixed split's loads."""
    rows = []
    for ph in phases:
        p, d = need(ph.rate, ph.isl, ph.osl, ph.hit, p_cap=p_cap, d_cap=d_cap)
        lp, ld = loads(ph, *static, p_cap=p_cap, d_cap=d_cap)
        rows.append({"phase": ph.name, "need_p": p, "need_d": d, "fits": p + d <= total, "static_p_load": lp, "static_d_load": ld})
    return rows


def seed_static_table(
    phases: Sequence[Phase] = SEED_PHASES,
    static: tuple[int, int] = SEED_STATIC,
    total: int = SEED_TOTAL,
    *,
    p_cap: float = SEED_P_CAP,
    d_cap: float = SEED_D_CAP,
) -> str:
    """The seed's printout, in English, with its exact numbers (e.g. 4P17D, prefill load 33%)."""
    lines = [f"Fixed {static[0]}P{static[1]}D vs sizing per phase ({total} instances in total):"]
    for r in static_rows(phases, static, total, p_cap=p_cap, d_cap=d_cap):
        verdict = "; ".join(
            f"{side} load {x:.0%}" + (" (overloaded)" if x > 1 else "")
            for side, x in (("prefill", r["static_p_load"]), ("decode", r["static_d_load"]))
        )
        enough = "fits" if r["fits"] else "does not fit"
        lines.append(f"  {r['phase']}: needs {r['need_p']}P{r['need_d']}D ({enough}); with the fixed split {verdict}")
    return "\n".join(lines)


# ---- dynamic planning ---------------------------------------------------------------------


@dataclass(frozen=True)
class PlannerConfig:
    """The dynamic planner's knobs.

    ``window``: seconds per planning step. ``warmup``: seconds a switched instance is unavailable
    (weights, CUDA graphs, JIT). ``drain``: extra seconds a decode instance needs to finish its
    running requests before it can switch to prefill. ``headroom``: target utilisation (<= 1)
    when sizing. ``hysteresis``: the current split is kept while both sides stay at or below
    this utilisation and the better split would move fewer than ``min_move`` instances;
    ``cooldown``: windows to wait after a switch before switching again, unless overloaded.
    """

    total: int = SEED_TOTAL
    p_cap: float = SEED_P_CAP
    d_cap: float = SEED_D_CAP
    window: float = 300.0
    warmup: float = 120.0
    drain: float = 60.0
    headroom: float = 0.85
    hysteresis: float = 0.95
    min_move: int = 2
    cooldown: int = 1
    initial: tuple[int, int] = SEED_STATIC

    def __post_init__(self) -> None:
        if self.total < 2:
            raise ValueError(f"total must be >= 2 (one P and one D), got {self.total}")
        if not (0 < self.headroom <= 1) or not (self.hysteresis > 0):
            raise ValueError(f"headroom must be in (0, 1] and hysteresis > 0, got {self.headroom}, {self.hysteresis}")
        if self.window <= 0 or self.warmup < 0 or self.drain < 0:
            raise ValueError("window must be > 0 and warmup, drain >= 0 seconds")
        if sum(self.initial) != self.total or min(self.initial) < 1:
            raise ValueError(f"initial split {self.initial} must have >= 1 of each and sum to total={self.total}")


@dataclass
class PlanStep:
    """One window of the schedule: the load seen, the split in force, and what it cost."""

    start: float
    phase: str
    rate: float
    isl: float
    osl: float
    hit: float
    need_p: int
    need_d: int
    p: int
    d: int
    switched: int  # instances that changed role at the start of this window (+: D->P, -: P->D)
    p_load: float  # utilisation with switching instances counted as absent while they switch
    d_load: float
    static_p_load: float
    static_d_load: float
    notes: list[str] = field(default_factory=list)

    @property
    def overloaded(self) -> bool:
        return self.p_load > 1 or self.d_load > 1

    @property
    def static_overloaded(self) -> bool:
        return self.static_p_load > 1 or self.static_d_load > 1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["overloaded"] = self.overloaded
        d["static_overloaded"] = self.static_overloaded
        return d


def _best_split(ph: Phase, cfg: PlannerConfig) -> tuple[int, int]:
    """The split of ``cfg.total`` minimising the worse side's utilisation at ``cfg.headroom``."""
    best, best_key = (1, cfg.total - 1), (math.inf, math.inf)
    for p in range(1, cfg.total):
        lp, ld = loads(ph, p, cfg.total - p, p_cap=cfg.p_cap, d_cap=cfg.d_cap)
        key = (max(lp, ld), abs(lp - ld))
        if key < best_key:
            best, best_key = (p, cfg.total - p), key
    return best


def plan_dynamic(
    windows: Iterable[Phase], cfg: PlannerConfig = PlannerConfig(), *, static: tuple[int, int] | None = None
) -> list[PlanStep]:
    """Plans P/D per window, reactively: the split for window k is chosen from what was observed
    in window k-1 (the first window runs ``cfg.initial``), like a planner that reads metrics.

    A change moves instances between roles; a moved instance is lost for ``warmup`` seconds
    (plus ``drain`` when it leaves decode), which this window's loads account for. Hysteresis
    keeps the split while it is good enough, so noise does not cause flapping.
    """
    static = static or cfg.initial
    steps: list[PlanStep] = []
    p, d = cfg.initial
    prev: Phase | None = None
    since_switch = cfg.cooldown
    t = 0.0
    for ph in windows:
        switched = 0
        notes: list[str] = []
        if prev is not None:
            lp, ld = loads(prev, p, d, p_cap=cfg.p_cap, d_cap=cfg.d_cap)
            tp, td = _best_split(prev, cfg)
            overloaded = max(lp, ld) > 1
            good_enough = max(lp, ld) <= cfg.hysteresis and abs(tp - p) < cfg.min_move
            cooling = since_switch < cfg.cooldown and not overloaded
            if tp != p and not good_enough and not cooling:
                switched = tp - p
                notes.append(f"{'D->P' if switched > 0 else 'P->D'} x{abs(switched)} (last window: P {lp:.0%}, D {ld:.0%})")
                p, d = tp, td
                since_switch = 0
            else:
                since_switch += 1
        # Instances switching this window are unavailable for part of it.
        lost = abs(switched) * min(1.0, (cfg.warmup + (cfg.drain if switched > 0 else 0.0)) / cfg.window)
        eff_p = p - (lost if switched > 0 else 0.0)
        eff_d = d - (lost if switched < 0 else 0.0)
        pw = ph.rate * ph.isl * (1 - ph.hit)
        dw = ph.rate * ph.osl
        lp = pw / (eff_p * cfg.p_cap) if eff_p > 0 else math.inf
        ld = dw / (eff_d * cfg.d_cap) if eff_d > 0 else math.inf
        sp, sd = loads(ph, *static, p_cap=cfg.p_cap, d_cap=cfg.d_cap)
        np_, nd = need(ph.rate, ph.isl, ph.osl, ph.hit, p_cap=cfg.p_cap, d_cap=cfg.d_cap)
        steps.append(PlanStep(t, ph.name, ph.rate, ph.isl, ph.osl, ph.hit, np_, nd, p, d, switched, lp, ld, sp, sd, notes))
        prev = ph
        t += ph.duration
    return steps


def expand_phases(phases: Sequence[Phase], window: float, *, ramp: float = 0.0) -> list[Phase]:
    """Cuts phases into ``window``-second windows; with ``ramp`` seconds, each phase's first
    windows blend linearly from the previous phase (loads rarely jump at once)."""
    if window <= 0:
        raise ValueError(f"window must be > 0 seconds, got {window}")
    out: list[Phase] = []
    prev: Phase | None = None
    for ph in phases:
        n = max(1, round(ph.duration / window))
        for k in range(n):
            a = 1.0 if prev is None or ramp <= 0 else min(1.0, (k + 1) * window / ramp)
            mix = (
                ph
                if a >= 1.0 or prev is None
                else Phase(
                    ph.name,
                    prev.rate + a * (ph.rate - prev.rate),
                    prev.isl + a * (ph.isl - prev.isl),
                    prev.osl + a * (ph.osl - prev.osl),
                    prev.hit + a * (ph.hit - prev.hit),
                    window,
                )
            )
            out.append(Phase(mix.name, mix.rate, mix.isl, mix.osl, mix.hit, window))
        prev = ph
    return out


def load_phases(path: str | os.PathLike[str]) -> list[Phase]:
    """Phases from JSON (a list of objects) or CSV with columns name, rate, isl, osl, hit[, duration]."""
    p = os.fspath(path)
    with open(p, encoding="utf-8") as f:
        if p.endswith(".json"):
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(f"{p}: expected a JSON list of phase objects")
        else:
            rows = list(csv.DictReader(f))
    out = []
    for i, r in enumerate(rows):
        try:
            out.append(
                Phase(
                    str(r.get("name", f"phase {i}")),
                    float(r["rate"]),
                    float(r["isl"]),
                    float(r["osl"]),
                    float(r["hit"]),
                    float(r.get("duration", 3600.0)),
                )
            )
        except KeyError as e:
            raise ValueError(f"{p}: phase {i} lacks field {e.args[0]!r}; expected name, rate, isl, osl, hit[, duration]") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: phase {i}: {e}") from None
    if not out:
        raise ValueError(f"{p}: no phases")
    return out


def phases_from_workload(workload: Any, window: float) -> list[Phase]:
    """Windows of a workload (e.g. a loaded trace): request rate, mean ISL/OSL, and the hit rate an
    infinite shared cache would see (blocks already seen earlier in the trace)."""
    import numpy as np

    if window <= 0:
        raise ValueError(f"window must be > 0 seconds, got {window}")
    n = len(workload)
    if n == 0:
        raise ValueError("the workload has no requests")
    seen: set[int] = set()
    out = []
    arr = workload.arrival
    bs = workload.block_size
    edges = np.arange(0.0, float(arr[-1]) + window, window)
    lo = 0
    for k in range(len(edges) - 1):
        hi = int(np.searchsorted(arr, edges[k + 1], side="left")) if k < len(edges) - 2 else n
        cnt = hi - lo
        if cnt == 0:
            out.append(Phase(f"w{k}", 0.0, 0.0, 0.0, 0.0, window))
            continue
        hit_tok = tot_tok = 0
        for i in range(lo, hi):
            hs = workload.request_hashes(i).tolist()
            nt = int(workload.num_tokens[i])
            m = 0
            for h in hs:
                if h not in seen:
                    break
                m += 1
            hit_tok += min(m * bs, nt)
            tot_tok += nt
            seen.update(hs)
        out.append(
            Phase(
                f"w{k}",
                cnt / window,
                float(workload.num_tokens[lo:hi].mean()),
                float(workload.output_tokens[lo:hi].mean()),
                hit_tok / tot_tok if tot_tok else 0.0,
                window,
            )
        )
        lo = hi
    return out


def format_schedule(steps: Sequence[PlanStep], cfg: PlannerConfig, static: tuple[int, int]) -> str:
    """The schedule as a table, with a summary against the fixed split."""
    head = f"  {'t (s)':>7}  {'window':<34}{'need':>8}{'plan':>8}{'P load':>8}{'D load':>8}   fixed {static[0]}P{static[1]}D (P/D)  change"
    lines = [
        f"Dynamic xPyD plan ({cfg.total} instances, window {cfg.window:g} s, warm-up {cfg.warmup:g} s, drain {cfg.drain:g} s, "
        f"hysteresis {cfg.hysteresis:.0%}):",
        head,
    ]
    for s in steps:
        flag = " !" if s.overloaded else "  "
        sflag = " !" if s.static_overloaded else "  "
        lines.append(
            f"  {s.start:>7.0f}  {s.phase[:33]:<34}{f'{s.need_p}P{s.need_d}D':>8}{f'{s.p}P{s.d}D':>8}{s.p_load:>8.0%}{s.d_load:>8.0%}{flag}"
            f"  {s.static_p_load:>6.0%} / {s.static_d_load:<6.0%}{sflag}  {'; '.join(s.notes)}"
        )
    n = len(steps)
    over = sum(s.overloaded for s in steps)
    sover = sum(s.static_overloaded for s in steps)
    moves = sum(abs(s.switched) for s in steps)
    changes = sum(1 for s in steps if s.switched)
    lines.append(
        f"overloaded windows (!): planned {over}/{n}, fixed {static[0]}P{static[1]}D {sover}/{n}; "
        f"{changes} re-plans moving {moves} instances in total"
    )
    return "\n".join(lines)


def plot_schedule(steps: Sequence[PlanStep], path: str) -> None:
    """P/D counts over time against need, and both sides' utilisation (planned vs fixed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install 'kvroute[plot]'") from e
    t = [s.start / 3600 for s in steps]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a1.step(t, [s.p for s in steps], where="post", label="P planned")
    a1.step(t, [s.d for s in steps], where="post", label="D planned")
    a1.step(t, [s.need_p for s in steps], where="post", ls=":", label="P needed")
    a1.step(t, [s.need_d for s in steps], where="post", ls=":", label="D needed")
    a1.set_ylabel("instances")
    a1.legend(fontsize=8)
    a1.grid(True, alpha=0.3)
    a2.step(t, [100 * min(s.p_load, 3) for s in steps], where="post", label="P load (planned)")
    a2.step(t, [100 * min(s.d_load, 3) for s in steps], where="post", label="D load (planned)")
    a2.step(t, [100 * min(s.static_p_load, 3) for s in steps], where="post", ls="--", label="P load (fixed)")
    a2.step(t, [100 * min(s.static_d_load, 3) for s in steps], where="post", ls="--", label="D load (fixed)")
    a2.axhline(100, color="grey", lw=0.8)
    a2.set_ylabel("utilisation (%)")
    a2.set_xlabel("time (h)")
    a2.legend(fontsize=8)
    a2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

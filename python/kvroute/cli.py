"""The ``kvroute`` command: ``simulate`` (the seed's routing experiment, trace replays,
rate sweeps) and ``plan`` (xPyD sizing, static and over time windows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvroute.cli_args import OneLineErrors, existing_file, integer, number, rate_list
from kvroute.router_flags import add_router_flags, router_options

if TYPE_CHECKING:
    from kvroute.sim import ClusterConfig, Workload

__all__ = ["main"]

#: The seed's table: its four policies without rejection, then "ttft" with rejection.
SEED_ROWS = (("random", False), ("least_load", False), ("cache_only", False), ("ttft", False), ("ttft", True))
# Where a user gets one: Mooncake's published traces (github.com/kvcache-ai/Mooncake, FAST25-release/traces/).
TRACE_DEFAULT = "conversation_trace.jsonl"


def _rates(values: Sequence[list[float]] | None) -> list[float] | None:
    """The ``--rate`` / ``--speedup`` values (each already a list, ``cli_args.rate_list``), in order."""
    if not values:
        return None
    return [x for v in values for x in v]


def _shapes() -> list[str]:
    from kvroute.sim.trace import SHAPES

    return list(SHAPES)


def _need_matplotlib(cmd: str) -> None:
    """``--plot`` checks for matplotlib before the run, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"kvroute {cmd}: --plot needs matplotlib (pip install matplotlib)") from None


def _policies() -> list[str]:
    from kvroute import POLICIES

    return list(POLICIES)


def _add_simulate(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate routing policies on a prefill cluster",
        description="Replays a workload on simulated prefill instances (LRU prefix caches, FIFO queues, KV events) "
        "with every request routed by kvroute.Router, and prints hit rate, TTFT p50/p99, SLO attainment. "
        "With no arguments: the seed's experiment (40 and 70 req/s) plus the default policy's row.",
    )
    p.add_argument(
        "--engine",
        choices=("seed", "aisim"),
        default="seed",
        help="engine model: seed (the seed's prefill-only FIFO + LRU model, exact for its tables; the default) or "
        "aisim (NVIDIA AISimulate's engines: continuous batching, chunked prefill, decode, one KV pool, preemption; "
        "recommended for anything else, needs a wheel built with the aisim feature; see docs/simulator.md)",
    )
    p.add_argument(
        "--scenario", choices=("seed-chat", "trace", "synthetic"), default=None, help="workload (default: seed-chat, or trace with --trace)"
    )
    p.add_argument(
        "--trace",
        metavar="PATH",
        type=existing_file,
        help=f"Mooncake-format JSONL trace (e.g. {TRACE_DEFAULT} from Mooncake's FAST25-release/traces/)",
    )
    p.add_argument("--shape", default="chat", choices=_shapes(), help="synthetic trace shape (scenario synthetic; default chat)")
    p.add_argument("--requests", type=integer(1), default=3000, help="synthetic trace length (default 3000)")
    p.add_argument(
        "--rate",
        action="append",
        type=rate_list,
        metavar="R",
        help="req/s; repeatable, or a list '40,70' or range '40:90:10' (seed-chat/synthetic)",
    )
    p.add_argument(
        "--speedup", action="append", type=rate_list, metavar="X", help="trace arrival speed-up; repeatable or a list (trace; default 1)"
    )
    p.add_argument("--duration", type=number(0, above=True), default=120.0, help="seconds of seed-chat arrivals (default 120)")
    p.add_argument("--seed", type=integer(0), default=0, help="workload seed (default 0, the seed's)")
    p.add_argument("--instances", type=integer(1), help="prefill instances (default 8)")
    p.add_argument(
        "--cache-blocks", type=integer(1), help="LRU cache per instance in blocks (default 3000 of 64 tokens; 1000 of 512 for traces)"
    )
    p.add_argument("--speed", type=number(0, above=True), help="prefill tokens/s per instance (default 20000)")
    p.add_argument("--slo", type=number(0, above=True), help="TTFT SLO in seconds (default 2.0)")
    p.add_argument(
        "--decode-instances", type=integer(0), default=0, help="PD mode: decode instances (default 0: prefill-only, as the seed)"
    )
    p.add_argument("--decode-kv-blocks", type=integer(1), default=20000, help="KV blocks per decode instance (default 20000)")
    p.add_argument(
        "--decode-speed",
        type=number(0, above=True),
        default=2000.0,
        help="decode tokens/s per instance: TPOT = 0.01 s + batch / speed (default 2000)",
    )
    p.add_argument("--tpot-slo", type=number(0, above=True), help="TPOT SLO in seconds (PD mode; default none)")
    add_router_flags(p, ["decode_choice"])
    p.add_argument(
        "--kv-compression", type=number(0, above=True), default=1.0, help="PD mode: bytes sent per KV byte (default 1; 0.5 = fp8 transfer)"
    )
    p.add_argument(
        "--incremental-transfer", action="store_true", help="PD mode: decode instances cache prefixes; only the blocks they lack move"
    )
    p.add_argument(
        "--prefill-batch-tokens",
        type=integer(0),
        default=0,
        help="the seed documents' prefill batching: token budget per batch (the seed: 8192; default 0 = FIFO)",
    )
    p.add_argument("--prefill-batch-wait", type=number(0), default=0.01, help="seconds an idle instance waits for a batch (default 0.01)")
    p.add_argument(
        "--decode-admission",
        action="store_true",
        help="PD mode: the seed documents' decode admission (at most 256 running, estimated ITL < 1.2 x target)",
    )
    p.add_argument("--event-lag", type=number(0), default=0.0, help="seconds before KV events reach the router's index (default 0)")
    p.add_argument("--policy", action="append", metavar="NAME", help="routing policy; repeatable; 'all' for every policy")
    p.add_argument("--reject", action="store_true", help="early rejection: turn away requests predicted to miss the TTFT SLO")
    add_router_flags(p, ["tie_break"], tie_break="tie-break; default lowest for seed-chat, as the seed, rotate otherwise")
    p.add_argument(
        "--router-seed", type=integer(0), default=1, help="seed of the router's random choices (default 1, the seed's Random(1))"
    )
    p.add_argument("--kv-blocks", type=integer(1), help="aisim: KV pool per engine in blocks (default 16384 of 64 tokens)")
    p.add_argument(
        "--itl-slo",
        type=number(0, above=True),
        help="aisim: mean inter-token latency SLO in seconds (default 0.2, MLPerf Llama-2-70B server)",
    )
    p.add_argument(
        "--timing-fit",
        metavar="FILE.json",
        type=existing_file,
        help="aisim: your hardware's pass-time fit (PolyFit fields; default AISimulate's built-in)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per run per line instead of tables")
    p.add_argument("--plot", metavar="PATH.png", help="TTFT CDFs and attainment vs rate (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is only drawn on a terminal anyway)")
    p.add_argument(
        "--suite",
        action="store_true",
        help="the policy benchmark suite: every policy with rejection on every case (tuning and held-out halves), "
        "event lag 0 and 50 ms, with the infinite-cache and global-cache bounds (other workload options are ignored)",
    )
    p.add_argument("--quick", action="store_true", help="with --suite: a small subset that runs in seconds")
    p.add_argument("--split", choices=("tuning", "held-out"), help="with --suite: only this half")
    p.add_argument("--case", action="append", metavar="NAME", help="with --suite: only cases whose name contains NAME; repeatable")
    p.add_argument(
        "--seeds",
        type=integer(1),
        metavar="N",
        help="with --suite: N workload seeds per case (default 10; tuning 0-2, 6-8, ...; held-out 3-5, 9-11, ...; "
        "the one fixed Mooncake trace runs once; --quick: its own seed per case unless given)",
    )
    p.set_defaults(func=cmd_simulate)


def _cluster(a: argparse.Namespace, trace_like: bool) -> ClusterConfig:
    from kvroute.sim import ClusterConfig

    def pick(v: float | None, default: float) -> float:
        return default if v is None else v

    return ClusterConfig(
        instances=int(pick(a.instances, 8)),
        cache_blocks=int(pick(a.cache_blocks, 1000 if trace_like else 3000)),
        speed=pick(a.speed, 20000.0),
        slo=pick(a.slo, 2.0),
        event_lag=a.event_lag,
        decode_instances=a.decode_instances,
        decode_kv_blocks=a.decode_kv_blocks,
        decode_tokens_per_s=a.decode_speed,
        tpot_slo=a.tpot_slo,
        kv_compression=a.kv_compression,
        incremental_transfer=a.incremental_transfer,
        decode_admission=a.decode_admission,
        prefill_batch_tokens=a.prefill_batch_tokens,
        prefill_batch_wait_s=a.prefill_batch_wait,
    )


def cmd_suite(a: argparse.Namespace) -> int:
    from kvroute.sim.suite import CASES, QUICK_CASES, SUITE_SEEDS, format_case, format_suite, run_suite

    cases = [c for c in (QUICK_CASES if a.quick else CASES) if a.split is None or c.split == a.split]
    if a.case:
        cases = [c for c in cases if any(n in c.name for n in a.case)]
        if not cases:
            raise SystemExit(f"kvroute simulate --suite: no case matches {a.case}")
    known = _policies()
    names = None
    if a.policy and "all" not in a.policy:
        bad = [x for x in a.policy if x not in known]
        if bad:
            raise SystemExit(f"kvroute simulate: unknown policy {bad[0]!r}; expected one of {', '.join(known)} or all")
        names = list(a.policy)

    def show(r: object) -> None:
        from kvroute.sim.suite import CaseResult

        assert isinstance(r, CaseResult)
        print(json.dumps(r.to_json()) if a.json else format_case(r), flush=True)

    if a.seeds is not None and a.seeds < 1:
        raise SystemExit(f"kvroute simulate: --seeds must be >= 1, got {a.seeds}")
    seeds = a.seeds if a.seeds is not None else (None if a.quick else SUITE_SEEDS)
    results = run_suite(cases, policies=names, on_result=show, seeds=seeds)
    if not a.json:
        print()
        print(format_suite(results))
    return 0


def cmd_simulate_aisim(a: argparse.Namespace) -> int:
    """``--engine aisim``: the workload on AISimulate's engines, each policy against round robin."""
    from kvroute.sim import synthetic_trace
    from kvroute.sim.aisim import HAS_AISIM, EngineModel, PolyFit, format_aisim_table, replay, router_for

    if not HAS_AISIM:
        raise SystemExit(
            "kvroute simulate: --engine aisim needs a kvroute built with the aisim feature: "
            'MATURIN_PEP517_ARGS="--features aisim" pip install .  (docs/simulator.md)'
        )
    if a.suite:
        raise SystemExit("kvroute simulate: the aisim suite is benches/bench_aisim.py (it races Dynamo's router too)")
    scenario = a.scenario or ("trace" if a.trace else "synthetic")
    if scenario == "seed-chat":
        raise SystemExit(
            "kvroute simulate: seed-chat is the seed engine's workload; with --engine aisim use --trace or --scenario synthetic"
        )
    if scenario == "trace" and not a.trace:
        raise SystemExit(f"kvroute simulate: --scenario trace needs --trace PATH (e.g. {TRACE_DEFAULT})")
    ignored = [
        f for f, v in (("--cache-blocks", a.cache_blocks), ("--speed", a.speed), ("--event-lag", a.event_lag or None)) if v is not None
    ]
    if ignored:
        raise SystemExit(
            f"kvroute simulate: {', '.join(ignored)} belong to the seed engine; with --engine aisim see --kv-blocks, --timing-fit"
        )
    timing: object = "builtin"
    if a.timing_fit:
        try:
            with open(a.timing_fit) as f:
                timing = PolyFit(**json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise SystemExit(f"kvroute simulate: --timing-fit {a.timing_fit}: {e}") from None
    engine = EngineModel(num_gpu_blocks=a.kv_blocks if a.kv_blocks is not None else 16384, timing=timing)  # type: ignore[arg-type]
    instances = a.instances if a.instances is not None else 8
    from kvroute.sim.suite import default_policy

    known = _policies()
    names = [default_policy()] if not a.policy else (known if "all" in a.policy else list(a.policy))
    bad = [x for x in names if x not in known]
    if bad:
        raise SystemExit(f"kvroute simulate: unknown policy {bad[0]!r}; expected one of {', '.join(known)} or all")
    try:
        rates = _rates(a.rate)
        speedups = _rates(a.speedup)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise SystemExit(f"kvroute simulate: {e}") from None
    if scenario == "synthetic":
        if a.requests < 1:
            raise SystemExit(f"kvroute simulate: --requests must be >= 1, got {a.requests}")
        loads: list[tuple[str, object, float]] = [
            (f"synthetic-{a.shape} {r:g} req/s", synthetic_trace(a.shape, requests=a.requests, rate=r, seed=a.seed), 1.0)
            for r in rates or [10.0]
        ]
    else:
        loads = [(f"{os.path.basename(a.trace)} speed-up {s:g}", a.trace, s) for s in speedups or [1.0]]
    slo = a.slo if a.slo is not None else 2.0
    itl = a.itl_slo if a.itl_slo is not None else 0.2
    topo = dict(prefill=instances, decode=a.decode_instances) if a.decode_instances else dict(workers=instances)
    for title, trace, speedup in loads:
        results = []
        for name in [*names, "round_robin"]:
            router = None
            if name != "round_robin":
                router = router_for(
                    engine,
                    policy=name,
                    ttft_slo=slo,
                    reject=a.reject,
                    seed=a.router_seed,
                    tie_break=router_options(a).get("tie_break", "rotate"),
                )
            try:
                r = replay(trace, router=router, engine=engine, ttft_slo=slo, itl_slo=itl, speedup=speedup, **topo)  # type: ignore[arg-type]
            except ValueError as e:
                raise SystemExit(f"kvroute simulate: {e}") from None
            results.append(r)
            if a.json:
                print(
                    json.dumps({"workload": title, "placement": r.placement, "reject": a.reject, **r.summary, "wall_s": r.wall_s}),
                    flush=True,
                )
        if not a.json:
            where = f"{(a.decode_instances and f'{instances}P{a.decode_instances}D') or f'{instances} workers'}"
            print(format_aisim_table(f"== {title}; {where}; TTFT SLO {slo:g} s, ITL SLO {itl * 1000:g} ms", results), flush=True)
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    if a.engine == "aisim":
        return cmd_simulate_aisim(a)
    if a.kv_blocks is not None or a.itl_slo is not None or a.timing_fit:
        raise SystemExit("kvroute simulate: --kv-blocks, --itl-slo and --timing-fit go with --engine aisim")
    if a.suite:
        return cmd_suite(a)
    if a.quick or a.split or a.case or a.seeds is not None:
        raise SystemExit("kvroute simulate: --quick, --split, --case and --seeds go with --suite")
    from kvroute.sim import load_trace, records_to_workload, seed_chat, simulate, synthetic_trace
    from kvroute.sim.report import format_table, max_sustained_rate, plot_runs
    from kvroute.sim.suite import default_policy

    scenario = a.scenario or ("trace" if a.trace else "seed-chat")
    if scenario == "trace" and not a.trace:
        raise SystemExit(f"kvroute simulate: --scenario trace needs --trace PATH (e.g. {TRACE_DEFAULT})")
    trace_like = scenario != "seed-chat"
    try:
        cluster = _cluster(a, trace_like)
    except ValueError as e:
        raise SystemExit(f"kvroute simulate: {e}") from None
    seed_policies = {p for p, _ in SEED_ROWS}

    def tie_for(policy: str) -> str:
        # The seed's rows break ties by lowest index, as the seed's min()/max() do; ours rotate.
        if "tie_break" in router_options(a):
            return str(router_options(a)["tie_break"])
        return "lowest" if scenario == "seed-chat" and policy in seed_policies else "rotate"

    known = _policies()
    if a.policy:
        names = known if "all" in a.policy else a.policy
        bad = [x for x in names if x not in known]
        if bad:
            raise SystemExit(f"kvroute simulate: unknown policy {bad[0]!r}; expected one of {', '.join(known)} or all")
        rows = [(x, a.reject) for x in names]
    elif scenario == "seed-chat" and not a.reject:
        rows = [*SEED_ROWS, (default_policy(), True)]
    else:
        rows = [(x, a.reject) for x in known]
    try:
        rates = _rates(a.rate)
        speedups = _rates(a.speedup)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise SystemExit(f"kvroute simulate: {e}") from None
    progress = False if a.no_progress or a.json else None

    def workloads() -> Iterator[Workload]:
        if scenario == "seed-chat":
            for r in rates or [40.0, 70.0]:
                yield seed_chat(r, a.duration, a.seed)
        elif scenario == "synthetic":
            for r in rates or [10.0]:
                w = records_to_workload(synthetic_trace(a.shape, requests=a.requests, rate=r, seed=a.seed), name=f"synthetic-{a.shape}")
                w.meta.update(scenario=f"synthetic-{a.shape}", rate=r, seed=a.seed)
                yield w
        else:
            for s in speedups or [1.0]:
                try:
                    w = load_trace(a.trace, speedup=s)
                except OSError as e:
                    raise SystemExit(f"kvroute simulate: cannot read trace: {e}") from None
                w.meta.update(rate=len(w) / max(w.duration, 1e-9), seed=None, speedup=s)
                yield w

    runs = []
    for w in workloads():
        block = []
        for policy, reject in rows:
            opts = {k: v for k, v in router_options(a).items() if k == "decode_choice"} or None
            r = simulate(
                w,
                policy,
                reject=reject,
                cluster=cluster,
                tie_break=tie_for(policy),
                seed=a.router_seed,
                progress=progress,
                router_options=opts,
            )
            if "speedup" in w.meta:
                r.extra["speedup"] = w.meta["speedup"]
            block.append(r)
            if a.json:
                print(json.dumps(r.to_json()), flush=True)
        runs.extend(block)
        if not a.json:
            what = f"{w.meta['rate']:g} req/s" if scenario != "trace" else f"speed-up {w.meta['speedup']:g} ({w.meta['rate']:.2f} req/s)"
            title = (
                f"== {w.name}: {what}, {len(w)} requests; {cluster.instances} prefill instances, "
                f"cache {cluster.cache_blocks} x {w.block_size}-token blocks, {cluster.speed:g} tokens/s, "
                f"TTFT SLO {cluster.slo:g} s"
                + (f", event lag {cluster.event_lag:g} s" if cluster.event_lag else "")
                + (
                    f"; {cluster.decode_instances} decode instances, {cluster.decode_kv_blocks} KV blocks, {cluster.decode_tokens_per_s:g} tokens/s"
                    + (f", TPOT SLO {cluster.tpot_slo:g} s" if cluster.tpot_slo else "")
                    if cluster.decode_instances
                    else ""
                )
            )
            print(format_table(title, block), flush=True)
    if not a.json and len({r.rate for r in runs}) >= 3:  # a sweep, not the seed's two rates
        print("\nmax rate with >= 99% attainment:")
        for label, rate in max_sustained_rate(runs).items():
            print(f"  {label:<24}{'below the sweep' if rate is None else f'{rate:g} req/s'}")
    if a.plot:
        try:
            plot_runs(runs, a.plot, title=runs[0].scenario if runs else "")
        except RuntimeError as e:
            raise SystemExit(f"kvroute simulate: {e}") from None
        if not a.json:
            print(f"plot written to {a.plot}")
    return 0


def _add_plan(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "plan",
        help="xPyD sizing: static per-phase needs, or a dynamic schedule over time windows",
        description="With no arguments: the seed's table (needs per phase vs a fixed 12P12D). "
        "With --dynamic, --phases or --trace: a planner that resizes P/D per window with warm-up, draining and hysteresis.",
    )
    p.add_argument("--phases", metavar="FILE", type=existing_file, help="phases as JSON list or CSV: name, rate, isl, osl, hit[, duration]")
    p.add_argument("--trace", metavar="PATH", type=existing_file, help="derive windows from a Mooncake-format trace")
    p.add_argument("--speedup", type=number(0, above=True), default=1.0, help="trace arrival speed-up (default 1)")
    p.add_argument("--dynamic", action="store_true", help="plan the seed's phases over time (each --phase-duration long)")
    p.add_argument(
        "--phase-duration", type=number(0, above=True), default=3600.0, help="seconds per seed phase with --dynamic (default 3600)"
    )
    p.add_argument("--ramp", type=number(0), default=600.0, help="seconds over which a phase blends into the next (default 600)")
    p.add_argument("--total", type=integer(2), default=24, help="instances in total (default 24)")
    p.add_argument("--static", default="12P12D", help="the fixed split to compare against (default 12P12D)")
    p.add_argument("--p-cap", type=number(0, above=True), default=20000.0, help="prompt tokens/s per prefill instance (default 20000)")
    p.add_argument(
        "--d-cap", type=number(0, above=True), default=3000.0, help="output tokens/s per decode instance within TPOT (default 3000)"
    )
    p.add_argument("--window", type=number(0, above=True), default=300.0, help="planning window in seconds (default 300)")
    p.add_argument("--warmup", type=number(0), default=120.0, help="seconds a switched instance is unavailable (default 120)")
    p.add_argument("--drain", type=number(0), default=60.0, help="extra seconds to drain a decode instance (default 60)")
    p.add_argument(
        "--hysteresis",
        type=number(0, above=True, hi=1.0),
        default=0.95,
        help="keep the split while both sides are below this load (default 0.95)",
    )
    p.add_argument("--min-move", type=integer(1), default=2, help="smallest worthwhile move when not overloaded (default 2)")
    p.add_argument(
        "--engine",
        choices=("seed", "aisim"),
        default="seed",
        help="seed: the seed's capacities, sized to full utilisation (default); aisim: the default AISimulate engine's "
        "capacities, sized to the SLOs (queueing, see docs/simulator.md)",
    )
    p.add_argument("--slo", type=number(0, above=True), default=2.0, help="with --engine aisim: TTFT SLO in seconds (default 2)")
    p.add_argument("--itl-slo", type=number(0, above=True), default=0.2, help="with --engine aisim: mean ITL SLO in seconds (default 0.2)")
    p.add_argument(
        "--check",
        action="store_true",
        help="with --engine aisim: simulate each phase's plan, and one instance fewer on each side, on AISimulate's engines "
        "(needs the aisim build feature)",
    )
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument("--plot", metavar="PATH.png", help="plot the schedule (needs matplotlib)")
    p.set_defaults(func=cmd_plan)


def _parse_split(s: str) -> tuple[int, int]:
    t = s.upper().rstrip("D").split("P")
    try:
        p, d = int(t[0]), int(t[1])
    except (IndexError, ValueError):
        raise SystemExit(f"kvroute plan: --static must look like 12P12D, got {s!r}") from None
    return p, d


def cmd_plan_aisim(a: argparse.Namespace) -> int:
    """``kvroute plan --engine aisim``: each phase sized to the SLOs on AISimulate's default engine."""
    from kvroute import planner as pl
    from kvroute.sim.aisim import plan_check

    if a.dynamic or a.trace:
        raise SystemExit(
            "kvroute plan: --engine aisim sizes phases (the seed's, or --phases FILE); --dynamic and --trace use the seed model"
        )
    try:
        phases = pl.load_phases(a.phases) if a.phases else list(pl.SEED_PHASES)
        rows = [plan_check(ph, ttft_slo=a.slo, itl_slo=a.itl_slo, simulate=a.check) for ph in phases]
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: --check on a build without aisim
        raise SystemExit(f"kvroute plan: {e}") from None
    for r in rows:
        if a.json:
            print(json.dumps(r))
            continue
        line = f"{r['phase']}: {r['p']}P{r['d']}D (TTFT SLO {a.slo:g} s, ITL SLO {a.itl_slo * 1000:g} ms)"
        if a.check:
            g = r["goodput"]
            line += "; simulated goodput " + ", ".join(f"{k} {v * 100:.1f}%" for k, v in g.items())
        print(line)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from kvroute import planner as pl

    if a.engine == "aisim":
        return cmd_plan_aisim(a)
    if a.check:
        raise SystemExit("kvroute plan: --check goes with --engine aisim")

    static = _parse_split(a.static)
    if sum(static) != a.total:
        raise SystemExit(f"kvroute plan: --static {a.static} has {sum(static)} instances but --total is {a.total}")
    dynamic = a.dynamic or a.phases or a.trace
    if not dynamic:
        if a.json:
            for r in pl.static_rows(pl.SEED_PHASES, static, a.total, p_cap=a.p_cap, d_cap=a.d_cap):
                print(json.dumps(r))
        else:
            print(pl.seed_static_table(pl.SEED_PHASES, static, a.total, p_cap=a.p_cap, d_cap=a.d_cap))
        return 0
    try:
        cfg = pl.PlannerConfig(
            total=a.total,
            p_cap=a.p_cap,
            d_cap=a.d_cap,
            window=a.window,
            warmup=a.warmup,
            drain=a.drain,
            hysteresis=a.hysteresis,
            min_move=a.min_move,
            initial=static,
        )
        if a.trace:
            from kvroute.sim import load_trace

            windows = pl.phases_from_workload(load_trace(a.trace, speedup=a.speedup), a.window)
        else:
            phases = (
                pl.load_phases(a.phases)
                if a.phases
                else [pl.Phase(p.name, p.rate, p.isl, p.osl, p.hit, a.phase_duration) for p in pl.SEED_PHASES]
            )
            windows = pl.expand_phases(phases, a.window, ramp=a.ramp)
    except (OSError, ValueError) as e:
        raise SystemExit(f"kvroute plan: {e}") from None
    steps = pl.plan_dynamic(windows, cfg, static=static)
    if a.json:
        for s in steps:
            print(json.dumps(s.to_json()))
    else:
        print(pl.format_schedule(steps, cfg, static))
    if a.plot:
        try:
            pl.plot_schedule(steps, a.plot)
        except RuntimeError as e:
            raise SystemExit(f"kvroute plan: {e}") from None
        if not a.json:
            print(f"plot written to {a.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `kvroute` command's parser, with its subcommands (docs/reference/cli.md is generated from it)."""
    from kvroute import __version__

    parser = OneLineErrors(prog="kvroute", description="kvroute: cache-aware request routing for disaggregated LLM serving")
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{simulate,plan,serve,epp}", parser_class=OneLineErrors)
    _add_simulate(sub)
    _add_plan(sub)
    # The gateway's `serve` and the endpoint picker's `epp` (need the gateway extra only when run).
    from kvroute.gateway.cli import add_epp_parser, add_serve_parser

    add_serve_parser(sub)
    add_epp_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvroute import KvrouteError

    parser = build_parser()
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(a, "plot", None):
            _need_matplotlib(a.command)
        return int(a.func(a))
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
        return 0
    except SystemExit as e:
        # A command's own refusal ("kvroute simulate: ..."): one line and status 2, as argparse's.
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
            return 2
        raise
    except (ValueError, OSError, KvrouteError) as e:
        # Bad input found while running (a trace that is not Mooncake JSONL, a file that cannot be read).
        print(f"kvroute {a.command}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())

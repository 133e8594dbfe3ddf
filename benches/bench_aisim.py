"""The race on AISimulate's engines: kvroute's Router as deployed against Dynamo 1.6's KV router,
tuned on the same tuning half, and round robin; same engines, traces and seeds, one process per run
(benches/aisim_race).

Workload families, fixed before any result was seen; the split is by family, so no held-out family
chose a constant of either router:
- tuning: `agent` (kvroute.sim.synthetic_trace: open-loop agent bursts over 4 long tool prefixes) and
  the first third of Mooncake's conversation trace (../shared/traces; skipped where absent).
- held out: the conversation trace's other two thirds; the closed-loop agentic families `tools`,
  `swarm` and `research` (kvroute.sim.agentic_trace: how sessions share prefixes, how long they run,
  think times and agent-type skew differ); long-context retrieval `long_rag`.
Topologies: 8 and 16 unified workers, and 4P12D for the conversation trace. Loads are chosen where
KV-aware placements differ (see LOADS).

Placements per case, none with admission (the primary comparison):
- `kvroute`: as deployed: `kvroute serve`'s defaults, told only what a deployment knows (KV pool,
  seats, PD link), prefill speed learned from the prefills it sees finish; clients send
  max_tokens=4096, never the true output length; early rejection off.
- `dynamo`: Dynamo's KvRouterConfig as tuned on the tuning half (`--tune-dynamo`, recorded in
  results/aisim_dynamo_tuning.json), shedding and queueing off.
- `round_robin`.
- `kvroute (told the fit)`: an ablation no deployment can run: the simulator's own timing fit and
  the true output lengths.
SLOs: TTFT <= 2 s and mean ITL <= 200 ms (MLPerf Inference's Llama-2-70B server scenario).

    python benches/bench_aisim.py                 # the suite (~20 min on 2 cores)
    python benches/bench_aisim.py --quick         # one seed, 8 workers
    python benches/bench_aisim.py --tune-dynamo   # sweep Dynamo's knobs on the tuning half
    python benches/bench_aisim.py --tune-shed     # sweep Dynamo's shedding thresholds on the tuning half
    python benches/bench_aisim.py --admission     # the admission race: early rejection against shedding
    python benches/bench_aisim.py --check         # CI: rerun one committed case; exit 1 if it moved
    python benches/bench_aisim.py --speed         # the whole conversation trace, 16 workers: wall time

Writes a results file (command, commit, machine, date, every run's summary); render it with
`python benches/render_results.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import results_file  # noqa: E402

RACE_DIR = os.path.join(HERE, "aisim_race")
RACE_BIN = os.path.join(RACE_DIR, "target", "release", "aisim-race")
RESULTS = os.path.join(HERE, "results")
SUITE_OUT = os.path.join(RESULTS, "aisim_suite.json")
TUNING_OUT = os.path.join(RESULTS, "aisim_dynamo_tuning.json")
TTFT_SLO_MS = 2000.0
ITL_SLO_MS = 200.0
#: Seeds per case: generator seeds, or the conversation trace's held-out thirds (it has 3 thirds;
#: the first is tuning data).
SEEDS = 2
#: The max_tokens every client sends (above every output length of these traces).
MAX_TOKENS = 4096
#: Closed-loop agentic traces: new sessions arrive for this long (sessions = rate x window), so the
#: cluster reaches the steady state of that rate instead of draining a short burst.
SESSION_WINDOW_S = 240.0
#: Requests per open-loop generated trace.
REQUESTS = 3000

#: Per family: (split, loads per 8 workers). Conversation loads are arrival speed-ups of the trace
#: (3.4 req/s whole); agentic loads are new sessions per second; the others requests per second.
#: Chosen where the placements differ: a calibration at 8 workers (seed 0, kvroute with the
#: registered prior, Dynamo's defaults, round robin) raised each family's load by 1.5x until round
#: robin served under half and a KV-aware router under 90%; the two loads below are where round
#: robin had fallen behind and the KV-aware routers had not yet all collapsed (loads where every
#: router served 99%+ separate nothing and were dropped).
LOADS: dict[str, tuple[str, tuple[float, ...]]] = {
    "conversation": ("held-out", (6.0, 7.5)),
    "agent": ("tuning", (20.0, 27.0)),
    "tools": ("held-out", (7.5, 9.0)),
    "swarm": ("held-out", (4.5, 5.5)),
    "research": ("held-out", (3.75, 4.5)),
    "long_rag": ("held-out", (30.0, 36.0)),
}


@dataclass(frozen=True)
class Case:
    family: str
    topology: tuple[int, int]  # (workers, 0) aggregated, or (prefill, decode)
    load: float  # speed-up (conversation), sessions/s (agentic) or req/s
    split: str

    @property
    def name(self) -> str:
        w, d = self.topology
        where = f"{w}P{d}D" if d else f"{w}w"
        unit = "x" if self.family == "conversation" else "/s"
        return f"{self.family} {where} {self.load:g}{unit}"

    def seeds(self, n: int) -> list[int]:
        """The seeds this case runs: the conversation trace's thirds (the first is the tuning half's),
        or generator seeds."""
        if self.family == "conversation":
            return [0] if self.split == "tuning" else [1, 2][:n]
        return list(range(n))


def cases(quick: bool) -> list[Case]:
    out = []
    for family, (split, loads) in LOADS.items():
        topologies: list[tuple[int, int]] = [(8, 0), (16, 0)] + ([(4, 12)] if family == "conversation" else [])
        for topo in topologies:
            scale = topo[0] / 8  # per prefill worker: 4P12D carries half the load of 8 unified workers
            for load in loads:
                # The conversation trace's first third is tuning data wherever it runs.
                for s in ("tuning", split) if family == "conversation" else (split,):
                    out.append(Case(family, topo, load * scale, s))
    if quick:
        out = [c for c in out if c.topology == (8, 0)]
    return out


def conversation_rows() -> list[dict[str, Any]] | None:
    from kvroute.sim.suite import mooncake_path
    from kvroute.sim.trace import find_shared_dir

    path = mooncake_path(find_shared_dir(ROOT))
    if path is None:
        return None
    with open(path) as f:
        return sorted((json.loads(x) for x in f if x.strip()), key=lambda r: r["timestamp"])


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    t0 = min(r["timestamp"] for r in rows if "timestamp" in r)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "timestamp": r["timestamp"] - t0} if "timestamp" in r else r) + "\n")


def trace_file(case: Case, seed: int, tmp: str, conversation: list[dict[str, Any]] | None) -> tuple[str, float]:
    """The case's trace for `seed` as a file, and the speed-up to replay it at."""
    from kvroute.sim import synthetic_trace
    from kvroute.sim.trace import agentic_trace

    path = os.path.join(tmp, f"{case.family}-{seed}-{case.load:g}.jsonl")
    if case.family == "conversation":
        assert conversation is not None
        third = len(conversation) // 3
        write_rows(conversation[seed * third : (seed + 1) * third], path)
        return path, case.load
    if case.family in ("tools", "swarm", "research"):
        sessions = max(1, round(case.load * SESSION_WINDOW_S))
        write_rows(agentic_trace(case.family, sessions=sessions, rate=case.load, seed=seed), path)
    else:
        write_rows(synthetic_trace(case.family, requests=REQUESTS, rate=case.load, seed=seed), path)
    return path, 1.0


def build_race() -> None:
    subprocess.run(["cargo", "build", "--release", "-q", "--manifest-path", os.path.join(RACE_DIR, "Cargo.toml")], check=True)


def race(
    case: Case, path: str, speedup: float, seed: int, placement: str, *, router: dict[str, Any] | None = None, **flags: Any
) -> dict[str, Any]:
    """One placement on one trace: the harness's JSON line."""
    w, d = case.topology
    cmd = [RACE_BIN, "--trace", path, *(["--disagg", f"{w},{d}"] if d else ["--workers", str(w)])]
    cmd += ["--speedup", str(speedup), "--seed", str(seed), "--ttft-slo-ms", str(TTFT_SLO_MS), "--itl-slo-ms", str(ITL_SLO_MS)]
    cmd += ["--placements", placement, "--max-tokens", str(MAX_TOKENS)]
    if router is not None:
        cmd += ["--router", json.dumps(router)]
    for k, v in flags.items():
        if v is True:
            cmd.append(f"--{k.replace('_', '-')}")
        elif v is not None:
            cmd += [f"--{k.replace('_', '-')}", v if isinstance(v, str) else json.dumps(v)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[0])


#: The placements of every case: label -> (placement, router parameters, other harness flags).
NO_REJECT = {"reject": False}
ABLATION = "kvroute (told the fit)"


def placements(dynamo_config: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any] | None, dict[str, Any]]]:
    return {
        "kvroute": ("kvroute", NO_REJECT, {}),
        "dynamo": ("dynamo", None, {"dynamo": dynamo_config}),
        "round_robin": ("round_robin", None, {}),
        ABLATION: ("kvroute", NO_REJECT, {"knowledge": "oracle"}),
    }


def run_case(case: Case, seed: int, path: str, speedup: float, dynamo_config: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, (placement, router, flags) in placements(dynamo_config).items():
        if label == ABLATION and case.topology != (8, 0):
            continue  # the ablation at 8 workers only: it answers one question, at a quarter of the cost
        got = race(case, path, speedup, seed, placement, router=router, **flags)
        rows.append({"case": case.name, "family": case.family, "split": case.split, "seed": seed, "label": label, **got})
    return rows


def tuned_dynamo() -> dict[str, Any]:
    """Dynamo's KvRouterConfig as `--tune-dynamo` chose it (Dynamo's defaults before it has run)."""
    try:
        with open(TUNING_OUT) as f:
            return dict(json.load(f)["chosen"])
    except FileNotFoundError:
        return {}


#: Dynamo's knobs swept on the tuning half: the overlap credit (how much a cached block lowers a
#: worker's cost), its decay with load, and the sampling temperature.
DYNAMO_GRID = {
    "overlap_score_credit": (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
    "overlap_score_credit_decay": (0.0, 1.0),
    "router_temperature": (0.0, 0.1),
}


def _sweep(
    benchmark: str,
    grid_def: dict[str, tuple[Any, ...]],
    out: str,
    argv: list[str] | None,
    placement: str,
    flags: Callable[[dict[str, Any]], dict[str, Any]],
    extra: dict[str, Any] | None = None,
) -> int:
    """Runs `placement` with `flags(setting)` for every setting of `grid_def` on the tuning half at 8
    workers (one seed per case) and keeps the best mean goodput (a rejected request is not good;
    TTFT p99 breaks ties within 0.1 points); writes the sweep to `out`."""
    build_race()
    conversation = conversation_rows()
    todo = [c for c in cases(True) if c.split == "tuning" and (c.family != "conversation" or conversation)]
    grid = [dict(zip(grid_def, v)) for v in itertools.product(*grid_def.values())]
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for case in todo:
            seed = case.seeds(1)[0]
            path, speedup = trace_file(case, seed, tmp, conversation)
            for cfg in grid:
                s = race(case, path, speedup, seed, placement, **flags(cfg))["summary"]
                rows.append({"case": case.name, "seed": seed, "config": cfg, "summary": s})
                shed = f" ({s['rejected_share'] * 100:.1f}% rejected)" if s["rejected_share"] else ""
                print(f"[{time.time() - t0:5.0f}s] {case.name} {cfg}: {s['goodput_share'] * 100:.1f}%{shed}", flush=True)

    def score(cfg: dict[str, Any]) -> tuple[float, float]:
        mine = [r["summary"] for r in rows if r["config"] == cfg]
        good = sum(s["goodput_share"] for s in mine) / len(mine)
        p99 = sum(s["ttft_p99_ms"] or 0.0 for s in mine) / len(mine)
        return round(good, 3), -p99

    chosen = max(grid, key=score)
    doc = {
        **results_file.header(benchmark, results_file.command("bench_aisim.py", argv)),
        "grid": grid_def,
        **(extra or {}),
        "cases": [c.name for c in todo],
        "chosen": chosen,
        "rows": rows,
    }
    results_file.write(out, doc)
    print(f"chosen: {chosen}; wrote {out}")
    return 0


def tune_dynamo(argv: list[str] | None) -> int:
    """Sweeps DYNAMO_GRID (16 configurations per case) for Dynamo's KV router, no shedding."""
    return _sweep("aisim_dynamo_tuning", DYNAMO_GRID, TUNING_OUT, argv, "dynamo", lambda cfg: {"dynamo": cfg})


ADMISSION_OUT = os.path.join(RESULTS, "aisim_admission.json")
SHED_TUNING_OUT = os.path.join(RESULTS, "aisim_shed_tuning.json")

#: Dynamo's busy thresholds (its frontend's `LoadThresholdConfig`) swept on the tuning half: active
#: prefill tokens per worker, and active decode blocks as a fraction of the worker's KV blocks
#: (None: that threshold off).
SHED_GRID = {
    "active_prefill_tokens_threshold": (None, 8192, 16384, 32768, 65536, 131072, 262144),
    "active_decode_blocks_threshold": (None, 0.8, 0.9, 0.95),
}


def _shed_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if v is not None}


def tune_shed(argv: list[str] | None) -> int:
    """Sweeps SHED_GRID for `dynamo_shed` (Dynamo's KV router as tuned, plus its shedding)."""
    dynamo_config = tuned_dynamo()
    return _sweep(
        "aisim_shed_tuning",
        SHED_GRID,
        SHED_TUNING_OUT,
        argv,
        "dynamo_shed",
        lambda cfg: {"dynamo": dynamo_config, "dynamo_shed": _shed_config(cfg)},
        {"dynamo_config": dynamo_config},
    )


def tuned_shed() -> dict[str, Any] | None:
    """The thresholds `--tune-shed` chose; None before it has run."""
    try:
        with open(SHED_TUNING_OUT) as f:
            return dict(json.load(f)["chosen"])
    except FileNotFoundError:
        return None


def admission_placements(
    dynamo_config: dict[str, Any], shed: dict[str, Any]
) -> dict[str, tuple[str, dict[str, Any] | None, dict[str, Any]]]:
    """The admission race's placements (label -> placement, router parameters, harness flags): kvroute's
    defaults, early rejection on; Dynamo's KV router with its shedding."""
    return {
        "kvroute": ("kvroute", None, {}),
        "dynamo": ("dynamo_shed", None, {"dynamo": dynamo_config, "dynamo_shed": _shed_config(shed)}),
    }


def admission(argv: list[str] | None, seeds: int, quick: bool) -> int:
    """The admission race, on every unified case (`dynamo_shed` runs aggregated topologies only):
    kvroute as deployed with its early rejection (its defaults: TTFT SLO 2 s, rejection on) against
    Dynamo's KV router as tuned with its shedding at the thresholds `--tune-shed` chose."""
    shed = tuned_shed()
    if shed is None:
        print(f"no {os.path.relpath(SHED_TUNING_OUT, ROOT)}: run `python benches/bench_aisim.py --tune-shed` first", file=sys.stderr)
        return 1
    build_race()
    dynamo_config = tuned_dynamo()
    conversation = conversation_rows()
    todo = [c for c in cases(quick) if c.topology[1] == 0 and (c.family != "conversation" or conversation is not None)]
    placements_ = admission_placements(dynamo_config, shed)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for case in todo:
            for seed in case.seeds(1 if quick else seeds):
                path, speedup = trace_file(case, seed, tmp, conversation)
                brief = []
                for label, (placement, router, flags) in placements_.items():
                    got = race(case, path, speedup, seed, placement, router=router, **flags)
                    rows.append({"case": case.name, "family": case.family, "split": case.split, "seed": seed, "label": label, **got})
                    s = got["summary"]
                    brief.append(f"{label}: {s['goodput_share'] * 100:.1f}% ({s['rejected_share'] * 100:.1f}% rejected)")
                print(f"[{time.time() - t0:6.0f}s] {case.name} seed {seed}: goodput " + "  ".join(brief), flush=True)
    result = {
        **results_file.header("aisim_admission", results_file.command("bench_aisim.py", argv)),
        "slo": {"ttft_ms": TTFT_SLO_MS, "itl_ms": ITL_SLO_MS},
        "max_tokens": MAX_TOKENS,
        "dynamo_config": dynamo_config,
        "shed_config": shed,
        "seeds": 1 if quick else seeds,
        "rows": rows,
    }
    results_file.write(ADMISSION_OUT, result)
    print(f"wrote {ADMISSION_OUT} ({len(rows)} runs, {time.time() - t0:.0f} s)")
    return 0


#: The case CI reruns (`--check`): small, held out, and its kvroute figures must equal the suite's.
CHECK_CASE = "tools 8w 7.5/s"
#: Summary fields compared exactly (to 1e-9 relative); wall time is not one.
CHECKED = ("requests", "completed", "rejected", "goodput_share", "prefix_hit_rate", "ttft_mean_ms", "ttft_p99_ms", "itl_p99_ms")


def _by_arrival(records: list[dict[str, Any]]) -> dict[float, list[dict[str, Any]]]:
    out: dict[float, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r["arrival_ms"], []).append(r)
    return out


def _sortable(v: Any) -> tuple[bool, float]:
    return (v is None, 0.0 if v is None else float(v))


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= 1e-6 * max(1.0, abs(x))
    return bool(x == y)


def _moved(label: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The CHECKED figures of a rerun summary that differ from the results file's (floats to 1e-9
    relative)."""
    out = []
    for k in CHECKED:
        a, b = got.get(k), want.get(k)
        if a != b and not (isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-9 * max(abs(a), abs(b))):
            out.append(f"{label}: {k} = {a}, the results file has {b}")
    return out


def check() -> int:
    """CI: builds the race, reruns CHECK_CASE's seed 0 for kvroute (as deployed and told the fit)
    and round robin, and fails when a figure differs from the committed suite's (and for both
    sides of the admission race, from its results file); then checks, per
    arrival instant, that AISimulate's and dynamo-mocker's round robin build the same engines (what every
    comparison with Dynamo rests on) and that Dynamo's tuned router runs."""
    with open(SUITE_OUT) as f:
        suite = json.load(f)
    want = {r["label"]: r for r in suite["rows"] if r["case"] == CHECK_CASE and r["seed"] == 0}
    if not want:
        print(f"{SUITE_OUT} has no {CHECK_CASE!r} seed 0: rerun the suite", file=sys.stderr)
        return 1
    build_race()
    case = next(c for c in cases(False) if c.name == CHECK_CASE)
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        path, speedup = trace_file(case, 0, tmp, None)
        for label, (placement, router, flags) in placements(suite["dynamo_config"]).items():
            if label == "dynamo":
                continue
            got = race(case, path, speedup, 0, placement, router=router, **flags)["summary"]
            bad += _moved(label, got, want[label]["summary"])
        rr = race(case, path, speedup, 0, "round_robin", records=True)["records"]
        drr = race(case, path, speedup, 0, "dynamo_round_robin", records=True)["records"]
        if len(rr) != len(drr):
            bad.append(f"round robin: AISimulate served {len(rr)} requests, dynamo-mocker {len(drr)}")
        # Per arrival instant: requests that arrive in the same millisecond may be dealt out in
        # either order, so each field is compared as the instant's sorted values.
        fields = ("prefill_worker", "input_tokens", "output_tokens", "cached_tokens", "ttft_ms", "itl_ms")
        mine, theirs = _by_arrival(rr), _by_arrival(drr)
        for at in sorted(set(mine) | set(theirs)):
            for k in fields:
                x = sorted((r.get(k) for r in mine.get(at, [])), key=_sortable)
                y = sorted((r.get(k) for r in theirs.get(at, [])), key=_sortable)
                if len(x) != len(y) or any(not _same(u, v) for u, v in zip(x, y)):
                    bad.append(f"round robin, arrivals at {at} ms: {k} = {x} in AISimulate, {y} in dynamo-mocker")
                    break
            if len(bad) > 20:
                break
        dyn = race(case, path, speedup, 0, "dynamo", dynamo=suite["dynamo_config"])["summary"]
        if dyn["requests"] != want["dynamo"]["summary"]["requests"]:
            bad.append(f"dynamo: {dyn['requests']} requests, the results file has {want['dynamo']['summary']['requests']}")
        # The admission race: both sides are deterministic (kvroute's Router; Dynamo's router seeded as
        # dynamo-mocker's canonical replay seeds it), so both must reproduce its results file.
        if os.path.exists(ADMISSION_OUT):
            with open(ADMISSION_OUT) as f:
                adm = json.load(f)
            want_adm = {r["label"]: r for r in adm["rows"] if r["case"] == CHECK_CASE and r["seed"] == 0}
            for label, (placement, router, flags) in admission_placements(adm["dynamo_config"], adm["shed_config"]).items():
                if label not in want_adm:
                    bad.append(f"{os.path.relpath(ADMISSION_OUT, ROOT)} has no {CHECK_CASE!r} seed 0 {label} row")
                    continue
                got = race(case, path, speedup, 0, placement, router=router, **flags)["summary"]
                bad += _moved(f"admission, {label}", got, want_adm[label]["summary"])
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        print(f"the race no longer reproduces {os.path.relpath(SUITE_OUT, ROOT)}: rerun `python benches/bench_aisim.py`", file=sys.stderr)
        return 1
    print(
        f"aisim race: {CHECK_CASE} seed 0 reproduces the results files (suite and admission); "
        f"round robin agrees at every arrival instant ({len(rr)} requests)"
    )
    return 0


def speed(out: str, argv: list[str] | None) -> int:
    """Wall time of the whole conversation trace (12,031 requests) at 16 workers, speed-up 1, per
    placement: the median of 3 runs each, and simulated seconds per wall second."""
    from kvroute.sim.suite import mooncake_path
    from kvroute.sim.trace import find_shared_dir

    path = mooncake_path(find_shared_dir(ROOT))
    if path is None:
        print("no ../shared/traces/mooncake_conversation_trace.jsonl", file=sys.stderr)
        return 1
    build_race()
    rows = []
    case = Case("conversation", (16, 0), 1.0, "held-out")
    for placement in ("kvroute", "dynamo", "round_robin"):
        runs = []
        for _ in range(3):
            d = race(case, path, 1.0, 0, placement)
            runs.append((d["wall_s"], d["summary"]["makespan_s"], d["summary"]["requests"]))
        runs.sort()
        wall, sim, n = runs[1]
        rows.append(
            {"placement": placement, "requests": n, "wall_s": wall, "sim_s": sim, "sim_per_wall": sim / wall, "walls": [r[0] for r in runs]}
        )
        print(f"{placement}: {n} requests, {wall:.1f} s wall (median of 3), {sim:.0f} s simulated, {sim / wall:.0f}x")
    results_file.write(out, {**results_file.header("aisim_speed", results_file.command("bench_aisim.py", argv)), "rows": rows})
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 8 workers")
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds per case (default {SEEDS}; at most 2 held-out conversation thirds)")
    ap.add_argument("--out", help="results file (default benches/results/aisim_suite.json, or aisim_speed.json with --speed)")
    ap.add_argument("--speed", action="store_true", help="time the whole conversation trace at 16 workers (quiet machine)")
    ap.add_argument("--tune-dynamo", action="store_true", help="sweep Dynamo's KvRouterConfig on the tuning half")
    ap.add_argument("--check", action="store_true", help="rerun one case of the committed suite; exit 1 if its figures moved")
    ap.add_argument("--tune-shed", action="store_true", help="sweep Dynamo's shedding thresholds on the tuning half")
    ap.add_argument("--admission", action="store_true", help="the admission race: kvroute's early rejection against Dynamo's shedding")
    a = ap.parse_args(argv)
    if a.check:
        return check()
    if a.speed:
        return speed(a.out or os.path.join(RESULTS, "aisim_speed.json"), argv)
    if a.tune_dynamo:
        return tune_dynamo(argv)
    if a.tune_shed:
        return tune_shed(argv)
    a.out = a.out or SUITE_OUT
    if not 1 <= a.seeds <= 5:
        ap.error("--seeds must be 1..5")
    seeds = 1 if a.quick else a.seeds
    if a.admission:
        return admission(argv, seeds, a.quick)
    build_race()
    dynamo_config = tuned_dynamo()
    conversation = conversation_rows()
    todo = [c for c in cases(a.quick) if c.family != "conversation" or conversation is not None]
    if conversation is None:
        print("no ../shared/traces/mooncake_conversation_trace.jsonl: conversation cases skipped", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for case in todo:
            for seed in case.seeds(seeds):
                path, speedup = trace_file(case, seed, tmp, conversation)
                got = run_case(case, seed, path, speedup, dynamo_config)
                rows.extend(got)
                brief = "  ".join(f"{r['label']}: {r['summary']['goodput_share'] * 100:.1f}%" for r in got)
                print(f"[{time.time() - t0:6.0f}s] {case.name} seed {seed}: goodput {brief}", flush=True)
    result = {
        **results_file.header("aisim_suite", results_file.command("bench_aisim.py", argv)),
        "slo": {"ttft_ms": TTFT_SLO_MS, "itl_ms": ITL_SLO_MS},
        "max_tokens": MAX_TOKENS,
        "dynamo_config": dynamo_config,
        "seeds": seeds,
        "rows": rows,
    }
    results_file.write(a.out, result)
    print(f"wrote {a.out} ({len(rows)} runs, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

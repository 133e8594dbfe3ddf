"""The cluster-scale suite on AISimulate's engines: kvroute's Router against Dynamo 1.6's KV router
(`KvRouterPlacement`, default `KvRouterConfig`) and round robin, same engines, traces and seeds,
one process per case (benches/aisim_race).

Cases (fixed before any result was seen; the split is by case):
- conversation: Mooncake's conversation trace (../shared/traces; skipped where absent), 8, 16 and
  32 workers, and 4P12D disaggregated; each seed is one third of the trace (requests by arrival).
- agent: `synthetic_trace("agent")` (tool-use sessions: long shared tool prefixes, bursts of turns).
- long: `synthetic_trace("long_rag")` (10-24k-token documents, short questions).
Loads are arrival speed-ups (conversation) or rates (generated) scaled with the cluster, from
comfortable to overloaded. Tuning half: agent, and conversation at 16 workers; held-out: the rest.

Placements per case: kvroute's default policy with early rejection (as it ships), the same without
rejection (latency compared on every request), Dynamo's KV router, round robin.
SLOs: TTFT <= 2 s and mean ITL <= 200 ms (MLPerf Inference's Llama-2-70B server scenario).

    python benches/bench_aisim.py                 # the suite, ~25 min on 2 cores
    python benches/bench_aisim.py --quick         # one seed, conversation and agent only
    python benches/bench_aisim.py --out benches/results/aisim_suite.json
    python benches/bench_aisim.py --speed         # the whole conversation trace, 16 workers: wall time

Writes a results file (command, commit, machine, date, every run's summary); render it with
`python benches/render_results.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

RACE_DIR = os.path.join(HERE, "aisim_race")
RACE_BIN = os.path.join(RACE_DIR, "target", "release", "aisim-race")
TTFT_SLO_MS = 2000.0
ITL_SLO_MS = 200.0
SEEDS = 3


@dataclass(frozen=True)
class Case:
    trace: str  # conversation | agent | long
    topology: tuple[int, int]  # (workers, 0) aggregated, or (prefill, decode)
    load: float  # speed-up (conversation) or req/s (generated)
    split: str

    @property
    def name(self) -> str:
        w, d = self.topology
        where = f"{w}P{d}D" if d else f"{w}w"
        unit = "x" if self.trace == "conversation" else "/s"
        return f"{self.trace} {where} {self.load:g}{unit}"


def cases(quick: bool) -> list[Case]:
    out = []
    # Conversation: its full-trace rate is 3.4 req/s; per 8 workers x3 is comfortable, x6 high, x9 overloaded.
    for workers in (8, 16, 32):
        split = "tuning" if workers == 16 else "held-out"
        for k in (3, 6, 9):
            out.append(Case("conversation", (workers, 0), k * workers / 8, split))
    for k in (3, 6, 9):
        out.append(Case("conversation", (4, 12), k * 4 / 8, "held-out"))
    # Generated: rates per 8 workers from comfortable to overloaded.
    for trace, rates, split in (("agent", (4, 8, 12), "tuning"), ("long", (12, 24, 36), "held-out")):
        for workers in (8, 16, 32):
            for r in rates:
                out.append(Case(trace, (workers, 0), r * workers / 8, split))
    if quick:
        out = [c for c in out if c.topology in ((8, 0), (4, 12)) and c.trace in ("conversation", "agent")]
    return out


def conversation_path() -> str | None:
    from kvroute.sim.suite import mooncake_path
    from kvroute.sim.trace import find_shared_dir

    return mooncake_path(find_shared_dir(ROOT))


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    t0 = min(r["timestamp"] for r in rows)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "timestamp": r["timestamp"] - t0}) + "\n")


def trace_file(case: Case, seed: int, tmp: str, conversation: list[dict[str, Any]] | None) -> tuple[str, float]:
    """The case's trace for `seed` as a file, and the speed-up to replay it at."""
    from kvroute.sim import synthetic_trace

    path = os.path.join(tmp, f"{case.trace}-{seed}-{case.load:g}.jsonl")
    if case.trace == "conversation":
        assert conversation is not None
        third = len(conversation) // SEEDS
        write_rows(conversation[seed * third : (seed + 1) * third], path)
        return path, case.load
    shape = {"agent": "agent", "long": "long_rag"}[case.trace]
    write_rows(synthetic_trace(shape, requests=3000, rate=case.load, seed=seed), path)
    return path, 1.0


def upper_bound(case: Case, path: str, speedup: float) -> float:
    """A TTFT-attainment limit no router can beat on this case (kvroute.sim.limit's counting
    argument: least work against the prefill pool's peak capacity); goodput is at most this."""
    from kvroute.sim import ClusterConfig, load_trace
    from kvroute.sim.aisim import EngineModel, engine_caps
    from kvroute.sim.limit import attainment_limit

    w = load_trace(path, speedup=speedup)
    prefill = case.topology[0]
    # The most prompt tokens per second one default engine can prefill: its best pass under the
    # step budget (decode steps beside it only lower it).
    peak = engine_caps(EngineModel(), 1, 1).p_cap
    cl = ClusterConfig(instances=prefill, speed=peak, slo=TTFT_SLO_MS / 1000.0)
    return attainment_limit(w, cl).attainment


def build_race() -> None:
    subprocess.run(["cargo", "build", "--release", "-q", "--manifest-path", os.path.join(RACE_DIR, "Cargo.toml")], check=True)


def run_case(case: Case, seed: int, path: str, speedup: float, policy: str) -> list[dict[str, Any]]:
    w, d = case.topology
    topo = ["--disagg", f"{w},{d}"] if d else ["--workers", str(w)]
    rows = []
    kv = f"kvroute:{policy}"
    runs = ((kv, kv, {}), (f"{kv} (no reject)", kv, {"reject": False}), ("dynamo", "dynamo", None), ("round_robin", "round_robin", None))
    for label, placement, router in runs:
        cmd = [RACE_BIN, "--trace", path, *topo, "--speedup", str(speedup), "--seed", str(seed)]
        cmd += ["--ttft-slo-ms", str(TTFT_SLO_MS), "--itl-slo-ms", str(ITL_SLO_MS), "--placements", placement]
        if router is not None:
            cmd += ["--router", json.dumps(router)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            d_ = json.loads(line)
            rows.append({"case": case.name, "trace": case.trace, "split": case.split, "seed": seed, "label": label, **d_})
    return rows


def meta(name: str, argv: list[str] | None) -> dict[str, Any]:
    return {
        "benchmark": name,
        "command": "python "
        + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "commit": git_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }


def speed(out: str, argv: list[str] | None) -> int:
    """Wall time of the whole conversation trace (12,031 requests) at 16 workers, speed-up 1, per
    placement: the median of 3 runs each, and simulated seconds per wall second."""
    from kvroute import Router

    path = conversation_path()
    if path is None:
        print("no ../shared/traces/mooncake_conversation_trace.jsonl", file=sys.stderr)
        return 1
    build_race()
    rows = []
    for placement in (f"kvroute:{Router().policy}", "dynamo", "round_robin"):
        runs = []
        for _ in range(3):
            cmd = [RACE_BIN, "--trace", path, "--workers", "16", "--speedup", "1", "--placements", placement]
            cmd += ["--ttft-slo-ms", str(TTFT_SLO_MS), "--itl-slo-ms", str(ITL_SLO_MS)]
            d = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[0])
            runs.append((d["wall_s"], d["summary"]["makespan_s"], d["summary"]["requests"]))
        runs.sort()
        wall, sim, n = runs[1]
        rows.append(
            {"placement": placement, "requests": n, "wall_s": wall, "sim_s": sim, "sim_per_wall": sim / wall, "walls": [r[0] for r in runs]}
        )
        print(f"{placement}: {n} requests, {wall:.1f} s wall (median of 3), {sim:.0f} s simulated, {sim / wall:.0f}x")
    with open(out, "w") as f:
        json.dump({**meta("aisim_speed", argv), "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 8 workers and 4P12D, conversation and agent")
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds per case (default {SEEDS}; conversation has {SEEDS} thirds)")
    ap.add_argument("--out", help="results file (default benches/results/aisim_suite.json, or aisim_speed.json with --speed)")
    ap.add_argument("--speed", action="store_true", help="time the whole conversation trace at 16 workers (quiet machine)")
    a = ap.parse_args(argv)
    if a.speed:
        return speed(a.out or os.path.join(HERE, "results", "aisim_speed.json"), argv)
    a.out = a.out or os.path.join(HERE, "results", "aisim_suite.json")
    if not 1 <= a.seeds <= SEEDS:
        ap.error(f"--seeds must be 1..{SEEDS}")
    seeds = 1 if a.quick else a.seeds
    from kvroute import Router

    policy = str(Router().policy)
    build_race()
    conv_path = conversation_path()
    conversation = None
    if conv_path:
        with open(conv_path) as f:
            conversation = sorted((json.loads(x) for x in f if x.strip()), key=lambda r: r["timestamp"])
    todo = [c for c in cases(a.quick) if c.trace != "conversation" or conversation is not None]
    if conversation is None:
        print("no ../shared/traces/mooncake_conversation_trace.jsonl: conversation cases skipped", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for case in todo:
            for seed in range(seeds):
                path, speedup = trace_file(case, seed, tmp, conversation)
                got = run_case(case, seed, path, speedup, policy)
                bound = upper_bound(case, path, speedup)
                got.append(
                    {
                        "case": case.name,
                        "trace": case.trace,
                        "split": case.split,
                        "seed": seed,
                        "label": "upper bound",
                        "summary": {"goodput_share": bound},
                    }
                )
                rows.extend(got)
                brief = "  ".join(f"{r['label'].replace('kvroute:', '')}: {r['summary']['goodput_share'] * 100:.1f}%" for r in got)
                print(f"[{time.time() - t0:6.0f}s] {case.name} seed {seed}: goodput {brief}", flush=True)
    result = {
        "benchmark": "aisim_suite",
        "command": "python "
        + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "commit": git_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "slo": {"ttft_ms": TTFT_SLO_MS, "itl_ms": ITL_SLO_MS},
        "default_policy": policy,
        "seeds": seeds,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out} ({len(rows)} runs, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The hot paths against an older commit, in one run:
#   benches/ab_commit.sh BASE [ROUNDS] [REPEAT]
# builds BASE's wheel and this checkout's (release) into two venvs under $KVROUTE_AB_DIR (default
# /tmp/kvroute-ab), then alternates the two ROUNDS times (default 8): the default policy's
# Router.route() (benches/route_timing.py, REPEAT timed routes per run, default 3000) and
# KvIndex.apply_event_batch on small interleaved vLLM batches (benches/bench_events.py, ours only).
# Prints the medians and the ratio current/BASE, and writes benches/results/ab_commit.json
# (command, commits, machine, date; docs/benchmarks.md renders it). Both sides are built with the
# same cargo profile (set CARGO_PROFILE_RELEASE_LTO / _CODEGEN_UNITS to shorten the builds); the
# alternation spreads a busy machine's noise over both sides: read the ratio.
set -euo pipefail

base=${1:?usage: $0 BASE_COMMIT [ROUNDS] [REPEAT]}
rounds=${2:-8}
repeat=${3:-3000}
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${KVROUTE_AB_DIR:-/tmp/kvroute-ab}
py=${PYTHON:-python3}

git -C "$here" rev-parse --verify --quiet "$base^{commit}" >/dev/null || { echo "not a commit: $base" >&2; exit 2; }
base_sha=$(git -C "$here" rev-parse --short "$base")
head_sha=$(git -C "$here" rev-parse --short HEAD)
mkdir -p "$dir"

build() { # $1 = name, $2 = source tree
  local venv="$dir/$1-venv"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip maturin numpy msgspec pyzmq >/dev/null
  (cd "$2" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$venv/bin/maturin" build --release -q -o "$dir/$1-wheels" >/dev/null)
  "$venv/bin/pip" install -q --force-reinstall --no-deps "$dir/$1-wheels"/kvroute-*.whl
}

rm -rf "$dir/base-src" "$dir/base-wheels" "$dir/head-wheels"
mkdir -p "$dir/base-src"
git -C "$here" archive "$base" | tar -x -C "$dir/base-src"
echo "building $base_sha ..." >&2
build base "$dir/base-src"
echo "building the checkout ($head_sha) ..." >&2
build head "$here"

events='import json, sys; sys.path.insert(0, sys.argv[1]); import bench_events; r = bench_events.run(reps=7); print(json.dumps({"blocks": r["blocks"], "blocks_per_s": r["ours_blocks_per_s"]}))'
results="$dir/results.jsonl"
: >"$results"
for r in $(seq 1 "$rounds"); do
  for side in base head; do
    route=$("$dir/$side-venv/bin/python" "$here/benches/route_timing.py" --repeat "$repeat")
    ev=$("$dir/$side-venv/bin/python" -c "$events" "$here/benches")
    echo "{\"side\": \"$side\", \"round\": $r, \"route\": $route, \"events\": $ev}" | tee -a "$results"
  done
done

"$py" - "$results" "$base_sha" "$head_sha" "$here/benches/results/ab_commit.json" "$rounds" "$repeat" <<'PY'
import datetime, json, os, platform, statistics, sys
path, base, head, out, rounds, repeat = sys.argv[1:7]
rows = [json.loads(l) for l in open(path)]
def med(side, part, key):
    return statistics.median(r[part][key] for r in rows if r["side"] == side)
summary = {}
for part, key in (("route", "p50_us"), ("route", "p99_us"), ("events", "blocks_per_s")):
    b, h = med("base", part, key), med("head", part, key)
    summary[f"{part}_{key}"] = {"base": b, "head": h, "ratio": h / b}
    print(f"{part} {key}: {base} {b:.4g}  {head} {h:.4g}  ratio {h / b:.3f}x")
doc = {
    "benchmark": "ab_commit",
    "command": f"benches/ab_commit.sh {base} {rounds} {repeat}",
    "commit": head,
    "base": base,
    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}",
    "date": datetime.date.today().isoformat(),
    "profile": {k: os.environ[k] for k in ("CARGO_PROFILE_RELEASE_LTO", "CARGO_PROFILE_RELEASE_CODEGEN_UNITS") if k in os.environ},
    "summary": summary,
    "rows": rows,
}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
print(f"wrote {out}")
PY

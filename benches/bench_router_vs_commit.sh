#!/usr/bin/env bash
# route() of the default policy against an older commit, in one run:
#   benches/bench_router_vs_commit.sh BASE [ROUNDS] [REPEAT]
# builds BASE's wheel and this checkout's (release) into two venvs under $KVROUTE_AB_DIR
# (default /tmp/kvroute-ab), then runs benches/route_timing.py in each, alternating, ROUNDS times
# (default 6) with REPEAT timed routes per run (default 3000), and prints every run, the median p50 /
# p99 of each side and the ratio current/BASE. The machine is shared: the alternation spreads its noise
# over both sides; read the ratio, not the absolute figures.
set -euo pipefail

base=${1:?usage: $0 BASE_COMMIT [ROUNDS] [REPEAT]}
rounds=${2:-6}
repeat=${3:-3000}
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${KVROUTE_AB_DIR:-/tmp/kvroute-ab}
py=${PYTHON:-python3}

git -C "$here" rev-parse --verify --quiet "$base^{commit}" >/dev/null || { echo "not a commit: $base" >&2; exit 2; }
base_sha=$(git -C "$here" rev-parse --short "$base")
mkdir -p "$dir"

build() { # $1 = name, $2 = source tree
  local venv="$dir/$1-venv"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip maturin numpy >/dev/null
  (cd "$2" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$venv/bin/maturin" build --release -q -o "$dir/$1-wheels" >/dev/null)
  "$venv/bin/pip" install -q --force-reinstall --no-deps "$dir/$1-wheels"/kvroute-*.whl
}

rm -rf "$dir/base-src" "$dir/base-wheels" "$dir/head-wheels"
mkdir -p "$dir/base-src"
git -C "$here" archive "$base" | tar -x -C "$dir/base-src"
echo "building $base_sha ..." >&2
build base "$dir/base-src"
echo "building the checkout ..." >&2
build head "$here"

results="$dir/results.jsonl"
: >"$results"
for r in $(seq 1 "$rounds"); do
  for side in base head; do
    line=$("$dir/$side-venv/bin/python" "$here/benches/route_timing.py" --repeat "$repeat")
    echo "{\"side\": \"$side\", \"round\": $r, \"run\": $line}" | tee -a "$results"
  done
done

"$py" - "$results" "$base_sha" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(side, key):
    return statistics.median(r["run"][key] for r in rows if r["side"] == side)
pol = {s: next(r["run"]["policy"] for r in rows if r["side"] == s) for s in ("base", "head")}
for key in ("p50_us", "p99_us"):
    b, h = med("base", key), med("head", key)
    print(f"{key}: {sys.argv[2]} ({pol['base']}) {b:.2f}  checkout ({pol['head']}) {h:.2f}  ratio {h / b:.2f}x")
EOF

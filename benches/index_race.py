"""The index race (benches/index_race/README.md): builds the harness, runs it, and writes
benches/results/index_race.json (command, commit, machine, date, every JSON line the harness printed,
and its summary), which benches/render_results.py renders into README.md and docs/benchmarks.md.

    python benches/index_race.py                 # the full race (several minutes, on a quiet machine)
    python benches/index_race.py --quick         # a smoke run (its results file says "quick")
    python benches/index_race.py -- --workers 8  # anything after -- goes to the harness (--help)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HARNESS = os.path.join(HERE, "index_race")
OUT = os.path.join(HERE, "results", "index_race.json")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the harness's smoke run")
    ap.add_argument("--out", default=OUT, help="results file (default: %(default)s)")
    a = ap.parse_args(argv)
    print("building benches/index_race (release, fat LTO) ...", file=sys.stderr)
    subprocess.run(["cargo", "build", "--release", "-q"], cwd=HARNESS, check=True)
    cmd = [os.path.join(HARNESS, "target", "release", "index-race"), *(["--quick"] if a.quick else []), *extra]
    # The harness's table and progress go to stderr (shown as it runs); its JSON lines to stdout.
    proc = subprocess.run(cmd, cwd=HARNESS, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"index-race exited with {proc.returncode}; {a.out} left as it was", file=sys.stderr)
        return proc.returncode
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    summary = next((r["summary"] for r in rows if "summary" in r), [])
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "rust/core", "benches/index_race"], cwd=ROOT, capture_output=True, text=True
    )
    command = " ".join(["python benches/index_race.py", *(["--quick"] if a.quick else []), *(["--", *extra] if extra else [])])
    doc = results_file.header("index_race", command, machine=f"{_cpu_model()}, {os.cpu_count()} CPUs")
    if dirty.stdout.strip():
        doc["commit"] += "+dirty"
    doc.update({"quick": a.quick, "rows": [r for r in rows if "summary" not in r], "summary": summary})
    results_file.write(a.out, doc)
    print(f"wrote {a.out}; render it with: python benches/render_results.py", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

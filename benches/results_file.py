"""Results files (benches/results/*.json): the header every one carries (benchmark, command, commit,
machine, date) and writing one; benches/render_results.py renders them into the docs."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(script: str, argv: Sequence[str] | None = None) -> str:
    """The command line that ran ``benches/<script>``: its arguments as given (default: ``sys.argv``'s)."""
    return shlex.join(["python", f"benches/{script}", *(sys.argv[1:] if argv is None else argv)])


def header(benchmark: str, command: str, machine: str | None = None) -> dict[str, Any]:
    """The fields every results file starts with; `machine` defaults to arch, CPUs and CPython."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # Uncommitted changes to tracked files (other results files aside): the figures are not exactly that commit's.
    status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benches/results"]
    if subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout.strip():
        commit += "-dirty"
    return {
        "benchmark": benchmark,
        "command": command,
        "commit": commit,
        "machine": machine or f"{platform.machine()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}",
        "date": datetime.date.today().isoformat(),
    }


def write(path: str, doc: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

"""The `kvroute` command: simulate and plan, tables, --json, errors, plots, quiet progress."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from kvroute.cli import main
from kvroute.sim import synthetic_trace, write_trace
from kvroute.sim.progress import Progress

JSON_KEYS = {"scenario", "rate", "seed", "policy", "reject", "requests", "hit_rate", "ttft_p50", "ttft_p99", "attainment", "rejected"}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_simulate_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "simulate", "--rate", "40", "--duration", "10", "--policy", "ttft", "--policy", "least_load", "--json")
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["policy"] for r in rows] == ["ttft", "least_load"]
    for r in rows:
        assert r.keys() >= JSON_KEYS
        assert r["scenario"] == "seed-chat" and r["rate"] == 40 and r["seed"] == 0 and r["reject"] is False
        assert 0 <= r["hit_rate"] <= 1 and 0 <= r["attainment"] <= 1
        assert not any(k.startswith("_") for k in r)


def test_simulate_table_default_rows(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "simulate", "--rate", "40", "--duration", "5")
    lines = out.splitlines()
    assert lines[0].startswith("== seed-chat@40/s: 40 req/s")
    body = [x.split() for x in lines[2:]]
    # The seed's five rows (lowest-index tie-break), then the Router's default policy with rejection.
    assert [(b[0], b[1], b[-1]) for b in body] == [
        ("random", "no", "lowest"),
        ("least_load", "no", "lowest"),
        ("cache_only", "no", "lowest"),
        ("ttft", "no", "lowest"),
        ("ttft", "yes", "lowest"),
        ("capacity", "yes", "rotate"),
    ]


def test_simulate_sweep_reports_max_rate(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "simulate", "--rate", "20:40:10", "--duration", "5", "--policy", "ttft", "--reject")
    assert "max rate with >= 99% attainment:" in out
    assert "ttft +reject" in out.split("max rate")[1]


def test_simulate_trace_and_synthetic(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(synthetic_trace("docs", requests=200, rate=2, seed=1), path)
    out = run(capsys, "simulate", "--trace", str(path), "--speedup", "1,2", "--policy", "slack", "--json")
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["speedup"] for r in rows] == [1.0, 2.0]
    assert rows[0]["scenario"] == "trace" and rows[0]["requests"] == 200
    out = run(capsys, "simulate", "--scenario", "synthetic", "--shape", "agent", "--requests", "150", "--rate", "2", "--policy", "ttft")
    assert "synthetic-agent" in out


@pytest.mark.parametrize(
    "args,msg",
    [
        (["simulate", "--policy", "nope"], "unknown policy"),
        (["simulate", "--scenario", "trace"], "needs --trace"),
        (["simulate", "--rate", "0"], "rates must be > 0"),
        (["simulate", "--trace", "/nonexistent/x.jsonl"], "cannot read trace"),
        (["plan", "--static", "12X"], "must look like 12P12D"),
        (["plan", "--static", "10P10D"], "--total is 24"),
    ],
)
def test_bad_arguments(args: list[str], msg: str) -> None:
    with pytest.raises(SystemExit, match=msg):
        main(args)


def test_plan_default_is_the_seed_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "plan")
    assert "needs 4P17D (fits); with the fixed split prefill load 33%; decode load 139% (overloaded)" in out
    assert "needs 20P3D" in out and "prefill load 160% (overloaded)" in out
    assert "needs 2P17D" in out and "prefill load 12%" in out


def test_plan_dynamic_and_json(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = run(capsys, "plan", "--dynamic", "--window", "900")
    assert "overloaded windows (!): planned" in out and "fixed 12P12D 12/12" in out
    out = run(capsys, "plan", "--dynamic", "--window", "1800", "--json")
    steps = [json.loads(x) for x in out.splitlines()]
    assert len(steps) == 6 and all(s["p"] + s["d"] == 24 for s in steps)
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    run(capsys, "plan", "--dynamic", "--plot", str(png))
    assert png.stat().st_size > 1000


def test_simulate_plot(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    run(capsys, "simulate", "--rate", "30,40", "--duration", "5", "--policy", "ttft", "--policy", "least_load", "--plot", str(png))
    assert png.stat().st_size > 1000


def test_progress_is_silent_off_a_terminal() -> None:
    buf = io.StringIO()
    p = Progress(100, "x", stream=buf)
    for i in range(100):
        p.update(i)
    p.close()
    assert buf.getvalue() == ""
    p = Progress(100, "x", stream=buf, enabled=True)
    p.update(100)
    p.close()
    assert "100%" in buf.getvalue()


def test_console_script_entry_point() -> None:
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "plan"], capture_output=True, text=True, timeout=60, check=True)
    assert "4P17D" in r.stdout and r.stderr == ""

"""The `kvroute` command: simulate and plan, tables, --json, errors, plots, quiet progress."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from cli_support import refusal
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


#: Every option that takes a value, given a bad one, and what the one-line error must say.
BAD = [
    (["simulate", "--policy", "nope"], "unknown policy"),
    (["simulate", "--scenario", "trace"], "needs --trace"),
    (["simulate", "--scenario", "nosuch"], "invalid choice"),
    (["simulate", "--engine", "gpu"], "invalid choice"),
    (["simulate", "--rate", "0"], "expected a finite number > 0"),
    (["simulate", "--rate", "50:40:10"], "empty range"),
    (["simulate", "--rate", "1:2"], "START:STOP:STEP"),
    (["simulate", "--rate", "x"], "expected a finite number > 0"),
    (["simulate", "--rate", ","], "one or more numbers"),
    (["simulate", "--speedup", "-1"], "expected a finite number > 0"),
    (["simulate", "--trace", "/nonexistent/x.jsonl"], "no such file"),
    (["simulate", "--shape", "nosuch", "--scenario", "synthetic"], "invalid choice"),
    (["simulate", "--requests", "-5"], "integer >= 1"),
    (["simulate", "--requests", "many"], "integer >= 1"),
    (["simulate", "--duration", "-5"], "number > 0"),
    (["simulate", "--duration", "inf"], "number > 0"),
    (["simulate", "--seed", "-1"], "integer >= 0"),
    (["simulate", "--instances", "0"], "integer >= 1"),
    (["simulate", "--cache-blocks", "0"], "integer >= 1"),
    (["simulate", "--speed", "0"], "number > 0"),
    (["simulate", "--slo", "nan"], "number > 0"),
    (["simulate", "--decode-instances", "-1"], "integer >= 0"),
    (["simulate", "--decode-kv-blocks", "0"], "integer >= 1"),
    (["simulate", "--decode-speed", "-3"], "number > 0"),
    (["simulate", "--tpot-slo", "0"], "number > 0"),
    (["simulate", "--kv-compression", "0"], "number > 0"),
    (["simulate", "--prefill-batch-tokens", "-1"], "integer >= 0"),
    (["simulate", "--prefill-batch-wait", "-1"], "number >= 0"),
    (["simulate", "--event-lag", "-1"], "number >= 0"),
    (["simulate", "--router-seed", "-1"], "integer >= 0"),
    (["simulate", "--kv-blocks", "0"], "integer >= 1"),
    (["simulate", "--itl-slo", "0"], "number > 0"),
    (["simulate", "--timing-fit", "/nonexistent.json"], "no such file"),
    (["simulate", "--seeds", "0"], "integer >= 1"),
    (["simulate", "--split", "half"], "invalid choice"),
    (["simulate", "--tie-break", "coin"], "invalid choice"),
    (["simulate", "--kv-blocks", "100"], "go with --engine aisim"),
    (["simulate", "--quick"], "go with --suite"),
    (["plan", "--static", "12X"], "must look like 12P12D"),
    (["plan", "--static", "10P10D"], "--total is 24"),
    (["plan", "--total", "-1"], "integer >= 2"),
    (["plan", "--phases", "/nonexistent.csv"], "no such file"),
    (["plan", "--trace", "/nonexistent.jsonl"], "no such file"),
    (["plan", "--speedup", "0"], "number > 0"),
    (["plan", "--phase-duration", "0"], "number > 0"),
    (["plan", "--ramp", "-1"], "number >= 0"),
    (["plan", "--p-cap", "0"], "number > 0"),
    (["plan", "--d-cap", "0"], "number > 0"),
    (["plan", "--window", "0"], "number > 0"),
    (["plan", "--warmup", "-1"], "number >= 0"),
    (["plan", "--drain", "-1"], "number >= 0"),
    (["plan", "--hysteresis", "1.5"], "<= 1"),
    (["plan", "--min-move", "0"], "integer >= 1"),
    (["plan", "--slo", "0"], "number > 0"),
    (["plan", "--itl-slo", "0"], "number > 0"),
    (["plan", "--engine", "gpu"], "invalid choice"),
    (["serve", "--worker", "http://127.0.0.1:9", "--port", "70000"], "<= 65535"),
    (["serve", "--worker", "http://127.0.0.1:9", "--port", "http"], "integer >= 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--threads", "0"], "integer >= 1"),
    (["serve", "--worker", "http://127.0.0.1:9", "--max-retries", "-1"], "integer >= 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--max-body-bytes", "0"], "integer >= 1"),
    (["serve", "--worker", "http://127.0.0.1:9", "--max-in-flight", "0"], "integer >= 1"),
    (["serve", "--worker", "http://127.0.0.1:9", "--max-client-concurrency", "0"], "integer >= 1"),
    (["serve", "--worker", "http://127.0.0.1:9", "--connect-timeout", "0"], "number > 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--read-timeout", "0"], "number > 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--client-timeout", "0"], "number > 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--health-interval", "0"], "number > 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--metrics-interval", "-1"], "number >= 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--models-interval", "-1"], "number >= 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--approx-ttl", "0"], "number > 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--prefill-tokens-per-s", "0"], "number > 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--prefix-cache-blocks", "-5"], "integer >= 0"),
    (["serve", "--worker", "http://127.0.0.1:9", "--pd-convention", "x"], "invalid choice"),
    (["serve", "--worker", "http://127.0.0.1:9", "--ttft-slo", "-1"], "ttft_slo"),
    (["serve", "--worker", "http://127.0.0.1:9", "--worker-models", "nope"], "URL=MODEL"),
    (["serve", "--worker", "http://127.0.0.1:9", "--worker-models", "http://x:1=m"], "not a configured worker"),
    (["serve", "--worker", "127.0.0.1:9"], "http(s)://host"),
    (["serve", "--worker", "http://127.0.0.1:9", "--tokenizer", "/nonexistent"], "tokenizer"),
    (["serve", "--prefill", "http://127.0.0.1:9", "x", "--decode", "http://127.0.0.1:8"], "integer >= 1"),
    (["serve", "--prefill", "http://127.0.0.1:9"], "both --prefill and --decode"),
    (["serve"], "at least one --worker"),
    (["epp"], "at least one --worker, or --endpoints-file"),
    (["epp", "--worker", "http://127.0.0.1:9", "--grpc-port", "70000"], "<= 65535"),
    (["epp", "--worker", "http://127.0.0.1:9", "--port", "-1"], "integer >= 0"),
    (["epp", "--worker", "http://127.0.0.1:9", "--kv-events-port", "0"], "TCP port (1..65535)"),
    (["epp", "--worker", "http://127.0.0.1:9", "--kv-events-port", "70000"], "<= 65535"),
    (["epp", "--endpoints-file", "/nonexistent/endpoints"], "no such directory: '/nonexistent'"),
    (["epp", "--endpoints-file", "/"], "is a directory"),
    (["epp", "--worker", "http://127.0.0.1:9", "--endpoints-interval", "0"], "number > 0"),
    (["epp", "--worker", "http://127.0.0.1:9", "--drain-seconds", "-1"], "number >= 0"),
    (["epp", "--worker", "http://127.0.0.1:9", "--threads", "0"], "integer >= 1"),
    (["epp", "--worker", "http://127.0.0.1:9", "--block-size", "0"], "block_size must be >= 1"),
    (["epp", "--worker", "http://127.0.0.1:9", "--token-share-bound", "0"], "token_share_bound"),
    (["epp", "--worker", "http://127.0.0.1:9", "--tpot-slo", "-1"], "tpot_slo"),
    (["epp", "--worker", "http://127.0.0.1:9", "--read-timeout", "0"], "number > 0"),
    (["epp", "--worker", "http://127.0.0.1:9", "--max-in-flight", "0"], "integer >= 1"),
    (["epp", "--worker", "127.0.0.1:9"], "http(s)://host"),
    (["nosuch"], "invalid choice"),
]


@pytest.mark.parametrize("args,msg", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_status_2(args: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    """No option answers a bad value with a traceback: one line on stderr naming the problem, exit 2."""
    assert msg in refusal(args, capsys)


@pytest.mark.parametrize(
    "content,msg",
    [("[1,", "not a JSON list of endpoints"), ('["10.0.0.1:8000", 7]', "a list of strings"), ("just-a-host\n", "is not host:port")],
)
def test_a_bad_endpoints_file_is_one_line(content: str, msg: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "endpoints"
    path.write_text(content)
    assert msg in refusal(["epp", "--endpoints-file", str(path)], capsys)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("kvroute ")


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

"""The guides' Python examples run as written, with what they leave to the reader filled in: the
Router's (docs/router.md), the KV-event subscriber's (docs/events.md), the realistic engine model's
(docs/simulator.md) and the gateway's `run` (docs/gateway.md, in front of mock engines). The
integrations' examples run in tests/docs/test_integrations_guide.py (with LiteLLM and Ray Serve, which
the real-engine bed has) and tests/e2e/test_e2e_litellm_proxy.py (the documented proxy config); the
endpoint picker's Envoy bootstrap runs in tests/gateway/test_epp.py."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import kvroute
import numpy as np
import pytest
from vllm_bed import free_port, stop_pid

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_block(page: str, after: str = "") -> str:
    """The first ```python block of docs/``page`` after the text ``after``."""
    text = (DOCS / page).read_text()
    if after:
        assert after in text, f"docs/{page} no longer has {after!r}"
        text = text[text.index(after) :]
    m = re.search(r"```python\n(.*?)```", text, flags=re.S)
    assert m, f"docs/{page} has no python block after {after!r}"
    return m.group(1)


def test_router_example_routes_admits_and_releases() -> None:
    code = python_block("router.md")
    sent: list[Any] = []
    busy: list[Any] = []
    scope: dict[str, Any] = {
        # What the example leaves to the reader: an index fed by events, a prompt, the host's I/O.
        "my_index": kvroute.KvIndex(),
        "tokens": np.arange(4096, dtype=np.uint32),
        "send": lambda worker, *rest: sent.append(worker),
        "reply_busy": busy.append,
    }
    exec(compile(code, "docs/router.md", "exec"), scope)
    router, d = scope["router"], scope["d"]
    assert d.admitted and sent == [d.worker] and not busy
    assert router.num_in_flight == 1
    router.prefill_done("req-1")
    router.finished("req-1")
    assert router.num_in_flight == 0


def test_event_subscriber_example_starts_and_stops() -> None:
    pytest.importorskip("zmq")
    code = python_block("events.md")
    # The engines' endpoints, on free loopback ports nothing publishes on yet.
    for host in ("engine-a", "engine-b"):
        for port in ("5557", "5558"):
            code = code.replace(f"tcp://{host}:{port}", f"tcp://127.0.0.1:{free_port()}")
    code += "\nstats = sub.stats()\n"
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/events.md", "exec"), scope)
    assert {"batches", "gaps", "replays", "synced"} <= set(scope["stats"])


def test_realistic_engine_model_example_runs() -> None:
    if not getattr(kvroute._core, "HAS_AISIM", False):
        pytest.skip("this build has no aisim feature")
    code = python_block("simulator.md", "## The realistic engine model")
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/simulator.md", "exec"), scope)
    kv, rr = scope["kv"], scope["rr"]
    assert kv.summary["ttft_p99_ms"] > 0 and rr.summary["ttft_p99_ms"] > 0
    assert 0 <= kv.summary["goodput_share"] <= 1


def test_gateway_run_example_serves_until_interrupted(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    code = python_block("gateway.md", "## From Python")
    mock = subprocess.Popen(
        [sys.executable, "-m", "kvroute.gateway.mock", "--workers", "2"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    serve: subprocess.Popen[bytes] | None = None
    try:
        assert mock.stdout is not None
        urls = [mock.stdout.readline().decode().strip() for _ in range(2)]
        assert all(u.startswith("http://127.0.0.1:") for u in urls), urls
        port = free_port()
        code = code.replace('"http://10.0.0.1:8000"', repr(urls[0])).replace('"http://10.0.0.2:8000"', repr(urls[1]))
        code = code.replace("port=9000", f"port={port}")
        script = tmp_path / "gateway_example.py"
        script.write_text(textwrap.dedent(code))
        # With SIGINT at its default, as in a user's shell (a test before this one may have left it
        # ignored in this process, and an ignored SIGINT is inherited: Python then never raises
        # KeyboardInterrupt).
        serve = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert serve.poll() is None, "the example exited"
            assert time.monotonic() < deadline, "the example's gateway never became healthy"
            time.sleep(0.05)
        body = b'{"model": "mock", "prompt": "hello from the guide", "max_tokens": 4}'
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and b"choices" in r.read()
        # "serves until Ctrl-C": an interrupt ends it cleanly.
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0
        serve = None
    finally:
        if serve is not None:
            stop_pid(serve)
        stop_pid(mock)

"""The README's gateway quick start runs as written: two mock engines, `kvroute serve` in front of
them, and the curl request, on free 127.0.0.1 ports in place of the README's."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_bed import free_port, stop_pid

README = Path(__file__).resolve().parents[2] / "README.md"

pytest.importorskip("aiohttp")


def _quick_start() -> list[str]:
    text = README.read_text()
    section = text.split("## Quick start: the gateway", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S)
    assert block, "the gateway quick start has a shell block"
    # Joined continuation lines, without comments.
    return [ln.split("#", 1)[0].strip() for ln in block.group(1).replace("\\\n", " ").splitlines() if ln.strip()]


def _two_free_ports() -> int:
    for _ in range(64):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _wait_lines(proc: subprocess.Popen[bytes], n: int, timeout: float = 30.0) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while len(lines) < n and time.monotonic() < deadline:
        line = proc.stdout.readline().decode().strip()
        if line:
            lines.append(line)
        elif proc.poll() is not None:
            break
    return lines


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvroute serve exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} not healthy within {timeout} s")


def test_readme_gateway_quick_start() -> None:
    cmds = _quick_start()
    assert cmds[0] == 'pip install ".[gateway]"'
    mock, serve, curl = (shlex.split(c) for c in cmds[1:4])
    assert mock[:3] == ["python", "-m", "kvroute.gateway.mock"] and mock[-1] == "&"
    assert serve[:2] == ["kvroute", "serve"] and curl[0] == "curl"
    first, gw = _two_free_ports(), free_port()
    ports = {"8100": str(first), "8101": str(first + 1), "9000": str(gw)}

    def local(args: list[str]) -> list[str]:
        return [re.sub(r"\b(8100|8101|9000)\b", lambda m: ports[m.group(1)], a) for a in args]

    kvroute_cli = shutil.which("kvroute", path=str(Path(sys.executable).parent)) or "kvroute"
    mock_proc = subprocess.Popen([sys.executable, *local(mock[1:-1])], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    serve_proc = None
    try:
        assert _wait_lines(mock_proc, 2) == [f"http://127.0.0.1:{first}", f"http://127.0.0.1:{first + 1}"]
        serve_proc = subprocess.Popen(
            [kvroute_cli, *local(serve[1:]), "--host", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        _wait_health(f"http://127.0.0.1:{gw}/health", serve_proc)
        url = next(a for a in local(curl) if a.startswith("http://"))
        body = curl[curl.index("-d") + 1]
        req = urllib.request.Request(url, data=body.encode(), headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            answer = json.loads(r.read())
        assert answer["object"] == "text_completion" and answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == json.loads(body)["max_tokens"]
    finally:
        if serve_proc is not None:
            stop_pid(serve_proc)  # type: ignore[arg-type]
        stop_pid(mock_proc)  # type: ignore[arg-type]

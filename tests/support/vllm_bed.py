"""The real-engine bed: a tiny local model and vLLM CPU engines on free 127.0.0.1 ports, with prefix
caching and KV events; every process started here is stopped by its own PID (bounded waits, SIGKILL last).

Importable (tests/e2e/, benchmarks, later integrations) and a small CLI:

    python tests/support/vllm_bed.py model DIR           # builds the tiny model directory (deterministic)
    python tests/support/vllm_bed.py up --engines 2      # starts engines, prints their URLs, stops them on Ctrl-C
    python tests/support/vllm_bed.py up --loras          # the same, serving the bed's two LoRA adapters too

The bed lives in ``$KVROUTE_E2E_BED`` (default ``<checkout>/.bed``), built by ``tests/e2e/build_bed.sh``:
``venv/`` (vLLM's CPU build, kvroute, openai) and ``model/``. Only the standard library is needed to
start engines; building the model needs ``tokenizers``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTER_NAMES",
    "BLOCK_SIZE",
    "MAX_LORA_RANK",
    "MODEL_NAME",
    "Bed",
    "BedError",
    "Engine",
    "LiteLLMProxy",
    "build_model",
    "free_port",
    "http_json",
    "poll",
    "skip_unless_bed",
    "stop_pid",
    "unavailable",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 32  # the CPU backend wants a multiple of 32
VOCAB_SIZE = 4096
# The bed's LoRA adapters (``Bed.adapters``): tiny seeded PEFT adapters on q_proj/v_proj, rank 8.
ADAPTER_NAMES = ("tenant-a", "tenant-b")
MAX_LORA_RANK = 8

# ChatML with a BOS in front; the tokenizer's post-processor adds the same BOS to completions prompts.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# What the engines need on this CPU build (issue #11): 1 GiB KV space, no thread pinning, one OpenMP
# thread (2 cores shared by several engines), no hub, and /reset_prefix_cache.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class BedError(RuntimeError):
    """The bed is missing or an engine failed to start or stop; the message says which and where its log is."""


def bed_dir() -> Path:
    return Path(os.environ.get("KVROUTE_E2E_BED") or ROOT / ".bed").resolve()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; the usual default elsewhere)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


# Not seeded: processes running side by side (CI and a developer's runs) must not draw the same ports.
_ports = random.SystemRandom()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a server started later (an engine, its KV-event
    replay socket, a gateway). Drawn below the kernel's ephemeral range: a port the kernel picks
    (binding port 0) is one it also hands to outgoing connections, so between this check and the
    server's bind an HTTP client or a ZMQ socket of another process could take it (CI lost a whole
    e2e run to an engine's replay port taken that way: "Address already in use")."""
    lo, _ = _ephemeral_range()
    low = max(1024, lo - 16384)
    for _ in range(256):
        port = _ports.randrange(low, lo) if lo > low else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port on 127.0.0.1 in {low}-{lo - 1} after 256 tries")


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """One HTTP request with a JSON body (or none); returns (status, decoded JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def chat_turns(conv: int, turn: int) -> list[dict[str, str]]:
    """Conversation ``conv`` up to user turn ``turn``: a system prompt of its own (several blocks), then
    alternating user questions and short assistant answers, so each turn extends the previous prompt."""
    msgs = [{"role": "system", "content": f"You are helper {conv}. " + "Answer briefly and precisely, citing sources. " * 8}]
    for t in range(turn + 1):
        msgs.append({"role": "user", "content": f"Question {t} of conversation {conv}?"})
        if t < turn:
            msgs.append({"role": "assistant", "content": f"Answer {t}."})
    return msgs


def poll(pred: Any, timeout: float, what: str, interval: float = 0.02) -> None:
    """Waits until ``pred()`` is true (bounded; raises TimeoutError naming ``what``): engines publish KV
    events on their next scheduler step, so tests synchronise on the state they expect, never on a sleep."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# ---- the model -----------------------------------------------------------------------------------


def _corpus() -> list[str]:
    """Text found on the machine, in a fixed order: the Python sources of a few standard-library
    packages (deterministic for one Python version, and unchanged by edits to this checkout)."""
    import email
    import http
    import json as _json
    import logging
    import urllib

    files: list[Path] = []
    for pkg in (_json, email, http, logging, urllib):
        files += sorted(Path(pkg.__file__).parent.glob("*.py"))
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def build_model(path: Path) -> Path:
    """Writes a tiny LlamaForCausalLM directory (config.json, tokenizer.json, tokenizer_config.json)
    for ``--load-format dummy``: random weights, a real byte-level BPE tokenizer and chat template."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return path


# ---- processes -----------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), so a stop reaches vLLM's engine-core process too."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_pid(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
    """Stops ``proc`` and its descendants by their PIDs: ``sig``, a bounded wait, then SIGKILL."""
    kids = _children(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    deadline = time.monotonic() + (timeout if sig != signal.SIGKILL else 0)
    kids = [k for k in kids if _alive(k)]
    while kids and time.monotonic() < deadline:
        time.sleep(0.1)
        kids = [k for k in kids if _alive(k)]
    for k in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(k, signal.SIGKILL)


_live: set[Engine | Gateway | LiteLLMProxy] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        engines = list(_live)
    for e in engines:
        e.stop(timeout=10)


class _Server:
    """What the bed's processes share: a log file and a stop by PID that forgets the process."""

    bed: Bed
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.bed.logs / f"{self.name}.log"

    def metrics(self) -> dict[str, float]:
        """The process's Prometheus samples from its /metrics, keyed by the sample line's name and labels."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _stop(self, sig: int, timeout: float) -> None:
        if self.proc is not None:
            stop_pid(self.proc, sig, timeout)
        with _live_lock:
            _live.discard(self)  # type: ignore[arg-type]

    def _launch(self, argv: list[str], health_path: str, timeout: float, env: dict[str, str] | None = None) -> None:
        """Starts ``argv`` (its output appended to the log) and polls ``health_path`` until it answers
        200, for at most ``timeout`` s; BedError with the log's tail if it exits or stays unhealthy."""
        self.bed.logs.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        with _live_lock:
            _live.add(self)  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BedError(f"{self.name} exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(self.url + health_path, timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(0.2)
        self._stop(signal.SIGTERM, 15.0)
        raise BedError(f"{self.name} not healthy within {timeout} s; log:\n{self.log_tail()}")


@dataclass(eq=False)
class Engine(_Server):
    """One vLLM OpenAI server on 127.0.0.1: ``url``, ``events`` (ZMQ PUB, an ipc socket) and ``replay``
    (ROUTER, tcp) endpoints. They stay fixed across ``restart()`` so subscribers reconnect to the new process."""

    bed: Bed
    name: str
    num_blocks: int = 64
    max_model_len: int | None = None  # default: what the cache holds (one block is vLLM's null block), at most 1024
    extra_args: Sequence[str] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    # LoRA adapters served beside the base model (name -> PEFT adapter directory, e.g. ``Bed.adapters()``):
    # ``--enable-lora --max-loras N --max-lora-rank 8 --lora-modules name=path ...``; None: no LoRA flags at all.
    loras: dict[str, Path] | None = None
    port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def events(self) -> str:
        # vLLM 0.32 binds its PUB socket only for a wildcard (tcp://*:P) or ipc/inproc endpoint and
        # *connects* it to any other tcp address; an ipc socket binds and stays on this machine.
        return f"ipc://{self.bed.logs}/{self.name}.events"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def argv(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
            "topic": "kv-events",
        }
        return [
            str(self.bed.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.bed.model),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load-format",
            "dummy",
            "--seed",
            "0",
            "--block-size",
            str(BLOCK_SIZE),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--max-model-len",
            str(self.max_model_len or min(1024, (self.num_blocks - 1) * BLOCK_SIZE)),
            "--max-num-seqs",
            "8",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            # Eager mode: no torch.compile warm-up (~30 s start instead of ~70 s); caching, events and
            # streaming are the same.
            "--enforce-eager",
            "--kv-events-config",
            json.dumps(kv_events),
            *self.lora_args(),
            *self.extra_args,
        ]

    def lora_args(self) -> list[str]:
        """The LoRA flags for ``loras`` (none when it is None or empty)."""
        if not self.loras:
            return []
        return [
            "--enable-lora",
            "--max-loras",
            str(max(2, len(self.loras))),
            "--max-lora-rank",
            str(MAX_LORA_RANK),
            "--lora-modules",
            *(f"{name}={Path(path).resolve()}" for name, path in self.loras.items()),
        ]

    def start(self) -> Engine:
        """Launches the server (returns at once; ``wait_ready`` waits for /health)."""
        if self.proc is not None and self.proc.poll() is None:
            raise BedError(f"engine {self.name} is already running (pid {self.proc.pid})")
        self.bed.logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **ENGINE_ENV, **self.extra_env}
        env.pop("VIRTUAL_ENV", None)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {self.starts} : {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.starts += 1
        with _live_lock:
            _live.add(self)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = 240.0) -> Engine:
        """Polls /health until 200; raises BedError (with the log's tail) if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise BedError(
                    f"engine {self.name} exited with {self.proc and self.proc.returncode} before /health; log:\n{self.log_tail()}"
                )
            if self.healthy():
                return self
            time.sleep(0.5)
        raise BedError(f"engine {self.name} not healthy within {timeout} s; log:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stops the server and its engine-core process by PID (``sig``, bounded wait, SIGKILL)."""
        self._stop(sig, timeout)

    def restart(self, timeout: float = 240.0) -> Engine:
        self.stop()
        return self.start().wait_ready(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- the engine's own API ----

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        status, out = http_json("POST", self.url + "/tokenize", {"model": MODEL_NAME, **body})
        if status != 200:
            raise BedError(f"{self.name} /tokenize answered {status}: {out}")
        return list(out["tokens"])

    def reset_prefix_cache(self) -> None:
        status, out = http_json("POST", self.url + "/reset_prefix_cache")
        if status != 200:
            raise BedError(f"{self.name} /reset_prefix_cache answered {status}: {out}")

    def complete(self, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """POST /v1/completions (or /v1/chat/completions when ``body`` has messages); the JSON answer."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, out = http_json("POST", self.url + path, {"model": MODEL_NAME, **body}, timeout)
        if status != 200:
            raise BedError(f"{self.name} {path} answered {status}: {out}")
        return dict(out)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for key, v in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
                total += v
        return total


def reset_caches(engines: Sequence[Engine]) -> None:
    """Empties every engine's prefix cache; one request makes it step, so the clear is published.
    (Its prompt is two blocks long: on this bed a first request of a few tokens has killed the
    engine's worker with SIGILL, longer first requests never did.)"""
    for i, e in enumerate(engines):
        e.reset_prefix_cache()
        e.complete({"prompt": " ".join(f"reset{i}x{k}" for k in range(40)), "max_tokens": 1, "temperature": 0})


@dataclass(eq=False)
class Gateway(_Server):
    """``kvroute serve`` (the bed's kvroute) in front of ``engines``, KV events on, on a free port."""

    bed: Bed
    engines: Sequence[Engine]
    args: Sequence[str] = ()
    name: str = "gateway"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    prefill: Sequence[Engine] = ()  # PD mode: these of ``engines`` prefill (--prefill), the others decode (--decode)
    alarm_expected: bool = False  # a deliberately misconfigured gateway: its self-check alarm is not a failure

    def argv(self) -> list[str]:
        out = [str(self.bed.python), "-m", "kvroute.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        out += ["--block-size", str(BLOCK_SIZE), "--health-interval", "0.5"]
        for e in self.engines:
            role = "--prefill" if e in self.prefill else "--decode" if self.prefill else "--worker"
            out += [role, e.url, "--kv-events", f"{e.url}={e.events}", "--kv-events-replay", f"{e.url}={e.replay}"]
        return out + list(self.args)

    def start(self, timeout: float = 60.0) -> Gateway:
        self._launch(self.argv(), "/health", timeout)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        self._stop(sig, timeout)
        # A correctly configured gateway's self-check never raises its alarm: this run's log (after
        # its "====" header line) has no alarm.
        if not self.alarm_expected and self.log_path.exists():
            run_log = self.log_path.read_text(errors="replace").rsplit("\n==== ", 1)[-1]
            alarms = [line for line in run_log.splitlines() if "kvroute self-check" in line]
            if alarms:
                raise BedError(f"{self.name}: the self-check raised its alarm: {alarms[0]}")


@dataclass(eq=False)
class Picker(Gateway):
    """``kvroute epp`` (the endpoint picker) for ``engines``, KV events on, and a real Envoy in front
    of them running deploy/envoy/envoy.yaml (tests/support/envoy_harness.py): ``url`` is Envoy's;
    the picker's /health, /metrics are on ``picker_url``. ``picker=False``: Envoy alone, its own round
    robin (the same bootstrap with no picker to ask: its health check fails it open)."""

    name: str = "epp"
    grpc_port: int = field(default_factory=free_port)
    picker: bool = True
    envoy: Any = None

    def argv(self) -> list[str]:
        out = super().argv()
        out[out.index("serve")] = "epp"
        return [*out, "--grpc-port", str(self.grpc_port), "--drain-seconds", "0"]

    @property
    def picker_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.envoy.url if self.envoy is not None else self.picker_url

    def metrics(self) -> dict[str, float]:
        envoy, self.envoy = self.envoy, None  # the picker's own /metrics
        try:
            return super().metrics()
        finally:
            self.envoy = envoy

    def start(self, timeout: float = 60.0) -> Picker:
        from envoy_harness import Envoy

        if self.picker:
            self._launch(self.argv(), "/health", timeout)
        self.envoy = Envoy([e.url for e in self.engines], f"127.0.0.1:{self.grpc_port}", failure_mode_allow=not self.picker)
        try:
            self.envoy.start_sync()
            self.envoy.picker_healthy_sync(self.picker)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        if self.picker:
            super().stop(sig, timeout)


@dataclass(eq=False)
class LiteLLMProxy(_Server):
    """The LiteLLM proxy of the bed's venv, ``litellm --config CONFIG`` (one uvicorn worker, no
    database), on a free 127.0.0.1 port; ``env`` adds to its environment (``KVROUTE_*`` settings).
    The proxy refuses to start without a master key: ``master_key`` is a fresh random one, passed as
    ``LITELLM_MASTER_KEY``; requests send it (``auth``). ``start`` polls ``/health/liveliness``
    (bounded); ``stop`` stops it by PID."""

    bed: Bed
    config: Path
    env: dict[str, str] = field(default_factory=dict)
    master_key: str = field(default_factory=lambda: "sk-" + secrets.token_hex(32))
    name: str = "litellm-proxy"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        exe = self.bed.root / "venv" / "bin" / "litellm"
        return [str(exe), "--config", str(self.config), "--host", "127.0.0.1", "--port", str(self.port), "--num_workers", "1"]

    def start(self, timeout: float = 120.0) -> LiteLLMProxy:
        # The bundled model cost map (no fetch from the network), no telemetry; the rest is the config's.
        env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_MASTER_KEY": self.master_key,
            "TOKENIZERS_PARALLELISM": "false",
            **self.env,
        }
        env.pop("VIRTUAL_ENV", None)
        self._launch(self.argv(), "/health/liveliness", timeout, env=env)
        return self

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.master_key}"}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        self._stop(sig, timeout)


class Bed:
    """The built bed (venv + model) and the engines started from it."""

    def __init__(self, root: Path | None = None, logs: bool = True) -> None:
        self.root = root or bed_dir()
        self.python = self.root / "venv" / "bin" / "python"
        self.model = self.root / "model"
        self.logs = Path(tempfile.mkdtemp(prefix="kvroute-e2e-logs-")) if logs else Path(tempfile.gettempdir())
        self.engines: list[Engine] = []

    def missing(self) -> str | None:
        """Why this bed cannot run engines, or None when it can."""
        if not self.python.exists():
            return f"no bed venv at {self.python.parent.parent} (build it with `make e2e` or tests/e2e/build_bed.sh)"
        if not list((self.root / "venv").glob(".complete-*")):
            return f"the bed venv at {self.root / 'venv'} is incomplete (rerun tests/e2e/build_bed.sh)"
        if not (self.model / "config.json").exists():
            return f"no model at {self.model} (rerun tests/e2e/build_bed.sh)"
        return None

    def adapters(self, names: Sequence[str] = ADAPTER_NAMES, rank: int = MAX_LORA_RANK) -> dict[str, Path]:
        """LoRA adapters for the bed's model, one per name (seeded by its position: 1, 2, ...), in
        ``<bed>/adapters/<name>``; made once, reused while their config matches. For ``loras=``."""
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            from lora import make_adapter
        finally:
            sys.path.pop(0)
        out: dict[str, Path] = {}
        for seed, name in enumerate(names, start=1):
            d = self.root / "adapters" / name
            try:
                ok = json.loads((d / "adapter_config.json").read_text())["r"] == rank and (d / "adapter_model.safetensors").exists()
            except (OSError, ValueError, KeyError):
                ok = False
            if not ok:
                make_adapter(self.model, d, rank=rank, seed=seed)
            out[name] = d
        return out

    def engine(self, name: str | None = None, **kw: Any) -> Engine:
        e = Engine(self, name or f"engine{len(self.engines)}", **kw)
        self.engines.append(e)
        return e

    def start(self, n: int, timeout: float = 300.0, **kw: Any) -> list[Engine]:
        """Starts ``n`` engines at once and waits until all are healthy (stops them all on failure)."""
        engines = [self.engine(**kw) for _ in range(n)]
        try:
            for e in engines:
                e.start()
            for e in engines:
                e.wait_ready(timeout)
        except BaseException:
            for e in engines:
                e.stop(timeout=10)
            raise
        return engines

    def stop_all(self) -> None:
        for e in self.engines:
            e.stop(timeout=20)

    @contextlib.contextmanager
    def running(self, n: int, **kw: Any) -> Iterator[list[Engine]]:
        engines = self.start(n, **kw)
        try:
            yield engines
        finally:
            for e in engines:
                e.stop(timeout=20)


def unavailable(bed: Bed | None = None) -> str | None:
    """Why the e2e tests cannot run in this interpreter, or None: they run in the bed's own venv
    (``make e2e``), which has vLLM, kvroute and openai."""
    bed = bed or Bed(logs=False)
    why = bed.missing()
    if why:
        return why
    if Path(sys.prefix).resolve() != (bed.root / "venv").resolve():
        return f"the e2e tests run in the bed's interpreter ({bed.python}): use `make e2e`"
    for mod in ("vllm", "openai", "zmq", "kvroute"):
        try:
            __import__(mod)
        except ImportError:
            return f"the bed venv lacks {mod}: rerun tests/e2e/build_bed.sh"
    return None


def skip_unless_bed() -> None:
    """At the top of an e2e test module: skips it without the bed, or fails with KVROUTE_E2E_REQUIRED=1
    (CI and ``make e2e``: a missing bed must not pass as a skip)."""
    import pytest

    why = unavailable()
    if why is None:
        return
    if os.environ.get("KVROUTE_E2E_REQUIRED") == "1":
        pytest.fail(f"KVROUTE_E2E_REQUIRED=1 but the real-engine bed is unavailable: {why}", pytrace=False)
    pytest.skip(f"real-engine bed unavailable: {why}", allow_module_level=True)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="vllm_bed", description="kvroute's real-engine bed")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model", help="build the tiny model directory")
    m.add_argument("dir", type=Path)
    u = sub.add_parser("up", help="start engines until Ctrl-C")
    u.add_argument("--engines", type=int, default=2)
    u.add_argument("--num-blocks", type=int, default=64)
    u.add_argument("--loras", action="store_true", help=f"serve the bed's LoRA adapters too ({', '.join(ADAPTER_NAMES)})")
    a = p.parse_args(argv)
    if a.cmd == "model":
        print(build_model(a.dir))
        return 0
    bed = Bed()
    why = bed.missing()
    if why:
        print(f"vllm_bed: {why}", file=sys.stderr)
        return 2
    loras = bed.adapters() if a.loras else None
    with bed.running(a.engines, num_blocks=a.num_blocks, loras=loras) as engines:
        for e in engines:
            print(f"{e.name}: {e.url} events={e.events} replay={e.replay} log={e.log_path}", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

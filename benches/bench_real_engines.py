"""Routers in front of the same real vLLM CPU engines (the bed, docs/e2e.md), one multi-turn chat
workload through the official ``openai`` client, streamed; the engines' own counters say what each router bought.

    KVROUTE_E2E_BED=.bed .bed/venv/bin/python benches/bench_real_engines.py [--json] [--results FILE] [--num-blocks 192]
        [--conversations 64] [--turns 6] [--threads 6] [--seeds 0,1,2] [--routers kvroute,kvroute:cache_only,sglang]
        [--sglang-router PATH] [--vllm-router PATH] [--no-pd] [--prefill-tokens-per-s N]

Routers, in turn, on the same 2 unified engines (caches reset between them): ``kvroute serve`` (default
policy, exact mode with the model's tokenizer.json + chat template, KV events; told the engines'
prefix-cache size and prefill speed, calibrated first: ``calibrate_prefill``), ``kvroute:NAME`` for
``kvroute serve --policy NAME`` (``round_robin`` is ``kvroute:round_robin``), ``epp`` for a real Envoy
(deploy/envoy/envoy.yaml) asking ``kvroute epp`` (the same flags as ``kvroute serve``), ``envoy`` for
that Envoy's own round robin (no picker), ``kvroute+nopending`` for the
default with ``--no-pending-prefixes`` (overlap from KV events only), ``sglang-router launch --policy
cache_aware`` and ``vllm-router --policy cache_aware`` (each skipped when not installed). With several
``--seeds`` every router runs the workload of each seed, and the summary gives each router's mean, min
and max hit rate over them. Then a PD run: 1 prefill + 1 decode engine with vLLM's
``ExampleConnector`` on one shared directory, behind ``kvroute serve --prefill P --decode D --pd-convention vllm``.

Per router: the engines' prefix-cache hit rate (deltas of ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``), client TTFT (request sent to first streamed chunk) p50/p99,
errors, prompt tokens per engine (``vllm:prompt_tokens_total`` deltas). For every kvroute run, shadow
``kvroute.Router``s beside the gateway (the gateway's policy and defaults, one per TTFT model, their
index fed by the same engines' KV events) route each request before it is sent; their predicted TTFT
for the engine the gateway chose (``X-Kvroute-Worker``) is compared with the measured TTFT. When a
shadow chose another engine, its request is moved to the gateway's (cancelled, re-routed there pinned,
at the send time), so its load model holds the requests where they really run and it hears
``prefill_done`` (the first streamed chunk) for them: the feedback the gateway's own Router gets. The
gateway does not expose its own prediction.

Workload (seeded): S shared system prompts, C conversations (more than the caches hold), T turns
each; the assistant turns in the history are seeded text, not the model's output (random weights),
so every router sees the same prompts. Client threads each own C/threads conversations and advance
them round robin, turn by turn, so a conversation's next turn comes after the others' turns.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_file
from vllm_bed import BLOCK_SIZE, MODEL_NAME, Bed, Engine, Gateway, Picker, free_port, http_json, poll, reset_caches, stop_pid

MAX_TOKENS = 16


# ---- the workload ---------------------------------------------------------------------------------


def vocabulary(model: Path) -> list[str]:
    """Whole words of the model's own BPE vocabulary (so prompts tokenize like text, not bytes)."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w[1:] for w in vocab if re.fullmatch(r"Ġ[a-z]{3,}", w))


@dataclass
class Conversation:
    system: str
    turns: list[tuple[str, str]]  # (user message, the assistant reply the next turns' history holds)

    def messages(self, turn: int) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system}]
        for user, reply in self.turns[:turn]:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return [*out, {"role": "user", "content": self.turns[turn][0]}]


def workload(words: list[str], systems: int, conversations: int, turns: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."

    prompts = [f"System prompt {s}. " + text(rng.randint(250, 350)) for s in range(systems)]
    return [
        Conversation(rng.choice(prompts), [(text(rng.randint(30, 60)), text(rng.randint(15, 30))) for _ in range(turns)])
        for _ in range(conversations)
    ]


# ---- one run --------------------------------------------------------------------------------------


def ttft_models() -> list[str]:
    """The Router's TTFT models this kvroute has ("configured" alone before the learned one existed)."""
    import kvroute

    return ["configured", "learned"] if "ttft_model" in kvroute.Router().config else ["configured"]


@dataclass
class Shadow:
    """kvroute.Routers beside the gateway (its policy and defaults, one per TTFT model), fed by the
    same engines' KV events: each one's predicted TTFT for the engine the gateway picked, per request."""

    engines: Sequence[Engine]
    policy: str | None = None
    #: What the gateway is told about the engines (None: the Router's defaults).
    prefill_tokens_per_s: float | None = None
    prefix_cache_blocks: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        import kvroute
        from kvroute.events import KvEventSubscriber
        from kvroute.prompt import ExactPrompter

        self.prompter = ExactPrompter(str(self.engines[0].bed.model), BLOCK_SIZE, 1337)
        index = kvroute.KvIndex()
        self.models = ttft_models()
        self.routers = {}
        for m in self.models:
            kw: dict[str, Any] = {"policy": self.policy} if self.policy else {}
            if len(self.models) > 1:
                kw["ttft_model"] = m
            r = kvroute.Router(block_size=BLOCK_SIZE, index=index, **kw)
            for w in range(len(self.engines)):
                spec: dict[str, Any] = {"prefix_cache_blocks": self.prefix_cache_blocks}
                if self.prefill_tokens_per_s:
                    spec["prefill_tokens_per_s"] = self.prefill_tokens_per_s
                r.add_worker(w, **spec)
            self.routers[m] = r
        self.worker_of = {e.url: w for w, e in enumerate(self.engines)}
        self.sub = KvEventSubscriber(
            index,
            {w: e.events for w, e in enumerate(self.engines)},
            replay_endpoints={w: e.replay for w, e in enumerate(self.engines)},
            topic="kv-events",
            block_size=BLOCK_SIZE,
        ).start()
        self.sent: dict[int, tuple[Any, dict[str, tuple[int, float]]]] = {}

    def route(self, rid: int, messages: list[dict[str, str]]) -> dict[str, dict[int, float]]:
        """Routes the request on every shadow (before it is sent); per model, predicted TTFT per worker."""
        p = self.prompter.prompt({"messages": messages}, True)
        out: dict[str, dict[int, float]] = {}
        chosen: dict[str, tuple[int, float]] = {}
        with self.lock:
            for m, r in self.routers.items():
                at = r.clock()
                d = r.route(hashes=p.hashes, num_tokens=p.num_tokens, request_id=rid, output_tokens=MAX_TOKENS, explain=True, now=at)
                out[m] = {int(s["worker"]): float(s["predicted_ttft"]) for s in d.explain or ()}
                chosen[m] = (d.worker, at)
            self.sent[rid] = (p, chosen)
        return out

    def placed(self, rid: int, worker: int | None) -> None:
        """The gateway sent the request to ``worker``: a shadow that chose another moves it there."""
        with self.lock:
            p, chosen = self.sent.pop(rid)
            if worker is None:
                return
            for m, r in self.routers.items():
                was, at = chosen[m]
                if was != worker:
                    r.cancel(rid)
                    r.route(hashes=p.hashes, num_tokens=p.num_tokens, request_id=rid, output_tokens=MAX_TOKENS, worker=worker, now=at)

    def event(self, what: str, rid: int) -> None:
        with self.lock:
            self.sent.pop(rid, None)
            for r in self.routers.values():
                getattr(r, what)(rid)

    def close(self) -> None:
        self.sub.stop()


@dataclass
class Result:
    router: str
    engines: str
    seed: int = 0
    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    hit_rate: float = 0.0
    prompt_tokens: list[int] = field(default_factory=list)
    external_kv_tokens: int = 0
    predicted: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # per TTFT model: (predicted, measured TTFT)
    wall_s: float = 0.0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        def q(p: float) -> float | None:
            s = sorted(self.ttft)
            return round(s[min(len(s) - 1, int(p * len(s)))] * 1e3, 1) if s else None

        return {
            "router": self.router,
            "engines": self.engines,
            "seed": self.seed,
            "requests": self.requests,
            "errors": self.errors,
            "hit_rate": round(self.hit_rate, 4),
            "ttft_p50_ms": q(0.5),
            "ttft_p99_ms": q(0.99),
            "prompt_tokens_per_engine": self.prompt_tokens,
            "external_kv_tokens": self.external_kv_tokens,
            "predicted_ttft": {m: prediction_figures(v) for m, v in self.predicted.items()},
            "wall_s": round(self.wall_s, 1),
            "error_kinds": self.error_kinds,
        }


def prediction_figures(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """How a shadow's predicted TTFT compared with the measured one: mean |error|, means, Pearson r."""
    if not pairs:
        return {"n": 0}
    p, m = zip(*pairs)
    return {
        "n": len(pairs),
        "abs_err_ms": round(statistics.fmean(abs(a - b) for a, b in pairs) * 1e3, 1),
        "pred_mean_ms": round(statistics.fmean(p) * 1e3, 1),
        "measured_mean_ms": round(statistics.fmean(m) * 1e3, 1),
        "corr": round(statistics.correlation(p, m), 3) if len(pairs) > 2 and len(set(p)) > 1 else None,
    }


def counters(engines: Sequence[Engine]) -> list[dict[str, float]]:
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total")
    out = []
    for e in engines:
        m = {n: e.metric(n) for n in names}
        m["external"] = e.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        out.append(m)
    return out


reset = reset_caches


def drive(url: str, convs: list[Conversation], threads: int, res: Result, shadow: Shadow | None) -> None:
    import openai

    lock = threading.Lock()
    counter = iter(range(10**9))

    def one(c: openai.OpenAI, conv: Conversation, turn: int) -> None:
        msgs = conv.messages(turn)
        with lock:
            rid = next(counter)
        predicted = shadow.route(rid, msgs) if shadow else {}
        t0 = time.perf_counter()
        first = None
        try:
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL_NAME,
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            worker = raw.headers.get("x-kvroute-worker")
            w = shadow.worker_of.get((worker or "").rstrip("/")) if shadow else None
            if shadow:
                shadow.placed(rid, w)
            finish = None
            for chunk in raw.parse():
                if first is None and chunk.choices:
                    first = time.perf_counter() - t0
                    if shadow:
                        shadow.event("prefill_done", rid)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if first is None or finish is None:
                raise RuntimeError(f"stream ended without {'a chunk' if first is None else 'a finish_reason'}")
            with lock:
                res.ttft.append(first)
                for m, per_worker in predicted.items():
                    if w is not None and w in per_worker:
                        res.predicted.setdefault(m, []).append((per_worker[w], first))
        except Exception as e:
            with lock:
                res.errors += 1
                res.error_kinds[type(e).__name__] = res.error_kinds.get(type(e).__name__, 0) + 1
        finally:
            with lock:
                res.requests += 1
            if shadow:
                shadow.event("finished" if first is not None else "cancel", rid)

    def client(mine: list[Conversation]) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120.0, max_retries=0)
        for turn in range(len(mine[0].turns) if mine else 0):
            for conv in mine:
                one(c, conv, turn)

    ts = [threading.Thread(target=client, args=(convs[i::threads],)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    res.wall_s = time.perf_counter() - t0


class Peer:
    """A router process of another project (sglang-router, vllm-router) on a free port, stopped by PID."""

    def __init__(self, bed: Bed, name: str, argv: list[str]) -> None:
        self.name, self.port = name, free_port()
        self.log = bed.logs / f"{name}.log"
        argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1"]
        argv += ["--prometheus-port", str(free_port())]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log {self.log}")
        try:
            status, _ = http_json("GET", self.url + "/v1/models", timeout=2)
        except OSError:
            return False
        return status == 200

    def stop(self) -> None:
        stop_pid(self.proc, timeout=10)


def calibrate_prefill(engines: Sequence[Engine], words: list[str], prompt_words: int = 600, repeats: int = 2) -> float:
    """The engines' prefill speed in tokens/s, for the Router's load model: cold prompts of
    ``prompt_words`` words (caches reset, max_tokens 1), prompt tokens over the request's wall time;
    the median over ``repeats`` prompts per engine."""
    rng = random.Random(1)
    reset(list(engines))
    speeds = []
    for _ in range(repeats):
        for e in engines:
            prompt = " ".join(rng.choice(words) for _ in range(prompt_words))
            t0 = time.perf_counter()
            out = e.complete({"prompt": prompt, "max_tokens": 1, "temperature": 0})
            speeds.append(out["usage"]["prompt_tokens"] / (time.perf_counter() - t0))
    return float(statistics.median(speeds))


def run(
    name: str,
    engines: Sequence[Engine],
    front: Any,
    convs: list[Conversation],
    threads: int,
    shadow: str | None,
    desc: str,
    told: dict[str, Any] | None = None,
) -> Result:
    """One router: caches reset, the router started, the workload driven, counters' deltas taken.
    ``shadow``: the kvroute policy to shadow ("" for the default), None for no shadow; ``told``: what
    the shadows are told about the engines, as the gateway is (`Shadow`'s fields)."""
    reset(engines)
    res = Result(name, desc)
    sh = None
    try:
        if isinstance(front, Gateway):  # kvroute serve, or Envoy with (or without) kvroute epp
            front.start()
        else:
            poll(front.ready, 60, f"{front.name} ready", interval=0.2)
        if shadow is not None:
            sh = Shadow(engines, policy=shadow or None, **(told or {}))
        before = counters(engines)
        drive(front.url, convs, threads, res, sh)
        after = counters(engines)
    finally:
        front.stop()
        if sh:
            sh.close()
    q = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"] for a, b in zip(after, before))
    h = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before))
    res.hit_rate = h / q if q else 0.0
    res.prompt_tokens = [int(a["vllm:prompt_tokens_total"] - b["vllm:prompt_tokens_total"]) for a, b in zip(after, before)]
    res.external_kv_tokens = int(sum(a["external"] - b["external"] for a, b in zip(after, before)))
    return res


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'router':<26}{'seed':>5}{'hit %':>7}{'TTFT p50 ms':>13}{'p99 ms':>9}{'errors':>8}  {'prompt tokens per engine':<26}"
        f"{'predicted TTFT: |err| ms, r (per model)':<40}"
    )
    for r in rows:
        pt = " / ".join(str(x) for x in r["prompt_tokens_per_engine"])
        if r["external_kv_tokens"]:
            pt += f" ({r['external_kv_tokens']} by transfer)"
        err = "; ".join(f"{m} {f['abs_err_ms']:.1f}, r={f['corr']}" for m, f in r["predicted_ttft"].items() if f["n"])
        p50, p99 = (f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("ttft_p50_ms", "ttft_p99_ms"))
        print(f"{r['router']:<26}{r['seed']:>5}{r['hit_rate'] * 100:>7.1f}{p50:>13}{p99:>9}{r['errors']:>8}  {pt:<26}{err}")


def print_summary(rows: list[dict[str, Any]]) -> None:
    """Per router over the seeds: hit rate mean (min-max), TTFT p50 mean, the predictions' mean r."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["router"], []).append(r)
    print(f"\n{'router':<26}{'runs':>5}{'hit % mean':>12}{'min-max':>14}{'TTFT p50 ms':>13}  predicted TTFT r, mean per model")
    for name, rs in by.items():
        h = [r["hit_rate"] * 100 for r in rs]
        p50 = statistics.fmean(r["ttft_p50_ms"] for r in rs if r["ttft_p50_ms"] is not None)
        models = {m for r in rs for m in r["predicted_ttft"]}
        corr = "; ".join(
            f"{m} {statistics.fmean(c):.3f}"
            for m in sorted(models)
            if (c := [r["predicted_ttft"][m]["corr"] for r in rs if r["predicted_ttft"].get(m, {}).get("corr") is not None])
        )
        print(f"{name:<26}{len(rs):>5}{statistics.fmean(h):>12.2f}{f'{min(h):.1f}-{max(h):.1f}':>14}{p50:>13.1f}  {corr}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON line per router (after the table)")
    ap.add_argument("--results", metavar="FILE", help="also write a results file (benches/results/real_engines.json)")
    ap.add_argument("--num-blocks", type=int, default=192, help="KV blocks of 32 tokens per engine (default 192)")
    ap.add_argument("--systems", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--threads", type=int, default=6, help="client threads (default 6)")
    ap.add_argument("--seeds", default="0", help="comma-separated workload seeds; every router runs each (default 0)")
    ap.add_argument("--sglang-router", default=shutil.which("sglang-router"), help="sglang-router executable (default: on PATH)")
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router"), help="vllm-router executable (default: on PATH)")
    ap.add_argument(
        "--routers",
        default="kvroute,round_robin,sglang,vllm",
        help="comma-separated: kvroute (default policy), kvroute+nopending (the same without pending prefixes), kvroute:POLICY, "
        "round_robin (= kvroute:round_robin), epp (Envoy + kvroute epp, deploy/envoy/envoy.yaml), envoy (the same Envoy's own "
        "round robin), sglang, vllm",
    )
    ap.add_argument("--no-pd", action="store_true", help="skip the 1P1D run")
    ap.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        help="the engines' prefill speed every kvroute gateway (and shadow) is told (default: calibrated on the engines, "
        "see calibrate_prefill; 0 = the gateway's own default, 20000)",
    )
    ap.add_argument(
        "--kvroute-args",
        default="",
        help="extra arguments for every kvroute gateway, e.g. '--local-prefill-max-tokens 64' (the shadow Routers are not told them)",
    )
    a = ap.parse_args(argv)

    bed = Bed()
    why = bed.missing()
    if why:
        print(f"bench_real_engines: {why}", file=sys.stderr)
        return 2
    words = vocabulary(bed.model)
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {a.seeds!r}")
    # Every kvroute gateway is told the engines' prefix-cache size (vLLM keeps one null block), which
    # the default policy ("capacity") charges evictions against.
    exact = ["--tokenizer", str(bed.model), "--log-level", "warning", "--prefix-cache-blocks", str(a.num_blocks - 1)]
    told: dict[str, Any] = {"prefix_cache_blocks": a.num_blocks - 1}
    wanted = a.routers.split(",")
    known = {"kvroute", "kvroute+nopending", "round_robin", "sglang", "vllm", "epp", "envoy"}
    bad = [w for w in wanted if w not in known and not w.startswith("kvroute:")]
    if bad:
        ap.error(
            f"--routers: unknown router {bad[0]!r}; expected kvroute, kvroute+nopending, kvroute:POLICY, round_robin, epp, envoy, "
            "sglang or vllm"
        )
    results: list[Result] = []
    t_start = time.monotonic()
    desc = f"2 x {a.num_blocks} blk"
    with bed.running(2, num_blocks=a.num_blocks) as engines:
        urls = [e.url for e in engines]
        # Every kvroute gateway is told the engines' prefill speed, as a deployment would configure it
        # (the gateway's default, 20,000 tokens/s, is 4-10x what these CPU engines do).
        speed = a.prefill_tokens_per_s if a.prefill_tokens_per_s is not None else calibrate_prefill(engines, words)
        if speed > 0:
            exact += ["--prefill-tokens-per-s", f"{speed:.0f}"]
            told["prefill_tokens_per_s"] = round(speed)
            print(f"kvroute is told the engines prefill {speed:.0f} tokens/s", file=sys.stderr, flush=True)
        exact += shlex.split(a.kvroute_args)
        # (label, router factory, the kvroute policy its shadows use: "" the default, None no shadow)
        fronts: list[tuple[str, Any, str | None]] = []
        for want in wanted:
            if want == "kvroute":
                fronts.append(("kvroute (default policy)", lambda: Gateway(bed, engines, exact, name="kvroute-default"), ""))
            elif want == "kvroute+nopending":
                args = [*exact, "--no-pending-prefixes"]
                fronts.append(
                    ("kvroute (default, no pending prefixes)", lambda args=args: Gateway(bed, engines, args, name="kvroute-nopend"), None)
                )
            elif want == "epp":
                fronts.append(("Envoy + kvroute epp", lambda: Picker(bed, engines, exact, name="epp"), ""))
            elif want == "envoy":
                fronts.append(("Envoy round robin", lambda: Picker(bed, engines, [], name="envoy-rr", picker=False), None))
            elif want == "round_robin" or want.startswith("kvroute:"):
                pol = want.split(":", 1)[1] if ":" in want else want
                fronts.append(
                    (f"kvroute {pol}", lambda pol=pol: Gateway(bed, engines, [*exact, "--policy", pol], name=f"kvroute-{pol}"), pol)
                )
        for key, exe, label in (
            ("sglang", a.sglang_router, "sglang-router cache_aware"),
            ("vllm", a.vllm_router, "vllm-router cache_aware"),
        ):
            if key not in wanted:
                continue
            if not exe:
                print(f"{label}: not installed, skipped", file=sys.stderr)
                continue
            cmd = [exe, "launch"] if key == "sglang" else [exe]
            cmd += ["--worker-urls", *urls, "--policy", "cache_aware"]
            fronts.append((label, lambda cmd=cmd, key=key: Peer(bed, key, cmd), None))
        # Seed by seed, every router in turn: a drift in the host's load touches every router alike.
        for seed in seeds:
            convs = workload(words, a.systems, a.conversations, a.turns, seed)
            for name, make, shadow in fronts:
                r = run(name, engines, make(), convs, a.threads, shadow, desc, told)
                r.seed = seed
                results.append(r)
                print(
                    f"{name} seed {seed}: hit {r.hit_rate:.3f} in {r.wall_s:.0f} s ({time.monotonic() - t_start:.0f} s so far)",
                    file=sys.stderr,
                    flush=True,
                )
    if not a.no_pd:
        convs = workload(words, a.systems, a.conversations, a.turns, seeds[0])
        with tempfile.TemporaryDirectory(prefix="kvroute-pd-kv-") as kvdir:
            cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": kvdir}}
            pd_args = ["--kv-transfer-config", json.dumps(cfg)]
            with bed.running(2, num_blocks=a.num_blocks, extra_args=pd_args) as (p, d):
                gw = Gateway(bed, [p, d], [*exact, "--pd-convention", "vllm"], name="kvroute-pd", prefill=[p])
                r = run("kvroute PD (vllm)", [p, d], gw, convs, a.threads, None, f"1P1D {a.num_blocks} blk")
                r.seed = seeds[0]
                results.append(r)
                print(f"PD: done in {r.wall_s:.0f} s ({time.monotonic() - t_start:.0f} s so far)", file=sys.stderr, flush=True)

    rows = [r.row() for r in results]
    turns = a.conversations * a.turns
    print(
        f"\n2 vLLM CPU engines ({a.num_blocks} blocks of {BLOCK_SIZE} tokens each), {a.systems} system prompts, {a.conversations} "
        f"conversations x {a.turns} turns = {turns} streamed chat requests per router, {a.threads} client threads, max_tokens {MAX_TOKENS}, "
        f"seeds {a.seeds}; kvroute told {told.get('prefill_tokens_per_s', 'the default')} prefill tokens/s; load average {os.getloadavg()[0]:.2f}; {time.monotonic() - t_start:.0f} s in all"
    )
    print_table(rows)
    if len(seeds) > 1:
        print_summary(rows)
    if a.json:
        for r in rows:
            print(json.dumps({**r, "kvroute_prefill_tokens_per_s": told.get("prefill_tokens_per_s")}))
    if a.results:
        doc = results_file.header("real_engines", results_file.command("bench_real_engines.py", argv))
        doc["setup"] = (
            f"2 vLLM CPU engines of the bed ({a.num_blocks} blocks of {BLOCK_SIZE} tokens each), {a.systems} system prompts, "
            f"{a.conversations} conversations x {a.turns} turns = {turns} streamed chat requests per router and seed, "
            f"{a.threads} client threads, max_tokens {MAX_TOKENS}; kvroute told {told.get('prefill_tokens_per_s', 'the default')} "
            "prefill tokens/s and the engines' prefix-cache size"
        )
        doc["load_average"] = os.getloadavg()[0]
        doc["seeds"] = seeds
        doc["rows"] = rows
        results_file.write(a.results, doc)
        print(f"wrote {a.results}", file=sys.stderr)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""kvroute inside LiteLLM and Ray Serve against those hosts' own policies, on the same 2 real vLLM CPU
engines (the bed, docs/e2e.md), with bench_real_engines.py's seeded multi-turn chat workload, streamed.

    KVROUTE_E2E_BED=.bed flock /work/e2e.lock .bed/venv/bin/python benches/bench_integrations.py --json
        [--integrations litellm,ray] [--num-blocks 192] [--conversations 64] [--turns 6] [--clients 6] [--prefill-tokens-per-s N] [--decode-model calibrate|off|STEP_S,TOKENS_PER_S]

LiteLLM 1.110 (``litellm.Router`` in this process): kvroute's ``KvrouteStrategy`` (exact mode, KV
events, engine /metrics) vs ``routing_strategy="simple-shuffle"`` (the default) and ``"least-busy"``.
Ray Serve 2.60 (a local cluster, ``kvroute.integrations.ray_serve.build_app``, 2 ingress replicas so 2
routers route at once): ``KvrouteRequestRouter`` vs Ray's ``PrefixCacheAffinityRouter`` and the default
power-of-two-choices; kvroute also with 1 ingress replica (one router), to see what a second router costs.
kvroute's Router is told the engines' prefill speed (``prefill_tokens_per_s``), calibrated first on cold
prompts unless given (on this bed it measured ~24,500 tokens/s, close to the Router's 20,000 default: the
tiny model prefills fast, and TTFT is mostly queueing and HTTP), and their decode step model (``decode_step_s``,
``decode_tokens_per_s``; calibrate_decode), from which its default policy charges the step a new prefill runs in
beside the requests already on an engine (``--decode-model off``: the Router sees no decode interference, as before
2026-12-02), and their prefix-cache size (``--num-blocks`` minus vLLM's null block; only the ``capacity`` policy
reads it). ``--kvroute-policy`` picks the Router policy; a ``kvroute:POLICY`` entry in ``--litellm-policies`` or
``--ray-policies`` adds a kvroute run with that Router policy, so two policies compare in one run, and a ``@X``
suffix (``kvroute@off``, ``kvroute:slack@1.5``) runs it with that bounded token share (EngineRouter's
``token_share_bound``; ``off``: none; without a suffix, EngineRouter's default).

Caches are reset between runs. Per run, one JSON line: ``{"integration", "policy", "routers", "hit_rate"
(the engines' prefix-cache hits / queries deltas), "ttft_p50_ms", "ttft_p99_ms" (client, to the first
streamed chunk), "errors", "prompt_tokens": {engine: tokens}, "imbalance" (max / mean prompt tokens)}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import EllipsisType
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Serve kills a proxy not ready within 5 s; a loaded 2-core host needs more (tests/conftest.py does the same).
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import results_file
from bench_real_engines import MAX_TOKENS, Conversation, Result, calibrate_prefill, counters, drive, reset, vocabulary, workload
from kvroute.integrations.engine_router import DEFAULT_TOKEN_SHARE_BOUND
from kvroute.sim.suite import default_policy
from vllm_bed import BLOCK_SIZE, MODEL_NAME, Bed, Engine, free_port


def summarise(
    integration: str, policy: str, routers: int, engines: Sequence[Engine], res: Result, before: Any, after: Any
) -> dict[str, Any]:
    q = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"] for a, b in zip(after, before))
    h = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before))
    tokens = {e.name: int(a["vllm:prompt_tokens_total"] - b["vllm:prompt_tokens_total"]) for e, a, b in zip(engines, after, before)}
    s = sorted(res.ttft)

    def q_ms(p: float) -> float | None:
        return round(s[min(len(s) - 1, int(p * len(s)))] * 1e3, 1) if s else None

    mean = statistics.fmean(tokens.values()) if tokens else 0
    return {
        "integration": integration,
        "policy": policy,
        "routers": routers,
        "requests": res.requests,
        "hit_rate": round(h / q, 4) if q else 0.0,
        "ttft_p50_ms": q_ms(0.5),
        "ttft_p99_ms": q_ms(0.99),
        "errors": res.errors,
        "error_kinds": res.error_kinds,
        "prompt_tokens": tokens,
        "imbalance": round(max(tokens.values()) / mean, 3) if mean else None,
        "wall_s": round(res.wall_s, 1),
    }


def calibrate_decode(engine: Engine, words: list[str], batch: int = 6, tokens: int = 64) -> tuple[float, float]:
    """The engine's decode step model for the Router, ``TPOT(b) = decode_step_s + b / decode_tokens_per_s``:
    ``tokens`` tokens decoded (``ignore_eos``, short prompts) by 1 and then by ``batch`` concurrent
    requests; each request's wall time over its tokens is its TPOT (the prefill of a short prompt is a
    step among ``tokens``), and the line through the two medians gives ``(decode_step_s,
    decode_tokens_per_s)``. On a unified engine every step runs each decoding request beside any
    prefill, which is what the Router's ``step_time`` charges (docs/router.md)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(2)

    def one(_: int) -> float:
        prompt = " ".join(rng.choice(words) for _ in range(8))
        t0 = time.perf_counter()
        out = engine.complete({"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0})
        return (time.perf_counter() - t0) / max(1, out["usage"]["completion_tokens"])

    with ThreadPoolExecutor(batch) as pool:
        solo = statistics.median([one(0) for _ in range(3)])
        many = statistics.median(x for _ in range(2) for x in pool.map(one, range(batch)))
    per_request = max(many - solo, 1e-6) / (batch - 1)
    return max(solo - per_request, 0.0), 1.0 / per_request


def decode_model(step: float, rate: float) -> dict[str, float]:
    """The EngineRouter arguments of a decode step model."""
    return {"decode_step_s": round(step, 5), "decode_tokens_per_s": round(rate, 1)}


def parse_decode_model(spec: str) -> dict[str, float] | None:
    """``--decode-model``, checked before any engine starts: the EngineRouter arguments it stands
    for, empty for 'off', None for 'calibrate' (calibrate_decode, once the engines run)."""
    if spec == "off":
        return {}
    if spec == "calibrate":
        return None
    try:
        step, rate = (float(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--decode-model: 'calibrate', 'off' or STEP_S,TOKENS_PER_S, got {spec!r}") from None
    if not (step >= 0 and rate > 0):
        raise SystemExit(f"--decode-model: STEP_S must be >= 0 and TOKENS_PER_S > 0, got {spec!r}")
    return decode_model(step, rate)


@dataclass(frozen=True)
class KvrouteSettings:
    """kvroute's EngineRouter settings, one set for every run, LiteLLM's and Ray's alike (before
    2026-12-02 the Ray routers got neither the calibrated prefill speed nor --kvroute-policy,
    whatever the row said)."""

    tokenizer: str
    prefill_tokens_per_s: float
    policy: str | None
    decode: dict[str, float]
    #: None: not given, so EngineRouter's fleet reads it from the engines' /metrics (``--cache-size learned``).
    prefix_cache_blocks: int | None
    #: ``token_share_bound`` for EngineRouter; ``...``: its default.
    token_share_bound: float | EllipsisType | None = ...

    def for_entry(self, entry: str) -> KvrouteSettings:
        """The settings of a policy-list entry: ``kvroute`` as given, ``kvroute:POLICY`` with that Router
        policy, either with ``@X`` with that token share bound (``@off``: none)."""
        policy, bound = kvroute_policy(entry), kvroute_share_bound(entry)
        return replace(self, policy=policy or self.policy, token_share_bound=self.token_share_bound if bound is ... else bound)

    def kwargs(self) -> dict[str, Any]:
        """``EngineRouter`` keyword arguments (Ray: ``request_router_kwargs``)."""
        return {
            "tokenizer": self.tokenizer,
            "block_size": BLOCK_SIZE,
            "metrics_interval": 0.5,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            **({} if self.prefix_cache_blocks is None else {"prefix_cache_blocks": self.prefix_cache_blocks}),
            **self.decode,
            **({"policy": self.policy} if self.policy else {}),
            **({} if self.token_share_bound is ... else {"token_share_bound": self.token_share_bound}),
        }

    def row(self) -> dict[str, Any]:
        """What a kvroute run's JSON line reports of them."""
        return {
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s),
            "kvroute_policy": self.policy or default_policy(),
            "prefix_cache_blocks": self.prefix_cache_blocks if self.prefix_cache_blocks is not None else "learned",
            "decode_model": self.decode or None,
            "token_share_bound": DEFAULT_TOKEN_SHARE_BOUND if self.token_share_bound is ... else self.token_share_bound,
        }


class ExplainingRouter:
    """Stands in for a LeaseTable's Router (``--diag``): every route asks for ``explain`` and keeps
    the per-worker rows, to tell the policy's load moves (another worker had more of the prompt
    cached) from requests no worker had cached; routing itself is unchanged."""

    def __init__(self, router: Any) -> None:
        self._router = router
        self.rows: list[tuple[int, list[dict[str, Any]]]] = []

    def route(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["explain"] = True
        d = self._router.route(*args, **kwargs)
        if d.explain is not None and kwargs.get("worker") is None:
            self.rows.append((int(d.worker), list(d.explain)))
        return d

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)

    def summary(self) -> dict[str, Any]:
        moved = [
            (w, rows)
            for w, rows in self.rows
            if max(r["overlap_blocks"] for r in rows) > next(r for r in rows if r["worker"] == w)["overlap_blocks"]
        ]
        forgone = sum(
            max(r["overlap_blocks"] for r in rows) - next(r for r in rows if r["worker"] == w)["overlap_blocks"] for w, rows in moved
        )
        none = sum(1 for _, rows in self.rows if max(r["overlap_blocks"] for r in rows) == 0)
        q_best = [max(rows, key=lambda r: r["overlap_blocks"])["queue_delay"] for _, rows in moved]
        return {
            "routes": len(self.rows),
            "moved_off_best_overlap": len(moved),
            "blocks_forgone": forgone,
            "no_overlap_anywhere": none,
            "best_queue_delay_ms_when_moved": round(statistics.fmean(q_best) * 1e3, 1) if q_best else None,
        }


# ---- LiteLLM ------------------------------------------------------------------------------------


async def drive_litellm(router: Any, convs: list[Conversation], clients: int, res: Result) -> None:
    """Like bench_real_engines.drive, through ``router.acompletion``: each client task owns its share of
    the conversations and advances them round robin, turn by turn."""

    async def one(conv: Conversation, turn: int) -> None:
        t0 = time.perf_counter()
        first = None
        try:
            stream = await router.acompletion(model="tiny", messages=conv.messages(turn), max_tokens=MAX_TOKENS, temperature=0, stream=True)
            finish = None
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter() - t0
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if first is None or finish is None:
                raise RuntimeError(f"stream ended without {'a chunk' if first is None else 'a finish_reason'}")
            res.ttft.append(first)
        except Exception as e:
            res.errors += 1
            res.error_kinds[type(e).__name__] = res.error_kinds.get(type(e).__name__, 0) + 1
        finally:
            res.requests += 1

    async def client(mine: list[Conversation]) -> None:
        for turn in range(len(mine[0].turns) if mine else 0):
            for conv in mine:
                await one(conv, turn)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(convs[i::clients]) for i in range(clients)))
    res.wall_s = time.perf_counter() - t0


# LiteLLM's own routing_strategy values (litellm.Router), any of which may run beside kvroute.
LITELLM_STRATEGIES = (
    "simple-shuffle",
    "least-busy",
    "usage-based-routing",
    "usage-based-routing-v2",
    "latency-based-routing",
    "cost-based-routing",
)


def kvroute_policy(entry: str) -> str | None:
    """The Router policy a ``kvroute:POLICY[@X]`` entry names (``None`` for a bare ``kvroute[@X]`` or a
    peer); with ``kvroute_share_bound``, the one place such an entry is parsed."""
    name = entry.split("@", 1)[0]
    return name.split(":", 1)[1] if name.startswith("kvroute:") else None


def kvroute_share_bound(entry: str) -> float | EllipsisType | None:
    """The token share bound of a kvroute entry's ``@X`` suffix: a number, ``None`` for ``@off``,
    ``...`` without a suffix (EngineRouter's default); ValueError for anything else."""
    if "@" not in entry:
        return ...
    text = entry.split("@", 1)[1]
    return None if text == "off" else float(text)


def is_kvroute(entry: str) -> bool:
    """``kvroute[@X]`` or ``kvroute:POLICY[@X]`` in a policy list."""
    return entry.split("@", 1)[0] == "kvroute" or kvroute_policy(entry) is not None


def check_policies(flag: str, entries: list[str], peers: Sequence[str]) -> None:
    """Reject an unknown entry (or an unknown kvroute Router policy) before any engine starts."""
    from kvroute import POLICIES

    def known(e: str) -> bool:
        if e.split("@", 1)[0] != "kvroute" and kvroute_policy(e) not in POLICIES:
            return False
        try:
            bound = kvroute_share_bound(e)
        except ValueError:
            return False
        return bound is None or bound is ... or (math.isfinite(bound) and bound >= 1.0)

    for e in entries:
        if e in peers or known(e):
            continue
        raise SystemExit(
            f"{flag}: unknown entry {e!r}; expected kvroute or kvroute:POLICY (POLICY one of {', '.join(POLICIES)}), either "
            f"optionally with @X (a token share bound >= 1, or @off), or one of {', '.join(peers)}"
        )


def run_litellm(
    engines: list[Engine],
    convs: list[Conversation],
    clients: int,
    policies: list[str],
    kv: KvrouteSettings,
    diag: bool = False,
) -> list[dict[str, Any]]:
    import litellm
    from kvroute.integrations.engine_router import EngineRouter
    from kvroute.integrations.litellm import KvrouteStrategy

    model_list = [
        {
            "model_name": "tiny",
            "litellm_params": {"model": f"hosted_vllm/{MODEL_NAME}", "api_base": e.url + "/v1", "api_key": "unused", "timeout": 120},
            "model_info": {"id": e.name, "kv_events": e.events, "kv_events_replay": e.replay},
        }
        for e in engines
    ]

    def run(policy: str, convs: list[Conversation], explain: bool) -> tuple[Result, Any, dict, dict]:
        saved = list(litellm.callbacks)
        er = None
        try:
            if is_kvroute(policy):
                router = litellm.Router(model_list=model_list, num_retries=0)
                er = EngineRouter(**kv.for_entry(policy).kwargs())
                if explain:
                    er.leases.router = ExplainingRouter(er.router)
                router.register_plugin(KvrouteStrategy(router, er))
            else:
                router = litellm.Router(model_list=model_list, num_retries=0, routing_strategy=policy)
            res = Result(policy, "litellm")
            before = counters(engines)
            asyncio.run(drive_litellm(router, convs, clients, res))
            after = counters(engines)
        finally:
            litellm.callbacks[:] = saved
            if er is not None:
                er.close()
        return res, er, before, after

    # One untimed pass per kind of router before the measured runs: a process's first LiteLLM
    # requests pay its lazy start-up (provider modules, HTTP clients, the tokenizer's first use),
    # which otherwise lands in whichever policy runs first (measured 2026-12-03, seeds 0-4: TTFT p99
    # 497-587 ms for `kvroute` run first against 184-219 ms for `kvroute:capacity` right after it).
    warm = [Conversation(c.system, c.turns[:1]) for c in convs[:clients]]
    for policy in dict.fromkeys(("kvroute" if is_kvroute(p) else "simple-shuffle") for p in policies):
        reset(engines)
        res = run(policy, warm, False)[0]
        if res.errors:
            raise SystemExit(f"litellm warm-up ({policy}): {res.errors} errors {res.error_kinds}")
    rows = []
    for policy in policies:
        reset(engines)
        res, er, before, after = run(policy, convs, diag)
        rows.append(summarise("litellm", policy, 1, engines, res, before, after))
        if is_kvroute(policy):
            rows[-1].update(kv.for_entry(policy).row())
            if er is not None and isinstance(er.leases.router, ExplainingRouter):
                rows[-1]["diag"] = er.leases.router.summary()
        print(f"litellm {policy}: {res.wall_s:.0f} s", file=sys.stderr, flush=True)
    return rows


# ---- Ray Serve ----------------------------------------------------------------------------------

RAY_POLICIES = {
    "kvroute": "kvroute.integrations.ray_serve:KvrouteRequestRouter",
    # Its public alias ray.serve.llm.request_router needs pyarrow (ray[llm]); this module runs with ray[serve] alone.
    "PrefixCacheAffinityRouter": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter",
    "pow2-default": None,
}


def run_ray(
    engines: list[Engine], convs: list[Conversation], clients: int, policies: list[str], kv: KvrouteSettings
) -> list[dict[str, Any]]:
    import ray
    from kvroute.integrations.ray_serve import build_app
    from ray import serve

    specs = [{"engine_url": e.url, "kv_events": e.events, "kv_events_replay": e.replay} for e in engines]
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        runs = [(p, 2) for p in policies] + [(p, 1) for p in policies if is_kvroute(p)]
        for policy, ingresses in runs:
            reset(engines)
            cls = RAY_POLICIES["kvroute" if is_kvroute(policy) else policy]
            kwargs = kv.for_entry(policy).kwargs() if is_kvroute(policy) else {}
            serve.run(
                build_app(specs, request_router_class=cls, request_router_kwargs=kwargs, ingress_replicas=ingresses),
                name="bench",
                route_prefix="/",
            )
            res = Result(policy, "ray")
            before = counters(engines)
            drive(f"http://127.0.0.1:{port}", convs, clients, res, None)
            after = counters(engines)
            serve.delete("bench")
            rows.append(summarise("ray", policy, ingresses, engines, res, before, after))
            if is_kvroute(policy):
                rows[-1].update(kv.for_entry(policy).row())
            print(f"ray {policy} x{ingresses}: {res.wall_s:.0f} s", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'integration':<12}{'policy':<28}{'routers':>8}{'hit %':>8}{'TTFT p50':>10}{'p99 ms':>9}{'errors':>8}{'max/mean':>10}  prompt tokens"
    )
    for r in rows:
        pt = " / ".join(str(v) for v in r["prompt_tokens"].values())
        print(
            f"{r['integration']:<12}{r['policy']:<28}{r['routers']:>8}{r['hit_rate'] * 100:>8.1f}{r['ttft_p50_ms'] or 0:>10.1f}"
            f"{r['ttft_p99_ms'] or 0:>9.1f}{r['errors']:>8}{r['imbalance'] or 0:>10.3f}  {pt}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON line per (integration, policy) after the table")
    ap.add_argument("--results", metavar="FILE", help="also write a results file (benches/results/integrations.json)")
    ap.add_argument("--integrations", default="litellm,ray")
    ap.add_argument("--litellm-policies", default="kvroute,simple-shuffle,least-busy")
    ap.add_argument("--ray-policies", default=",".join(RAY_POLICIES))
    ap.add_argument("--num-blocks", type=int, default=192, help="KV blocks of 32 tokens per engine (default 192)")
    ap.add_argument(
        "--cache-size",
        choices=("given", "learned"),
        default="given",
        help="kvroute's prefix-cache size: given (--num-blocks - 1, as before) or learned from the engines' /metrics "
        "(what a user who sets only the documented options gets)",
    )
    ap.add_argument("--systems", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--kvroute-policy", default=None, help="kvroute's Router policy (default: the Router's default, capacity)")
    ap.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        help="kvroute's prefill speed per engine (default: calibrated on the engines, see calibrate_prefill; 0 = kvroute's own default)",
    )
    ap.add_argument(
        "--decode-model",
        default="calibrate",
        help="kvroute's decode step model per engine: 'calibrate' (default, see calibrate_decode), 'off' (none:"
        " the Router sees no decode interference), or STEP_S,TOKENS_PER_S",
    )
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--diag", action="store_true", help="LiteLLM kvroute: count the routes that left the best-cached engine (explain)")
    a = ap.parse_args(argv)
    check_policies("--litellm-policies", a.litellm_policies.split(","), LITELLM_STRATEGIES)
    check_policies("--ray-policies", a.ray_policies.split(","), [p for p in RAY_POLICIES if p != "kvroute"])

    bed = Bed()
    why = bed.missing()
    if why:
        print(f"bench_integrations: {why}", file=sys.stderr)
        return 2
    decode = parse_decode_model(a.decode_model)
    words = vocabulary(bed.model)
    convs = workload(words, a.systems, a.conversations, a.turns, a.seed)
    wanted = a.integrations.split(",")
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with bed.running(2, num_blocks=a.num_blocks) as engines:
        prefill = a.prefill_tokens_per_s if a.prefill_tokens_per_s is not None else calibrate_prefill(engines, words)
        prefill = prefill or 20000.0  # 0: the Router's default
        print(f"kvroute prefill_tokens_per_s = {prefill:.0f}", file=sys.stderr, flush=True)
        if decode is None:
            decode = decode_model(*calibrate_decode(engines[0], words))
        print(f"kvroute decode model = {decode}", file=sys.stderr, flush=True)
        # vLLM keeps one of its blocks as the null block: the prefix cache holds the rest.
        kv = KvrouteSettings(str(bed.model), prefill, a.kvroute_policy, decode, a.num_blocks - 1 if a.cache_size == "given" else None)
        if "litellm" in wanted:
            rows += run_litellm(engines, convs, a.clients, a.litellm_policies.split(","), kv, a.diag)
        if "ray" in wanted:
            rows += run_ray(engines, convs, a.clients, a.ray_policies.split(","), kv)
    print(
        f"\n2 vLLM CPU engines ({a.num_blocks} blocks of {BLOCK_SIZE} tokens), {a.systems} system prompts, {a.conversations} conversations"
        f" x {a.turns} turns = {a.conversations * a.turns} streamed chat requests per run, {a.clients} clients, max_tokens {MAX_TOKENS},"
        f" seed {a.seed}; kvroute prefill_tokens_per_s {prefill:.0f}, decode model {decode}; load average {os.getloadavg()[0]:.2f}; {time.monotonic() - t0:.0f} s in all"
    )
    print_table(rows)
    if a.json:
        for r in rows:
            print(json.dumps(r))
    if a.results:
        doc = results_file.header("integrations", results_file.command("bench_integrations.py", argv))
        doc["setup"] = (
            f"2 vLLM CPU engines of the bed ({a.num_blocks} blocks of {BLOCK_SIZE} tokens), {a.systems} system prompts, "
            f"{a.conversations} conversations x {a.turns} turns = {a.conversations * a.turns} streamed chat requests per run, "
            f"{a.clients} clients, max_tokens {MAX_TOKENS}, workload seed {a.seed}; kvroute told {prefill:.0f} prefill tokens/s"
        )
        doc["load_average"] = os.getloadavg()[0]
        doc["rows"] = rows
        results_file.write(a.results, doc)
        print(f"wrote {a.results}", file=sys.stderr)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The gateway's Prometheus metrics (text exposition written by hand, no client library) and the
parser for the engines' own /metrics that feeds ``Router.observe``.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["GatewayMetrics", "Histogram", "parse_engine_metrics"]

# Routing (tokenize + hash + route) takes microseconds; buckets span 10 us .. 100 ms.
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def merged(self, counts: Sequence[int], total: float, count: int) -> Histogram:
        """A copy with another histogram over the same buckets added (per-bucket counts, +Inf last)."""
        if len(counts) != len(self.counts):
            raise ValueError(f"histograms differ in buckets: {len(counts)} counts for {len(self.counts)}")
        h = Histogram(self.bounds)
        h.counts = [a + b for a, b in zip(self.counts, counts)]
        h.sum = self.sum + total
        h.count = self.count + count
        return h

    def render(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        cum = 0
        for b, c in zip(self.bounds, self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.9g}")
        out.append(f"{name}_count {self.count}")
        return out


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}" if d else ""


class GatewayMetrics:
    """Counters the gateway bumps on its hot path (plain ints: one event loop, no locks)."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status class)
        self.rejections: defaultdict[str, int] = defaultdict(int)  # reason
        self.retries = 0
        self.upstream_errors: defaultdict[str, int] = defaultdict(int)  # worker url
        self.client_disconnects = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.routing = Histogram(ROUTING_BUCKETS)

    def merged(self, plane: Mapping[str, Any]) -> GatewayMetrics:
        """A copy with the Rust data plane's counters (``DataPlane.metrics()``) added."""
        if tuple(plane["routing_bounds"]) != self.routing.bounds:
            raise ValueError("the data plane's routing buckets differ from ROUTING_BUCKETS")
        m = GatewayMetrics()
        for source in (self.requests, plane["requests"]):
            for key, n in source.items():
                m.requests[key] += n
        for counts, out in (
            (self.rejections, m.rejections),
            (plane["rejections"], m.rejections),
            (self.upstream_errors, m.upstream_errors),
            (plane["upstream_errors"], m.upstream_errors),
        ):
            for name, n in counts.items():
                out[name] += n
        m.retries = self.retries + plane["retries"]
        m.client_disconnects = self.client_disconnects + plane["client_disconnects"]
        m.prompt_tokens = self.prompt_tokens + plane["prompt_tokens"]
        m.cached_tokens = self.cached_tokens + plane["cached_tokens"]
        m.routing = self.routing.merged(plane["routing_counts"], plane["routing_sum"], plane["routing_count"])
        return m

    def render(self, workers: list[tuple[str, str, bool, int, int]]) -> str:
        """``workers``: (url, role, healthy, in_flight, requests served) per worker."""
        lines: list[str] = []

        def counter(name: str, help_: str, series: list[tuple[dict[str, str], float]], kind: str = "counter") -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, v in series:
                lines.append(f"{name}{_labels(labels)} {v:.9g}" if isinstance(v, float) else f"{name}{_labels(labels)} {v}")

        counter(
            "kvroute_requests_total",
            "Requests answered, by endpoint and HTTP status class.",
            [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())],
        )
        counter(
            "kvroute_rejections_total",
            "Requests turned away early (HTTP 429), by reason.",
            [({"reason": r}, n) for r, n in sorted(self.rejections.items())],
        )
        counter(
            "kvroute_retries_total",
            "Dispatches retried on another worker after a failure before any byte reached the client.",
            [({}, self.retries)],
        )
        counter(
            "kvroute_upstream_errors_total",
            "Failed dispatches (connection refused/reset, 5xx, broken stream), by worker.",
            [({"worker": w}, n) for w, n in sorted(self.upstream_errors.items())],
        )
        counter(
            "kvroute_client_disconnects_total",
            "Requests whose client went away; their upstream request was cancelled.",
            [({}, self.client_disconnects)],
        )
        counter("kvroute_prompt_tokens_total", "Prompt tokens routed (approximate mode: estimated from bytes).", [({}, self.prompt_tokens)])
        counter(
            "kvroute_cached_tokens_total", "Prompt tokens the router expected the chosen worker to have cached.", [({}, self.cached_tokens)]
        )
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        counter(
            "kvroute_cache_hit_ratio", "Estimated prefix-cache hit rate: cached / prompt tokens since start.", [({}, float(hit))], "gauge"
        )
        counter(
            "kvroute_worker_in_flight",
            "Requests the gateway has in flight on each worker.",
            [({"worker": u, "role": r}, n) for u, r, _, n, _ in workers],
            "gauge",
        )
        counter(
            "kvroute_worker_healthy",
            "1 while a worker is routed to, 0 while it is marked unhealthy and probed.",
            [({"worker": u, "role": r}, int(h)) for u, r, h, _, _ in workers],
            "gauge",
        )
        counter(
            "kvroute_worker_requests_total",
            "Requests dispatched to each worker.",
            [({"worker": u, "role": r}, n) for u, r, _, _, n in workers],
        )
        lines += self.routing.render("kvroute_routing_seconds", "Time to tokenize/hash and route one request.")
        return "\n".join(lines) + "\n"


# Engine gauges folded into Router.observe: (waiting, running, kv usage fraction) per engine family.
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Sums an engine's waiting / running gauges over all label sets (data-parallel ranks) and
    averages its KV usage; returns the keys found among ``waiting``, ``running``, ``kv_usage``."""
    sums: defaultdict[str, float] = defaultdict(float)
    counts: defaultdict[str, int] = defaultdict(int)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        key = "waiting" if name in _WAITING else "running" if name in _RUNNING else "kv_usage" if name in _KV_USAGE else None
        if key is None:
            continue
        value_part = line[line.rfind("}") + 1 :] if "}" in line else line[name_end:]
        fields = value_part.split()
        if not fields:
            continue
        try:
            v = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(v):
            sums[key] += v
            counts[key] += 1
    out: dict[str, float] = {}
    for k in ("waiting", "running"):
        if counts[k]:
            out[k] = sums[k]
    if counts["kv_usage"]:
        out["kv_usage"] = min(1.0, max(0.0, sums["kv_usage"] / counts["kv_usage"]))
    return out

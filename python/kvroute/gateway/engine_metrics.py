"""The parser for the engines' own /metrics that feeds ``Router.observe`` (the gateway's own
/metrics is rendered by the data plane).
"""

from __future__ import annotations

import math
from collections import defaultdict

__all__ = ["parse_engine_metrics"]


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

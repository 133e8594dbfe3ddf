"""The parser for the engines' own /metrics: the load that feeds ``Router.observe`` and the cache
configuration an engine publishes (vLLM's ``vllm:cache_config_info``). The gateway's own /metrics is
rendered by the data plane.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["CacheConfig", "parse_cache_config", "parse_engine_metrics"]


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


@dataclass(frozen=True)
class CacheConfig:
    """What an engine says of its KV cache: tokens per block, and the prefix cache's size in blocks
    (vLLM: ``num_gpu_blocks`` less its null block; 0 with prefix caching off); None where unknown."""

    block_size: int | None
    prefix_cache_blocks: int | None


_INFO = "vllm:cache_config_info{"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_cache_config(text: str) -> CacheConfig | None:
    """The cache configuration in an engine's /metrics (vLLM publishes its ``CacheConfig`` as the
    labels of ``vllm:cache_config_info``, one series per engine core), or None when it has none.
    With several engine cores the smallest cache is the one a request may land on."""
    sizes: list[int] = []
    blocks: list[int] = []
    found = False
    for line in text.splitlines():
        if not line.startswith(_INFO):
            continue
        found = True
        labels = dict(_LABEL.findall(line[len(_INFO) : line.rfind("}")]))
        bs, gpu, prefix = labels.get("block_size", ""), labels.get("num_gpu_blocks", ""), labels.get("enable_prefix_caching")
        if bs.isdigit() and int(bs) > 0:
            sizes.append(int(bs))
        if gpu.isdigit() and int(gpu) > 0:
            # vLLM reserves block 0 as its null block: the rest hold KV.
            blocks.append(0 if prefix == "False" else int(gpu) - 1)
    if not found:
        return None
    return CacheConfig(block_size=min(sizes) if sizes else None, prefix_cache_blocks=min(blocks) if blocks else None)

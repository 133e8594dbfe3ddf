"""Per-run metrics exactly as the seed computes them: token hit rate, TTFT median and
p99 by index into the sorted TTFTs, SLO attainment over all requests (rejected ones count as missed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RunResult", "summarize"]


@dataclass
class RunResult:
    """One simulator run. Rates are fractions, times seconds."""

    scenario: str
    rate: float | None
    seed: int | None
    policy: str
    reject: bool
    requests: int
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    attainment: float
    rejected: float
    tie_break: str = "rotate"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update({k: v for k, v in d.pop("extra").items() if not k.startswith("_")})
        return d


def summarize(
    ttfts: list[float],
    *,
    requests: int,
    rejected: int,
    hit_tokens: int,
    total_tokens: int,
    slo: float,
    good: int | None = None,
    **labels: Any,
) -> RunResult:
    """The seed's formulas: ``ttfts`` of admitted requests (sorted here), ``p50 = ttfts[len // 2]``,
    ``p99 = ttfts[int(len * 0.99)]``, attainment ``= #(ttft <= slo) / requests`` where ``requests``
    includes rejected ones; ``good`` overrides the count of requests meeting every SLO (e.g. TPOT too).
    """
    if requests < 1:
        raise ValueError(f"a run needs at least one request, got {requests}")
    ttfts = sorted(ttfts)
    n = len(ttfts)
    if good is None:
        good = sum(x <= slo for x in ttfts)
    nan = float("nan")
    r = RunResult(
        requests=requests,
        hit_rate=hit_tokens / total_tokens if total_tokens else 0.0,
        ttft_p50=ttfts[n // 2] if n else nan,
        ttft_p99=ttfts[int(n * 0.99)] if n else nan,
        attainment=good / requests,
        rejected=rejected / requests,
        **labels,
    )
    r.extra["_ttfts"] = ttfts
    return r

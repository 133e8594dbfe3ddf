"""Readable tables and plots of simulator runs (matplotlib only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.sim.summary import RunResult

__all__ = ["format_table", "max_sustained_rate", "plot_runs"]

_HEAD = f"  {'policy':<16}{'reject':<8}{'hit rate':>9}{'TTFT p50':>11}{'TTFT p99':>11}{'attainment':>12}{'rejected':>10}  tie-break"


def format_row(r: RunResult) -> str:
    return (
        f"  {r.policy:<16}{'yes' if r.reject else 'no':<8}{r.hit_rate:>9.1%}{r.ttft_p50:>9.2f} s{r.ttft_p99:>9.2f} s"
        f"{r.attainment:>12.1%}{r.rejected:>10.1%}  {r.tie_break}"
    )


def format_table(title: str, runs: Sequence[RunResult]) -> str:
    return "\n".join([title, _HEAD, *(format_row(r) for r in runs)])


def max_sustained_rate(runs: Sequence[RunResult], target: float = 0.99) -> dict[str, float | None]:
    """Per (policy, reject) label: the highest rate whose attainment is >= target, with every
    lower rate in the sweep also meeting it (None when even the lowest misses)."""
    by: dict[str, list[RunResult]] = {}
    for r in runs:
        by.setdefault(r.policy + (" +reject" if r.reject else ""), []).append(r)
    out: dict[str, float | None] = {}
    for label, rs in by.items():
        best = None
        for r in sorted(rs, key=lambda x: x.rate or 0.0):
            if r.attainment >= target:
                best = r.rate
            else:
                break
        out[label] = best
    return out


def plot_runs(runs: Sequence[RunResult], path: str, *, title: str = "") -> None:
    """TTFT CDFs per policy (at each rate) and, for sweeps, attainment vs rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install 'kvroute[plot]'") from e
    rates = sorted({r.rate for r in runs if r.rate is not None})
    sweep = len(rates) > 1
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    shown = [r for r in runs if r.rate == (rates[-1] if rates else None)] if sweep else list(runs)
    for r in shown:
        xs = r.extra.get("_ttfts") or []
        if not xs:
            continue
        n = r.requests
        ax.step(xs, [(k + 1) / n for k in range(len(xs))], where="post", label=r.policy + (" +reject" if r.reject else ""))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of all requests")
    ax.set_title(f"TTFT CDF{f' at {rates[-1]:g} req/s' if rates else ''}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if sweep:
        ax2 = axes[0][1]
        by: dict[str, list[RunResult]] = {}
        for r in runs:
            by.setdefault(r.policy + (" +reject" if r.reject else ""), []).append(r)
        for label, rs in by.items():
            rs = sorted(rs, key=lambda x: x.rate or 0.0)
            ax2.plot([r.rate for r in rs], [100 * r.attainment for r in rs], marker="o", label=label)
        ax2.axhline(99, color="grey", ls="--", lw=0.8)
        ax2.set_xlabel("request rate (req/s)")
        ax2.set_ylabel("SLO attainment (%)")
        ax2.set_title("attainment vs rate")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

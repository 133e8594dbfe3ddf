"""Renders benchmark results files (benches/results/*.json, written by the benchmarks) into the docs,
between markers, so no figure is typed by hand:

    <!-- results:aisim_suite -->  ...generated...  <!-- /results -->

    python benches/render_results.py          # rewrite the marked blocks in README.md and docs/*.md
    python benches/render_results.py --check  # exit 1 if a block is out of date (the docs test runs this)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from collections import defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
BLOCK = re.compile(r"(<!-- results:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def _mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


LABELS = {"round_robin": "round robin", "dynamo": "Dynamo KV router (tuned)", "kvroute": "kvroute (as deployed)"}

#: A results file's runs grouped: (split, case) in first-seen order -> label -> seed -> row.
Grouped = tuple[list[tuple[str, str]], dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]]]


def _by_case(res: dict[str, Any]) -> Grouped:
    by: dict[tuple[str, str], dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    order: list[tuple[str, str]] = []
    for r in res["rows"]:
        key = (r["split"], r["case"])
        if key not in by:
            order.append(key)
        by[key][r["label"]][r["seed"]] = r
    return order, by


def _label(raw: str) -> str:
    return LABELS.get(raw, raw)


def _dynamo_config(res: dict[str, Any]) -> str:
    cfg = res.get("dynamo_config") or {}
    return ", ".join(f"`{k}={v}`" for k, v in sorted(cfg.items())) or "its defaults"


def aisim_suite(res: dict[str, Any]) -> str:
    """Per case: mean over seeds of goodput, TTFT mean/p50/p99, ITL and more for every placement."""
    order, by = _by_case(res)
    slo = res["slo"]
    out = [
        f"Goodput: share of requests with TTFT <= {slo['ttft_ms'] / 1000:g} s and mean ITL <= {slo['itl_ms']:g} ms; "
        f"mean ± SE over seeds. TTFT in seconds. No placement rejects. Dynamo's KvRouterConfig: {_dynamo_config(res)}.",
        "",
        "| split | case | placement | goodput | TTFT mean | p50 | p99 | ITL p50 ms | p99 | output tok/s | prefix hits | preemptions |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for split in ("tuning", "held-out"):
        for key in [k for k in order if k[0] == split]:
            for label, per_seed in by[key].items():
                sums = [r["summary"] for r in per_seed.values()]

                def m(f: str, scale: float = 1.0, sums: list[dict[str, Any]] = sums, fmt: str = ".2f") -> str:
                    vals = [s_[f] for s_ in sums if s_.get(f) is not None]
                    return "-" if not vals else format(sum(vals) / len(vals) * scale, fmt)

                g, se = _mean_se([s_["goodput_share"] * 100 for s_ in sums])
                out.append(
                    f"| {split} | {key[1]} | {_label(label)} | {g:.1f}% ± {se:.1f} | {m('ttft_mean_ms', 1e-3)} | "
                    f"{m('ttft_p50_ms', 1e-3)} | {m('ttft_p99_ms', 1e-3)} | {m('itl_p50_ms')} | {m('itl_p99_ms')} | "
                    f"{m('output_tok_s', fmt='.0f')} | {m('prefix_hit_rate', 100)}% | {m('preemptions', fmt='.0f')} |"
                )
    out += ["", f"`{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}."]
    return "\n".join(out) + "\n"


def aisim_speed(res: dict[str, Any]) -> str:
    out = ["| placement | requests | wall s (median of 3) | simulated s | simulated / wall |", "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {_label(r['placement'])} | {r['requests']} | {r['wall_s']:.1f} | {r['sim_s']:.0f} | {r['sim_per_wall']:.0f}x |")
    out += ["", f"`{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}."]
    return "\n".join(out) + "\n"


def _goodput(per_seed: dict[int, dict[str, Any]]) -> str:
    g, se = _mean_se([r["summary"]["goodput_share"] * 100 for r in per_seed.values()])
    return f"{g:.1f}% ± {se:.1f}"


def _p99(per_seed: dict[int, dict[str, Any]]) -> float:
    vals = [r["summary"]["ttft_p99_ms"] / 1000 for r in per_seed.values() if r["summary"].get("ttft_p99_ms") is not None]
    return sum(vals) / len(vals) if vals else math.nan


def aisim_headline(res: dict[str, Any]) -> str:
    """README: every held-out family at 16 workers (4P12D for the conversation trace too), at its
    highest load: kvroute as deployed against the tuned Dynamo and round robin, none admitting."""
    order, by = _by_case(res)
    top: dict[tuple[str, str], tuple[float, str]] = {}
    for split, case in order:
        family, where, load_text = case.split(" ")
        if split != "held-out" or where == "8w":
            continue
        load = float(load_text.rstrip("x/s"))
        if (family, where) not in top or load > top[(family, where)][0]:
            top[(family, where)] = (load, case)
    want = ["kvroute", "dynamo", "round_robin"]
    out = [
        "| case (held out, highest load) | " + " | ".join(f"{_label(w)} goodput" for w in want) + " | TTFT p99 s: kvroute / Dynamo |",
        "|---|" + "---:|" * (len(want) + 1),
    ]
    for _, case in top.values():
        labs = by[("held-out", case)]
        cells = [_goodput(labs[w]) for w in want]
        out.append(f"| {case} | " + " | ".join(cells) + f" | {_p99(labs['kvroute']):.2f} / {_p99(labs['dynamo']):.2f} |")
    out += [
        "",
        f"Goodput: TTFT <= {res['slo']['ttft_ms'] / 1000:g} s and mean ITL <= {res['slo']['itl_ms']:g} ms; no placement rejects; "
        f"mean ± SE over seeds. kvroute is told what a deployment knows and learns the engines' speed; clients send "
        f"max_tokens={res['max_tokens']}. Dynamo's KvRouterConfig tuned on the tuning half: {_dynamo_config(res)}. "
        f"`{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}.",
    ]
    return "\n".join(out) + "\n"


def _paired(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], field: str) -> tuple[float, float]:
    ds = [
        a[s_]["summary"][field] - b[s_]["summary"][field]
        for s_ in a
        if s_ in b and a[s_]["summary"].get(field) is not None and b[s_]["summary"].get(field) is not None
    ]
    return _mean_se(ds) if ds else (math.nan, math.nan)


def aisim_verdict(res: dict[str, Any]) -> str:
    """kvroute as deployed against the tuned Dynamo, paired over seeds, per case, against the targets:
    goodput at least Dynamo's - 0.5 points and TTFT p99 at most 1.05x Dynamo's (no admission on
    either side); a loss beyond 2 SE is marked as such."""
    order, by = _by_case(res)
    out = [
        "| split | case | goodput, kvroute - Dynamo (points) | TTFT p99 kvroute / Dynamo | target met | beyond 2 SE |",
        "|---|---|---:|---:|---|---|",
    ]
    met = {"tuning": 0, "held-out": 0}
    counts = {"tuning": 0, "held-out": 0}
    for split in ("tuning", "held-out"):
        for key in [k for k in order if k[0] == split]:
            labs = by[key]
            g, gse = _paired(labs["kvroute"], labs["dynamo"], "goodput_share")
            t, tse = _paired(labs["kvroute"], labs["dynamo"], "ttft_p99_ms")
            ratio = _p99(labs["kvroute"]) / _p99(labs["dynamo"])
            ok = g * 100 >= -0.5 and ratio <= 1.05
            beyond = []
            if g < 0 and -g > 2 * gse:
                beyond.append("goodput")
            if t > 0 and t > 2 * tse:
                beyond.append("TTFT p99")
            counts[split] += 1
            met[split] += ok
            out.append(
                f"| {split} | {key[1]} | {g * 100:+.2f} ± {gse * 100:.2f} | {ratio:.2f}x | {'yes' if ok else 'no'} | "
                f"{', '.join(beyond) or '-'} |"
            )
    out.append("")
    out.append(
        "; ".join(f"{s_}: targets met in {met[s_]} of {counts[s_]} cases" for s_ in ("tuning", "held-out") if counts[s_])
        + f" (paired over seeds). `{res['command']}` at {res['commit']}, {res['date']}."
    )
    return "\n".join(out) + "\n"


def aisim_learned(res: dict[str, Any]) -> str:
    """How close kvroute's learned prefill speeds end to the timing fit's (the oracle's number), per
    family, over every kvroute run's prefill workers with at least 200 finished prefills."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in res["rows"]:
        router = r.get("router") or {}
        fit = router.get("fit_prefill_tokens_per_s")
        if r["label"] != "kvroute" or not fit:
            continue
        by[r["family"]] += [w["prefill_tokens_per_s"] / fit for w in router.get("speeds", []) if w["samples"] >= 200]
    out = [
        "| family | workers (runs x workers) | learned / fit, median | 10th percentile | 90th percentile | within 20% |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fam, xs in by.items():
        xs.sort()
        q = [xs[min(len(xs) - 1, int(p * len(xs)))] for p in (0.5, 0.1, 0.9)]
        within = sum(1 for x in xs if 0.8 <= x <= 1.2) / len(xs)
        out.append(f"| {fam} | {len(xs)} | {q[0]:.2f} | {q[1]:.2f} | {q[2]:.2f} | {within * 100:.0f}% |")
    out += ["", f"`{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}."]
    return "\n".join(out) + "\n"


def aisim_ablation(res: dict[str, Any]) -> str:
    """kvroute as deployed against the same Router told the simulator's timing fit and the true
    output lengths (an ablation), per held-out case: what knowing the engines is worth."""
    order, by = _by_case(res)
    out = ["| case | goodput, deployed | told the fit | TTFT p99 s, deployed / told |", "|---|---:|---:|---:|"]
    for split, case in order:
        if split != "held-out":
            continue
        labs = by[(split, case)]
        told = labs.get("kvroute (told the fit)")
        if not told:
            continue
        out.append(f"| {case} | {_goodput(labs['kvroute'])} | {_goodput(told)} | {_p99(labs['kvroute']):.2f} / {_p99(told):.2f} |")
    out += ["", f"`{res['command']}` at {res['commit']}, {res['date']}."]
    return "\n".join(out) + "\n"


def aisim_tuning(res: dict[str, Any]) -> str:
    """Dynamo's KvRouterConfig sweep on the tuning half: mean goodput and TTFT p99 per setting, the
    chosen one first."""
    per: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in res["rows"]:
        per[json.dumps(r["config"], sort_keys=True)].append(r["summary"])
    chosen = json.dumps(res["chosen"], sort_keys=True)
    keys = sorted(per, key=lambda k: (k != chosen, -sum(x["goodput_share"] for x in per[k])))
    out = ["| KvRouterConfig | mean goodput | mean TTFT p99 s |", "|---|---:|---:|"]
    for k in keys:
        xs = per[k]
        cfg = ", ".join(f"{a}={b}" for a, b in json.loads(k).items())
        g = sum(x["goodput_share"] for x in xs) / len(xs) * 100
        p = sum((x["ttft_p99_ms"] or 0) for x in xs) / len(xs) / 1000
        out.append(f"| {cfg}{' (chosen)' if k == chosen else ''} | {g:.1f}% | {p:.2f} |")
    out += ["", f"Cases: {', '.join(res['cases'])}. `{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}."]
    return "\n".join(out) + "\n"


def aisim_admission(res: dict[str, Any]) -> str:
    """The admission race: kvroute's early rejection against Dynamo's shedding, per case, paired over
    seeds, against the target (goodput at least Dynamo's in every case)."""
    order, by = _by_case(res)
    out = [
        "| split | case | kvroute goodput (rejected) | Dynamo + shedding goodput (rejected) | goodput, kvroute - Dynamo (points) | >= Dynamo |",
        "|---|---|---:|---:|---:|---|",
    ]
    met = {"tuning": 0, "held-out": 0}
    counts = {"tuning": 0, "held-out": 0}

    def cell(per_seed: dict[int, dict[str, Any]]) -> str:
        rej, _ = _mean_se([r["summary"]["rejected_share"] * 100 for r in per_seed.values()])
        return f"{_goodput(per_seed)} ({rej:.1f}%)"

    for split in ("tuning", "held-out"):
        for key in [k for k in order if k[0] == split]:
            labs = by[key]
            g, gse = _paired(labs["kvroute"], labs["dynamo"], "goodput_share")
            ok = g >= 0
            counts[split] += 1
            met[split] += ok
            out.append(
                f"| {split} | {key[1]} | {cell(labs['kvroute'])} | {cell(labs['dynamo'])} | {g * 100:+.2f} ± {gse * 100:.2f} | "
                f"{'yes' if ok else 'no'} |"
            )
    shed = ", ".join(f"`{k}={v}`" for k, v in sorted((res.get("shed_config") or {}).items())) or "none"
    out += [
        "",
        "; ".join(f"{s_}: kvroute at or above Dynamo in {met[s_]} of {counts[s_]} cases" for s_ in ("tuning", "held-out") if counts[s_])
        + f". Goodput counts a rejected request as not served. kvroute: as deployed, early rejection on (TTFT SLO "
        f"{res['slo']['ttft_ms'] / 1000:g} s, rejection once a worker's speed is measured). Dynamo: its KV router ({_dynamo_config(res)}) "
        f"with its busy thresholds as swept on the tuning half ({shed}); unified workers only. `{res['command']}` at {res['commit']}, "
        f"{res['machine']}, {res['date']}.",
    ]
    return "\n".join(out) + "\n"


def aisim_admission_headline(res: dict[str, Any]) -> str:
    """README: the admission race on every held-out family at 16 workers, at its highest load."""
    order, by = _by_case(res)
    top: dict[str, tuple[float, str]] = {}
    for split, case in order:
        family, where, load_text = case.split(" ")
        if split != "held-out" or where != "16w":
            continue
        load = float(load_text.rstrip("x/s"))
        if family not in top or load > top[family][0]:
            top[family] = (load, case)
    out = [
        "| case (held out, highest load) | kvroute goodput (rejected) | Dynamo + shedding goodput (rejected) |",
        "|---|---:|---:|",
    ]
    for _, case in top.values():
        labs = by[("held-out", case)]
        cells = []
        for w in ("kvroute", "dynamo"):
            rej, _ = _mean_se([r["summary"]["rejected_share"] * 100 for r in labs[w].values()])
            cells.append(f"{_goodput(labs[w])} ({rej:.1f}%)")
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    shed = ", ".join(f"`{k}={v}`" for k, v in sorted((res.get("shed_config") or {}).items())) or "none"
    out += [
        "",
        f"Both sides admit: kvroute's early rejection (its defaults) against Dynamo's KV router with its busy thresholds "
        f"swept on the tuning half ({shed}). `{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}.",
    ]
    return "\n".join(out) + "\n"


def aisim_shed_tuning(res: dict[str, Any]) -> str:
    """Dynamo's shedding thresholds swept on the tuning half: the best five by mean goodput, the
    chosen one first, and shedding off."""
    per: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in res["rows"]:
        per[json.dumps(r["config"], sort_keys=True)].append(r["summary"])
    chosen = json.dumps(res["chosen"], sort_keys=True)
    off = json.dumps({k: None for k in res["grid"]}, sort_keys=True)
    ranked = sorted(per, key=lambda k: (k != chosen, -sum(x["goodput_share"] for x in per[k])))
    keys = ranked[:5] + ([off] if off in per and off not in ranked[:5] else [])
    out = ["| busy thresholds | mean goodput | mean rejected | mean TTFT p99 s |", "|---|---:|---:|---:|"]
    for k in keys:
        xs = per[k]
        cfg = ", ".join(f"{a}={b}" for a, b in json.loads(k).items() if b is not None) or "none (shedding off)"
        g = sum(x["goodput_share"] for x in xs) / len(xs) * 100
        rj = sum(x["rejected_share"] for x in xs) / len(xs) * 100
        p = sum((x["ttft_p99_ms"] or 0) for x in xs) / len(xs) / 1000
        out.append(f"| {cfg}{' (chosen)' if k == chosen else ''} | {g:.1f}% | {rj:.1f}% | {p:.2f} |")
    out += [
        "",
        f"{len(per)} settings on {', '.join(res['cases'])}. `{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}.",
    ]
    return "\n".join(out) + "\n"


#: The index race's figures as the tables name them, in order (summary "figure" -> label).
_RACE_FIGURES = [
    ("store_blocks_per_s", "store (M blocks/s)"),
    ("store_remove_blocks_per_s", "store + remove (M blocks/s)"),
    ("match p50 us @128", "match 128 blocks, p50 (us)"),
    ("match p99 us @128", "match 128 blocks, p99 (us)"),
    ("match p50 us @1024", "match 1024 blocks, p50 (us)"),
    ("match p99 us @1024", "match 1024 blocks, p99 (us)"),
    ("match p50 us @replayed", "match, replayed prompts, p50 (us)"),
    ("match p99 us @replayed", "match, replayed prompts, p99 (us)"),
    ("bytes per entry", "bytes per (block, worker) entry"),
    ("conc p99 us beside writer @128", "128 blocks beside a 1M blocks/s writer, p99 (us)"),
    ("conc p99 writer/idle @128", "128 blocks, p99 beside the writer / idle"),
    ("conc p99 us beside writer @1024", "1024 blocks beside a 1M blocks/s writer, p99 (us)"),
    ("conc p99 writer/idle @1024", "1024 blocks, p99 beside the writer / idle"),
    ("conc 2-reader match/s @128", "two readers, 128 blocks (M matches/s)"),
    ("conc 2-reader match/s @1024", "two readers, 1024 blocks (M matches/s)"),
]


def _race_cells(res: dict[str, Any]) -> tuple[list[tuple[str, int]], dict[tuple[str, str, int], dict[str, Any]]]:
    cols: list[tuple[str, int]] = []
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in res["summary"]:
        col = (r["workload"], r["workers"])
        if col not in cols:
            cols.append(col)
        cells[(r["figure"], *col)] = r
    return cols, cells


def _race_value(fig: str, v: float) -> str:
    if "blocks_per_s" in fig or "match/s" in fig:
        return f"{v / 1e6:.1f}"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _race_figures(cells: dict[tuple[str, str, int], dict[str, Any]]) -> list[tuple[str, str]]:
    """The figures the run has, in table order: the known ones, then any others (concurrent)."""
    have = {k[0] for k in cells}
    known = [(f, label) for f, label in _RACE_FIGURES if f in have]
    rest = sorted(have - {f for f, _ in _RACE_FIGURES})
    return known + [(f, f) for f in rest]


def _footer(res: dict[str, Any]) -> str:
    """Where a result comes from: its command, commit (a `--quick` smoke run said so), machine, date
    and, where the file has it, the load average when it ended."""
    quick = " (a `--quick` smoke run)" if res.get("quick") else ""
    load = f", load average {res['load_average']:.2f}" if "load_average" in res else ""
    return f"`{res['command']}` at {res['commit']}{quick}, {res['machine']}, {res['date']}{load}."


def _setup_footer(res: dict[str, Any]) -> str:
    return f"{res['setup']}. {_footer(res)}"


def index_race(res: dict[str, Any]) -> str:
    """docs/benchmarks.md: every figure with both sides and which Dynamo indexer was the better."""
    cols, cells = _race_cells(res)
    out = ["| stream | figure | kvroute | better Dynamo indexer | kvroute's advantage |", "|---|---|---:|---:|---:|"]
    for col in cols:
        for fig, label in _race_figures(cells):
            c = cells.get((fig, *col))
            if not c or c.get("kvroute") is None or c.get("best_dynamo") is None:
                continue
            adv = c.get("kvroute_advantage")
            out.append(
                f"| {col[0]} W={col[1]} | {label} | {_race_value(fig, c['kvroute'])} | "
                f"{_race_value(fig, c['best_dynamo'])} ({c['best_dynamo_indexer']}) | {adv:.2f}x |"
            )
    out += ["", _footer(res)]
    return "\n".join(out) + "\n"


def index_race_brief(res: dict[str, Any]) -> str:
    """README: kvroute's advantage per figure, lowest and highest over the streams with ~1M entries."""
    rows = [r for r in res["summary"] if r["workload"] != "vllm-replay" and r.get("kvroute") is not None]
    streams = sorted({(r["workload"], r["workers"]) for r in rows})
    figures = [
        ("match p50 us @128", "match, 128 blocks, p50"),
        ("match p99 us @128", "match, 128 blocks, p99"),
        ("match p50 us @1024", "match, 1024 blocks, p50"),
        ("match p99 us @1024", "match, 1024 blocks, p99"),
        ("store", "store (and remove, with churn)"),
        ("bytes per entry", "memory per (block, worker) entry"),
    ]
    out = ["| figure | kvroute's advantage over Dynamo's better indexer |", "|---|---:|"]
    for key, label in figures:
        adv = [r["kvroute_advantage"] for r in rows if r["figure"].startswith(key) and r.get("kvroute_advantage")]
        if adv:
            out.append(f"| {label} | {min(adv):.2f}x to {max(adv):.2f}x |")
    ratio = [r["kvroute"] for r in rows if "writer/idle" in r["figure"]]
    if ratio:
        out.append(f"| reader p99 beside a 1M blocks/s writer, against idle | at most {max(ratio):.2f}x |")
    names = ", ".join(f"{w} W={n}" for w, n in streams)
    out += ["", f"Lowest and highest over {len(streams)} streams ({names}; ~1M entries). {_footer(res)}"]
    return "\n".join(out) + "\n"


def install_time(res: dict[str, Any]) -> str:
    """README: how long a fresh `pip install .` took."""
    m, sec = divmod(round(res["seconds"]), 60)
    took = f"{m} min {sec} s" if m else f"{sec} s"
    return (
        f"A fresh `pip install .` took {took} on a quiet machine with cargo's crate downloads cached "
        f"(`{res['command']}` at {res['commit']}, {res['machine']}, {res['date']}).\n"
    )


def _gateway_table(res: dict[str, Any]) -> list[str]:
    out = ["| target | p50 ms | p99 ms | CPU per request (us) | failed |", "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        cpu = "" if r["cpu_per_request_us"] is None else f"{r['cpu_per_request_us']:.0f}"
        out.append(f"| {r['target']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {cpu} | {r['failed']} |")
    return out


def gateway_epp(res: dict[str, Any]) -> str:
    """docs/epp.md, docs/benchmarks.md: Envoy alone against Envoy + kvroute epp, same engines, same run."""
    v = res["verdicts"]["epp_added"]
    out = _gateway_table(res)
    out += [
        "",
        f"The picker adds **{v['p50_us']:.0f} us** at p50 and {v['p99_us']:.0f} us at p99 over Envoy alone (target: p50 <= 1 ms: "
        f"{'met' if v['met'] else 'missed'}); its own CPU is {v['epp_cpu_us']:.0f} us per request. "
        "(CPU per request: envoy is Envoy's process, envoy+epp the picker's; direct is the client straight to the engines.)",
        "",
        _setup_footer(res),
    ]
    return "\n".join(out) + "\n"


def gateway_exact(res: dict[str, Any]) -> str:
    """docs/benchmarks.md: exact mode's CPU per request against approximate mode and against itself
    without the prefix store, same run."""
    v = res["verdicts"]["exact_cpu"]
    out = _gateway_table(res)
    out += [
        "",
        f"Exact mode costs **{v['exact_us']:.0f} us** of gateway CPU per request, {v['ratio']:.2f}x approximate mode's "
        f"{v['approx_us']:.0f} us (target: <= 2x: {'met' if v['met'] else 'missed'}); without the prefix store (kvroute-whole) "
        f"{v['whole_us']:.0f} us, {v['whole_us'] / v['exact_us']:.2f}x more.",
        "",
        _setup_footer(res),
    ]
    return "\n".join(out) + "\n"


def compare_index(res: dict[str, Any]) -> str:
    """docs/benchmarks.md: kvroute's index and hashing against ai-dynamo-runtime's Python RadixTree."""
    out = ["| figure | kvroute | Dynamo RadixTree (Python binding) | kvroute's advantage |", "|---|---:|---:|---:|"]
    for r in res["rows"]:
        ours, theirs, unit = r["kvroute"], r["dynamo"], r["unit"]
        fmt = (lambda v: f"{v / 1e6:.2f}M") if unit == "blocks/s" else (lambda v: f"{v:.2f}")
        adv = "" if theirs is None else f"{ours / theirs if unit == 'blocks/s' else theirs / ours:.1f}x"
        out.append(f"| {r['metric']} | {fmt(ours)} | {'' if theirs is None else fmt(theirs)} | {adv} |")
    size = f", ~{res['entries']:,} (block, worker) entries" if res.get("entries") else ""
    out += ["", f"The {res['workload']} workload{size}. {_footer(res)}"]
    return "\n".join(out) + "\n"


def bench_router(res: dict[str, Any]) -> str:
    """docs/benchmarks.md: one Router.route() from Python against the decision built from Dynamo's Python pieces."""
    out = ["| what | calls | p50 (us) | p99 (us) |", "|---|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {r['what'].strip()} | {r['calls']:,} | {r['p50_us']:.1f} | {r['p99_us']:.1f} |")
    ours = next(r for r in res["rows"] if r["what"].startswith("kvroute Router.route (numpy"))
    peer = next((r for r in res["rows"] if r["what"].startswith("dynamo")), None)
    out.append("")
    if peer is not None:
        out.append(
            f"Dynamo's pieces take {peer['p50_us'] / ours['p50_us']:.1f}x kvroute's time at p50 and "
            f"{peer['p99_us'] / ours['p99_us']:.1f}x at p99 (same decisions checked on 16 prompts first)."
        )
        out.append("")
    out.append(f"{res['setup'][0].upper()}{res['setup'][1:]}. {_footer(res)}")
    return "\n".join(out) + "\n"


def bench_events(res: dict[str, Any]) -> str:
    """docs/benchmarks.md, docs/events.md: KV-event decode-and-apply against Dynamo's RadixTree.apply_event."""
    out = [
        "| apply path | M blocks/s |",
        "|---|---:|",
        f"| kvroute `apply_event_batch` (vLLM msgpack) | {res['ours_blocks_per_s'] / 1e6:.2f} |",
    ]
    if res.get("dynamo_blocks_per_s"):
        out.append(f"| Dynamo `RadixTree.apply_event` (JSON, hashes precomputed) | {res['dynamo_blocks_per_s'] / 1e6:.2f} |")
        out += ["", f"kvroute applies **{res['ratio']:.2f}x** Dynamo's blocks per second."]
    out += ["", f"{res['blocks']:,} blocks per run; {res['setup']}. {_footer(res)}"]
    return "\n".join(out) + "\n"


def real_engines(res: dict[str, Any]) -> str:
    """docs/benchmarks.md: routers in front of the bed's real vLLM engines; per router, over the seeds."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in res["rows"]:
        by[r["router"]].append(r)
    out = [
        "| router | engines | seeds | prefix-cache hit, mean (min-max) | TTFT p50 ms | TTFT p99 ms | errors | prompt tokens per engine (mean) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, rs in by.items():
        h = [r["hit_rate"] * 100 for r in rs]
        p50 = [r["ttft_p50_ms"] for r in rs if r["ttft_p50_ms"] is not None]
        p99 = [r["ttft_p99_ms"] for r in rs if r["ttft_p99_ms"] is not None]
        tokens = " / ".join(f"{sum(col) / len(rs):,.0f}" for col in zip(*(r["prompt_tokens_per_engine"] for r in rs)))
        ext = sum(r["external_kv_tokens"] for r in rs) / len(rs)
        if ext:
            tokens += f" ({ext:,.0f} loaded by transfer)"
        spread = f" ({min(h):.1f}-{max(h):.1f})" if len(rs) > 1 else ""
        out.append(
            f"| {name} | {rs[0]['engines']} | {len(rs)} | {sum(h) / len(h):.1f}%{spread} | "
            f"{sum(p50) / len(p50):.1f} | {sum(p99) / len(p99):.1f} | {sum(r['errors'] for r in rs)} | {tokens} |"
        )
    out += [
        "",
        _setup_footer(res),
    ]
    return "\n".join(out) + "\n"


def integrations(res: dict[str, Any]) -> str:
    """docs/benchmarks.md, docs/integrations.md: kvroute inside LiteLLM and Ray Serve against their own policies."""
    out = [
        "| integration | policy | routers | prefix-cache hit | TTFT p50 ms | TTFT p99 ms | errors | max/mean prompt tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        p50, p99, imb = (r[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "imbalance"))
        out.append(
            f"| {r['integration']} | {r['policy']} | {r['routers']} | {r['hit_rate'] * 100:.1f}% | "
            f"{'' if p50 is None else f'{p50:.1f}'} | {'' if p99 is None else f'{p99:.1f}'} | {r['errors']} | "
            f"{'' if imb is None else f'{imb:.3f}'} |"
        )
    out += [
        "",
        _setup_footer(res),
    ]
    return "\n".join(out) + "\n"


def gateway(res: dict[str, Any]) -> str:
    """docs/benchmarks.md, docs/gateway.md: kvroute serve's added latency and CPU against the direct path and its peer."""
    out = _gateway_table(res)
    v = res["verdicts"].get("overhead")
    if v is not None:
        out += [
            "",
            f"`kvroute serve` adds **{v['p50_us']:.0f} us** at p50 and {v['p99_us']:.0f} us at p99 over calling the engines directly "
            f"(target: p50 <= 300 us, p99 <= 1000 us: {'met' if v['met'] else 'missed'}).",
        ]
    out += ["", _setup_footer(res)]
    return "\n".join(out) + "\n"


def bench_sim(res: dict[str, Any]) -> str:
    """docs/benchmarks.md: the simulator's speed against the seed's pure-Python script, same run."""
    st = res["seed_table"]
    out = [
        "| run | seconds |",
        "|---|---:|",
        f"| the seed's table through kvroute (median of {len(st['kvroute_runs'])}) | {st['kvroute_s']:.3f} |",
        f"| the seed's table through the seed's script (`benches/seed_reference.py`) | {st['seed_script_s']:.3f} |",
    ]
    mc = res.get("mooncake")
    if mc:
        for policy, sec in mc["replay_s"].items():
            out.append(f"| Mooncake conversation trace ({mc['requests']:,} requests), `{policy}`, median of 3 | {sec:.3f} |")
    out += [
        "",
        f"kvroute runs the seed's table **{st['ratio']:.1f}x** faster than the seed's script (target >= 10x), with the same figures"
        + (f"; the slowest policy replays the Mooncake trace in {max(mc['replay_s'].values()):.2f} s (target < 5 s)." if mc else "."),
        "",
        _footer(res),
    ]
    return "\n".join(out) + "\n"


def bench_sim_brief(res: dict[str, Any]) -> str:
    """docs/architecture.md: the one figure that kept the simulator's loop in Python."""
    st = res["seed_table"]
    return (
        f"The seed's whole table runs in {st['kvroute_s']:.2f} s against {st['seed_script_s']:.2f} s for the seed's script "
        f"(`{res['command']}` at {res['commit']}, {res['date']}).\n"
    )


#: Block name -> (the results file's "benchmark", the renderer).
def ab_commit(res: dict[str, Any]) -> str:
    names = {
        "route_p50_us": "`Router.route()` p50 (us)",
        "route_p99_us": "`Router.route()` p99 (us)",
        "events_blocks_per_s": "`apply_event_batch` (M blocks/s)",
    }
    out = [f"| hot path | {res['base']} | {res['commit']} | ratio |", "|---|---:|---:|---:|"]
    for key, label in names.items():
        v = res["summary"][key]
        scale = 1e-6 if key.startswith("events") else 1.0
        out.append(f"| {label} | {v['base'] * scale:.2f} | {v['head'] * scale:.2f} | {v['ratio']:.3f}x |")
    rounds = len(res["rows"]) // 2
    profile = ", ".join(f"{k}={v}" for k, v in sorted(res.get("profile", {}).items())) or "the release profile"
    out += [
        "",
        f"Medians of {rounds} alternating runs per side. `{res['command']}` at {res['commit']} ({profile}), {res['machine']}, {res['date']}.",
    ]
    return "\n".join(out) + "\n"


RENDERERS = {
    "ab_commit": ("ab_commit", ab_commit),
    "aisim_suite": ("aisim_suite", aisim_suite),
    "aisim_speed": ("aisim_speed", aisim_speed),
    "aisim_headline": ("aisim_suite", aisim_headline),
    "aisim_verdict": ("aisim_suite", aisim_verdict),
    "aisim_learned": ("aisim_suite", aisim_learned),
    "aisim_ablation": ("aisim_suite", aisim_ablation),
    "aisim_tuning": ("aisim_dynamo_tuning", aisim_tuning),
    "aisim_admission": ("aisim_admission", aisim_admission),
    "aisim_admission_headline": ("aisim_admission", aisim_admission_headline),
    "aisim_shed_tuning": ("aisim_shed_tuning", aisim_shed_tuning),
    "index_race": ("index_race", index_race),
    "index_race_brief": ("index_race", index_race_brief),
    "install_time": ("install_time", install_time),
    "gateway_epp": ("gateway_epp", gateway_epp),
    "gateway_exact": ("gateway_exact", gateway_exact),
    "gateway": ("gateway", gateway),
    "compare_index": ("compare_index", compare_index),
    "bench_router": ("bench_router", bench_router),
    "bench_events": ("bench_events", bench_events),
    "bench_sim": ("bench_sim", bench_sim),
    "bench_sim_brief": ("bench_sim", bench_sim_brief),
    "real_engines": ("real_engines", real_engines),
    "integrations": ("integrations", integrations),
}


def render_all() -> dict[str, str]:
    out = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as f:
            res = json.load(f)
        for block, (source, fn) in RENDERERS.items():
            if res.get("benchmark") == source:
                out[block] = fn(res)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check that the docs' blocks are current")
    a = ap.parse_args(argv)
    blocks = render_all()
    stale = []
    for doc in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(doc) as f:
            text = f.read()

        def sub(mt: re.Match[str], doc: str = doc) -> str:
            body = blocks.get(mt["name"])
            if body is None:
                raise SystemExit(f"{doc}: no results file renders {mt['name']!r}")
            return mt.group(1) + body + mt.group(4)

        new = BLOCK.sub(sub, text)
        if new != text:
            stale.append(os.path.relpath(doc, ROOT))
            if not a.check:
                with open(doc, "w") as f:
                    f.write(new)
    if a.check and stale:
        print(f"out of date (run python benches/render_results.py): {', '.join(stale)}")
        return 1
    if not a.check:
        print(f"rendered {len(blocks)} result set(s); updated {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

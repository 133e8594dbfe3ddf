"""The seed documents' PD options in the simulator, one row each: compressed (fp8) transfer,
incremental transfer, both, the seed's decode score and its decode admission, against the default PD cluster
(docs/simulator.md, "The seed engine model").

    python benches/bench_pd_options.py
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvroute.sim import ClusterConfig, records_to_workload, simulate, synthetic_trace


def main() -> None:
    print("| workload | option | attainment | rejected | TTFT p50 (s) | TTFT p99 (s) | TPOT p99 | moved |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, rate, slo in (("agent", 16, 2.0), ("long", 20, 5.0)):
        w = records_to_workload(synthetic_trace(shape, requests=3000, rate=rate, seed=0), name=shape)
        base = ClusterConfig(
            instances=4,
            cache_blocks=1000,
            slo=slo,
            decode_instances=4,
            decode_kv_blocks=4000,
            decode_tokens_per_s=4000.0,
            tpot_slo=0.1,
            link_bytes_per_s=5e9,
        )
        variants: dict[str, tuple[ClusterConfig, dict[str, Any]]] = {
            "baseline": (base, {}),
            "fp8 transfer": (dataclasses.replace(base, kv_compression=0.5), {}),
            "incremental": (dataclasses.replace(base, incremental_transfer=True), {}),
            "fp8 + incremental": (dataclasses.replace(base, kv_compression=0.5, incremental_transfer=True), {}),
            "decode score": (base, {"decode_choice": "score"}),
            "decode admission": (dataclasses.replace(base, decode_admission=True), {}),
        }
        for name, (cl, opts) in variants.items():
            r = simulate(w, "slack", reject=True, cluster=cl, progress=False, router_options=opts)
            print(
                f"| {shape} {rate}/s | {name} | {100 * r.attainment:.2f}% | {100 * r.rejected:.2f}% | {r.ttft_p50:.3f} | "
                f"{r.ttft_p99:.3f} | {1000 * r.extra['tpot_p99']:.1f} | {r.extra['transferred_tokens'] / 1e6:.1f}M |",
                flush=True,
            )


if __name__ == "__main__":
    main()

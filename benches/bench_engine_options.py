"""The seed documents' prefill batching against the FIFO engines, on the seed's chat
workload (docs/simulator.md, "The seed engine model").

    python benches/bench_engine_options.py
"""

from __future__ import annotations

import dataclasses

from kvroute.sim import SEED_CLUSTER, seed_chat, simulate


def main() -> None:
    print("| req/s | engines | policy | attainment | rejected | TTFT p50 (s) | TTFT p99 (s) | hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    batched = dataclasses.replace(SEED_CLUSTER, prefill_batch_tokens=8192, prefill_batch_wait_s=0.01)
    for rate in (40, 70):
        w = seed_chat(rate, 120.0, 0)
        for name, cl in (("FIFO", SEED_CLUSTER), ("batches of 8192, 10 ms wait", batched)):
            for pol in ("slack", "cache_only", "ttft"):
                r = simulate(w, pol, reject=True, cluster=cl, progress=False)
                print(
                    f"| {rate} | {name} | {pol} | {100 * r.attainment:.2f}% | {100 * r.rejected:.2f}% | {r.ttft_p50:.3f} | "
                    f"{r.ttft_p99:.3f} | {100 * r.hit_rate:.1f}% |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

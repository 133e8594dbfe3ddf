"""The policy suite with and without pending prefixes in one run (docs/simulator.md, "Pending
prefixes"): per case and event lag, the attainment and hit rate of "cache_only" and the default
"slack" with pending prefixes on, off, and the change.

    python benches/bench_pending.py            # event lag 50 ms, every case of the suite
    python benches/bench_pending.py 0.05,0     # comma-separated event lags (seconds)
"""

from __future__ import annotations

import sys
import time

import numpy as np
from kvroute.sim.suite import CASES, run_suite

POLICIES = ["cache_only", "slack"]


def main(argv: list[str]) -> int:
    lags = [float(x) for x in argv[0].split(",")] if argv else [0.05]
    t0 = time.time()
    for case in CASES:
        att: dict[tuple[float, str, bool], float] = {}
        hit: dict[tuple[float, str, bool], float] = {}
        for on in (True, False):
            res = run_suite(
                [case], policies=POLICIES, event_lags=lags, bounds=False, default="slack", router_options={"pending_prefixes": on}
            )
            for r in res:
                for i, p in enumerate(POLICIES):
                    att[(r.event_lag, p, on)] = r.attainment[p]
                    # runs are in (workload seed, policy) order
                    hit[(r.event_lag, p, on)] = float(np.mean([x.hit_rate for x in r.runs[i :: len(POLICIES)]]))
        for lag in lags:
            if (lag, "slack", True) not in att:
                continue  # a case needing the shared Mooncake trace, absent here
            cells = []
            for p in POLICIES:
                a1, a0, h1, h0 = att[(lag, p, True)], att[(lag, p, False)], hit[(lag, p, True)], hit[(lag, p, False)]
                cells.append(
                    f"{p}: att {100 * a1:.2f} vs {100 * a0:.2f} ({100 * (a1 - a0):+.2f}), "
                    f"hit {100 * h1:.2f} vs {100 * h0:.2f} ({100 * (h1 - h0):+.2f})"
                )
            print(f"| {case.name} [{case.split}] lag {lag * 1000:g} ms | " + " | ".join(cells) + f" | {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

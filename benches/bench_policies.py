"""The policy benchmark suite in one command: every routing policy with early rejection on every
case (tuning and held-out halves, event lag 0 and 50 ms, several workload seeds), beside the
infinite-cache and global-cache bounds; per case whether the default policy is best.

    python benches/bench_policies.py            # the whole suite, 10 seeds per case (minutes on 2 cores)
    python benches/bench_policies.py --seeds 3  # the first three seeds of each half, faster
    python benches/bench_policies.py --quick    # a small subset, seconds
    python benches/bench_policies.py --split held-out --json

The same as ``kvroute simulate --suite [...]``; arguments are passed on.
"""

from __future__ import annotations

import sys

from kvroute.cli import main

if __name__ == "__main__":
    sys.exit(main(["simulate", "--suite", *sys.argv[1:]]))

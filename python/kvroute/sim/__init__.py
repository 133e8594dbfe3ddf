"""kvroute's cluster simulator: workloads (the seed's chat, Mooncake-format traces),
simulated prefill engines publishing KV events, the Router driving them, and the seed's metrics.
"""

from kvroute.sim.cluster import SEED_CLUSTER, ClusterConfig, make_router, simulate
from kvroute.sim.summary import RunResult, summarize
from kvroute.sim.trace import SHAPES, load_trace, records_to_workload, synthetic_trace, write_trace
from kvroute.sim.workload import Workload, seed_chat

__all__ = [
    "SEED_CLUSTER",
    "SHAPES",
    "ClusterConfig",
    "RunResult",
    "Workload",
    "load_trace",
    "make_router",
    "records_to_workload",
    "seed_chat",
    "simulate",
    "summarize",
    "synthetic_trace",
    "write_trace",
]

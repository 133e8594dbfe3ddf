"""kvroute: a Rust-accelerated, cache-aware request router for disaggregated LLM serving.

The core (block hashing and the concurrent KV prefix index) is Rust; see ``kvroute._core``.

>>> import kvroute
>>> idx = kvroute.KvIndex()
>>> h = kvroute.block_hashes(list(range(256)), 64)
>>> idx.store(worker=0, hashes=h)
4
>>> dict(idx.match(h))
{0: 4}
"""

from collections.abc import Mapping

from kvroute._core import (
    NUM_SHARDS,
    POLICIES,
    Decision,
    EventError,
    IndexCapacityError,
    KvIndex,
    KvrouteError,
    MatchResult,
    NoWorkersError,
    PrefixCheck,
    Router,
    UnknownRequestError,
    UnknownWorkerError,
    __version__,
    block_hashes,
    chain_hashes,
    identity_root,
    local_block_hashes,
)

Mapping.register(MatchResult)

TIERS = ("device", "host", "disk")

__all__ = [
    "NUM_SHARDS",
    "POLICIES",
    "TIERS",
    "Decision",
    "EventError",
    "IndexCapacityError",
    "KvIndex",
    "KvrouteError",
    "MatchResult",
    "NoWorkersError",
    "PrefixCheck",
    "Router",
    "UnknownRequestError",
    "UnknownWorkerError",
    "__version__",
    "block_hashes",
    "chain_hashes",
    "identity_root",
    "local_block_hashes",
]

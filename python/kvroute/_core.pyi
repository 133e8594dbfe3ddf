"""Type stubs for kvroute's Rust extension module (rust/py)."""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypedDict

import numpy as np
import numpy.typing as npt

__version__: str
NUM_SHARDS: int

Tier = Literal["device", "host", "disk"]
TokenIds = Sequence[int] | npt.NDArray[np.integer]
Hashes = Sequence[int] | npt.NDArray[np.integer]

class KvrouteError(Exception):
    """Base class of kvroute's own errors."""

class IndexCapacityError(KvrouteError):
    """The index cannot hold more blocks or workers."""

def local_block_hashes(tokens: TokenIds, block_size: int = 64, *, seed: int = 1337) -> npt.NDArray[np.uint64]:
    """Per full block, xxh3-64 of the block's token ids as little-endian u32, with `seed`.

    >>> local_block_hashes(list(range(16)), 16).tolist()
    [15310707395893867146]
    """

def block_hashes(tokens: TokenIds, block_size: int = 64, *, seed: int = 1337) -> npt.NDArray[np.uint64]:
    """Chained sequence hashes of every full block (NVIDIA Dynamo's scheme).

    >>> block_hashes(list(range(32)), 16).tolist()[1]
    13769157705258532664
    """

def chain_hashes(local_hashes: Hashes, *, parent: int | None = None, seed: int = 1337) -> npt.NDArray[np.uint64]:
    """Chains local block hashes into sequence hashes; `parent` continues an existing chain."""

class IndexStats(TypedDict):
    nodes: int
    entries: int
    workers: int
    estimated_bytes: int
    orphan_stores: int
    duplicate_stores: int
    parent_mismatches: int
    unknown_removals: int
    evictions: int
    max_nodes: int | None

class MatchResult(Mapping[int, int]):
    """Read-only mapping worker -> leading blocks held, built lazily from Rust vectors."""

    @property
    def workers(self) -> npt.NDArray[np.uint64]: ...
    @property
    def depths(self) -> npt.NDArray[np.uint32]: ...
    def best(self) -> tuple[int, int] | None: ...
    def to_dict(self) -> dict[int, int]: ...
    def __getitem__(self, worker: int) -> int: ...
    def __iter__(self) -> Iterator[int]: ...
    def __len__(self) -> int: ...

class KvIndex:
    """Concurrent radix index over chained block hashes with per-worker membership.

    >>> idx = KvIndex()
    >>> idx.store(0, block_hashes(list(range(128)), 64))
    2
    """

    def __init__(self, max_nodes: int | None = None) -> None: ...
    def store(self, worker: int, hashes: Hashes, *, parent: int | None = None, tier: Tier = "device") -> int: ...
    def remove(self, worker: int, hashes: Hashes, *, tier: Tier | None = None) -> int: ...
    def clear(self, worker: int) -> int: ...
    def remove_worker(self, worker: int) -> int: ...
    def match(self, hashes: Hashes, *, tier: Tier | None = None) -> MatchResult: ...
    def match_tiers(self, hashes: Hashes) -> dict[Tier, MatchResult]: ...
    def workers(self) -> list[int]: ...
    def num_blocks(self, worker: int) -> int: ...
    def stats(self) -> IndexStats: ...
    def dump(self) -> bytes: ...
    @staticmethod
    def load(data: bytes, *, max_nodes: int | None = None) -> KvIndex: ...
    def __len__(self) -> int: ...

# ---- simulator (rust/py/src/sim.rs) ----------------------------------------------------------

def seed_chat_workload(
    rate: float,
    seconds: float,
    seed: int = 0,
    *,
    systems: int = 20,
    system_tokens: int = 2048,
    conversations: int = 400,
    turn_tokens: int = 300,
    vocab: int = 1_000_000,
    block_size: int = 64,
    hash_seed: int = 1337,
    with_tokens: bool = False,
) -> dict[str, Any]: ...
def chain_block_ids(ids: Hashes, offsets: Hashes, *, seed: int = 1337) -> npt.NDArray[np.uint64]: ...

class PrefillEngines:
    """Simulated prefill engines: LRU prefix caches and FIFO queues publishing KV events."""

    def __init__(
        self,
        worker_ids: Sequence[int],
        *,
        capacity_blocks: int,
        tokens_per_s: float,
        block_size: int = 64,
        index: KvIndex | None = None,
        event_lag: float = 0.0,
    ) -> None: ...
    def __len__(self) -> int: ...
    @property
    def worker_ids(self) -> list[int]: ...
    @property
    def busy_until(self) -> list[float]: ...
    @property
    def events_published(self) -> int: ...
    @property
    def pending_events(self) -> int: ...
    def prefill(self, engine: int, hashes: Hashes, num_tokens: int, now: float) -> tuple[int, int, float, float]: ...
    def hit_blocks(self, engine: int, hashes: Hashes) -> int: ...
    def advance(self, now: float) -> None: ...
    def flush(self) -> None: ...
    def cached_blocks(self, engine: int) -> npt.NDArray[np.uint64]: ...
    def clear(self, engine: int, now: float) -> int: ...

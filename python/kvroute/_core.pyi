"""Type stubs for kvroute's Rust extension module (rust/py)."""

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeVar, final, overload

import numpy as np
import numpy.typing as npt

__version__: str
NUM_SHARDS: int
#: Whether this build carries the realistic engine model (the ``aisim`` cargo feature).
HAS_AISIM: bool

_T = TypeVar("_T")

Tier = Literal["device", "host", "disk"]
TokenIds = Sequence[int] | npt.NDArray[np.integer]
Hashes = Sequence[int] | npt.NDArray[np.integer]

class KvrouteError(Exception):
    """Base class of kvroute's own errors."""

class IndexCapacityError(KvrouteError):
    """The index cannot hold more blocks or workers."""

class EventError(KvrouteError):
    """A KV-event batch payload was malformed (the message names the field and the problem); nothing of it was applied."""

def local_block_hashes(tokens: TokenIds, block_size: int = 64, *, seed: int = 1337) -> npt.NDArray[np.uint64]:
    """Per full block, xxh3-64 of the block's token ids as little-endian u32, with `seed`.

    >>> local_block_hashes(list(range(16)), 16).tolist()
    [15310707395893867146]
    """

def block_hashes(tokens: TokenIds, block_size: int = 64, *, seed: int = 1337, identity: int | None = None) -> npt.NDArray[np.uint64]:
    """Chained sequence hashes of every full block (NVIDIA Dynamo's scheme). `identity`
    (`identity_root`) keys the blocks under a LoRA adapter or a cache salt.

    >>> block_hashes(list(range(32)), 16).tolist()[1]
    13769157705258532664
    """

def identity_root(*, lora: str | None = None, cache_salt: str | None = None) -> int | None:
    """The identity a request's KV is keyed under when the engine mixes more than its tokens into
    block keys: its LoRA adapter (the name the engine serves it under) and its `cache_salt`. None
    for the base model without a salt."""

@final
class PrefixCheck:
    """The router's self-check: each request's predicted prefix hit against the engine's reported
    `cached_tokens`; `threshold` mismatches over the last `window` requests raise one alarm."""

    def __new__(cls, window: int = 20, threshold: int = 8) -> PrefixCheck: ...
    def observe(
        self,
        worker: int,
        predicted_blocks: int,
        block_size: int,
        prompt_tokens: int,
        cached_tokens: int,
        *,
        routed_tokens: int | None = None,
        indexed_blocks: int = 0,
    ) -> tuple[Literal["match", "over", "under", "prompt_length"], str | None]: ...
    def snapshot(self) -> dict[str, Any]: ...

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

@final
class MatchResult(Mapping[int, int]):
    """Read-only mapping worker -> leading blocks held, built lazily from Rust vectors."""

    @property
    def workers(self) -> npt.NDArray[np.uint64]: ...
    @property
    def depths(self) -> npt.NDArray[np.uint32]: ...
    def best(self) -> tuple[int, int] | None: ...
    def to_dict(self) -> dict[int, int]: ...
    def __getitem__(self, worker: int, /) -> int: ...
    @overload
    def get(self, worker: int, default: None = None) -> int | None: ...
    @overload
    def get(self, worker: int, default: int | _T) -> int | _T: ...
    def __iter__(self) -> Iterator[int]: ...
    def __len__(self) -> int: ...

@final
class KvIndex:
    """Concurrent radix index over chained block hashes with per-worker membership.

    >>> idx = KvIndex()
    >>> idx.store(0, block_hashes(list(range(128)), 64))
    2
    """

    def __new__(cls, max_nodes: int | None = None) -> KvIndex: ...
    def store(self, worker: int, hashes: Hashes, *, parent: int | None = None, tier: Tier = "device") -> int: ...
    def remove(self, worker: int, hashes: Hashes, *, tier: Tier | None = None) -> int: ...
    def clear(self, worker: int) -> int: ...
    def remove_worker(self, worker: int) -> int: ...
    def apply_event_batch(self, worker: int, payload: bytes, *, block_size: int, seed: int = 1337) -> int: ...
    def _apply_event_batch_stats(
        self, worker: int, payload: bytes, *, block_size: int, seed: int = 1337
    ) -> tuple[int, int, int, int, int, int, int]: ...
    def match(self, hashes: Hashes, *, tier: Tier | None = None) -> MatchResult: ...
    def match_tiers(self, hashes: Hashes) -> dict[Tier, MatchResult]: ...
    def workers(self) -> list[int]: ...
    def num_blocks(self, worker: int) -> int: ...
    def stats(self) -> IndexStats: ...
    def dump(self) -> bytes: ...
    @staticmethod
    def load(data: bytes, *, max_nodes: int | None = None) -> KvIndex: ...
    def __len__(self) -> int: ...

# ---- router ---------------------------------------------------------------------------------

POLICIES: list[str]
ROUTER_PRESETS: list[str]
Policy = Literal["random", "round_robin", "least_load", "cache_only", "cache_aware", "ttft", "cost", "node_score", "capacity", "slack"]
Preset = Literal["simulator", "gateway", "gateway_approx", "host_router"]

def router_parameters(preset: Preset = "simulator") -> list[tuple[str, str, object, list[str], str]]:
    """The Router's parameters as ``(name, type, default, policies, help)`` under ``preset``: the one
    definition the constructor, ``Router.config``, this stub and the CLIs' flags follow. ``policies``
    lists the policies a parameter belongs to (empty: every policy); ``type`` is spelled as here.

    >>> [p[2] for p in router_parameters() if p[0] == "block_size"], [p[2] for p in router_parameters("gateway") if p[0] == "block_size"]
    ([64], [16])
    """

class NoWorkersError(KvrouteError):
    """Routing found no worker to route to (none registered, or none of the needed role)."""

class UnknownWorkerError(KvrouteError):
    """A worker id that was never registered with add_worker (or was removed)."""

class UnknownRequestError(KvrouteError):
    """A request id that is not in flight (never routed with it, or already finished)."""

Role = Literal["both", "prefill", "decode"]
RequestId = int | str

class WorkerScore(TypedDict):
    worker: int
    overlap_blocks: int
    queue_delay: float
    prefill_time: float
    transfer_time: float
    step_time: float
    predicted_ttft: float
    in_flight: int
    score: float

class WorkerLoad(TypedDict):
    role: Role
    busy_until: float
    queue_delay: float
    in_flight: int
    prefilling: int
    prefill_tokens: int
    decoding: int
    decode_blocks: int
    kv_capacity_blocks: int | None
    prefix_cache_blocks: int | None
    max_running: int | None
    prefill_tokens_per_s: float
    decode_tokens_per_s: float | None
    observed_waiting: int | None
    observed_running: int | None
    observed_kv_usage: float | None
    prefill_samples: int
    #: The learned prefill model (learned TTFT model): the worker's own fit once it has
    #: `prefill_samples` >= 16, else the pool's fit over every worker's samples; None before either.
    #: How late prefills here have finished beyond the queue's prediction lately (learned model).
    learned_lateness_s: float
    learned_overhead_s: float | None
    learned_prefill_tokens_per_s: float | None

@final
class Decision:
    """The outcome of `Router.route`."""

    @property
    def worker(self) -> int: ...
    @property
    def decode_worker(self) -> int | None: ...
    @property
    def overlap_blocks(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def uncached_tokens(self) -> int: ...
    @property
    def queue_delay(self) -> float: ...
    @property
    def predicted_ttft(self) -> float: ...
    @property
    def predicted_tpot(self) -> float | None: ...
    @property
    def busy_until(self) -> float: ...
    @property
    def admitted(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def path(self) -> Literal["unified", "disaggregated", "local"]: ...
    @property
    def fetch_from(self) -> int | None: ...
    @property
    def request_id(self) -> RequestId | None: ...
    @property
    def explain(self) -> list[WorkerScore] | None: ...
    def to_dict(self) -> dict[str, object]: ...

@final
class Router:
    """Cache- and load-aware router over a KvIndex; see docs/router.md for each policy's rule.

    >>> r = Router(policy="ttft")
    >>> r.add_worker(0); r.add_worker(1)
    >>> r.route(list(range(256)), now=0.0).worker in (0, 1)
    True
    """

    def __new__(
        cls,
        *,
        preset: Preset = "simulator",
        index: KvIndex | None = None,
        # The parameters, in router_parameters()' order; tests/router/test_config.py holds them to it.
        policy: Policy = "capacity",
        block_size: int = 64,
        tie_break: Literal["rotate", "lowest"] = "rotate",
        seed: int = 0,
        ttft_slo: float | None = None,
        tpot_slo: float | None = None,
        reject: bool = True,
        admission_work_factor: float | None = None,
        shed_load_threshold: float = 1.0,
        shed_load_ramp: float = 1.0,
        shed_load_sigmas: float = 2.0,
        load_window_s: float | None = None,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64.0,
        balance_rel_threshold: float = 1.5,
        prefill_load_scale: float = 1.0,
        temperature: float = 0.0,
        queue_weight: float = 0.2,
        prefill_weight: float = 1.0,
        pressure_weight: float = 8.0,
        slo_margin: float = 0.0,
        eviction_weight: float = 0.0,
        kv_headroom: float = 0.2,
        decode_step_s: float = 0.01,
        decode_choice: Literal["tpot", "score"] = "tpot",
        kv_bytes_per_token: float = 327680.0,
        link_bytes_per_s: float = 25e9,
        link_latency_s: float = 0.001,
        kv_compression: float = 1.0,
        local_prefill_max_tokens: int = 0,
        prefill_busy_queue_s: float | None = None,
        optimistic_insert: bool = False,
        pending_prefixes: bool = True,
        pending_grace_s: float = 1.0,
        pending_ttl_s: float = 60.0,
        stale_overlaps: bool = True,
        hash_seed: int = 1337,
        ttft_model: Literal["configured", "learned"] = "configured",
        token_share_bound: float | None = None,
    ) -> Router:
        """Every keyword but ``preset`` and ``index`` is a Router parameter (``router_parameters()``);
        a policy's own parameters (``cache_threshold`` for "cache_aware", ...) are accepted only with
        that policy. ``preset`` picks an entry point's defaults: "simulator" (``Router()``; 64-token
        blocks), "gateway" (16-token blocks), "gateway_approx" (no KV events: no pending prefixes or
        stale-overlap corrections), "host_router" (16-token blocks, ``token_share_bound`` 1.25).
        Unknown names and values of the wrong type raise TypeError; values out of range ValueError.
        """
    def add_worker(
        self,
        worker: int,
        *,
        role: Role = "both",
        prefill_tokens_per_s: float = 20000.0,
        kv_capacity_blocks: int | None = None,
        decode_tokens_per_s: float | None = None,
        prefix_cache_blocks: int | None = None,
        max_running: int | None = None,
    ) -> None: ...
    def remove_worker(self, worker: int) -> None: ...
    def route(
        self,
        tokens: TokenIds | None = None,
        *,
        hashes: Hashes | None = None,
        num_tokens: int | None = None,
        now: float | None = None,
        request_id: RequestId | None = None,
        output_tokens: int | None = None,
        explain: bool = False,
        worker: int | None = None,
        identity: int | None = None,
        workers: Sequence[int] | None = None,
    ) -> Decision: ...
    def prefill_done(self, request_id: RequestId, now: float | None = None) -> None: ...
    def finished(self, request_id: RequestId, now: float | None = None) -> None: ...
    def output_done(self, request_id: RequestId, tokens: int, now: float | None = None) -> None:
        """The request, still in flight (call before `finished`), produced ``tokens`` output tokens
        (its response's usage): decode KV is then reserved for what requests produce (mean + 2 SD
        over ~256), capped by each request's ``output_tokens``, instead of the whole cap, once 16
        were reported; with ``ttft_model="learned"``, one sample of its decode worker's step."""
    def cancel(self, request_id: RequestId, now: float | None = None) -> None: ...
    def set_prefix_cache_blocks(self, worker: int, blocks: int | None) -> None:
        """Sets a registered worker's prefix-cache size in KV blocks (None: unknown), e.g. once its
        engine reports it; the worker's load and in-flight requests are kept."""
    def observe(
        self,
        worker: int,
        *,
        waiting: int | None = None,
        running: int | None = None,
        kv_usage: float | None = None,
        queue_delay: float | None = None,
        now: float | None = None,
    ) -> None: ...
    def workers(self) -> list[int]: ...
    def load(self, worker: int, *, now: float | None = None) -> WorkerLoad: ...
    @property
    def num_in_flight(self) -> int: ...
    def num_pending_blocks(self, now: float | None = None) -> int:
        """(block, worker) pairs counted as cached on a worker because a request was routed there
        and its engine's KV events cannot have reported them yet (``pending_prefixes``).

        >>> r = Router(); r.add_worker(0); _ = r.route(list(range(128)), now=0.0, request_id=1)
        >>> r.num_pending_blocks(now=0.0)
        2
        """
    @property
    def index(self) -> KvIndex: ...
    @property
    def policy(self) -> str: ...
    @property
    def config(self) -> dict[str, object]: ...
    def offered_load(self, now: float | None = None) -> float: ...
    def evicted_reuse(self, now: float | None = None) -> float: ...
    def clock(self) -> float: ...

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

@final
class PrefillEngines:
    """Simulated prefill engines: LRU prefix caches and FIFO queues publishing KV events."""

    def __new__(
        cls,
        worker_ids: Sequence[int],
        *,
        capacity_blocks: int,
        tokens_per_s: float,
        block_size: int = 64,
        index: KvIndex | None = None,
        event_lag: float = 0.0,
        shared_cache: bool = False,
    ) -> PrefillEngines: ...
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

@final
class DataPlane:
    """The gateway's request path: serves completions on ``router`` (unified workers and PD pairs in
    ``pd_convention``; exact mode with ``tokenizer``, else approximate mode), ``/v1/models``,
    ``/health`` and ``/metrics``, and passes ``/admin`` requests to the admin API given to ``start``."""

    def __new__(
        cls,
        router: Router,
        *,
        pd_convention: Literal["vllm", "sglang"] | str = "vllm",
        max_body_bytes: int = 33554432,
        max_client_concurrency: int = 256,
        max_in_flight: int = 10000,
        client_key_header: str | None = None,
        max_retries: int = 2,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        client_timeout: float = 30.0,
        approx_ttl: float | None = ...,  # 120.0 seconds
        threads: int = 1,
        on_unhealthy: Callable[[int, str], None] | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        models: list[str] = ...,
        health_timeout: float = 2.0,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> DataPlane: ...
    def start(
        self, host: str = "127.0.0.1", port: int = 0, *, admin_port: int | None = None, epp_port: int | None = None
    ) -> tuple[str, int]: ...
    def stop(self) -> None: ...
    @property
    def running(self) -> bool: ...
    @property
    def url(self) -> str | None: ...
    @property
    def epp_address(self) -> str | None: ...
    def set_draining(self, draining: bool) -> None: ...
    def add_worker(
        self, worker: int, url: str, *, role: Literal["both", "prefill", "decode"] | str = "both", bootstrap_port: int | None = None
    ) -> None: ...
    def remove_worker(self, worker: int) -> bool: ...
    def set_worker_models(self, worker: int, models: bytes | None) -> bool:
        """The models a worker serves (its /v1/models answer as JSON bytes; None: not known)."""
    def set_healthy(self, worker: int, healthy: bool) -> bool: ...
    def mark_unhealthy(self, worker: int, reason: str) -> bool: ...
    def metrics_text(self) -> str: ...
    def workers(self) -> list[dict[str, Any]]: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def active_clients(self) -> int: ...
    def metrics(self) -> dict[str, Any]: ...
    def approx_insert(self, worker: int, hashes: Hashes) -> None: ...
    def approx_drop_worker(self, worker: int) -> None: ...
    def approx_expire(self, now: float | None = None) -> int: ...
    def approx_clock(self) -> float: ...
    def approx_len(self) -> int: ...
    @property
    def has_approx(self) -> bool: ...
    @property
    def exact(self) -> bool: ...
    @property
    def template_unsupported(self) -> str | None: ...
    def prompt(self, body: bytes, chat: bool) -> tuple[npt.NDArray[np.uint64], int, int | None]: ...
    @property
    def prefix_reuse(self) -> dict[str, int] | None: ...
    def exact_tokens(self, body: bytes, chat: bool) -> npt.NDArray[np.uint32] | None: ...
    def render_chat(self, body: bytes) -> str | None: ...

@final
class ApproxCache:
    """The router's own decisions as cache state, for when no KV events arrive: each routed prompt's
    blocks are stored in ``index`` for its worker and removed ``ttl`` seconds after their last use.
    The data plane's own implementation, thread-safe.

    >>> idx = KvIndex(); c = ApproxCache(idx, ttl=10.0)
    >>> c.insert(0, [1, 2], now=0.0); c.expire(10.0), idx.num_blocks(0)
    (2, 0)
    """

    def __new__(cls, index: KvIndex, ttl: float) -> ApproxCache: ...
    def insert(self, worker: int, hashes: Hashes, now: float) -> None:
        """Records that ``worker`` was sent a prompt with these sequence hashes at ``now`` (seconds)."""
    def expire(self, now: float) -> int:
        """Removes blocks untouched for ``ttl`` as of ``now``; returns how many."""
    def drop_worker(self, worker: int) -> None:
        """Forgets a worker's blocks (it failed: its cache is presumed gone), in the index too."""
    @property
    def store_errors(self) -> int:
        """Index stores that failed (the index refused the blocks); counted, never raised."""
    def __len__(self) -> int: ...

@final
class ExactPrompter:
    """Exact mode's prompter, as the data plane runs it: a ``tokenizer.json`` (or its directory) and
    the chat template of the ``tokenizer_config.json`` beside it. Bodies are raw JSON bytes;
    ValueError carries the client's 400 message for an invalid body."""

    def __new__(cls, path: str | os.PathLike[str], block_size: int = 64, *, seed: int = 1337) -> ExactPrompter: ...
    def prompt(self, body: bytes, chat: bool, *, lora: str | None = None) -> tuple[npt.NDArray[np.uint64], int, int | None, bool]:
        """(sequence hashes, num_tokens, output_tokens, exact); exact False: approximate hashes."""
    def token_ids(self, body: bytes, chat: bool) -> npt.NDArray[np.uint32] | None: ...
    def render_chat(self, body: bytes) -> str | None: ...
    @property
    def template_unsupported(self) -> str | None: ...
    @property
    def prefix_reuse(self) -> dict[str, int] | None:
        """The prefix store's counters (hits, misses, entries, tokens), or None without one."""
    @property
    def prefix_reuse_unavailable(self) -> str | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def seed(self) -> int: ...

def approx_prompt(
    body: bytes, chat: bool, block_size: int = 64, *, seed: int = 1337, lora: str | None = None
) -> tuple[npt.NDArray[np.uint64], int, int | None]:
    """The data plane's approximate prompt of a raw request body (hashes, num_tokens, output_tokens);
    ValueError with the client's 400 message for an invalid body."""

def aisim_replay(
    spec_json: str,
    *,
    router: Router | None = None,
    trace_path: str | None = None,
    trace_jsonl: str | None = None,
    speedup: float = 1.0,
    trace_block_size: int = ...,  # the Mooncake traces' 512-token blocks (rust/aisim TRACE_BLOCK_SIZE)
) -> str:
    """Builds with the ``aisim`` feature only: one replay on AISimulate's engines (see kvroute.sim.aisim)."""

"""Request leases: route a request, then release its load on the Router exactly once.

For hosts that only see "routed" and later "finished" or "failed" (LiteLLM callbacks, Ray Serve's
``on_request_completed``): each outcome is reported by ticket, duplicates are ignored, and a lease
nobody releases (an abandoned stream fires no callback) expires after ``ttl`` seconds.

>>> import kvroute
>>> from kvroute.integrations.lease import LeaseTable
>>> router = kvroute.Router()
>>> router.add_worker(0); router.add_worker(1)
>>> leases = LeaseTable(router, ttl=60.0)
>>> lease = leases.open(kvroute.block_hashes(list(range(128)), 64), num_tokens=128)
>>> router.num_in_flight, leases.finish(lease.ticket), leases.finish(lease.ticket), router.num_in_flight
(1, True, False, 0)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvroute._core import Decision, KvrouteError, NoWorkersError, Router

__all__ = ["Lease", "LeaseTable", "Outcome", "RequestRejected"]

log = logging.getLogger(__name__)

#: How a lease ended: the host reported success, failure or a cancel, or nobody reported within the TTL.
Outcome = Literal["finished", "failed", "cancelled", "expired"]

_tickets = itertools.count()


class RequestRejected(KvrouteError):
    """The Router's early rejection refused the request (it was created with ``ttft_slo``); ``decision``
    says why (``decision.reason``, ``decision.predicted_ttft``). Nothing is leased."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(f"request rejected: {decision.reason} (predicted TTFT {decision.predicted_ttft:.3f} s)")
        self.decision = decision


@dataclass
class Lease:
    """One routed request's load on the Router. ``ticket`` is the key a host carries to its callbacks."""

    ticket: str
    worker: int
    decision: Decision
    opened: float
    prefilled: bool = False
    outcome: Outcome | None = field(default=None)
    #: When the Router expected the first token (its clock, ``Router.clock()``): routed at plus ``decision.predicted_ttft``.
    first_token_due: float = float("inf")
    #: The prompt length the router counted when its tokens are the engine's (exact mode), else None:
    #: the self-check (``EngineRouter.check_usage``) compares it with the engine's ``prompt_tokens``.
    routed_tokens: int | None = None

    @property
    def released(self) -> bool:
        return self.outcome is not None


class LeaseTable:
    """Open leases by ticket, on one Router; every method is thread-safe and never blocks on I/O, so
    asyncio code calls it directly.

    ``ttl`` bounds how long a lease nobody releases holds load: expired leases are released (as
    ``finished``) by ``expire()``, which ``open`` runs on every call, so expiry needs no timer thread.
    ``clock`` is the monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, router: Router, ttl: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        self.router = router
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, Lease] = {}
        #: Releases by outcome, plus ``no_first_token``: leases that finished (or expired) with no first
        #: token reported, whose prefill time the table bounded instead of measuring (see ``release``).
        self.counts: dict[str, int] = {
            "opened": 0,
            "finished": 0,
            "failed": 0,
            "cancelled": 0,
            "expired": 0,
            "duplicates": 0,
            "no_first_token": 0,
        }

    def __len__(self) -> int:
        return len(self._open)

    def open(
        self,
        hashes: npt.NDArray[np.uint64],
        num_tokens: int,
        output_tokens: int | None = None,
        allowed: Collection[int] | None = None,
        ticket: str | None = None,
    ) -> Lease:
        """Routes one request and leases its load until it is released.

        ``allowed`` restricts the choice to these workers (a host's healthy list minus the ones a
        retry already failed on, the engines serving the request's model): the Router chooses among
        them (``Router.route(workers=)``). ``identity`` (``kvroute.identity_root``) is not needed
        here: ``hashes`` carry it. Raises ``NoWorkersError`` when no allowed worker is registered,
        ``RequestRejected`` on rejection.
        """
        self.expire()
        rid = ticket if ticket is not None else f"kvroute-{next(_tickets)}"
        with self._lock:
            if rid in self._open:
                raise ValueError(f"ticket {rid!r} is already leased")
        if allowed is not None:
            allowed = set(allowed) & set(self.router.workers())
            if not allowed:
                raise NoWorkersError("none of the allowed workers is registered with the router")
        now = self.router.clock()  # one instant for the decision and its first token's due time
        pool = None if allowed is None else sorted(allowed)
        d = self.router.route(hashes=hashes, num_tokens=num_tokens, output_tokens=output_tokens, request_id=rid, now=now, workers=pool)
        if not d.admitted:
            raise RequestRejected(d)
        lease = Lease(rid, d.worker, d, self.clock(), first_token_due=now + d.predicted_ttft)
        with self._lock:
            self._open[rid] = lease
            self.counts["opened"] += 1
        return lease

    def get(self, ticket: str) -> Lease | None:
        with self._lock:
            return self._open.get(ticket)

    def prefill_done(self, ticket: str) -> bool:
        """The request's first token arrived (its prefill is over); False when no such lease is open."""
        with self._lock:
            lease = self._open.get(ticket)
            if lease is None or lease.prefilled:
                return False
            lease.prefilled = True
        self._call(self.router.prefill_done, ticket)
        return True

    def finish(self, ticket: str) -> bool:
        return self.release(ticket, "finished")

    def fail(self, ticket: str) -> bool:
        return self.release(ticket, "failed")

    def cancel(self, ticket: str) -> bool:
        return self.release(ticket, "cancelled")

    def release(self, ticket: str, outcome: Outcome) -> bool:
        """Releases the lease once: True the first time, False (counted as a duplicate) after.

        A request that failed or was cancelled before its first token gives its queued prefill
        back (``Router.cancel``); any other ending frees its load (``Router.finished``). A request
        that finishes with no first token reported (hosts without that signal, such as LiteLLM's
        callbacks) is taken to have prefilled when the Router predicted, or at its end if that is
        earlier: its end bounds the prefill but does not measure it, and reporting the whole answer
        as prefill time would shift that engine's predicted queue by the decode time."""
        with self._lock:
            lease = self._open.pop(ticket, None)
            if lease is None:
                self.counts["duplicates"] += 1
                return False
            lease.outcome = outcome
            self.counts[outcome] += 1
            bounded = not lease.prefilled and outcome in ("finished", "expired")
            if bounded:
                self.counts["no_first_token"] += 1
        if outcome in ("failed", "cancelled") and not lease.prefilled:
            self._call(self.router.cancel, ticket)
            return True
        if bounded:
            due = min(self.router.clock(), lease.first_token_due)
            self._call(lambda t: self.router.prefill_done(t, now=due), ticket)
        self._call(self.router.finished, ticket)
        return True

    def expire(self, now: float | None = None) -> int:
        """Releases (as ``expired``) every lease opened more than ``ttl`` seconds ago; returns how many."""
        cutoff = (self.clock() if now is None else now) - self.ttl
        stale = []
        with self._lock:
            for t, lease in self._open.items():  # in opening order (the clock is monotonic)
                if lease.opened > cutoff:
                    break
                stale.append(t)
        return sum(self.release(t, "expired") for t in stale)

    def release_worker(self, worker: int, outcome: Outcome = "failed") -> int:
        """Releases every open lease on ``worker`` (it died or left); returns how many."""
        with self._lock:
            tickets = [t for t, lease in self._open.items() if lease.worker == worker]
        return sum(self.release(t, outcome) for t in tickets)

    def _call(self, fn: Callable[[str], None], ticket: str) -> None:
        try:
            fn(ticket)
        except KvrouteError as e:
            # The worker was removed from the Router meanwhile (its load went with it).
            log.debug("releasing %s: %s", ticket, e)

"""Shared fixtures: paths to the optional ../shared data (seeds, traces) next to the checkout; and the
tests' helpers (``tests/support``: fake engines, the real-engine bed, reference models) on the path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# Ray Serve kills a proxy that is not ready within 5 s (then serve.start fails with ActorDiedError);
# on a loaded 2-core CI host a proxy takes longer to start. Give Serve's own checks room (the tests'
# waits stay bounded by their own timeouts). Set before any test module starts a Ray cluster.
for _var in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
    os.environ.setdefault(_var, "60")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def shared_dir() -> Path:
    """../shared beside the checkout; tests that need it skip cleanly where it is absent."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not present (fresh clone)")
    return SHARED

"""Shared fixtures: paths to the optional ../shared data (seeds, traces) next to the checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def shared_dir() -> Path:
    """../shared beside the checkout; tests that need it skip cleanly where it is absent."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not present (fresh clone)")
    return SHARED

"""The docstring examples in the public API run as written."""

from __future__ import annotations

import doctest

import kvroute
import kvroute._core
import kvroute.integrations.engine_router
import kvroute.integrations.lease
import kvroute.prompt


def test_package_doctests() -> None:
    for mod in (kvroute, kvroute._core, kvroute.integrations.lease, kvroute.integrations.engine_router, kvroute.prompt):
        assert doctest.testmod(mod, extraglobs=vars(kvroute)).failed == 0
    assert doctest.testmod(kvroute).attempted >= 3


def test_aisim_docstring_example_runs() -> None:
    import kvroute.sim.aisim

    # On a build without the aisim feature the example checks HAS_AISIM and does nothing.
    assert doctest.testmod(kvroute.sim.aisim).failed == 0


def test_rendered_results_in_the_docs_are_current() -> None:
    """Tables rendered from benches/results/*.json (README, docs/) match their results files."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "benches", "render_results.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

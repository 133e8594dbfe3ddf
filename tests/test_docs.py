"""The docstring examples in the public API run as written."""

from __future__ import annotations

import doctest

import kvroute
import kvroute._core
import kvroute.engines
import kvroute.lease
import kvroute.prompt


def test_package_doctests() -> None:
    for mod in (kvroute, kvroute._core, kvroute.lease, kvroute.engines, kvroute.prompt):
        assert doctest.testmod(mod, extraglobs=vars(kvroute)).failed == 0
    assert doctest.testmod(kvroute).attempted >= 3

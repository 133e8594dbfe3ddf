"""The docstring examples in the public API run as written."""

from __future__ import annotations

import doctest

import kvroute
import kvroute._core


def test_package_doctests() -> None:
    for mod in (kvroute, kvroute._core):
        assert doctest.testmod(mod, extraglobs=vars(kvroute)).failed == 0
    assert doctest.testmod(kvroute).attempted >= 3

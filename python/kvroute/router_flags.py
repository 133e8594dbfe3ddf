"""The Router's parameters as command-line flags, built from the binary's own table
(``kvroute._core.router_parameters``), so every CLI names, types and documents them alike.

>>> import argparse
>>> p = argparse.ArgumentParser()
>>> add_router_flags(p, ["ttft_slo", "reject"])
>>> router_options(p.parse_args(["--ttft-slo", "2", "--no-reject"]))
{'ttft_slo': 2.0, 'reject': False}
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvroute._core import router_parameters

if TYPE_CHECKING:
    from kvroute._core import Preset

__all__ = ["add_router_flags", "router_options"]

_DEST = "_router_flags"


def _table(preset: Preset) -> dict[str, tuple[str, object, list[str], str]]:
    return {name: (typ, default, policies, help_) for name, typ, default, policies, help_ in router_parameters(preset)}


def _converter(name: str, typ: str) -> Any:
    """argparse's `type` for a parameter: what its stub type accepts, with the parameter's name in errors."""
    if typ == "int":
        return int
    if typ in ("float", "float | None"):

        def number(v: str) -> float | None:
            if typ != "float" and v.lower() == "none":
                return None
            try:
                return float(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')} expects a number, got {v!r}") from None

        return number
    return str


def _choices(typ: str) -> list[str] | None:
    if typ.startswith("Literal["):
        return [str(x) for x in ast.literal_eval("(" + typ[len("Literal[") : -1] + ",)")]
    return None


def add_router_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: Iterable[str], *, preset: Preset = "simulator", **overrides: str
) -> None:
    """Adds ``--name-with-dashes`` for each Router parameter in ``names`` (bools as ``--x/--no-x``),
    typed, with the table's help and its default under ``preset``; ``overrides`` replace a flag's whole
    help (say the default there when the caller's differs from the Router's).
    A flag that is not given leaves the parameter to the Router (``router_options`` omits it)."""
    table = _table(preset)
    for name in names:
        typ, default, policies, help_ = table[name]
        note = f"default {default}" if default is not None else "default: none"
        if policies:
            note += "; policy " + " or ".join(policies)
        text = overrides.get(name, f"{help_} ({note})")
        kw: dict[str, Any] = {"dest": f"{_DEST}.{name}", "default": None, "help": text}
        flag = "--" + name.replace("_", "-")
        if typ == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        choices = _choices(typ)
        if choices:
            kw["choices"] = choices
        else:
            kw["type"] = _converter(name, typ)
            kw["metavar"] = "N" if typ == "int" else "X"
        parser.add_argument(flag, **kw)


def router_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Router keyword arguments the flags of ``add_router_flags`` were given."""
    prefix = _DEST + "."
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}

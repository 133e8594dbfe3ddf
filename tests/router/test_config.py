"""The Router's one configuration: the binary's parameter table, the stub, `Router.config` and the
presets agree, and bad configurations fail with the error a Python user expects."""

from __future__ import annotations

import ast
import pathlib

import kvroute
import pytest
from kvroute._core import POLICIES, ROUTER_PRESETS, router_parameters

STUB = pathlib.Path(kvroute.__file__).with_name("_core.pyi")


def _stub_router_params() -> list[tuple[str, str, object]]:
    """(name, annotation, default) of the stub's Router constructor, aliases expanded."""
    tree = ast.parse(STUB.read_text())
    aliases = {
        n.targets[0].id: ast.unparse(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Subscript)
    }
    router = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Router")
    new = next(f for f in router.body if isinstance(f, ast.FunctionDef) and f.name == "__new__")
    out = []
    for arg, default in zip(new.args.kwonlyargs, new.args.kw_defaults, strict=True):
        assert arg.annotation is not None and default is not None, arg.arg
        ann = ast.unparse(arg.annotation)
        out.append((arg.arg, aliases.get(ann, ann), ast.literal_eval(default)))
    return out


def test_the_stub_lists_the_binarys_parameters_types_and_defaults():
    stub = _stub_router_params()
    assert [n for n, _, _ in stub[:2]] == ["preset", "index"]
    binary = [(name, ast.unparse(ast.parse(typ, mode="eval").body), default) for name, typ, default, _, _ in router_parameters()]
    assert stub[2:] == binary


def test_config_round_trips_for_every_policy():
    for policy in POLICIES:
        r = kvroute.Router(policy=policy)
        assert r.policy == policy
        again = kvroute.Router(**r.config)
        assert again.config == r.config, policy
        own = {name for name, _, _, policies, _ in router_parameters() if policy in policies}
        shared = {name for name, _, _, policies, _ in router_parameters() if not policies}
        assert set(r.config) == own | shared, policy


def test_a_policys_parameter_needs_that_policy():
    with pytest.raises(ValueError, match='cache_threshold is a parameter of the "cache_aware" policy, not of "ttft"'):
        kvroute.Router(policy="ttft", cache_threshold=0.5)
    with pytest.raises(ValueError, match='queue_weight is a parameter of the "capacity" and "slack" policy'):
        kvroute.Router(policy="cost", queue_weight=1.0)
    assert kvroute.Router(policy="cache_aware", cache_threshold=0.5).config["cache_threshold"] == 0.5


def test_presets_change_only_what_they_say():
    table = {p: {name: default for name, _, default, _, _ in router_parameters(p)} for p in ROUTER_PRESETS}
    sim = table["simulator"]
    diff = {p: {k: v for k, v in t.items() if sim[k] != v} for p, t in table.items()}
    assert diff == {
        "simulator": {},
        "gateway": {"block_size": 16, "ttft_model": "learned"},
        "gateway_approx": {"pending_prefixes": False, "stale_overlaps": False, "ttft_model": "learned"},
        "host_router": {"block_size": 16, "token_share_bound": 1.25, "ttft_model": "learned"},
    }
    r = kvroute.Router(preset="host_router", block_size=32)
    assert (r.config["block_size"], r.config["token_share_bound"]) == (32, 1.25)
    assert kvroute.Router().config["block_size"] == 64


def test_bad_configurations_fail_clearly():
    with pytest.raises(TypeError, match='unexpected keyword argument "blocksize"'):
        kvroute.Router(blocksize=16)
    with pytest.raises(TypeError, match=r"block_size must be an integer, got 1\.5"):
        kvroute.Router(block_size=1.5)
    with pytest.raises(TypeError, match="reject must be True or False"):
        kvroute.Router(reject=1)
    with pytest.raises(TypeError, match="ttft_slo: expected None, a bool, a number or a str, got list"):
        kvroute.Router(ttft_slo=[1])
    with pytest.raises(ValueError, match="block_size must be an integer >= 0, got -1"):
        kvroute.Router(block_size=-1)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        kvroute.Router(block_size=0)
    with pytest.raises(ValueError, match='unknown tie_break "x"; expected one of rotate, lowest'):
        kvroute.Router(tie_break="x")
    with pytest.raises(ValueError, match='preset must be one of simulator, gateway, gateway_approx, host_router, got "sim"'):
        kvroute.Router(preset="sim")
    # An int where a number is expected is that number.
    assert kvroute.Router(ttft_slo=2).config["ttft_slo"] == 2.0

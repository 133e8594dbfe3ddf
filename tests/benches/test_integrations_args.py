"""`benches/bench_integrations.py`'s policy entries: ``kvroute[:POLICY][@X]`` reach EngineRouter as the
Router policy and token share bound they name, and a malformed entry stops the bench before any engine starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from bench_integrations import KvrouteSettings, check_policies, kvroute_policy, kvroute_share_bound


def test_entries_name_a_policy_and_a_share_bound() -> None:
    assert [kvroute_policy(e) for e in ("kvroute", "kvroute@off", "kvroute:slack@1.5", "PrefixCacheAffinityRouter")] == [
        None,
        None,
        "slack",
        None,
    ]
    assert [kvroute_share_bound(e) for e in ("kvroute", "kvroute@off", "kvroute:slack@1.5")] == [..., None, 1.5]
    kv = KvrouteSettings("tok", 20000.0, None, {}, 191)
    assert "token_share_bound" not in kv.for_entry("kvroute").kwargs(), "no suffix: EngineRouter's default"
    assert kv.for_entry("kvroute").row()["token_share_bound"] == 1.25
    off = kv.for_entry("kvroute@off")
    assert off.kwargs()["token_share_bound"] is None and "policy" not in off.kwargs() and off.row()["token_share_bound"] is None
    kw = kv.for_entry("kvroute:slack@1.5").kwargs()
    assert (kw["policy"], kw["token_share_bound"]) == ("slack", 1.5)


@pytest.mark.parametrize("bad", ["kvroute:nope", "kvroute@0.5", "kvroute@inf", "kvroute@nan", "kvroute@lots", "kvroot", "kvroute:slack@"])
def test_a_malformed_entry_stops_the_bench(bad: str) -> None:
    check_policies("--litellm-policies", ["kvroute", "kvroute@off", "kvroute:capacity@1.3", "simple-shuffle"], ["simple-shuffle"])
    with pytest.raises(SystemExit, match="unknown entry"):
        check_policies("--litellm-policies", [bad], ["simple-shuffle"])

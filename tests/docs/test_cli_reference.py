"""docs/reference/cli.md is the command's own help, regenerated: it never drifts from the parsers."""

from __future__ import annotations

import runpy
from pathlib import Path

GEN = Path(__file__).resolve().parents[2] / "docs" / "reference" / "gen_cli.py"


def test_cli_reference_is_current() -> None:
    gen = runpy.run_path(str(GEN))
    text = gen["render"]()
    assert text == Path(gen["OUT"]).read_text(), "docs/reference/cli.md is out of date: run python docs/reference/gen_cli.py"
    for command in ("## kvroute simulate", "## kvroute plan", "## kvroute serve"):
        assert command in text

"""Helpers for tests of the ``kvroute`` command line."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kvroute.cli import main


def refusal(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs ``kvroute argv``, which must refuse it: status 2 and one line on stderr, returned."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors exit from parse_args
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (argv, rc, err)
    return lines[0]

"""Writes docs/reference/cli.md from the `kvroute` command's argparse parsers, so the reference is
the command's own help:

    python docs/reference/gen_cli.py          # rewrite cli.md
    python docs/reference/gen_cli.py --check  # exit 1 if cli.md is out of date (tests/docs runs this)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli.md")


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: fixed, for a stable file
    from kvroute.cli import build_parser

    parser = build_parser()
    out = [
        "# Command line",
        "",
        "Generated from the command's own parsers by `python docs/reference/gen_cli.py`; every option",
        "is checked, and a bad value gets one line on stderr and exit status 2.",
        "",
        "## kvroute",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        out += ["", f"## kvroute {name}", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check that cli.md is current")
    a = ap.parse_args(argv)
    text = render()
    current = Path(OUT).read_text() if os.path.exists(OUT) else ""
    if a.check:
        if text != current:
            print(f"{OUT} is out of date: run python docs/reference/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

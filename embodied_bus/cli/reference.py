"""The command-line reference (``docs/cli.md``), generated from the parsers themselves.

``python -m embodied_bus.cli.reference > docs/cli.md`` writes it; a test checks that the file
is what the parsers say.
"""

from __future__ import annotations

import argparse
import os
import sys

from embodied_bus.cli.main import build_parser

__all__ = ["markdown"]

#: Width the help text is wrapped to (independent of the terminal that runs the generator).
WIDTH = 100


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _section(name: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f"{'#' * level} `{name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for sub, p in _subparsers(parser).items():
        lines += _section(f"{name} {sub}", p, level + 1)
    return lines


def markdown() -> str:
    """The reference of every command and subcommand, as Markdown."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        parser = build_parser()
        lines = [
            "# Command line",
            "",
            "Generated from the parsers (`python -m embodied_bus.cli.reference > docs/cli.md`).",
            "`--bus` defaults to `$EMBODIED_BUS_URL`, else `zenoh:`; `--ns` to `$EMBODIED_BUS_NAMESPACE`.",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
            "",
        ]
        for name, sub in _subparsers(parser).items():
            lines += _section(f"embodied-bus {name}", sub, 2)
        return "\n".join(lines)
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


if __name__ == "__main__":
    sys.stdout.write(markdown())

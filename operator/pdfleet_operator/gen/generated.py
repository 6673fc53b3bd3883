"""The shared end of every command that regenerates checked-in files (`pdfleet crds|rules|chart|dashboards`).

`regenerate` writes the files, or with `check` writes nothing and names each stale one (exit 1), the
test every generator's `--check` is. `standalone` runs one plugin's `register` as its own program
(`python -m pdfleet_operator.gen.chart chart --check`), which the tests use.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path


def regenerate(
    command: str, check: bool, stale: Callable[[], Iterable[Path]], write: Callable[[], Iterable[Path]]
) -> int:
    if check:
        found = list(stale())
        for path in found:
            print(f"stale: {path} (run `pdfleet {command}` to regenerate)", file=sys.stderr)
        return 1 if found else 0
    for path in write():
        print(f"wrote {path}")
    return 0


def standalone(register: Callable[[argparse._SubParsersAction], None], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdfleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)

"""The `pdfleet` command: one entry point for the operator, the worker and the local tools.

Control-plane subcommands live here; data-plane ones (`model`, `worker`, `router`) are registered
by `pdfleet_worker.cli`, loaded by name so that the operator image (no torch) still starts and
says clearly what is missing when a worker command is asked for.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pdfleet_operator import __version__

# Modules that add subcommands with `register(subparsers)`; the first is the data plane.
PLUGINS = ("pdfleet_worker.cli",)


def _cmd_crds(args: argparse.Namespace) -> int:
    from pdfleet_operator import crds

    out = Path(args.out)
    if args.check:
        stale = crds.stale_files(out)
        for path in stale:
            print(f"stale: {path} (run `pdfleet crds` to regenerate)", file=sys.stderr)
        return 1 if stale else 0
    for path in crds.write_all(out):
        print(f"wrote {path}")
    return 0


def _cmd_rules(args: argparse.Namespace) -> int:
    from pdfleet_operator import alerts

    out = Path(args.out)
    text = alerts.render_rule_file()
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"stale: {out} (run `pdfleet rules` to regenerate)", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from pdfleet_operator import validate

    checked, problems = validate.validate_paths(Path(p) for p in args.files)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} error(s) in {checked} object(s)", file=sys.stderr)
        return 1
    print(f"{checked} object(s) valid", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdfleet",
        description="Prefill/decode-disaggregated LLM inference fleets on Kubernetes (and on one machine).")
    parser.add_argument("--version", action="version", version=f"pdfleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("crds", help="regenerate the CustomResourceDefinitions from the API models")
    p.add_argument("--out", default="crds", help="directory to write (default: crds)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files are stale")
    p.set_defaults(func=_cmd_crds)

    p = sub.add_parser("rules", help="regenerate the Prometheus alerting rules (rollback on 5xx, SLO burn)")
    p.add_argument("--out", default="dashboards/rules/pdfleet.rules.yaml", help="file to write")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is stale")
    p.set_defaults(func=_cmd_rules)

    p = sub.add_parser("validate", help="check custom resources offline with the API server's rules")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML files or directories")
    p.set_defaults(func=_cmd_validate)

    for name in PLUGINS:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # the operator image ships without the data plane's dependencies
            _missing_plugin(sub, name, exc)
            continue
        module.register(sub)
    return parser


def _missing_plugin(sub: argparse._SubParsersAction, name: str, exc: ImportError) -> None:
    def explain(_: argparse.Namespace) -> int:
        print(f"pdfleet: this command needs {name} ({exc}); install `pdfleet[worker]`", file=sys.stderr)
        return 2

    for command in ("model", "worker", "router"):
        if command not in sub.choices:
            sub.add_parser(command, help=f"(unavailable: {exc.name} is not installed)").set_defaults(func=explain)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

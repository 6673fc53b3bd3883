"""The `pdfleet` command: one entry point for the operator, the worker and the local tools.

Small commands live here. The others are registered by their own modules (`register(subparsers)`),
imported only when their command is run: `pdfleet validate` does not pay for kopf, numpy or torch,
and an image without an extra (the operator image has no torch) still starts and says clearly
what is missing when one of those commands is asked for.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pdfleet_operator import __version__
from pdfleet_operator.gen import generated

# command -> (module whose register(subparsers) adds it, the extra that installs its dependencies, help)
PLUGINS: dict[str, tuple[str, str, str]] = {
    "operator": ("pdfleet_operator.kube.operator_cli", "operator", "run the operator (kopf) against a cluster"),
    "simulate": ("pdfleet_operator.sim.cli", "sim", "plan a fleet against a simulated cluster and a request trace"),
    "model": ("pdfleet_worker.cli", "worker", "create and inspect model directories"),
    "worker": ("pdfleet_worker.cli", "worker", "serve a model: OpenAI API, /health, /ready, /metrics"),
    "router": ("pdfleet_worker.cli", "worker", "the OpenAI endpoint in front of the workers"),
    "up": (
        "pdfleet_operator.local.cli",
        "operator",
        "run an InferenceDeployment on this machine: router + workers + autoscaler",
    ),
    "load": ("pdfleet_operator.local.cli", "operator", "open-loop load on an OpenAI endpoint: TTFT/ITL and tokens/s"),
    "render": (
        "pdfleet_operator.kube.render_cli",
        "operator",
        "print the objects the operator would create (like helm template)",
    ),
    "chart": ("pdfleet_operator.gen.chart", "dev", "regenerate the Helm chart's generated files"),
    "dashboards": ("pdfleet_operator.gen.dashboards", "dev", "regenerate the Grafana dashboards"),
}


def _cmd_crds(args: argparse.Namespace) -> int:
    from pdfleet_operator.gen import crds

    out = Path(args.out)
    return generated.regenerate("crds", args.check, lambda: crds.stale_files(out), lambda: crds.write_all(out))


def _cmd_rules(args: argparse.Namespace) -> int:
    from pdfleet_operator.gen import alerts

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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the plugin module of the command in argv (if any) is imported."""
    parser = argparse.ArgumentParser(
        prog="pdfleet",
        description="Prefill/decode-disaggregated LLM inference fleets on Kubernetes (and on one machine).",
    )
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

    command = next((a for a in (argv or []) if not a.startswith("-")), None)
    if command in PLUGINS:
        module_name, extra, _ = PLUGINS[command]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # an image built without this command's extra
            _unavailable(sub, command, f"needs {exc.name}, which is not installed (pip install 'pdfleet[{extra}]')")
        else:
            module.register(sub)
    for name, (_, _, help_text) in PLUGINS.items():
        if name not in sub.choices:  # listed in --help; its module is loaded when it is the command
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _unavailable(sub: argparse._SubParsersAction, command: str, why: str) -> None:
    def explain(_: argparse.Namespace) -> int:
        print(f"pdfleet {command}: {why}", file=sys.stderr)
        return 2

    sub.add_parser(command, help=f"(unavailable: {why})", add_help=False, prefix_chars="\0").set_defaults(func=explain)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""`pdfleet render SPEC... [--classes FILE]`: print the objects the operator would create, like `helm template`.

Each InferenceDeployment in the given files is validated as admission validates it, its pools are
planned by the operator's own placement and rendered by the operator's own `render`, and the
objects are printed as one YAML stream on stdout (exit 0), or every problem is printed on stderr
naming the object and the field (exit 1). AcceleratorClasses come from `--classes` (files or
directories) and from the SPEC files themselves.

Without `--nodes` the plan is made on a cluster with room for every listed class (each role at its
minReplicas on its first class, as a fresh cluster with free accelerators would get); `--nodes FILE`
plans on the Node objects in FILE instead (for example `kubectl get nodes -o yaml`), so the sizes
and classes are the ones that cluster would get.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from pdfleet_operator import validate
from pdfleet_operator.api import AcceleratorClass, AcceleratorClassSpec, InferenceDeployment
from pdfleet_operator.decide import inventory, placement, runtimes
from pdfleet_operator.kube import render


class RenderError(Exception):
    """What stops the rendering: one line per problem."""


def _documents(paths: list[Path]) -> list[tuple[str, Any]]:
    out = []
    for path in validate.expand(paths):
        try:
            out += validate.load_documents(path)
        except (OSError, ValueError) as exc:
            raise RenderError(str(exc)) from None
    return out


def roomy_inventory(
    deployments: list[InferenceDeployment], classes: dict[str, AcceleratorClassSpec]
) -> inventory.Inventory:
    """One node per listed class with room for every role at its maxReplicas: placement is then limited
    only by the spec (preferences, tier, SLO), as on a cluster with free accelerators."""
    need: dict[str, int] = {}
    for dep in deployments:
        for rs in dep.spec.roles().values():
            for name in rs.accelerator_classes:
                need[name] = need.get(name, 0) + rs.max_replicas
    nodes = []
    for name, replicas in sorted(need.items()):
        cls = classes.get(name)
        if cls is None:
            continue
        nodes.append(
            inventory.NodeInventory(
                f"room-for-{name}", dict(cls.node_selector), (), {cls.resource_name: cls.count * replicas}
            )
        )
    return inventory.Inventory(tuple(nodes))


def render_files(
    specs: list[Path], class_paths: list[Path], nodes_path: Path | None = None, *, monitoring: bool = False
) -> list[dict[str, Any]]:
    """Every object for every InferenceDeployment in `specs`; RenderError listing each problem."""
    docs = _documents(specs) + _documents(class_paths)
    problems = [str(p) for source, doc in docs for p in validate.validate_object(doc, source)]
    if problems:
        raise RenderError("\n".join(problems))
    classes = {
        d["metadata"]["name"]: AcceleratorClass.model_validate(d).spec
        for _, d in docs
        if d.get("kind") == "AcceleratorClass"
    }
    deployments = [
        (source, InferenceDeployment.model_validate(d))
        for source, d in _documents(specs)
        if d.get("kind") == "InferenceDeployment"
    ]
    if not deployments:
        raise RenderError(f"no InferenceDeployment in {', '.join(map(str, specs))}")
    for source, dep in deployments:
        missing = sorted({c for rs in dep.spec.roles().values() for c in rs.accelerator_classes} - set(classes))
        if missing:
            problems.append(
                f"{source}: InferenceDeployment/{dep.name}: AcceleratorClass {', '.join(missing)} not "
                f"found (give the file that defines it with --classes)"
            )
        problems += [f"{source}: InferenceDeployment/{dep.name}: {p}" for p in runtimes.check(dep.spec, classes)]
    if problems:
        raise RenderError("\n".join(problems))
    if nodes_path is not None:
        node_docs = [d for _, d in _documents([nodes_path])]
        items = [n for d in node_docs for n in (d.get("items") or [d]) if n.get("kind", "Node") == "Node"]
        inv = inventory.build(items, [])
    else:
        inv = roomy_inventory([d for _, d in deployments], classes)
    out: list[dict[str, Any]] = []
    for source, dep in deployments:
        plan = placement.plan(dep.spec, classes, inv)
        if plan.shortfalls:
            problems += [
                f"{source}: InferenceDeployment/{dep.name}: {s.role}: {s.message or s.reason}" for s in plan.shortfalls
            ]
            continue
        owner = render.Owner(dep.name, dep.metadata.namespace or "default", "<uid>")
        out += render.render(owner, dep.spec, plan, classes, revision=1, monitoring=monitoring)
    if problems:
        raise RenderError("\n".join(problems))
    return out


def _run(args: argparse.Namespace) -> int:
    try:
        objects = render_files(
            [Path(p) for p in args.specs],
            [Path(p) for p in args.classes or []],
            Path(args.nodes) if args.nodes else None,
            monitoring=args.monitoring,
        )
    except RenderError as exc:
        print(exc, file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=120))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "render",
        help="print the objects the operator would create for InferenceDeployments",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("specs", nargs="+", metavar="SPEC", help="YAML files (or directories) with InferenceDeployments")
    p.add_argument(
        "--classes",
        action="append",
        metavar="FILE",
        help="YAML file or directory with the AcceleratorClasses (repeatable; also read from SPEC)",
    )
    p.add_argument("--nodes", metavar="FILE", help="plan on these Node objects instead of room for every class")
    p.add_argument("--monitoring", action="store_true", help="also render the PodMonitor and PrometheusRule")
    p.set_defaults(func=_run)

"""Offline validation of pdfleet custom resources; `pdfleet validate` and `pdfleet up` call it.

Two independent checks run on every object and must agree: admission (the CRD's structural schema
and CEL rules, exactly what the API server enforces) and the pydantic models (what the operator
parses). Errors are reported per object and field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml

from pdfleet_operator.api import schema
from pdfleet_operator.api.validation import Problem, pydantic_problems, validate_object  # noqa: F401 (the command's API)


def load_documents(path: Path) -> list[tuple[str, Any]]:
    """(source label, document) for each non-empty YAML document in a file; raises ValueError on bad YAML."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if len(docs) == 1:
        return [(str(path), docs[0])]
    return [(f"{path}#{i}", d) for i, d in enumerate(docs)]


def validate_paths(paths: Iterable[Path]) -> tuple[int, list[Problem]]:
    """Validate files (directories: their *.yaml / *.yml); returns (objects checked, problems)."""
    crd_by_kind = schema.load_crds()
    checked, problems = 0, []
    valid: list[tuple[str, dict[str, Any]]] = []
    for path in expand(paths):
        try:
            documents = load_documents(path)
        except (OSError, ValueError) as exc:
            problems.append(Problem(str(path), "?", "", str(exc)))
            continue
        for source, doc in documents:
            checked += 1
            if isinstance(doc, dict) and doc.get("kind") == "SimulatedFleet":
                # A `pdfleet simulate` input, not a cluster object: checked by the simulator's own parser
                # (imported here: it needs numpy, which the core install that runs `pdfleet validate` lacks).
                from pdfleet_operator.sim import fleet

                name = (doc.get("metadata") or {}).get("name", "<no name>")
                problems.extend(
                    Problem(source, f"SimulatedFleet/{name}", "", line)
                    for line in fleet.validate_document(doc, source, path.parent)
                )
                continue
            found = validate_object(doc, source, crd_by_kind)
            problems.extend(found)
            if not found and isinstance(doc, dict) and doc.get("kind") in ("InferenceDeployment", "AcceleratorClass"):
                valid.append((source, doc))
    problems.extend(_runtime_problems(valid))
    return checked, problems


def _runtime_problems(docs: list[tuple[str, dict[str, Any]]]) -> list[Problem]:
    """The rules across objects (`decide.runtimes`): each valid InferenceDeployment against the valid
    AcceleratorClasses given with it (the classes it lists that are not given are not checked here)."""
    from pdfleet_operator.api import AcceleratorClass, InferenceDeployment
    from pdfleet_operator.decide import runtimes

    classes = {
        d["metadata"]["name"]: AcceleratorClass.model_validate(d).spec
        for _, d in docs
        if d["kind"] == "AcceleratorClass"
    }
    out = []
    for source, doc in docs:
        if doc["kind"] == "InferenceDeployment":
            dep = InferenceDeployment.model_validate(doc)
            out += [
                Problem(source, f"InferenceDeployment/{dep.name}", p.field, p.message)
                for p in runtimes.check(dep.spec, classes)
            ]
    return out


def expand(paths: Iterable[Path]) -> list[Path]:
    out = []
    for p in paths:
        if p.is_dir():
            out.extend(sorted(x for x in p.rglob("*") if x.suffix in (".yaml", ".yml")))
        else:
            out.append(p)
    return out

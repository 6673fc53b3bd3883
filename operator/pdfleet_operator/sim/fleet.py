"""The `SimulatedFleet` file: nodes, AcceleratorClasses, a base InferenceDeployment and the policies to compare.

One YAML document (`apiVersion: sim.pdfleet.io/v1alpha1`, `kind: SimulatedFleet`); the simulator
and `pdfleet simulate` read it. It is not applied to a cluster. Every InferenceDeployment a policy
produces (the base spec with the policy's changes merged in) and every AcceleratorClass is validated
with the same models and admission rules as on a cluster; nodes become Node objects that the
operator's `inventory.build` reads. Errors name the field, as `pdfleet validate` does.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdfleet_operator import trace as tr
from pdfleet_operator.api import (
    AcceleratorClass,
    AcceleratorClassSpec,
    InferenceDeployment,
    InferenceDeploymentSpec,
    schema,
    validation,
)
from pdfleet_operator.decide import autoscaler, inventory, runtimes

API_VERSION = "sim.pdfleet.io/v1alpha1"
KIND = "SimulatedFleet"
AUTOSCALER_POLICIES = {"pdfleet": autoscaler.PDFLEET, "per-role": autoscaler.PER_ROLE}
TOP_LEVEL = {
    "apiVersion",
    "kind",
    "metadata",
    "acceleratorClassFiles",
    "acceleratorClasses",
    "nodes",
    "simulation",
    "trace",
    "deployment",
    "policies",
    "compare",
    "headline",
    "equalSlo",
}


class FleetError(ValueError):
    """A fleet file that cannot be simulated; the message names the file and the field."""


@dataclass(frozen=True)
class Settings:
    """How the simulated cluster behaves beyond what the API objects say."""

    startup_s: float = 120.0  # pod scheduled -> serving (image pull, weights load, warm-up)
    startup_s_by_class: Mapping[str, float] = field(default_factory=dict)
    scrape_interval_s: float = 5.0  # Prometheus scrape interval of the workers
    kv_transfer_latency_s: float = 0.002
    sample_interval_s: float = 60.0  # time series resolution of the report and plots
    drain_timeout_s: float = 1800.0  # after the trace ends, how long in-flight requests may finish

    def startup(self, cls: str) -> float:
        return self.startup_s_by_class.get(cls, self.startup_s)


@dataclass(frozen=True)
class DeploymentPlan:
    """One InferenceDeployment a policy runs and the share of the trace's requests it gets."""

    name: str
    namespace: str
    spec: InferenceDeploymentSpec
    share: float


@dataclass(frozen=True)
class Policy:
    name: str
    description: str
    deployments: tuple[DeploymentPlan, ...]
    autoscaler_policy: autoscaler.Policy
    variant: str = ""  # a sweep variant of the policy (`equalSlo.sweep`): what it changes, e.g. "targetUtilization 0.6"


@dataclass(frozen=True)
class EqualSlo:
    """The equal-SLO comparison: each policy's variants are run too, and the cheapest of a policy's runs
    (itself included) whose SLO attainment reaches the target policy's is that policy's equal-SLO cost.
    `variants` (`sweep`) all run; `search` variants are ordered from least to most headroom and only those
    a bisection for the first that reaches the target needs are run (`sim.search`)."""

    target: str  # the policy whose attainment the others must reach
    variants: Mapping[str, tuple[Policy, ...]]  # policy -> its sweep variants (not itself)
    search: Mapping[str, tuple[Policy, ...]] = field(default_factory=dict)  # policy -> ordered variants


@dataclass(frozen=True)
class TraceDefaults:
    preset: str = "conversation"
    mean_rate: float = 1.0
    duration_s: float = tr.DAY_S
    start_hour: float = 0.0


@dataclass(frozen=True)
class Fleet:
    name: str
    source: str
    classes: Mapping[str, AcceleratorClassSpec]
    nodes: tuple[dict[str, Any], ...]  # Node objects (what the API server would return)
    devices: int  # physical accelerators (a MIG-partitioned GPU is one)
    settings: Settings
    trace: TraceDefaults
    policies: Mapping[str, Policy]
    compare: tuple[str, ...]
    headline: tuple[str, str] | None  # (baseline, candidate) for the one-line comparison
    equal_slo: EqualSlo | None = None

    def inventory(self) -> inventory.Inventory:
        return inventory.build(self.nodes, [])

    def policy(self, name: str) -> Policy:
        if name not in self.policies:
            raise FleetError(f"{self.source}: no policy {name!r}; the fleet defines {', '.join(self.policies)}")
        return self.policies[name]


def load(path: str | Path) -> Fleet:
    """Read and validate a fleet file; FleetError naming what is wrong."""
    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except FileNotFoundError:
        raise FleetError(f"{path}: no such fleet file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise FleetError(f"{path}: not readable YAML: {exc}") from exc
    if len(docs) != 1:
        raise FleetError(f"{path}: expected one {KIND} document, found {len(docs)}")
    return parse(docs[0], source=str(path), base_dir=path.parent)


def parse(doc: Any, *, source: str = "<fleet>", base_dir: Path = Path(".")) -> Fleet:
    if not isinstance(doc, dict):
        raise FleetError(f"{source}: expected a mapping, got {type(doc).__name__}")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise FleetError(
            f"{source}: expected apiVersion {API_VERSION} and kind {KIND}, "
            f"got {doc.get('apiVersion')!r} / {doc.get('kind')!r}"
        )
    unknown = sorted(set(doc) - TOP_LEVEL)
    if unknown:
        raise FleetError(f"{source}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(TOP_LEVEL))})")
    name = str((doc.get("metadata") or {}).get("name") or Path(source).stem)
    classes = _classes(doc, source, base_dir)
    nodes, devices = _nodes(doc.get("nodes"), classes, source)
    settings = _settings(doc.get("simulation") or {}, source)
    defaults = _trace(doc.get("trace") or {}, source)
    policies = _policies(doc, classes, source)
    compare = tuple(doc.get("compare") or policies)
    for p in compare:
        if p not in policies:
            raise FleetError(f"{source}: compare lists {p!r}, not a policy of this fleet ({', '.join(policies)})")
    headline = None
    if doc.get("headline"):
        h = doc["headline"]
        if not isinstance(h, dict) or set(h) != {"baseline", "candidate"}:
            raise FleetError(f"{source}: headline must be {{baseline: POLICY, candidate: POLICY}}")
        for key in ("baseline", "candidate"):
            if h[key] not in policies:
                raise FleetError(f"{source}: headline.{key} {h[key]!r} is not a policy of this fleet")
        headline = (h["baseline"], h["candidate"])
    equal = _equal_slo(doc, policies, classes, source)
    return Fleet(name, source, classes, nodes, devices, settings, defaults, policies, compare, headline, equal)


# --- parts ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _crds() -> dict[str, dict[str, Any]]:
    return schema.load_crds()


def _check_object(obj: dict[str, Any], where: str) -> None:
    problems = validation.validate_object(obj, where, _crds())
    if problems:
        raise FleetError("\n".join(str(p) for p in problems))


def _classes(doc: dict[str, Any], source: str, base_dir: Path) -> dict[str, AcceleratorClassSpec]:
    objects: list[tuple[str, dict[str, Any]]] = []
    for rel in doc.get("acceleratorClassFiles") or []:
        path = (base_dir / rel).resolve()
        try:
            found = [d for d in yaml.safe_load_all(path.read_text()) if d]
        except (OSError, yaml.YAMLError) as exc:
            raise FleetError(f"{source}: acceleratorClassFiles: cannot read {rel}: {exc}") from exc
        objects += [(f"{rel}#{i}", d) for i, d in enumerate(found) if d.get("kind") == "AcceleratorClass"]
    for i, d in enumerate(doc.get("acceleratorClasses") or []):
        if not isinstance(d, dict):
            raise FleetError(f"{source}: acceleratorClasses[{i}] must be an AcceleratorClass object")
        objects.append(
            (
                f"{source}: acceleratorClasses[{i}]",
                {"apiVersion": "pdfleet.io/v1alpha1", "kind": "AcceleratorClass", **d},
            )
        )
    out: dict[str, AcceleratorClassSpec] = {}
    for where, obj in objects:
        _check_object(obj, where)
        ac = AcceleratorClass.model_validate(obj)
        out[ac.name] = ac.spec  # later definitions (the fleet's own) override the files'
    if not out:
        raise FleetError(f"{source}: no AcceleratorClasses (acceleratorClassFiles or acceleratorClasses)")
    return out


def _nodes(
    raw: Any, classes: Mapping[str, AcceleratorClassSpec], source: str
) -> tuple[tuple[dict[str, Any], ...], int]:
    """Node objects from node groups: `{name, count, accelerators: {class: units}, devices, labels, taints}`."""
    if not isinstance(raw, list) or not raw:
        raise FleetError(f"{source}: nodes must be a non-empty list of node groups")
    nodes: list[dict[str, Any]] = []
    devices = 0
    seen: set[str] = set()
    for i, group in enumerate(raw):
        where = f"{source}: nodes[{i}]"
        if not isinstance(group, dict):
            raise FleetError(f"{where}: expected a mapping")
        extra = sorted(set(group) - {"name", "count", "accelerators", "devices", "labels", "taints"})
        if extra:
            raise FleetError(f"{where}: unknown field(s) {', '.join(extra)}")
        gname, count, accs = group.get("name"), group.get("count", 1), group.get("accelerators")
        if not isinstance(gname, str) or not gname:
            raise FleetError(f"{where}.name: required (node names are NAME-0, NAME-1, ...)")
        if gname in seen:
            raise FleetError(f"{where}.name: {gname!r} used twice")
        seen.add(gname)
        if not isinstance(count, int) or count < 1:
            raise FleetError(f"{where}.count: must be a whole number >= 1, got {count!r}")
        if not isinstance(accs, dict) or not accs:
            raise FleetError(f"{where}.accelerators: expected {{AcceleratorClass: units per node}}")
        labels: dict[str, str] = {}
        allocatable: dict[str, str] = {}
        for cname, units in accs.items():
            if cname not in classes:
                raise FleetError(
                    f"{where}.accelerators: unknown AcceleratorClass {cname!r} (known: {', '.join(sorted(classes))})"
                )
            if not isinstance(units, int) or units < 1:
                raise FleetError(f"{where}.accelerators.{cname}: units must be a whole number >= 1, got {units!r}")
            cls = classes[cname]
            for k, v in cls.node_selector.items():
                if labels.get(k, v) != v:
                    raise FleetError(f"{where}: classes {', '.join(accs)} need conflicting node label {k}")
                labels[k] = v
            resource = cls.resource_name
            allocatable[resource] = str(int(allocatable.get(resource, "0")) + units)
        labels.update({str(k): str(v) for k, v in (group.get("labels") or {}).items()})
        per_node = group.get("devices", sum(accs.values()))
        if not isinstance(per_node, int) or per_node < 0:
            raise FleetError(f"{where}.devices: physical accelerators per node, a whole number >= 0")
        devices += per_node * count
        taints = group.get("taints") or []
        for j in range(count):
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": f"{gname}-{j}", "labels": dict(labels)},
                "spec": {"taints": copy.deepcopy(taints)},
                "status": {"allocatable": dict(allocatable), "conditions": [{"type": "Ready", "status": "True"}]},
            }
            nodes.append(node)
    try:
        inventory.build(nodes, [])
    except (ValueError, KeyError, TypeError) as exc:
        raise FleetError(f"{source}: nodes: {exc}") from exc
    return tuple(nodes), devices


def _seconds(value: Any, where: str) -> float:
    try:
        return tr.parse_span(str(value))
    except ValueError as exc:
        raise FleetError(f"{where}: {exc}") from None


def _settings(raw: dict[str, Any], source: str) -> Settings:
    known = {"startup", "startupByClass", "scrapeInterval", "kvTransferLatency", "sampleInterval", "drainTimeout"}
    extra = sorted(set(raw) - known)
    if extra:
        raise FleetError(
            f"{source}: simulation: unknown field(s) {', '.join(extra)} (known: {', '.join(sorted(known))})"
        )
    s = Settings()
    by_class = {
        k: _seconds(v, f"{source}: simulation.startupByClass.{k}") for k, v in (raw.get("startupByClass") or {}).items()
    }
    return Settings(
        startup_s=_seconds(raw["startup"], f"{source}: simulation.startup") if "startup" in raw else s.startup_s,
        startup_s_by_class=by_class,
        scrape_interval_s=_seconds(raw["scrapeInterval"], f"{source}: simulation.scrapeInterval")
        if "scrapeInterval" in raw
        else s.scrape_interval_s,
        kv_transfer_latency_s=_seconds(raw["kvTransferLatency"], f"{source}: simulation.kvTransferLatency")
        if "kvTransferLatency" in raw
        else s.kv_transfer_latency_s,
        sample_interval_s=_seconds(raw["sampleInterval"], f"{source}: simulation.sampleInterval")
        if "sampleInterval" in raw
        else s.sample_interval_s,
        drain_timeout_s=_seconds(raw["drainTimeout"], f"{source}: simulation.drainTimeout")
        if "drainTimeout" in raw
        else s.drain_timeout_s,
    )


def _trace(raw: dict[str, Any], source: str) -> TraceDefaults:
    known = {"preset", "meanRatePerSecond", "duration", "startHour"}
    extra = sorted(set(raw) - known)
    if extra:
        raise FleetError(f"{source}: trace: unknown field(s) {', '.join(extra)} (known: {', '.join(sorted(known))})")
    d = TraceDefaults()
    rate = raw.get("meanRatePerSecond", d.mean_rate)
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise FleetError(f"{source}: trace.meanRatePerSecond must be a number > 0, got {rate!r}")
    preset = raw.get("preset", d.preset)
    if preset not in tr.PRESETS:
        raise FleetError(f"{source}: trace.preset {preset!r} is not one of {', '.join(tr.PRESETS)}")
    start = raw.get("startHour", 0.0)
    if not isinstance(start, (int, float)) or not 0 <= start < 24:
        raise FleetError(f"{source}: trace.startHour must be in [0, 24), got {start!r}")
    return TraceDefaults(
        preset,
        float(rate),
        _seconds(raw["duration"], f"{source}: trace.duration") if "duration" in raw else d.duration_s,
        float(start),
    )


def merge(base: Any, patch: Any) -> Any:
    """`patch` over `base`: mappings merge key by key, anything else (lists included) replaces; null deletes."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(base.get(k), v)
        return out
    return copy.deepcopy(patch)


def _deployment(obj: dict[str, Any], where: str, classes: Mapping[str, AcceleratorClassSpec]) -> InferenceDeployment:
    full = {"apiVersion": "pdfleet.io/v1alpha1", "kind": "InferenceDeployment", **obj}
    full.setdefault("metadata", {}).setdefault("namespace", "default")
    _check_object(full, where)
    dep = InferenceDeployment.model_validate(full)
    if dep.spec.model.architecture is None:
        raise FleetError(f"{where}: spec.model.architecture is required to simulate a model")
    for role, rs in dep.spec.roles().items():
        for cname in rs.accelerator_classes:
            if cname not in classes:
                raise FleetError(f"{where}: spec.{role}.acceleratorClasses lists unknown class {cname!r}")
    # NOTE: only what the runtimes can run is simulated: a class with count > 1 is one tensor-parallel
    # replica for vLLM and refused for the pdfleet worker, prefill and decode run one engine, and so on
    # (`decide.runtimes`, the operator's own check). Before this, the example's decode ran on
    # `count: 2` domestic classes that the pdfleet worker (no tensor parallelism) cannot serve.
    problems = runtimes.check(dep.spec, classes)
    if problems:
        raise FleetError("\n".join(f"{where}: {p}" for p in problems))
    return dep


def _policies(doc: dict[str, Any], classes: Mapping[str, AcceleratorClassSpec], source: str) -> dict[str, Policy]:
    base = doc.get("deployment")
    if not isinstance(base, dict) or "spec" not in base:
        raise FleetError(f"{source}: deployment: the base InferenceDeployment (metadata + spec) is required")
    raw = doc.get("policies")
    if not isinstance(raw, list) or not raw:
        raise FleetError(f"{source}: policies: a non-empty list of {{name, description, spec | deployments}}")
    out: dict[str, Policy] = {}
    for i, p in enumerate(raw):
        where = f"{source}: policies[{i}]"
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            raise FleetError(f"{where}: needs a name")
        if p["name"] in out:
            raise FleetError(f"{where}: policy {p['name']!r} defined twice")
        out[p["name"]] = _policy(p, base, classes, where)
    return out


def _policy(
    p: dict[str, Any], base: dict[str, Any], classes: Mapping[str, AcceleratorClassSpec], where: str, variant: str = ""
) -> Policy:
    """One policy: the base deployment with the policy's spec (or each tier's) merged over it."""
    extra = sorted(set(p) - {"name", "description", "spec", "deployments", "autoscalerPolicy"})
    if extra:
        raise FleetError(f"{where}: unknown field(s) {', '.join(extra)}")
    if "spec" in p and "deployments" in p:
        raise FleetError(f"{where}: give spec (one deployment) or deployments (traffic tiers), not both")
    how = p.get("autoscalerPolicy", "pdfleet")
    if how not in AUTOSCALER_POLICIES:
        raise FleetError(f"{where}.autoscalerPolicy: {how!r} is not one of {', '.join(AUTOSCALER_POLICIES)}")
    tiers = p.get("deployments") or [{"share": 1.0, "spec": p.get("spec") or {}}]
    deps: list[DeploymentPlan] = []
    targets = _routing_targets(tiers, base)
    names = [
        (t.get("name") if isinstance(t, dict) else None) or (base.get("metadata") or {}).get("name") for t in tiers
    ]
    for target in sorted(targets - set(names)):
        raise FleetError(
            f"{where}: spec.routing.target: {target!r} is not a deployment of this policy "
            f"({', '.join(str(n) for n in names)})"
        )
    for j, tier in enumerate(tiers):
        twhere = f"{where}.deployments[{j}]" if "deployments" in p else where
        if not isinstance(tier, dict):
            raise FleetError(f"{twhere}: expected {{name, share, spec}}")
        meta = merge(base.get("metadata") or {}, {"name": tier["name"]} if tier.get("name") else {})
        if meta.get("name") in targets:
            # a routing target gets what its router sends it, no share of the trace of its own
            if "share" in tier:
                raise FleetError(
                    f"{twhere}.share: {meta['name']!r} is a spec.routing.target: it serves the "
                    "requests routed to it, not a share of the trace"
                )
            share = 0.0
        else:
            share = tier.get("share", 1.0 if len(tiers) - len(targets) == 1 else None)
            if not isinstance(share, (int, float)) or share <= 0:
                raise FleetError(f"{twhere}.share: the fraction of requests this deployment serves, > 0")
        obj = {"metadata": meta, "spec": merge(base["spec"], tier.get("spec") or {})}
        dep = _deployment(obj, twhere, classes)
        deps.append(DeploymentPlan(dep.name, dep.metadata.namespace or "default", dep.spec, float(share)))
    total = sum(d.share for d in deps)
    if abs(total - 1.0) > 1e-6:
        raise FleetError(f"{where}: deployment shares sum to {total:g}, not 1")
    if len({d.name for d in deps}) != len(deps):
        raise FleetError(f"{where}: deployment names must differ")
    for j, d in enumerate(deps):
        _check_routing(d, deps, f"{where}.deployments[{j}]" if "deployments" in p else where)
    return Policy(p["name"], str(p.get("description", "")).strip(), tuple(deps), AUTOSCALER_POLICIES[how], variant)


def _routing_targets(tiers: Any, base: dict[str, Any]) -> set[str]:
    """Names of the deployments a policy's deployments route to (spec.routing.target, base spec merged)."""
    out = set()
    for tier in tiers if isinstance(tiers, list) else ():
        spec = merge(base.get("spec") or {}, tier.get("spec") or {}) if isinstance(tier, dict) else {}
        target = (spec.get("routing") or {}).get("target") if isinstance(spec, dict) else None
        if isinstance(target, str):
            out.add(target)
    return out


def _check_routing(d: DeploymentPlan, deps: list[DeploymentPlan], where: str) -> None:
    """What the simulator can route: length rules to a deployment of the same policy, no routing twice."""
    routing = d.spec.routing
    if routing is None:
        return
    names = {x.name: x for x in deps}
    if routing.target not in names:
        raise FleetError(
            f"{where}: spec.routing.target: {routing.target!r} is not a deployment of this policy "
            f"({', '.join(sorted(names))})"
        )
    if names[routing.target].spec.routing is not None:
        raise FleetError(
            f"{where}: spec.routing.target: {routing.target!r} routes further; the router sends a "
            "routed request on no further, so the simulator does not either"
        )
    rules = routing.rules
    # NOTE: a trace has token counts, not text: what reads text (characters, patterns, a classifier) is refused,
    # not ignored, since ignoring it would route more requests than the real router does.
    for name, set_ in (
        ("rules.maxPromptChars", rules.max_prompt_chars is not None),
        ("rules.patterns", bool(rules.patterns)),
        ("rules.excludePatterns", bool(rules.exclude_patterns)),
        ("classifier", routing.classifier is not None),
    ):
        if set_:
            raise FleetError(
                f"{where}: spec.routing.{name}: the simulator's requests are token counts, not text; "
                "simulate with rules.maxPromptTokens and rules.maxTokens"
            )


def _equal_slo(
    doc: dict[str, Any], policies: Mapping[str, Policy], classes: Mapping[str, AcceleratorClassSpec], source: str
) -> EqualSlo | None:
    """`equalSlo: {target: POLICY, sweep: {POLICY: [{name, spec}, ...]}, search: {POLICY: [...]}}`: each
    variant's spec is merged over its policy's (over the base deployment's), validated like a policy;
    a search's variants are ordered from least to most headroom."""
    raw = doc.get("equalSlo")
    if raw is None:
        return None
    where = f"{source}: equalSlo"
    if not isinstance(raw, dict) or set(raw) - {"target", "sweep", "search"} or "target" not in raw:
        raise FleetError(
            f"{where}: expected {{target: POLICY, sweep: {{POLICY: [{{name, spec}}, ...]}}, "
            f"search: {{POLICY: [{{name, spec}}, ...]}}}}"
        )
    if raw["target"] not in policies:
        raise FleetError(f"{where}.target: {raw['target']!r} is not a policy of this fleet")
    variants = {
        kind: _variants(doc, raw.get(kind), policies, classes, f"{where}.{kind}") for kind in ("sweep", "search")
    }
    for name in sorted(set(variants["sweep"]) & set(variants["search"])):
        names = {v.variant for v in variants["sweep"][name]} & {v.variant for v in variants["search"][name]}
        if names:
            raise FleetError(f"{where}: {name}: variant(s) {', '.join(sorted(names))} both in sweep and search")
    return EqualSlo(raw["target"], variants["sweep"], variants["search"])


def _variants(
    doc: dict[str, Any],
    raw: Any,
    policies: Mapping[str, Policy],
    classes: Mapping[str, AcceleratorClassSpec],
    where: str,
) -> dict[str, tuple[Policy, ...]]:
    """`{POLICY: [{name, spec}, ...]}`: each variant as a Policy (its spec over the policy's)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise FleetError(f"{where}: expected {{POLICY: [{{name, spec}}, ...]}}")
    raw_policies = {p["name"]: p for p in doc["policies"]}
    out: dict[str, tuple[Policy, ...]] = {}
    for name, items in raw.items():
        if name not in policies:
            raise FleetError(f"{where}: {name!r} is not a policy of this fleet")
        if not isinstance(items, list) or not items:
            raise FleetError(f"{where}.{name}: a non-empty list of {{name, spec}}")
        orig = raw_policies[name]
        if "deployments" in orig:
            raise FleetError(f"{where}.{name}: a policy of traffic tiers cannot be swept")
        made = []
        for j, item in enumerate(items):
            vwhere = f"{where}.{name}[{j}]"
            if not isinstance(item, dict) or set(item) - {"name", "spec"} or not isinstance(item.get("name"), str):
                raise FleetError(f"{vwhere}: expected {{name, spec}}")
            patched = {**orig, "spec": merge(orig.get("spec") or {}, item.get("spec") or {})}
            made.append(_policy(patched, doc["deployment"], classes, vwhere, variant=item["name"]))
        if len({v.variant for v in made}) != len(made):
            raise FleetError(f"{where}.{name}: variant names must differ")
        out[name] = tuple(made)
    return out


def validate_document(doc: Any, source: str, base_dir: Path) -> list[str]:
    """Problems of a SimulatedFleet document for `pdfleet validate` (empty when it simulates)."""
    try:
        parse(doc, source=source, base_dir=base_dir)
    except FleetError as exc:
        return str(exc).splitlines()
    return []

"""The chart under test: rendering with Helm's own engine, the value sets the tests use, and validation of every object.

Built-in kinds go through `kubernetes-validate` (strict, Kubernetes 1.30 and 1.37); pdfleet.io objects through
`pdfleet_operator.api.admission.validate` against the generated CRDs (schema and CEL, as the API server
would); monitoring.coreos.com objects through the small schemas in this file, written by hand from
the prometheus-operator API reference (monitoring.coreos.com/v1: ServiceMonitorSpec, PodMonitorSpec,
Endpoint, PodMetricsEndpoint, RelabelConfig, PrometheusRuleSpec, RuleGroup, Rule) for the fields a
chart may set — they are not the upstream CRDs, which cannot be downloaded here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import yaml

from pdfleet_operator.api import admission, schema
from tests.kube.cluster import standard_nodes

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "pdfleet"
RELEASE = "pdfleet"
NAMESPACE = "pdfleet-system"
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the chart's kubeVersion floor and the newest schemas kubernetes-validate has

# The value sets every rendering test runs over (besides the defaults).
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "cluster-wide": {
        "operator": {
            "watchNamespaces": [],
            "resyncInterval": 60,
            "verbose": True,
            "metricsProfile": "vllm",
            "prometheusUrl": "http://kube-prometheus-stack-prometheus.monitoring.svc:9090",
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
        },
        "image": {"repository": "registry.example.com/pdfleet/pdfleet-operator", "digest": "sha256:" + "ab" * 32},
        "serviceAccount": {"name": "pdfleet-controller", "annotations": {"iam.example.com/role": "pdfleet"}},
        "monitoring": {
            "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
            "podMonitor": {"labels": {"release": "kube-prometheus-stack"}, "interval": "5s"},
            "prometheusRule": {"labels": {"release": "kube-prometheus-stack"}},
        },
        "dashboards": {"namespace": "monitoring", "folder": "Inference"},
    },
    "monitoring-off": {
        "monitoring": {"enabled": False},
        "dashboards": {"enabled": False},
        "operator": {"autoscaler": False, "alertmanagerPort": 0, "analysisInterval": 0},
    },
    "custom-classes": {
        "acceleratorClasses": {
            "includeDefaults": False,
            "classes": {
                "h20-96gb": {
                    "vendor": "nvidia",
                    "model": "H20 96GB",
                    "resourceName": "nvidia.com/gpu",
                    "memoryGiB": 96,
                    "peakTflops": 148,
                    "memoryBandwidthGBps": 4000,
                    "costPerHour": 1.35,
                    "costSource": "our contract",
                    "costAsOf": "2026-01-15",
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H20"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                },
                "ascend-910c": {
                    "vendor": "huawei",
                    "model": "Ascend 910C",
                    "resourceName": "huawei.com/Ascend910",
                    "count": 2,
                    "memoryGiB": 64,
                    "peakTflops": 400,
                    "memoryBandwidthGBps": 1600,
                    "costPerHour": 1.1,
                    "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/Ascend/driver/lib64"}],
                    "volumes": [{"name": "driver", "hostPath": {"path": "/usr/local/Ascend/driver/lib64"}}],
                    "volumeMounts": [{"name": "driver", "mountPath": "/usr/local/Ascend/driver/lib64"}],
                },
                "cpu": {
                    "vendor": "cpu",
                    "resourceName": "cpu",
                    "count": 4,
                    "memoryGiB": 16,
                    "peakTflops": 1,
                    "memoryBandwidthGBps": 40,
                    "costPerHour": 0.05,
                },
            },
        }
    },
    "bring-your-own": {
        "crds": {"install": False},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "platform-pdfleet"},
        "acceleratorClasses": {"create": False},
    },
    # What e2e/run.sh installs on kind (NOTE: not named "e2e": a test id is a keyword, and that one is opt-in).
    "kind": yaml.safe_load((ROOT / "e2e" / "values.yaml").read_text()),
}


def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render(
    values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE, loaded: helm_python.Chart | None = None
) -> list[dict[str, Any]]:
    """Every object `helm template` would print for these values (NOTES.txt left out)."""
    manifests = (loaded or chart()).render(values or {}, name=RELEASE, namespace=namespace)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def notes(values: dict[str, Any] | None = None) -> str:
    manifests = chart().render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def the(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def _renamed(node: dict[str, Any], name: str) -> dict[str, Any]:
    node["metadata"]["name"] = name
    node["metadata"]["labels"]["kubernetes.io/hostname"] = name
    return node


def install(kube: Any, values: dict[str, Any], namespaces: list[str]) -> helm_python.Config:
    """Namespaces, the monitoring CRDs and a fleet of Nodes into the emulator, then `helm install` of the chart."""
    for ns in namespaces:
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kube.apply(monitoring_crds())  # as if the Prometheus Operator were installed
    # One fleet of Nodes per namespace the tests fill (and one for `default`): capacity is shared by every
    # namespace, so each namespace's examples need their own room to all become Ready.
    for i in range(len(namespaces) + 1):
        kube.apply(
            standard_nodes() if i == 0 else [_renamed(n, f"{n['metadata']['name']}-{i}") for n in standard_nodes()]
        )
    config = helm_python.Config(kubeconfig_path=kube.kubeconfig, namespace=NAMESPACE, storage_driver="memory")
    release = config.install(CHART, RELEASE, values, namespace=NAMESPACE, create_namespace=True, timeout=60)
    assert release["status"] == "deployed", release
    return config


# --- monitoring.coreos.com/v1, as documented -------------------------------------------------------------

_DURATION = {
    "type": "string",
    "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_NAME = {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
_RELABEL_ACTIONS = [
    "replace",
    "keep",
    "drop",
    "hashmod",
    "labelmap",
    "labeldrop",
    "labelkeep",
    "lowercase",
    "uppercase",
    "keepequal",
    "dropequal",
]
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": _LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 0},
        "replacement": {"type": "string"},
        "action": {"enum": _RELABEL_ACTIONS + [a.capitalize() for a in _RELABEL_ACTIONS]},
    },
}
_ENDPOINT_COMMON = {
    "path": {"type": "string"},
    "scheme": {"enum": ["http", "https"]},
    "interval": _DURATION,
    "scrapeTimeout": _DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
    "relabelings": {"type": "array", "items": _RELABEL},
    "metricRelabelings": {"type": "array", "items": _RELABEL},
}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}


def _kind(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": spec,
        },
    }


MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _kind(
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            **_ENDPOINT_COMMON,
                        },
                    },
                },
            },
        },
    ),
    "PodMonitor": _kind(
        "PodMonitor",
        {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _NAMESPACE_SELECTOR,
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"port": {"type": "string"}, **_ENDPOINT_COMMON},
                    },
                },
            },
        },
    ),
    "PrometheusRule": _kind(
        "PrometheusRule",
        {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                                    "properties": {
                                        "record": {"type": "string"},
                                        "alert": {"type": "string"},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": _DURATION,
                                        "keep_firing_for": _DURATION,
                                        "labels": _STRING_MAP,
                                        "annotations": _STRING_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    ),
}
MONITORING_PLURALS = {
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
}


def monitoring_crds() -> list[dict[str, Any]]:
    """CRDs that make the emulator serve the three monitoring kinds (it stores them as sent; the tests
    validate them with MONITORING_SCHEMAS)."""
    out = []
    for kind, plural in MONITORING_PLURALS.items():
        out.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.monitoring.coreos.com"},
                "spec": {
                    "group": "monitoring.coreos.com",
                    "scope": "Namespaced",
                    "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {
                                        "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                                    },
                                }
                            },
                        }
                    ],
                },
            }
        )
    return out


# --- validation ----------------------------------------------------------------------------------------------

_PDFLEET_CRDS = schema.load_crds(ROOT / "crds")


def validate(obj: dict[str, Any]) -> list[str]:
    """Problems of one rendered object (empty when valid), by the rules the API server would apply."""
    group = obj["apiVersion"].rpartition("/")[0]
    if group == "pdfleet.io":
        return [str(e) for e in admission.validate(_PDFLEET_CRDS[obj["kind"]], copy.deepcopy(obj))]
    if group == "monitoring.coreos.com":
        validator = jsonschema.Draft7Validator(MONITORING_SCHEMAS[obj["kind"]])
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    problems = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{version}: {'.'.join(map(str, exc.path))}: {exc.message}")
    return problems

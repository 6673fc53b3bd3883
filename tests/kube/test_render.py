"""Rendered children: valid for Kubernetes 1.30 (strict), named deterministically, labelled, secured, owned."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from pdfleet_operator import api, engine_args
from pdfleet_operator.api import names
from pdfleet_operator.decide import inventory, pd_threshold, placement
from pdfleet_operator.decide.placement import FleetPlan, PlannedPool
from pdfleet_operator.kube import render
from tests.kube.cluster import classes, example_deployments, spec_of, standard_nodes

CLASSES = classes()
EXAMPLES = example_deployments()
OWNER = render.Owner("llama31-8b", "default", "0f6c2a9e-1111-2222-3333-444455556666")

# Hand-checked against prometheus-operator v0.75 CRDs: the fields render() uses, nothing else allowed.
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "targetLabel": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop", "labelmap"]},
    },
}
_META = {"type": "object", "required": ["name", "namespace", "ownerReferences"]}
MONITORING_SCHEMAS = {
    "PodMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PodMonitor"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"]},
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {
                                    "type": "string",
                                    "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                                },
                                "relabelings": {"type": "array", "items": _RELABEL},
                            },
                        },
                    },
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["expr"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "record": {"type": "string"},
                                            "alert": {"type": "string"},
                                            "expr": {"type": "string"},
                                            "for": {"type": "string"},
                                            "labels": {"type": "object"},
                                            "annotations": {"type": "object"},
                                        },
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
    },
}


def validate(obj: dict) -> None:
    if obj["kind"] in render.MONITORING_KINDS:
        jsonschema.validate(obj, MONITORING_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def rendered(
    name: str, *, desired: dict[str, int] | None = None, monitoring: bool = True, owner_name: str | None = None
) -> list[dict]:
    spec = spec_of(EXAMPLES[name])
    plan = placement.plan(spec, CLASSES, inventory.build(standard_nodes(), []), desired)
    owner = render.Owner(owner_name or name, "team-a", "uid-" + name)
    return render.render(owner, spec, plan, CLASSES, revision=3, monitoring=monitoring)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_object_is_valid_and_owned(name: str) -> None:
    objs = rendered(name)
    for obj in objs:
        validate(obj)
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert len(meta["name"]) <= 63
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pdfleet.io/v1alpha1",
                "kind": "InferenceDeployment",
                "name": name,
                "uid": "uid-" + name,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdfleet-operator"
        assert meta["labels"]["pdfleet.io/deployment"] == name
    kinds = sorted(o["kind"] for o in objs)
    roles = len(spec_of(EXAMPLES[name]).roles())
    assert kinds.count("Service") == roles + 1
    assert kinds.count("PodDisruptionBudget") == roles + 1  # one per role and the router's
    assert kinds.count("ConfigMap") == 1 and kinds.count("PodMonitor") == 1 and kinds.count("PrometheusRule") == 1


def test_validation_is_strict() -> None:
    bad = rendered("qwen2-7b")[-3]  # a Deployment
    assert bad["kind"] == "Deployment"
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    pm = rendered("qwen2-7b")[-2]
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(pm)


def test_worker_pod_for_a_domestic_class() -> None:
    objs = rendered("chat-cost")
    dep = next(o for o in objs if o["metadata"]["name"] == "chat-cost-prefill-ascend-910b")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"]["matchLabels"] == {
        "pdfleet.io/deployment": "chat-cost",
        "pdfleet.io/role": "prefill",
        "pdfleet.io/accelerator": "ascend-910b",
    }
    tmpl = dep["spec"]["template"]
    assert tmpl["metadata"]["labels"]["pdfleet.io/revision"] == "3"
    assert tmpl["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    pod = tmpl["spec"]
    assert pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert "tolerations" not in pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    # The device the worker must compute on (it exits when it lacks it) and its class, from the class.
    assert c["args"] == [
        "worker",
        "--model",
        "/models/Qwen2-7B-Instruct",
        "--role",
        "prefill",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--engine-config",
        "/etc/pdfleet/engine.json",
        "--heartbeat-interval",
        "10s",
        "--drain-timeout",
        "600s",
        "--auth-token-file",
        "/var/run/pdfleet/auth/token",
        "--kv-port",
        "8001",
        "--device",
        "npu",
        "--accelerator",
        "ascend-910b",
        "--num-threads",
        "auto",
    ]
    assert {"name": "kv", "containerPort": 8001, "protocol": "TCP"} in c["ports"]  # named in the NetworkPolicy
    assert c["image"] == "ghcr.io/pdfleet/pdfleet-worker:0.1.0-npu", "the image of the class's platform"
    # Host memory: 7.6B bf16 weights (14.2 GiB) + 4 GiB overhead; 2 cores per card; no CPU limit.
    assert c["resources"] == {
        "requests": {"cpu": "2", "huawei.com/Ascend910": "1", "memory": "19Gi"},
        "limits": {"huawei.com/Ascend910": "1", "memory": "38Gi"},
    }
    # The device plugin sets the visible devices; the driver's userland comes from the class, read-only; HCCL binds
    # the pod's IP; the threads come from the pod's CPU request.
    assert not any(e["name"].endswith("_VISIBLE_DEVICES") for e in c["env"])
    env = {e["name"]: e for e in c["env"]}
    assert env["HCCL_IF_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["PDFLEET_CPU_REQUEST"]["valueFrom"] == {
        "resourceFieldRef": {"containerName": "worker", "resource": "requests.cpu", "divisor": "1m"}
    }
    assert {"name": "class-driver-lib64", "mountPath": "/usr/local/Ascend/driver/lib64", "readOnly": True} in c[
        "volumeMounts"
    ]
    assert {
        "name": "class-driver-version",
        "hostPath": {"path": "/usr/local/Ascend/driver/version.info", "type": "File"},
    } in pod["volumes"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # The drain lets the longest request finish: 8,192 tokens at the 80 ms ITL target is 655 s, capped at 600 s;
    # 25 s more to shut down.
    assert pod["terminationGracePeriodSeconds"] == 625
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}


def test_mig_pool_requests_the_slice_and_tolerates_gpu_taint() -> None:
    objs = rendered("llama31-8b")
    dep = next(o for o in objs if o["metadata"]["name"] == "llama31-8b-decode-h100-mig-3g-40gb")
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"memory": "38Gi", "nvidia.com/mig-3g.40gb": "1"}
    assert pod["containers"][0]["args"][-6:] == [
        "--device",
        "cuda",
        "--accelerator",
        "h100-mig-3g-40gb",
        "--num-threads",
        "auto",
    ]
    assert pod["containers"][0]["image"] == "ghcr.io/pdfleet/pdfleet-worker:0.1.0-cuda"
    assert pod["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/mig.strategy": "mixed",
    }
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert dep["spec"]["replicas"] == 2


def test_router_services_and_config() -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in rendered("llama31-8b")}
    router = objs[("Deployment", "llama31-8b-router")]
    assert router["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "router",
        "--prefill",
        "http://llama31-8b-prefill.team-a.svc:8000",
        "--decode",
        "http://llama31-8b-decode.team-a.svc:8000",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--auth-token-file",
        "/var/run/pdfleet/auth/token",
        "--api-key-file",
        "/var/run/pdfleet/api-keys/api-keys",
        "--api-key-file-optional",
        "--drain-accept",
        "5",
        "--heartbeat-interval",
        "10",
        "--drain-timeout",
        "600",
        "--pd-min-prompt-tokens",  # the cost model's, for the H100 prefill and MIG decode classes
        str(pd_threshold.threshold(spec_of(example_deployments()["llama31-8b"]), classes())),
    ]
    assert 0 < pd_threshold.threshold(spec_of(example_deployments()["llama31-8b"]), classes()) < 100
    assert objs[("Service", "llama31-8b-prefill")]["spec"]["clusterIP"] == "None"
    assert objs[("Service", "llama31-8b")]["spec"]["ports"][0]["port"] == 80
    # One voluntary disruption at a time, never below the role's minimum (2 decode replicas, minReplicas 2).
    assert objs[("PodDisruptionBudget", "llama31-8b-decode")]["spec"]["minAvailable"] == 2
    assert objs[("PodDisruptionBudget", "llama31-8b-router")]["spec"]["minAvailable"] == 1
    spread = router["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname" and router["spec"]["replicas"] == 2
    assert router["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "1",
        "memory": "512Mi",
    }
    config = json.loads(objs[("ConfigMap", "llama31-8b-engine")]["data"]["engine.json"])
    assert config["max_model_len"] == 16384 and config["max_num_batched_tokens"] == 4096
    assert config["kv_transfer"] == {"timeout_seconds": 5.0, "lease_seconds": 30.0, "on_failure": "recompute"}
    colocated = {(o["kind"], o["metadata"]["name"]): o for o in rendered("qwen2-7b")}
    assert colocated[("Deployment", "qwen2-7b-router")]["spec"]["template"]["spec"]["containers"][0]["args"][:3] == [
        "router",
        "--workers",
        "http://qwen2-7b-colocated.team-a.svc:8000",
    ]
    assert names.endpoint("qwen2-7b", "team-a") == "http://qwen2-7b.team-a.svc:80/v1"


def test_monitoring_only_when_asked() -> None:
    assert not any(o["kind"] in render.MONITORING_KINDS for o in rendered("qwen2-7b", monitoring=False))
    pm = next(o for o in rendered("qwen2-7b") if o["kind"] == "PodMonitor")
    targets = [r["targetLabel"] for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]]
    assert targets == ["pdfleet_deployment", "pdfleet_role", "pdfleet_accelerator", "namespace"]
    assert pm["spec"]["podMetricsEndpoints"][0]["relabelings"][1]["sourceLabels"] == [
        "__meta_kubernetes_pod_label_pdfleet_io_role"
    ]


def test_long_names_are_hashed_deterministically() -> None:
    long = "a" * 40
    name = render.pool_name(long, "colocated", "b" * 63)
    assert len(name) == 63 and name == render.pool_name(long, "colocated", "b" * 63)
    assert name != render.pool_name(long, "colocated", "b" * 62 + "c")
    assert names.child_name("x", "y") == "x-y"
    with pytest.raises(ValueError):
        names.child_name("x", "")
    spec = spec_of(EXAMPLES["qwen2-7b"])
    cls = CLASSES["l40s-48gb"]
    plan = FleetPlan(pools=(PlannedPool("colocated", "l" * 63, 1),), targets={"colocated": 1})
    objs = render.render(render.Owner(long, "ns", "u"), spec, plan, {"l" * 63: cls}, revision=1)
    for obj in objs:
        validate(obj)


def test_template_hash_changes_with_what_pods_run_only() -> None:
    base = EXAMPLES["llama31-8b"]
    h = render.template_hash(spec_of(base))

    def changed(path: list[str], value: object) -> str:
        import copy

        doc = copy.deepcopy(base)
        target = doc["spec"]
        for p in path[:-1]:
            target = target.setdefault(p, {})
        target[path[-1]] = value
        return render.template_hash(spec_of(doc))

    assert changed(["decode", "maxReplicas"], 12) == h
    assert changed(["autoscaling", "interval"], "30s") == h
    assert changed(["rollback", "for"], "5m") == h
    assert changed(["router", "replicas"], 3) == h
    assert changed(["tier"], "latency") == h, "a tier change restarts no pod (it may re-plan classes, which does)"
    from pdfleet_operator.decide import rollback

    assert h == rollback.fingerprint(rollback.template_spec(spec_of(base))), "one identity: pods, revisions, rollback"
    assert changed(["engine", "image"], "ghcr.io/pdfleet/pdfleet-worker:0.2.0") != h
    assert changed(["engine", "maxNumSeqs"], 64) != h
    assert changed(["decode", "acceleratorClasses"], ["a100-80gb"]) != h


def test_wrong_calls_raise() -> None:
    spec = spec_of(EXAMPLES["qwen2-7b"])
    with pytest.raises(ValueError, match="revision must be >= 1"):
        render.render(OWNER, spec, FleetPlan(pools=()), CLASSES, revision=0)
    with pytest.raises(ValueError, match="plan has a prefill pool"):
        render.render(OWNER, spec, FleetPlan(pools=(PlannedPool("prefill", "l40s-48gb", 1),)), CLASSES, revision=1)
    with pytest.raises(ValueError, match="not among"):
        render.render(OWNER, spec, FleetPlan(pools=(PlannedPool("colocated", "nope", 1),)), CLASSES, revision=1)


# Every module of api/ and decide/, and the pure parts of the backends.
_PKG = Path(__file__).resolve().parents[2] / "operator" / "pdfleet_operator"
PURE = tuple(
    sorted(f"{pkg}.{p.stem}" for pkg in ("api", "decide") for p in (_PKG / pkg).glob("*.py") if p.stem != "__init__")
) + ("kube.render", "engine_args")


def test_decision_modules_import_no_kopf_kubernetes_or_http() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        + "".join(f"import pdfleet_operator.{m}\n" for m in PURE)
        + (
            "bad = sorted(m for m in ('kopf', 'kubernetes', 'aiohttp', 'httpx', 'prometheus_client', 'torch') "
            "if m in sys.modules)\n"
        )
        + "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_config_keys_are_the_worker_engine_config_fields() -> None:
    import dataclasses

    config = pytest.importorskip("pdfleet_worker.config")
    fields = {f.name for f in dataclasses.fields(config.EngineConfig)}
    rendered = set(engine_args.engine_config(spec_of(EXAMPLES["llama31-8b"])))
    operator_only = {"served_model_name", "kv_cache_memory_fraction", "kv_transfer"}  # the worker reads these itself
    assert rendered - operator_only <= fields, sorted(rendered - operator_only - fields)


def test_worker_and_router_flags_parse_with_the_worker_cli() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="pdfleet")
    sub = parser.add_subparsers(dest="command")
    from pdfleet_worker import cli

    cli.register(sub)
    assert {"worker", "router"} <= set(sub.choices)
    spec = spec_of(EXAMPLES["llama31-8b"])
    parser.parse_args(render.worker_args(spec, "prefill"))
    parser.parse_args(render.worker_args(spec_of(EXAMPLES["qwen2-7b"]), "colocated"))
    parser.parse_args(render.router_args(OWNER, ["prefill", "decode"]))
    parser.parse_args(render.router_args(OWNER, ["colocated"]))


def test_the_worker_reads_the_rendered_engine_config(tmp_path) -> None:
    from pdfleet_worker.server import worker_config

    path = tmp_path / "engine.json"
    path.write_text(engine_args.config_text(spec_of(EXAMPLES["llama31-8b"])))
    loaded = worker_config.load_engine_file(str(path))
    assert loaded["served_model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert loaded["max_num_batched_tokens"] == 4096


def _admits(
    policy: dict,
    pod_labels: dict,
    namespace: str,
    port: int,
    source_labels: dict,
    source_ns: str,
    policy_ns: str = "team-a",
) -> bool:
    """Whether a NetworkPolicy (ingress) lets a pod (source_labels in source_ns) reach port on a pod (pod_labels in
    namespace), by the NetworkPolicy rules for what this operator renders (matchLabels, In, ipBlock-free peers)."""

    def matches(sel: dict, labels: dict) -> bool:
        if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
            return False
        return all(
            labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions") or [] if e["operator"] == "In"
        )

    spec = policy["spec"]
    if namespace != policy_ns or not matches(spec["podSelector"], pod_labels):
        return True  # not selected: this policy says nothing about the pod
    for rule in spec["ingress"]:
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            ns_ok = (
                (source_ns == policy_ns)
                if "namespaceSelector" not in peer
                else matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source_ns})
            )
            pod_ok = "podSelector" not in peer or matches(peer["podSelector"], source_labels)
            if "ipBlock" not in peer and ns_ok and pod_ok:
                return True
    return False


def test_workers_accept_only_their_router_peers_and_scrapers() -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in rendered("llama31-8b")}
    workers = objs[("NetworkPolicy", "llama31-8b-workers")]
    router_policy = objs[("NetworkPolicy", "llama31-8b-router")]
    prefill = objs[("Deployment", "llama31-8b-prefill-h100-80gb")]["spec"]["template"]["metadata"]["labels"]
    router = objs[("Deployment", "llama31-8b-router")]["spec"]["template"]["metadata"]["labels"]
    decode = objs[("Deployment", "llama31-8b-decode-h100-mig-3g-40gb")]["spec"]["template"]["metadata"]["labels"]
    other = {"pdfleet.io/deployment": "someone-else", "pdfleet.io/role": "decode"}
    assert _admits(workers, prefill, "team-a", 8000, router, "team-a")  # router -> prefill
    assert _admits(workers, prefill, "team-a", 8001, decode, "team-a")  # decode pulls KV from prefill
    assert _admits(workers, prefill, "team-a", 8000, {"app": "prometheus"}, "monitoring")  # scrape
    assert not _admits(workers, prefill, "team-a", 8001, {"app": "prometheus"}, "monitoring")  # not the KV port
    # The attacks: another deployment's pod or any pod of another namespace pulling KV or calling a worker.
    assert not _admits(workers, prefill, "team-a", 8001, other, "team-a")
    assert not _admits(workers, decode, "team-a", 8000, {"pdfleet.io/deployment": "llama31-8b"}, "team-b")
    assert not _admits(workers, decode, "team-a", 8000, {}, "team-a")
    # The router is open to every source by default, and to the listed ones only when spec.router.allowFrom says.
    assert _admits(router_policy, router, "team-a", 8000, {}, "anywhere")
    spec = spec_of(EXAMPLES["llama31-8b"])
    spec = spec.model_copy(
        update={
            "router": spec.router.model_copy(
                update={
                    "allow_from": [
                        api.NetworkPeer(namespace="gateway", pod_labels={"app": "envoy"}),
                        api.NetworkPeer(cidr="10.0.0.0/8"),
                    ]
                }
            )
        }
    )
    plan = placement.plan(spec, CLASSES, inventory.build(standard_nodes(), []))
    objs = {
        (o["kind"], o["metadata"]["name"]): o
        for o in render.render(render.Owner("llama31-8b", "team-a", "u"), spec, plan, CLASSES, revision=1)
    }
    limited = objs[("NetworkPolicy", "llama31-8b-router")]
    assert _admits(limited, router, "team-a", 8000, {"app": "envoy"}, "gateway")
    assert not _admits(limited, router, "team-a", 8000, {"app": "curl"}, "gateway")
    assert not _admits(limited, router, "team-a", 8000, {}, "team-a")
    assert {"ipBlock": {"cidr": "10.0.0.0/8"}} in limited["spec"]["ingress"][0]["from"]
    # Prometheus keeps scraping the router (rollback analysis reads its answers' status codes): HEAD's allowFrom
    # shut the scraper namespaces out with everyone else.
    assert _admits(limited, router, "team-a", 8000, {"app": "prometheus"}, "monitoring")
    assert not _admits(limited, router, "team-a", 8000, {"app": "prometheus"}, "elsewhere")


def test_vllm_kv_connectors_get_the_ports_they_need_between_the_deployments_pods_only() -> None:
    """NIXL's side channel (5600) and UCX's run-time ports: every port, from this deployment's own pods only.
    HEAD opened 8000, 8001 and 5600 alone (UCX over TCP and Mooncake's transfer engine were cut off)."""
    spec = spec_of(EXAMPLES["llama31-8b"])
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"runtime": "vllm"})}, deep=True)
    plan = placement.plan(spec, CLASSES, inventory.build(standard_nodes(), []))
    objs = {
        (o["kind"], o["metadata"]["name"]): o
        for o in render.render(render.Owner("llama31-8b", "team-a", "u"), spec, plan, CLASSES, revision=1)
    }
    workers = objs[("NetworkPolicy", "llama31-8b-workers")]
    prefill = objs[("Deployment", "llama31-8b-prefill-h100-80gb")]["spec"]["template"]["metadata"]["labels"]
    decode = objs[("Deployment", "llama31-8b-decode-h100-mig-3g-40gb")]["spec"]["template"]["metadata"]["labels"]
    for port in (5600, 41234, 18000):
        assert _admits(workers, prefill, "team-a", port, decode, "team-a"), port
        assert not _admits(workers, prefill, "team-a", port, {"pdfleet.io/deployment": "x"}, "team-a"), port
        assert not _admits(workers, prefill, "team-a", port, {"app": "prometheus"}, "monitoring"), port
    # The pdfleet engine moves KV over its own fixed port: only 8000 and 8001 between its pods.
    plain = {(o["kind"], o["metadata"]["name"]): o for o in rendered("llama31-8b")}[
        ("NetworkPolicy", "llama31-8b-workers")
    ]
    assert not _admits(plain, prefill, "team-a", 5600, decode, "team-a")


def test_pools_with_room_roll_without_shrinking_and_the_others_one_pod_at_a_time() -> None:
    from pdfleet_operator.decide import inventory, placement
    from tests.kube.cluster import node

    spec = spec_of(EXAMPLES["llama31-8b"])
    free = inventory.build([node("g1", "h100", 8), node("m1", "h100-mig", 2)], [])
    plan = placement.plan(spec, CLASSES, free)
    objs = render.render(OWNER, spec, plan, CLASSES, revision=1, surge=placement.surge_room(plan, CLASSES, free))
    strategy = {
        o["metadata"]["name"]: o["spec"]["strategy"]["rollingUpdate"]
        for o in objs
        if o["kind"] == "Deployment" and o["metadata"]["labels"].get(render.LABEL_ROLE) in ("prefill", "decode")
    }
    assert strategy == {
        "llama31-8b-prefill-h100-80gb": {"maxSurge": 1, "maxUnavailable": 0},
        "llama31-8b-decode-h100-mig-3g-40gb": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_drains_are_sized_from_the_longest_request_and_pdbs_never_break_a_role_below_its_minimum() -> None:
    from pdfleet_operator import engine_args

    spec = spec_of(EXAMPLES["qwen2-7b"])
    short = spec.model_copy(update={"model": spec.model.model_copy(update={"max_model_len": 1024})})
    assert engine_args.drain_seconds(short) == 81.9  # 1,024 tokens at the 80 ms ITL target (0.1 s steps)
    assert engine_args.grace_seconds(short) == 82 + engine_args.SHUTDOWN_MARGIN_S
    assert engine_args.drain_seconds(spec) == engine_args.DRAIN_CAP_S  # 655 s capped
    tiny = spec.model_copy(update={"model": spec.model.model_copy(update={"max_model_len": 64})})
    assert engine_args.drain_seconds(tiny) == engine_args.DRAIN_FLOOR_S
    # (planned size, minReplicas) -> minAvailable: one at a time, never below the minimum, never the last replica.
    assert [render.pdb_min_available(n, m) for n, m in ((1, 1), (1, 0), (2, 1), (4, 1), (4, 4), (0, 0))] == [
        1,
        1,
        1,
        3,
        4,
        0,
    ]

"""The Helm chart rendered by Helm's engine: every value set valid for Kubernetes 1.30, strict lint, the schema,
generated files current."""

from __future__ import annotations

import argparse
import json
import re

import helm_python
import pytest
import yaml

from pdfleet_operator import __version__
from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.gen import alerts, chart, crds, dashboards
from pdfleet_operator.kube import render
from tests.gen.chart import helm


@pytest.fixture(scope="module")
def loaded() -> helm_python.Chart:
    return helm.chart()


@pytest.fixture(scope="module")
def rendered(loaded) -> dict[str, list[dict]]:
    return {name: helm.render(values, loaded=loaded) for name, values in helm.VALUE_SETS.items()}


def test_generated_files_are_current() -> None:
    assert chart.stale_files() == [], "run `pdfleet chart` (and commit the result)"
    assert dashboards.stale_files() == [], "run `pdfleet dashboards`"


def test_chart_crds_are_the_generated_crds_and_valid() -> None:
    copies = sorted((helm.CHART / "charts" / "crds" / "crds").glob("*.yaml"))
    assert [p.name for p in copies] == sorted(crds.render_all())
    for path in copies:
        assert path.read_text() == (helm.ROOT / "crds" / path.name).read_text()
        crd = yaml.safe_load(path.read_text())
        assert helm.validate(crd) == [], path.name


def test_app_version_is_the_package_version(loaded) -> None:
    assert loaded.metadata["appVersion"] == __version__
    (dep,) = loaded.metadata["dependencies"]
    assert (dep["name"], dep["condition"]) == ("crds", "crds.install")


@pytest.mark.parametrize("name", sorted(helm.VALUE_SETS))
def test_strict_lint_passes(name: str) -> None:
    report = helm_python.lint(
        helm.CHART, helm.VALUE_SETS[name], strict=True, namespace=helm.NAMESPACE, kube_version="v1.30.0"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == [], problems
    assert [m["error"] for m in report["messages"]] in ([], ["icon is recommended"])


@pytest.mark.parametrize("name", sorted(helm.VALUE_SETS))
def test_every_rendered_object_is_valid(name: str, rendered) -> None:
    objects = rendered[name]
    assert objects
    problems = {f"{o['kind']}/{o['metadata']['name']}": helm.validate(o) for o in objects}
    assert {k: v for k, v in problems.items() if v} == {}
    names_seen = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(set(names_seen)) == len(names_seen), "two objects with one name"
    for o in objects:
        assert len(o["metadata"]["name"]) <= 63
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdfleet"


def test_validation_catches_what_the_api_server_would_refuse(rendered) -> None:
    import copy

    objects = rendered["defaults"]
    dep = copy.deepcopy(helm.the(objects, "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    assert any("securityContxt" in p for p in helm.validate(dep))
    pm = copy.deepcopy(helm.the(objects, "PodMonitor"))
    pm["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "rename"
    assert helm.validate(pm)
    rule = copy.deepcopy(helm.the(objects, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "two minutes"
    assert helm.validate(rule)
    cls = copy.deepcopy(next(o for o in objects if o["kind"] == "AcceleratorClass" and o["metadata"]["name"] == "cpu"))
    cls["spec"]["resourceName"] = "nvidia.com/gpu"  # a CEL rule: resourceName 'cpu' goes with vendor 'cpu'
    assert any("resourceName" in p for p in helm.validate(cls))


def test_what_each_value_set_creates(rendered) -> None:
    kinds = {name: sorted({o["kind"] for o in objs}) for name, objs in rendered.items()}
    # (Role: the leader Lease; Secret: the Alertmanager receiver's token; NetworkPolicy: the operator's own)
    everything = [
        "AcceleratorClass",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodMonitor",
        "PrometheusRule",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    policy = ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert kinds["defaults"] == everything
    assert kinds["cluster-wide"] == everything
    assert kinds["namespaced"] == everything
    assert kinds["monitoring-off"] == sorted(
        [
            "AcceleratorClass",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "NetworkPolicy",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
        ]
        + policy
    )
    assert kinds["bring-your-own"] == sorted(
        [
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "PodMonitor",
            "PrometheusRule",
            "Secret",
            "Service",
            "ServiceMonitor",
        ]
        + policy
    )
    classes = {o["metadata"]["name"]: o["spec"] for o in helm.by_kind(rendered["defaults"], "AcceleratorClass")}
    examples = chart._class_defaults()
    assert classes == examples and len(classes) == 11
    custom = {o["metadata"]["name"]: o["spec"] for o in helm.by_kind(rendered["custom-classes"], "AcceleratorClass")}
    assert custom == helm.VALUE_SETS["custom-classes"]["acceleratorClasses"]["classes"]
    assert custom["h20-96gb"]["costPerHour"] == 1.35
    # A class of your own replaces the default of that name entirely; a null default is left out.
    mixed = helm.render(
        {
            "acceleratorClasses": {
                "classes": {"cpu": custom["cpu"]},
                "defaultClasses": {"kunlunxin-r200": None, "h200-141gb": {"costPerHour": 3.1}},
            }
        }
    )
    mixed_classes = {o["metadata"]["name"]: o["spec"] for o in helm.by_kind(mixed, "AcceleratorClass")}
    assert mixed_classes["cpu"] == custom["cpu"] and "kunlunxin-r200" not in mixed_classes
    assert len(mixed_classes) == 10 and mixed_classes["h100-80gb"] == examples["h100-80gb"]
    assert mixed_classes["h200-141gb"] == {**examples["h200-141gb"], "costPerHour": 3.1}  # a price change alone


def test_operator_pod_is_locked_down_and_runs_the_operator_command(rendered) -> None:
    for name, objects in rendered.items():
        dep = helm.the(objects, "Deployment")
        pod = dep["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = container["securityContext"]
        assert sc == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert container["command"] == ["pdfleet"] and container["args"][0] == "operator"
        # Two replicas by default, one acting (the leader Lease's holder); a new pod of a rolling update stands by
        # until the old leader releases the Lease.
        assert dep["spec"]["replicas"] == 2
        assert dep["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
        assert {
            "--leader-elect",
            f"--leader-election-namespace={helm.NAMESPACE}",
            f"--leader-election-name={helm.RELEASE}-operator",
        } <= set(container["args"])
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
        # the leader publishes its receiver (http://POD_IP:port) in the Lease; a standby relays alerts there
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
        # The ports the Dockerfile exposes (9090 metrics, 8080 liveness) are the ones passed as flags.
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert f"--metrics-port={ports['metrics']}" in container["args"]
        assert f"--liveness-port={ports['health']}" in container["args"]
        if "alerts" in ports:
            assert f"--alertmanager-port={ports['alerts']}" in container["args"]
            service = helm.the(objects, "Service")
            assert {"name": "alerts", "port": ports["alerts"], "targetPort": "alerts", "protocol": "TCP"} in service[
                "spec"
            ]["ports"]
        else:
            assert "--alertmanager-port=0" in container["args"] and "--no-autoscaler" in container["args"]
        # Every flag the chart passes is one `pdfleet operator` accepts (parsed by its own parser).
        from pdfleet_operator.kube import operator_cli

        parser = argparse.ArgumentParser()
        operator_cli.register(parser.add_subparsers(dest="command"))
        parser.parse_args(container["args"])
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    byo = helm.the(rendered["bring-your-own"], "Deployment")["spec"]["template"]["spec"]
    assert byo["serviceAccountName"] == "platform-pdfleet"
    cw = helm.the(rendered["cluster-wide"], "Deployment")["spec"]["template"]["spec"]
    assert "--prometheus-url=http://kube-prometheus-stack-prometheus.monitoring.svc:9090" in cw["containers"][0]["args"]
    assert "--metrics-profile=vllm" in cw["containers"][0]["args"]
    assert cw["containers"][0]["image"] == "registry.example.com/pdfleet/pdfleet-operator@sha256:" + "ab" * 32
    assert (
        helm.the(rendered["defaults"], "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
        == f"ghcr.io/pdfleet/pdfleet-operator:{__version__}"
    )


def test_watch_scope_matches_rbac_scope(rendered) -> None:
    args = helm.the(rendered["defaults"], "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args
    lease_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": f"{helm.RELEASE}-operator-leader-election", "namespace": helm.NAMESPACE},
        "rules": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [f"{helm.RELEASE}-operator"],
                "verbs": ["get", "update"],
            },
        ],
    }
    (role,) = helm.by_kind(rendered["defaults"], "Role")  # only the leader Lease's, in the release namespace
    assert {**role, "metadata": {k: role["metadata"][k] for k in ("name", "namespace")}} == lease_role
    namespaced = rendered["namespaced"]
    args = helm.the(namespaced, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert sorted(r["metadata"]["namespace"] for r in helm.by_kind(namespaced, "Role")) == [
        helm.NAMESPACE,
        "team-a",
        "team-b",
    ]
    cluster_role = helm.the(namespaced, "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes",
        "acceleratorclasses",
        "acceleratorclasses/status",
        "customresourcedefinitions",
        "namespaces",
        "pods",
    }, "namespaced mode reads only cluster-scoped kinds and lists pods everywhere (capacity), writes the class status"
    assert [rule["verbs"] for rule in cluster_role["rules"] if "pods" in rule["resources"]] == [["list"]]
    writes = {
        (r, v)
        for rule in cluster_role["rules"]
        for r in rule["resources"]
        for v in rule["verbs"]
        if v not in ("get", "list", "watch")
    }
    # (the class patch is the pdfleet.io/in-use finalizer of a class a pool runs on: issue 24, rule 3)
    assert writes == {("acceleratorclasses/status", "patch"), ("acceleratorclasses", "patch")}
    for objects in rendered.values():
        for role in helm.by_kind(objects, "ClusterRole") + helm.by_kind(objects, "Role"):
            for rule in role["rules"]:
                # Secrets: create only (each deployment's token, when missing): the operator can read none
                assert "secrets" not in rule["resources"] or rule["verbs"] == ["create"], rule
                assert "*" not in rule["resources"] + rule["verbs"]
    pm = helm.the(namespaced, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert helm.the(rendered["defaults"], "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}


def test_pod_monitor_turns_pod_labels_into_the_labels_the_operator_queries(rendered) -> None:
    pm = helm.the(rendered["cluster-wide"], "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["interval"] == "5s"

    def meta_label(pod_label: str) -> str:  # how Prometheus' kubernetes_sd names a pod label
        return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)

    made = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert made == {
        names.LABEL_NAMESPACE: ["__meta_kubernetes_namespace"],
        names.LABEL_DEPLOYMENT: [meta_label(render.LABEL_DEPLOYMENT)],
        names.LABEL_ROLE: [meta_label(render.LABEL_ROLE)],
        names.LABEL_ACCELERATOR: [meta_label(render.LABEL_ACCELERATOR)],
        dashboards.REVISION_LABEL: [meta_label(render.LABEL_REVISION)],
    }
    # It selects what the operator renders: worker and router pods, not the operator's own pod.
    selector = pm["spec"]["selector"]["matchLabels"]
    owner = render.Owner("d", "ns", "uid")
    for pod_labels in (
        render.labels(owner, "prefill", role="prefill", accelerator="a", revision=1),
        render.labels(owner, render.ROUTER_ROLE, role=render.ROUTER_ROLE),
    ):
        assert selector.items() <= pod_labels.items() and render.LABEL_DEPLOYMENT in pod_labels
    operator_pod = helm.the(rendered["cluster-wide"], "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= operator_pod.items()


def test_service_monitor_keeps_the_operators_namespace_label(rendered) -> None:
    sm = helm.the(rendered["defaults"], "ServiceMonitor")
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True and endpoint["port"] == "metrics"
    svc = helm.the(rendered["defaults"], "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["port"] == 9090


def test_prometheus_rule_is_the_generated_rule_file(rendered) -> None:
    rule = helm.the(rendered["defaults"], "PrometheusRule")
    assert rule["spec"] == {"groups": alerts.rule_file()["groups"]}
    assert "{{ $labels.namespace }}" in json.dumps(rule)  # Helm did not eat Prometheus' templates


def test_dashboards_ship_as_sidecar_configmaps(rendered) -> None:
    cms = helm.by_kind(rendered["cluster-wide"], "ConfigMap")
    assert sorted(c["metadata"]["name"] for c in cms) == [
        "pdfleet-dashboard-deployment",
        "pdfleet-dashboard-fleet-cost",
        "pdfleet-dashboard-operator",
    ]
    for cm in cms:
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Inference"}
        ((file, text),) = cm["data"].items()
        assert text + "\n" == dashboards.render_all()[file]
        assert json.loads(text)["uid"] == file.removesuffix(".json")


def test_notes_say_where_things_are() -> None:
    text = helm.notes()
    assert "every namespace" in text and "check their costPerHour" in text and "kubectl apply --server-side -f" in text
    text = helm.notes(helm.VALUE_SETS["namespaced"])
    assert "team-a, team-b" in text


def test_unpublished_default_images_are_named_at_install_and_the_worker_image_reaches_the_operator() -> None:
    text = helm.notes()
    assert "WARNING: image.repository=ghcr.io/pdfleet/pdfleet-operator" in text and "ImagePullBackOff" in text
    assert "make images REGISTRY=" in text
    own = {
        "image": {"repository": "reg.example.com/t/pdfleet-operator"},
        "workerImage": {"repository": "reg.example.com/t/pdfleet-worker", "tag": "dev"},
    }
    assert "WARNING: image.repository" not in helm.notes(own)
    assert "ImagePullBackOff" in helm.notes({"image": own["image"]}), "one unpublished default is enough to warn"

    def operator_args(values: dict) -> list[str]:
        deployment = next(o for o in helm.render(values) if o["kind"] == "Deployment")
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    args = operator_args(own)
    assert [a for a in args if a.startswith("--worker-image")] == [
        "--worker-image=cpu=reg.example.com/t/pdfleet-worker:dev-cpu",
        "--worker-image=cuda=reg.example.com/t/pdfleet-worker:dev-cuda",
    ], "one image per platform make images built"
    default = operator_args({})
    from pdfleet_operator.decide import worker_images

    flags = [a.removeprefix("--worker-image=") for a in default if a.startswith("--worker-image=")]
    assert worker_images.WorkerImages.parse(flags) == worker_images.defaults(platforms=("cpu", "cuda")), (
        "the operator's own default names, for the platforms make images builds"
    )
    vendors = operator_args({"workerImage": {"platforms": ["cpu", "cuda", "npu"]}})
    assert "--worker-image=npu=ghcr.io/pdfleet/pdfleet-worker:0.1.0-npu" in vendors


@pytest.mark.parametrize(
    "values, field",
    [
        ({"operator": {"watchNamespace": ["a"]}}, "watchNamespace"),
        ({"operator": {"resyncInterval": "often"}}, "resyncInterval"),
        ({"operator": {"watchNamespaces": ["Team_A"]}}, "watchNamespaces"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"monitoring": {"podMonitor": {"interval": "15 seconds"}}}, "interval"),
        (
            {
                "acceleratorClasses": {
                    "classes": {
                        "x": {
                            "vendor": "nvidia",
                            "resourceName": "nvidia.com/gpu",
                            "memoryGiB": 80,
                            "peakTflops": 1,
                            "memoryBandwidthGBps": 1,
                            "costPerHour": -1,
                        }
                    }
                }
            },
            "costPerHour",
        ),
        (
            {
                "acceleratorClasses": {
                    "classes": {
                        "x": {
                            "vendor": "nvidia",
                            "resourceName": "nvidia.com/gpu",
                            "memoryGiB": 80,
                            "peakTflops": 1,
                            "memoryBandwidthGBps": 1,
                            "costPerHour": 1,
                            "costPerHoure": 2,
                        }
                    }
                }
            },
            "costPerHoure",
        ),
        ({"acceleratorClasses": {"classes": {"Bad_Name": {}}}}, "Bad_Name"),
        ({"acceleratorClasses": {"defaultClasses": {"cpu": {"costPerHour": "cheap"}}}}, "costPerHour"),
    ],
)
def test_values_violating_the_schema_are_rejected_naming_the_field(values, field, loaded) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        loaded.validate_schema(values)
    assert field in str(err.value)
    with pytest.raises(helm_python.HelmError) as err:  # and an install/template with them fails the same way
        loaded.render(values, name=helm.RELEASE, namespace=helm.NAMESPACE)
    assert field in str(err.value)


def test_every_value_is_documented_and_typed() -> None:
    def walk(node, path):
        assert node.doc or not path, f"{path} has no comment"
        if isinstance(node, chart.Group):
            for key, child in node.keys.items():
                yield from walk(child, f"{path}.{key}" if path else key)
        else:
            assert node.schema, f"{path} has no schema"
            yield path

    keys = list(walk(chart.values_tree(), ""))
    assert len(keys) > 40
    text = (helm.CHART / "values.yaml").read_text()
    assert yaml.safe_load(text) == chart.defaults()
    helm.chart().validate_schema(chart.defaults())


def test_check_commands_name_stale_files(tmp_path) -> None:
    import shutil
    import subprocess
    import sys

    for module, command in (("pdfleet_operator.gen.chart", "chart"), ("pdfleet_operator.gen.dashboards", "dashboards")):
        ok = subprocess.run(
            [sys.executable, "-m", module, command, "--check"], capture_output=True, text=True, timeout=120
        )
        assert ok.returncode == 0, ok.stderr
    root = tmp_path / "repo"
    shutil.copytree(helm.ROOT / "charts", root / "charts")
    shutil.copytree(helm.ROOT / "examples", root / "examples")
    shutil.copytree(helm.ROOT / "dashboards", root / "dashboards")
    (root / "charts/pdfleet/values.yaml").write_text("# edited by hand\n")
    (root / "charts/pdfleet/files/dashboards/pdfleet-old.json").write_text("{}")
    stale = subprocess.run(
        [sys.executable, "-m", "pdfleet_operator.gen.chart", "chart", "--check", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stale.returncode == 1
    assert "charts/pdfleet/values.yaml" in stale.stderr and "pdfleet-old.json" in stale.stderr
    fixed = subprocess.run(
        [sys.executable, "-m", "pdfleet_operator.gen.chart", "chart", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fixed.returncode == 0 and not (root / "charts/pdfleet/files/dashboards/pdfleet-old.json").exists()
    assert chart.stale_files(root) == []


def test_the_alertmanager_receiver_is_authenticated_by_default_with_a_token_the_chart_makes(loaded) -> None:
    """HEAD: no operator.alertmanagerTokenSecret meant an unauthenticated receiver on every address."""

    def operator(values):
        objs = helm.render(values, loaded=loaded)
        dep = next(o for o in objs if o["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"], [o for o in objs if o["kind"] == "Secret"]

    pod, secrets = operator({})
    (c,) = pod["containers"]
    assert "--alertmanager-token-file=/etc/pdfleet/alertmanager/token" in c["args"]
    (made,) = [o for o in secrets if o["metadata"]["name"] == f"{helm.RELEASE}-operator-alertmanager"]
    import base64

    assert len(base64.b64decode(made["data"]["token"])) == 48
    assert {
        "name": "alertmanager-token",
        "secret": {"secretName": made["metadata"]["name"], "items": [{"key": "token", "path": "token"}]},
    } in pod["volumes"]
    pod, secrets = operator({"operator": {"alertmanagerTokenSecret": "am-token"}})
    (c,) = pod["containers"]
    assert "--alertmanager-token-file=/etc/pdfleet/alertmanager/token" in c["args"]
    assert {"name": "alertmanager-token", "mountPath": "/etc/pdfleet/alertmanager", "readOnly": True} in c[
        "volumeMounts"
    ]
    assert {
        "name": "alertmanager-token",
        "secret": {"secretName": "am-token", "items": [{"key": "token", "path": "token"}]},
    } in pod["volumes"]
    assert not any(o["metadata"]["name"].endswith("-alertmanager") for o in secrets), "the admin's Secret, none of ours"
    off, secrets = operator({"operator": {"alertmanagerPort": 0}})
    assert not any(a.startswith("--alertmanager-token-file") for a in off["containers"][0]["args"]) and not any(
        o["metadata"]["name"].endswith("-alertmanager") for o in secrets
    )
    # The operator itself refuses an unauthenticated receiver unless told so in as many words.
    from pdfleet_operator.kube import alertmanager

    with pytest.raises(ValueError, match="without --alertmanager-token-file"):
        alertmanager.check_receiver(9443, None, unauthenticated=False)
    alertmanager.check_receiver(9443, None, unauthenticated=True)
    alertmanager.check_receiver(0, None, unauthenticated=False)
    from pdfleet_operator.cli import build_parser

    args = build_parser(["operator"]).parse_args(["operator", "--alertmanager-token-file=/x"])
    assert args.alertmanager_token_file == "/x"


def test_the_operator_pods_have_a_network_policy_a_readiness_probe_and_cpu_and_memory_bounds(loaded) -> None:
    objs = helm.render({}, loaded=loaded)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert set(c["resources"]["requests"]) == {"cpu", "memory"} and set(c["resources"]["limits"]) == {"cpu", "memory"}
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert set(rules) == {ports["metrics"], ports["alerts"]}, "nothing else comes in"

    def ns(peers: list[dict]) -> set[str]:
        return {
            p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            for p in peers
            if "namespaceSelector" in p
        }

    assert ns(rules[ports["metrics"]]) == {"monitoring"} and ns(rules[ports["alerts"]]) == {"monitoring"}
    assert {"podSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}} in rules[ports["alerts"]], (
        "a standby relays alerts to the leader"
    )
    assert not [
        o for o in helm.render({"operator": {"networkPolicy": False}}, loaded=loaded) if o["kind"] == "NetworkPolicy"
    ]


def test_the_host_path_admission_policy_refuses_what_the_admin_does_not_allow(loaded) -> None:
    """The chart's ValidatingAdmissionPolicy, valid for Kubernetes 1.30, and its CEL evaluated (cel-python) as
    the API server would on objects that try the attack (the operator's own check is tests/decide)."""
    import celpy
    import kubernetes_validate

    objs = helm.render(
        {"operator": {"hostPath": {"allowedPrefixes": ["/srv/models"], "allowedNamespaces": ["ml-admin"]}}},
        loaded=loaded,
    )
    policy = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicy")
    binding = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding")
    for o in (policy, binding):
        kubernetes_validate.validate(o, "1.30.0", strict=True)
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    env = celpy.Environment()

    def admitted(namespace: str, source: dict) -> bool:
        obj = celpy.json_to_cel({"metadata": {"namespace": namespace}, "spec": {"model": {"source": source}}})
        (var,) = policy["spec"]["variables"]
        path = env.program(env.compile(var["expression"])).evaluate({"object": obj})
        (rule,) = policy["spec"]["validations"]
        return bool(
            env.program(env.compile(rule["expression"])).evaluate(
                {"object": obj, "variables": celpy.celtypes.MapType({celpy.celtypes.StringType("path"): path})}
            )
        )

    assert admitted("team-a", {"pvc": {"claimName": "models"}})
    assert admitted("team-a", {"hostPath": {"path": "/srv/models/qwen"}})
    assert admitted("ml-admin", {"hostPath": {"path": "/etc"}})
    for attack in ("/", "/etc/kubernetes", "/srv/models2", "/srv/models/../../etc"):
        assert not admitted("team-a", {"hostPath": {"path": attack}}), attack
    assert not any(
        o["kind"] == "ValidatingAdmissionPolicy"
        for o in helm.render({"operator": {"hostPath": {"admissionPolicy": False}}}, loaded=loaded)
    )


def test_allowed_prometheus_urls_and_its_ca_reach_the_operator(loaded) -> None:
    dep = next(
        o
        for o in helm.render(
            {
                "operator": {
                    "allowedPrometheusUrls": ["http://prom.monitoring.svc:9090"],
                    "prometheusCaSecret": "prom-ca",
                }
            },
            loaded=loaded,
        )
        if o["kind"] == "Deployment"
    )
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--allow-prometheus-url=http://prom.monitoring.svc:9090" in c["args"]
    assert "--prometheus-ca=/etc/pdfleet/prometheus-ca/ca.crt" in c["args"]
    from pdfleet_operator.cli import build_parser

    args = build_parser(["operator"]).parse_args(["operator", *c["args"][1:]])
    assert args.allow_prometheus_url == ["http://prom.monitoring.svc:9090"] and args.prometheus_ca.endswith("ca.crt")


def test_several_replicas_need_leader_election_and_spread_over_nodes() -> None:
    with pytest.raises(Exception, match="operator.replicas > 1 needs operator.leaderElection.enabled"):
        helm.render({"operator": {"replicas": 2, "leaderElection": {"enabled": False}}})
    with pytest.raises(Exception, match="retryPeriod < renewDeadline < leaseDuration"):
        helm.render({"operator": {"leaderElection": {"renewDeadline": 15}}})
    single = helm.render({"operator": {"replicas": 1, "leaderElection": {"enabled": False}}})
    dep = helm.the(single, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert not any("leader" in a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "affinity" not in dep["spec"]["template"]["spec"] and helm.by_kind(single, "Role") == []
    spread = helm.the(helm.render({}), "Deployment")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    own = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}
                    ]
                }
            }
        }
    }
    assert (
        helm.the(helm.render({"operator": own}), "Deployment")["spec"]["template"]["spec"]["affinity"]
        == own["affinity"]
    )


@pytest.mark.parametrize("chart_pod_monitor", [True, False])
def test_exactly_one_pod_monitor_scrapes_each_worker(chart_pod_monitor) -> None:
    """The chart's PodMonitor and a per-deployment one would both scrape every worker (queues double, $/1M tokens
    halves where Prometheus takes both): the operator the chart installs renders its own only without the chart's."""
    import argparse

    from pdfleet_operator.decide import inventory, placement
    from pdfleet_operator.kube import operator_cli, render
    from tests.kube.cluster import classes, example_deployments, spec_of, standard_nodes

    values = {"monitoring": {"podMonitor": {"enabled": chart_pod_monitor}}}
    chart_objects = helm.render(values)
    operator = next(o for o in chart_objects if o["kind"] == "Deployment")
    parser = argparse.ArgumentParser()
    operator_cli.register(parser.add_subparsers(dest="command"))
    argv = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    args = parser.parse_args(argv if argv[:1] == ["operator"] else ["operator", *argv])

    spec, cls = spec_of(example_deployments()["llama31-8b"]), classes()
    plan = placement.plan(spec, cls, inventory.build(standard_nodes(), []))
    objects = render.render(
        render.Owner("llama31-8b", "team-a", "uid"),
        spec,
        plan,
        cls,
        revision=1,
        monitoring=True,
        own_pod_monitor=args.pod_monitors,
    )
    worker = next(o for o in objects if o["kind"] == "Deployment" and "prefill" in o["metadata"]["name"])
    pod_labels = worker["spec"]["template"]["metadata"]["labels"]

    def scrapes(monitor: dict) -> bool:
        sel, ns = monitor["spec"]["selector"], monitor["spec"].get("namespaceSelector", {})
        if monitor["metadata"].get("namespace") not in (None, "team-a") and not ns:
            return False  # a PodMonitor without a namespaceSelector scrapes its own namespace only
        if ns and not (ns.get("any") or "team-a" in ns.get("matchNames", [])):
            return False
        exprs_ok = all((e["operator"] == "Exists") == (e["key"] in pod_labels) for e in sel.get("matchExpressions", []))
        return exprs_ok and all(pod_labels.get(k) == v for k, v in sel.get("matchLabels", {}).items())

    monitors = [o for o in chart_objects + objects if o["kind"] == "PodMonitor"]
    assert len([m for m in monitors if scrapes(m)]) == 1, [m["metadata"]["name"] for m in monitors if scrapes(m)]

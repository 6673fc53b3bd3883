"""The operator running for real (kopf) against the API emulator: golden objects, edits, GC, drift, resync, re-plans."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from typing import Any

import yaml

from pdfleet_operator.kube import handlers
from tests.kube import golden, ha
from tests.kube.cluster import EXAMPLES, example_deployments, example_files, node, pod
from tests.kube.harness import (
    CHILD_RESOURCES,
    children,
    events,
    mark_ready,
    prepare_cluster,
    running_operator,
    settle,
    strip_server_fields,
    wait_reconciled,
)

LLAMA = EXAMPLES / "llama31-8b-pd-mig.yaml"


def test_golden_files_are_current() -> None:
    assert golden.stale() == [], "run `python -m tests.kube.golden --update` and review the diff"


def test_examples_yield_exactly_the_golden_objects_status_and_columns(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        for path in example_files().values():
            kube.apply(path)
        for stem in example_files():
            for want in yaml.safe_load_all(golden.golden_path(stem).read_text()):
                cr = wait_reconciled(kube, want["name"])
                got = {k: strip_server_fields(v) for k, v in children(kube, want["name"]).items()}
                expected = {f"{o['kind']}/{o['metadata']['name']}": o for o in want["objects"]}
                assert sorted(got) == sorted(expected), want["name"]
                for key, obj in expected.items():
                    assert got[key] == obj, key
                assert golden.normalize_status(cr["status"]) == want["status"], want["name"]
        settle(kube)
    table = kube.kubectl("get", "infdep").stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "PREFILL", "DECODE", "P:D", "$/H", "READY", "AGE"]
    row = next(line.split() for line in table[1:] if line.startswith("llama31-8b "))
    assert row[2:7] == ["1", "2", "1:2", "5.75", "False"]  # (2 router replicas of 1 core at $0.10)


def test_spec_edit_changes_only_what_must(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(LLAMA)
        wait_reconciled(kube, "llama31-8b")
        settle(kube)
        before = {k: v["metadata"]["resourceVersion"] for k, v in children(kube, "llama31-8b").items()}

        kube.clear_requests()
        kube.patch("infdep", "llama31-8b", {"spec": {"decode": {"minReplicas": 3}}})
        wait_reconciled(kube, "llama31-8b", check=lambda cr: cr["status"]["decodeReplicas"] == 3)
        settle(kube)
        writes = [(w.verb, w.resource, w.name, w.subresource) for w in kube.writes()]
        # The decode PDB follows the role's size (one disruption at a time, never below minReplicas: now 3).
        assert writes == [
            ("patch", "poddisruptionbudgets", "llama31-8b-decode", None),
            ("patch", "deployments", "llama31-8b-decode-h100-mig-3g-40gb", None),
            ("patch", "inferencedeployments", "llama31-8b", "status"),
            ("create", "events", None, None),
        ], [(e["reason"], e["message"]) for e in events(kube, "llama31-8b")]
        ev = events(kube, "llama31-8b")[-1]
        assert ev["reason"] == "Replanned" and "decode 3xh100-mig-3g-40gb" in ev["message"]

        kube.clear_requests()
        kube.patch("infdep", "llama31-8b", {"spec": {"engine": {"maxNumSeqs": 64}}})
        wait_reconciled(kube, "llama31-8b", check=lambda cr: cr["status"]["currentRevision"] == 2)
        settle(kube)
        changed = sorted(
            w.name for w in kube.writes() if w.resource != "inferencedeployments" and w.resource != "events"
        )
        # (plus the superseded revision 1's ControllerRevision, issue 7: revision 2 is on the ConfigMap now)
        assert changed == [
            "llama31-8b-decode-h100-mig-3g-40gb",
            "llama31-8b-engine",
            "llama31-8b-prefill-h100-80gb",
            "llama31-8b-rev-1",
        ]
        after = {k: v["metadata"]["resourceVersion"] for k, v in children(kube, "llama31-8b").items()}
        assert {k for k in before if before[k] != after[k]} == {
            "ConfigMap/llama31-8b-engine",
            "Deployment/llama31-8b-decode-h100-mig-3g-40gb",
            "Deployment/llama31-8b-prefill-h100-80gb",
            "PodDisruptionBudget/llama31-8b-decode",
        }  # (by the minReplicas edit above)
        pool = kube.get("deployments.apps", "llama31-8b-prefill-h100-80gb")
        assert pool["spec"]["template"]["metadata"]["labels"]["pdfleet.io/revision"] == "2"

        # A pool the plan no longer has keeps serving until its replacement is ready, then is deleted.
        mark_ready(kube, "llama31-8b")
        settle(kube)
        kube.clear_requests()
        kube.patch("infdep", "llama31-8b", {"spec": {"decode": {"acceleratorClasses": ["h100-80gb"]}}})
        wait_reconciled(
            kube, "llama31-8b", check=lambda cr: cr["status"]["pools"][1]["acceleratorClass"] == "h100-80gb"
        )
        settle(kube)
        assert "Deployment/llama31-8b-decode-h100-80gb" in children(kube, "llama31-8b")
        assert "Deployment/llama31-8b-decode-h100-mig-3g-40gb" in children(kube, "llama31-8b")
        assert not [w for w in kube.writes() if w.verb == "delete"]
        cond = {c["type"]: c for c in kube.get("infdep", "llama31-8b")["status"]["conditions"]}
        assert (
            "keeping llama31-8b-decode-h100-mig-3g-40gb 3/3 ready until the replacements serve (3 of 3 ready in "
            "the role)" in cond["Progressing"]["message"]
        ), cond["Progressing"]
        assert "waiting for llama31-8b-decode-h100-80gb 0/3" in cond["Progressing"]["message"]
        assert cond["Ready"]["status"] == "True", cond["Ready"]  # the kept pool serves decode meanwhile
        replanned = [e for e in events(kube, "llama31-8b") if e["reason"] == "Replanned"][-1]
        assert (
            "keeping llama31-8b-decode-h100-mig-3g-40gb 3/3 ready until the replacements serve" in replanned["message"]
        )
        mark_ready(kube, "llama31-8b")
        kube.wait_for(
            lambda: "Deployment/llama31-8b-decode-h100-mig-3g-40gb" not in children(kube, "llama31-8b"),
            message="the replaced pool deleted once the new one is ready",
        )
        settle(kube)
        assert [w.name for w in kube.writes() if w.verb == "delete"] == ["llama31-8b-decode-h100-mig-3g-40gb"]
        retired = [e for e in events(kube, "llama31-8b") if e["reason"] == "PoolRetired"]
        assert len(retired) == 1 and retired[0]["message"].startswith("deleted llama31-8b-decode-h100-mig-3g-40gb")


def test_deleting_the_cr_removes_children_by_garbage_collection(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(LLAMA)
        wait_reconciled(kube, "llama31-8b")
        settle(kube)
        assert len(children(kube, "llama31-8b")) == 12  # 9 + the two NetworkPolicies + the router's PDB
        kube.clear_requests()
        kube.delete("infdep", "llama31-8b")
        kube.wait_for(lambda: not children(kube, "llama31-8b"), message="children collected")
        settle(kube)
        # The operator neither deleted children itself nor recreated them.
        assert [w for w in kube.writes() if w.resource != "events"] == []


def test_hand_edits_are_reverted(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(LLAMA)
        wait_reconciled(kube, "llama31-8b")
        settle(kube)
        name = "llama31-8b-prefill-h100-80gb"
        original = kube.get("deployments.apps", name)
        kube.patch(
            "deployments.apps",
            name,
            {
                "spec": {
                    "replicas": 7,
                    "template": {
                        "spec": {
                            "containers": [
                                {**original["spec"]["template"]["spec"]["containers"][0], "image": "evil:latest"}
                            ]
                        }
                    },
                }
            },
        )
        kube.wait_for(lambda: kube.get("deployments.apps", name)["spec"]["replicas"] == 1, message="replicas reverted")
        reverted = kube.get("deployments.apps", name)
        assert (
            reverted["spec"]["template"]["spec"]["containers"][0]["image"]
            == original["spec"]["template"]["spec"]["containers"][0]["image"]
        )
        ev = kube.wait_for(
            lambda: [e for e in events(kube, "llama31-8b") if e["reason"] == "DriftReverted"], message="event"
        )
        assert f"Deployment/{name}" in ev[0]["message"] and ".spec.replicas" in ev[0]["message"]
        # A child deleted by hand comes back.
        kube.delete("services", "llama31-8b")
        kube.wait_for(lambda: kube.get("services", "llama31-8b"), message="router Service recreated")
        settle(kube)


def test_steady_state_resync_and_restart_make_zero_writes(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        for path in example_files().values():
            kube.apply(path)
        for name in example_deployments():
            wait_reconciled(kube, name)
        settle(kube)
        for name in example_deployments():
            mark_ready(kube, name)
        for name in example_deployments():
            wait_reconciled(
                kube,
                name,
                check=lambda cr: any(
                    c["type"] == "Ready" and c["status"] == "True" for c in cr["status"]["conditions"]
                ),
            )
        settle(kube)
    before = {name: kube.get("infdep", name)["status"] for name in example_deployments()}
    kube.clear_requests()
    with running_operator(kube, resync_interval=0.3):  # a restart (every CR created/resumed again) + resyncs
        kube.wait_for(
            lambda: handlers.RECONCILER.reconciles >= 4 * len(example_deployments()),
            timeout=20,
            message="a restart and several resyncs",
        )
        settle(kube)
    written = [
        f"{w.verb} {w.resource}/{w.name}: "
        f"{_changed(before.get(w.name or '') or {}, (w.body or {}).get('status') or w.body)}"
        for w in kube.writes()
    ]
    assert written == [], "a restart writes nothing, not even the token Secret's create (status.tokenSecret)"
    assert {r.verb for r in kube.requests} - {None} <= {"get", "list", "watch"}  # None: discovery


def _changed(before: Any, after: Any, at: str = "") -> list[str]:
    """Where two JSON values differ, as `path: before -> after` lines (what a failed zero-writes check prints)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [d for k in sorted(set(before) | set(after)) for d in _changed(before.get(k), after.get(k), f"{at}.{k}")]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in _changed(b, a, f"{at}[{i}]")]
    return [] if before == after else [f"{at}: {before!r} -> {after!r}"]


def test_new_ascend_node_replans_with_an_event(kube) -> None:
    cost = copy.deepcopy(example_deployments()["chat-cost"])
    prepare_cluster(kube, nodes=[node("hygon-0", "hygon", 8)])
    with running_operator(kube):
        kube.apply(cost)
        cr = wait_reconciled(kube, "chat-cost")
        assert [(p["role"], p["acceleratorClass"]) for p in cr["status"]["pools"]] == [
            ("prefill", "hygon-dcu-k100"),
            ("decode", "hygon-dcu-k100"),
        ]
        mark_ready(kube, "chat-cost")  # (a pool that serves nothing yet would go at once: it holds no traffic)
        settle(kube)
        kube.apply(node("ascend-1", "ascend", 8))
        cr = wait_reconciled(
            kube, "chat-cost", check=lambda cr: cr["status"]["pools"][0]["acceleratorClass"] == "ascend-910b"
        )
        settle(kube)
        ev = [e for e in events(kube, "chat-cost") if e["reason"] == "Replanned"]
        # (the emulator, like a kubelet, reports a new node's allocatable in a second write: "added" or "changed")
        assert ev and ev[-1]["message"].startswith("node ascend-1 ") and "8 huawei.com/Ascend910" in ev[-1]["message"]
        assert (
            "allocatable): prefill 1xascend-910b, prefill 1xhygon-dcu-k100, decode 2xhygon-dcu-k100"
            in ev[-1]["message"]
        )
        # the Hygon prefill pool serves until the Ascend one is ready
        assert "Deployment/chat-cost-prefill-hygon-dcu-k100" in children(kube, "chat-cost")
        mark_ready(kube, "chat-cost")
        kube.wait_for(
            lambda: "Deployment/chat-cost-prefill-hygon-dcu-k100" not in children(kube, "chat-cost"),
            message="the Hygon prefill pool deleted once the Ascend one is ready",
        )
        settle(kube)
        # A node of an unrelated kind re-plans nothing.
        kube.clear_requests()
        kube.apply(node("l40s-9", "l40s", 4))
        settle(kube)
        assert kube.writes() == []


def test_price_change_replans_with_an_event(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(EXAMPLES / "qwen2-7b-mixed-tiers.yaml")
        wait_reconciled(kube, "chat-cost")
        wait_reconciled(kube, "chat-latency")
        settle(kube)
        kube.clear_requests()
        kube.patch("acc", "hygon-dcu-k100", {"spec": {"costPerHour": 2.0}})
        cr = wait_reconciled(
            kube, "chat-cost", check=lambda cr: cr["status"]["pools"][1]["acceleratorClass"] == "ascend-910b"
        )
        settle(kube)
        ev = [e for e in events(kube, "chat-cost") if e["reason"] == "Replanned"][-1]
        assert ev["message"].startswith("AcceleratorClass hygon-dcu-k100 changed: costPerHour 0.9 -> 2.0: ")
        assert cr["status"]["costPerHour"] == round(2 * 1.20 + 1.20 + 2 * 0.10, 4)  # + 2 routers
        # chat-latency does not list the class: untouched.
        assert not [w for w in kube.writes() if "chat-latency" in (w.name or "")]


def test_full_cluster_is_scaling_limited_until_capacity_frees(kube) -> None:
    prepare_cluster(kube, nodes=[node("l40s-0", "l40s", 2)])
    kube.apply(pod("training", "l40s-0", {"nvidia.com/gpu": "2"}, namespace="default"))
    with running_operator(kube):
        kube.apply(EXAMPLES / "qwen2-7b.yaml")
        cr = wait_reconciled(kube, "qwen2-7b")
        cond = {c["type"]: c for c in cr["status"]["conditions"]}
        assert cond["ScalingLimited"]["status"] == "True" and cond["ScalingLimited"]["reason"] == "InsufficientCapacity"
        assert "missing 1 x nvidia.com/gpu on l40s-48gb" in cond["ScalingLimited"]["message"]
        assert cond["Degraded"]["reason"] == "RoleUnplaced"
        assert not any(k.startswith("Deployment/qwen2-7b-colocated") for k in children(kube, "qwen2-7b"))
        kube.wait_for(
            lambda: [e for e in events(kube, "qwen2-7b") if e["reason"] == "ScalingLimited"],
            message="a ScalingLimited Event (posted after the status)",
        )
        kube.delete("pods", "training")
        cr = wait_reconciled(kube, "qwen2-7b", check=lambda cr: cr["status"]["pools"])
        assert cr["status"]["pools"][0]["desired"] == 1
        settle(kube)


def test_restart_mid_reconcile_converges_without_duplicates(kube, tmp_path) -> None:
    prepare_cluster(kube, nodes=[node(f"h100-{i}", "h100", 8) for i in range(4)] + [node("mig-0", "h100-mig", 64)])
    names = [f"llama-{i}" for i in range(12)]
    base = yaml.safe_load(LLAMA.read_text())
    for n in names:
        doc = copy.deepcopy(base)
        doc["metadata"]["name"] = n
        kube.apply(doc)
    cmd = [
        sys.executable,
        "-m",
        "pdfleet_operator.kube.operator_cli",
        "operator",
        "--metrics-port",
        "0",
        "--liveness-port",
        "0",
        "--resync-interval",
        "0",
    ]
    ha.install_chart_rbac(kube)  # the processes run as the chart's ServiceAccount, its RBAC enforced
    env = kube.env_with(kube.service_account_kubeconfig(ha.NAMESPACE, ha.SERVICE_ACCOUNT, pod="operator-0"))
    log = open(tmp_path / "operator.log", "w")
    first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        kube.wait_for(
            lambda: len(kube.writes()) >= 40 or first.poll() is not None,
            timeout=30,
            message="the first operator to be mid-way",
        )
        assert first.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    partial = sum(len(children(kube, n)) for n in names)
    assert 0 < partial < 11 * len(names), "the kill should land mid-reconcile"
    second = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for n in names:
            wait_reconciled(kube, n, timeout=30)
        settle(kube)
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
    for n in names:
        got = children(kube, n)
        assert sorted(got) == sorted(
            [
                "ConfigMap/" + n + "-engine",
                "Service/" + n,
                "Service/" + n + "-prefill",
                "Service/" + n + "-decode",
                "PodDisruptionBudget/" + n + "-prefill",
                "PodDisruptionBudget/" + n + "-decode",
                "PodDisruptionBudget/" + n + "-router",
                "Deployment/" + n + "-prefill-h100-80gb",
                "Deployment/" + n + "-decode-h100-mig-3g-40gb",
                "Deployment/" + n + "-router",
                "NetworkPolicy/" + n + "-workers",
                "NetworkPolicy/" + n + "-router",
            ]
        ), n
    total = sum(len(kube.list(r, "default")) for r in CHILD_RESOURCES if r != "services") + len(
        [s for s in kube.list("services", "default") if s["metadata"]["name"] != "kubernetes"]
    )
    assert total == 12 * len(names)
    assert [r.denied for r in kube.requests if r.denied] == [] and {r.pod for r in kube.requests} == {"operator-0"}


def test_a_pool_that_cannot_run_is_refused_with_an_event_naming_the_field_and_nothing_is_created(
    kube, tmp_path
) -> None:
    """decide.runtimes' rules read AcceleratorClasses, which CEL cannot: the operator applies them and says why."""
    prepare_cluster(kube)
    doc = copy.deepcopy(example_deployments()["chat-cost"])
    doc["metadata"]["name"] = "on-kunlunxin"
    doc["spec"]["decode"]["acceleratorClasses"] = ["kunlunxin-r200"]  # the pdfleet worker has no bridge for it
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(doc))
    with running_operator(kube):
        kube.apply(path)
        ev = kube.wait_for(
            lambda: [e for e in events(kube, "on-kunlunxin") if "spec.decode.acceleratorClasses[0]" in e["message"]],
            message="an Event naming the field",
        )
        assert "no PyTorch bridge for kunlunxin" in ev[0]["message"] and ev[0]["type"] != "Normal"
        settle(kube)
        assert children(kube, "on-kunlunxin") == {}
        # `kubectl get` shows it too: nothing was ever planned, so Ready=False as well as Degraded, naming the field.
        cond = {c["type"]: c for c in kube.get("infdep", "on-kunlunxin")["status"]["conditions"]}
        assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "InvalidSpec")
        assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "InvalidSpec")
        assert "spec.decode.acceleratorClasses[0]" in cond["Ready"]["message"]
        # Fixed, it is planned and the conditions say so.
        kube.patch("infdep", "on-kunlunxin", {"spec": {"decode": {"acceleratorClasses": ["hygon-dcu-k100"]}}})
        cr = wait_reconciled(kube, "on-kunlunxin", check=lambda cr: cr["status"].get("pools"))
        cond = {c["type"]: c for c in cr["status"]["conditions"]}
        assert cond["Degraded"]["reason"] != "InvalidSpec" and cond["Ready"]["reason"] != "InvalidSpec"


def test_fields_dropped_from_a_class_leave_the_live_pods(kube) -> None:
    """A toleration, a nodeSelector key and an env var added to a class reach the pool; removed, they leave it
    (containment alone saw nothing to do: the live object still held everything rendered)."""
    prepare_cluster(kube)
    name = "llama31-8b-prefill-h100-80gb"

    def pod_spec() -> dict:
        return kube.get("deployments.apps", name)["spec"]["template"]["spec"]

    with running_operator(kube):
        kube.apply(LLAMA)
        wait_reconciled(kube, "llama31-8b")
        settle(kube)
        cls = kube.get("acceleratorclasses", "h100-80gb")
        original = copy.deepcopy(cls["spec"])
        for n in kube.list("nodes"):  # the selector key added below must still match the H100 nodes
            if (
                n["metadata"].get("labels", {}).get("nvidia.com/gpu.product")
                == original["nodeSelector"]["nvidia.com/gpu.product"]
            ):
                kube.patch("nodes", n["metadata"]["name"], {"metadata": {"labels": {"pool": "inference"}}})
        extra = {
            "tolerations": original["tolerations"]
            + [{"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
            "nodeSelector": {**original["nodeSelector"], "pool": "inference"},
            "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        }
        kube.patch("acceleratorclasses", "h100-80gb", {"spec": extra})
        kube.wait_for(lambda: pod_spec()["nodeSelector"].get("pool") == "inference", message="class fields applied")
        assert {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in pod_spec()["tolerations"]
        assert {"name": "NCCL_DEBUG", "value": "INFO"} in pod_spec()["containers"][0]["env"]
        settle(kube)

        # A map key alone (lists are compared whole, so a shorter list was always re-applied).
        kube.patch("acceleratorclasses", "h100-80gb", {"spec": {"nodeSelector": {"pool": None}}})
        kube.wait_for(lambda: "pool" not in pod_spec()["nodeSelector"], message="the nodeSelector key pruned")
        settle(kube)
        kube.patch("acceleratorclasses", "h100-80gb", {"spec": {"tolerations": original["tolerations"], "env": None}})
        kube.wait_for(lambda: pod_spec()["tolerations"] == original["tolerations"], message="the toleration pruned")
        spec = pod_spec()
        assert spec["tolerations"] == original["tolerations"], spec["tolerations"]
        assert all(e["name"] != "NCCL_DEBUG" for e in spec["containers"][0].get("env", []))
        settle(kube)
        kinds = {e["reason"] for e in events(kube, "llama31-8b")}
        assert "DriftReverted" not in kinds, "a removal in the render is not a hand edit"


def test_the_worker_image_defaults_in_the_operator_not_in_the_crd(kube) -> None:
    """A CRD upgrade must not roll fleets: the schema defaults no image; the operator's --worker-image PLATFORM=IMAGE
    does (the H100 and MIG pools: cuda; the router: cpu), and the status says which images those were."""
    from pdfleet_operator.decide import worker_images

    prepare_cluster(kube)
    images = worker_images.WorkerImages.of(
        {
            "cpu": "registry.example.com/team/pdfleet-worker:dev-cpu",
            "cuda": "registry.example.com/team/pdfleet-worker:dev-cuda",
        }
    )
    saved = handlers.OPTIONS.worker_images
    handlers.OPTIONS.worker_images = images
    try:
        with running_operator(kube):
            kube.apply(LLAMA)
            assert "image" not in kube.get("infdep", "llama31-8b")["spec"]["engine"], "the CRD defaults no image"
            cr = wait_reconciled(
                kube, "llama31-8b", check=lambda cr: cr["status"].get("workerImage") == images.describe()
            )
            pools = {
                k: o["spec"]["template"]["spec"]["containers"][0]["image"]
                for k, o in children(kube, "llama31-8b").items()
                if k.startswith("Deployment/")
            }
            assert pools == {
                "Deployment/llama31-8b-prefill-h100-80gb": images.get("cuda"),
                "Deployment/llama31-8b-decode-h100-mig-3g-40gb": images.get("cuda"),
                "Deployment/llama31-8b-router": images.get("cpu"),
            }, pools
            kube.patch("infdep", "llama31-8b", {"spec": {"engine": {"image": "registry.example.com/w:1"}}})
            wait_reconciled(
                kube, "llama31-8b", check=lambda cr: cr["status"].get("workerImage") == "registry.example.com/w:1"
            )
            settle(kube)
            assert cr["status"]["currentRevision"] == 1
    finally:
        handlers.OPTIONS.worker_images = saved

"""The Kubernetes API emulator (tests/support/k8s/, formerly tests/support/k8s_emulator.py) behaves enough like
kube-apiserver.

Raw HTTP checks pin the semantics (metadata, generation, watches, patches, conflicts, dry runs,
apply, status, finalizers, garbage collection, admission); then the real clients prove it:
the ``kubernetes`` Python client, ``kubectl`` and kopf (``kopf run`` and ``KopfRunner``).
What the emulator does not do is listed in the package docstring (tests/support/k8s/__init__.py).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

import httpx
import kmock
import pytest
import yaml

from tests.support import components
from tests.support.k8s_fixtures import Kube

REPO = pathlib.Path(__file__).resolve().parents[1]
OPERATOR = REPO / "tests" / "support" / "emulator_operator.py"
WIDGETS = "/apis/emulator.pdfleet.io/v1/namespaces/default/widgets"

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.emulator.pdfleet.io"},
    "spec": {
        "group": "emulator.pdfleet.io",
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wd"],
            "categories": ["emulated"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Color", "type": "string", "jsonPath": ".spec.color"},
                    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "!has(self.maxSize) || self.size <= self.maxSize",
                                        "message": "size must not exceed maxSize",
                                        "fieldPath": ".size",
                                    }
                                ],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1},
                                    "maxSize": {"type": "integer"},
                                    "color": {"type": "string", "enum": ["red", "green", "blue"], "default": "red"},
                                },
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, size: int = 1, **spec) -> dict:
    return {
        "apiVersion": "emulator.pdfleet.io/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": size, **spec},
    }


def watching(kube: Kube, resource: str, since: int, timeout: float = 20.0) -> None:
    """Wait until a watch on `resource` opened after the first `since` ones streams: the emulator sets a watch's
    status to 200 once it is registered for events (and its headers are out), so nothing done from now on is missed.
    NOTE: a client that is still connecting misses a change made now (or sees it only as the state it lists)."""
    kube.wait_for(
        lambda: any(r.status == 200 for r in kube.requests_for(verb="watch", resource=resource)[since:]),
        timeout=timeout,
        message=f"a new watch on {resource} to be streaming",
    )


def _need(module: str):
    """Import a client the test needs: skip locally when it is missing, fail under CI=true."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        components.missing(module)


def cm(name: str, **meta) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}, "data": {"k": "v"}}


@pytest.fixture()
def http(kube: Kube):
    with httpx.Client(base_url=kube.url, timeout=10) as client:
        yield client


@pytest.fixture()
def widgets(kube: Kube) -> Kube:
    kube.apply(WIDGET_CRD)
    return kube


def watch_events(http: httpx.Client, path: str, count: int | None = None, **params) -> list[tuple[str, str, str]]:
    """Watch events as (type, name, resourceVersion): all within 1 s, or stop after ``count`` of them."""
    params = {"watch": "true", "timeoutSeconds": "1" if count is None else "10", **params}
    events = []
    with http.stream("GET", path, params=params) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("application/json")
        for line in response.iter_lines():
            if line.strip():
                events.append(json.loads(line))
            if count is not None and len(events) >= count:
                break
    return [
        (e["type"], e["object"]["metadata"].get("name", ""), e["object"]["metadata"].get("resourceVersion"))
        for e in events
    ]


# ----------------------------------------------------------------------------------------------
# Discovery and the basics kmock 0.8 got wrong
# ----------------------------------------------------------------------------------------------


def test_discovery_serves_core_builtins_and_applied_crds(widgets: Kube, http: httpx.Client):
    core = http.get("/api/v1").json()
    assert core["groupVersion"] == "v1"
    pods = next(r for r in core["resources"] if r["name"] == "pods")
    assert pods["namespaced"] is True and pods["kind"] == "Pod"
    assert http.get("/api").json()["versions"] == ["v1"]

    groups = {g["name"]: g for g in http.get("/apis").json()["groups"]}
    assert groups["emulator.pdfleet.io"]["preferredVersion"]["groupVersion"] == "emulator.pdfleet.io/v1"
    assert "apps" in groups and "apiextensions.k8s.io" in groups
    resources = {r["name"]: r for r in http.get("/apis/emulator.pdfleet.io/v1").json()["resources"]}
    assert resources["widgets"]["shortNames"] == ["wd"]
    assert resources["widgets"]["categories"] == ["emulated"]
    assert resources["widgets"]["namespaced"] is True
    assert resources["widgets/status"]["verbs"] == ["get", "patch", "update"]
    assert http.get("/openapi/v2").status_code == 200 and http.get("/openapi/v2").content == b""

    namespaces = http.get("/api/v1/namespaces").json()
    assert namespaces["kind"] == "NamespaceList"
    assert {"default", "kube-system"} <= {n["metadata"]["name"] for n in namespaces["items"]}
    assert http.get("/api/v1/namespaces/default").json()["status"]["phase"] == "Active"
    assert http.get("/apis/nothere.io/v1/things").status_code == 404


def test_create_fills_metadata_and_lists_have_kind_and_resource_version(widgets: Kube, http: httpx.Client):
    created = http.post(WIDGETS, json=widget("a", 2)).json()
    meta = created["metadata"]
    assert meta["namespace"] == "default" and meta["uid"] and meta["generation"] == 1
    assert meta["creationTimestamp"].endswith("Z") and int(meta["resourceVersion"]) > 0
    assert created["spec"]["color"] == "red"  # the schema default was applied
    second = http.post("/api/v1/namespaces/default/configmaps", json=cm("c")).json()
    assert int(second["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])  # one global counter

    listing = http.get(WIDGETS).json()
    assert listing["kind"] == "WidgetList" and listing["apiVersion"] == "emulator.pdfleet.io/v1"
    assert listing["metadata"]["resourceVersion"] == second["metadata"]["resourceVersion"]
    assert [i["metadata"]["name"] for i in listing["items"]] == ["a"]

    again = http.post(WIDGETS, json=widget("a"))
    assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"
    missing_ns = http.post("/api/v1/namespaces/nope/configmaps", json=cm("x"))
    assert missing_ns.status_code == 404 and missing_ns.json()["message"] == 'namespaces "nope" not found'
    generated = http.post(WIDGETS, json={**widget(""), "metadata": {"generateName": "w-"}}).json()
    assert generated["metadata"]["name"].startswith("w-") and len(generated["metadata"]["name"]) == 7


def test_generation_bumps_on_spec_changes_only(widgets: Kube, http: httpx.Client):
    http.post(WIDGETS, json=widget("g", 1))
    merge = {"headers": {"Content-Type": "application/merge-patch+json"}}
    spec = http.patch(f"{WIDGETS}/g", content=json.dumps({"spec": {"size": 2}}), **merge).json()
    assert spec["metadata"]["generation"] == 2
    labels = http.patch(f"{WIDGETS}/g", content=json.dumps({"metadata": {"labels": {"a": "b"}}}), **merge).json()
    assert labels["metadata"]["generation"] == 2
    assert int(labels["metadata"]["resourceVersion"]) > int(spec["metadata"]["resourceVersion"])
    status = http.patch(
        f"{WIDGETS}/g/status", content=json.dumps({"status": {"seen": 1}, "spec": {"size": 9}}), **merge
    ).json()
    assert status["metadata"]["generation"] == 2 and status["status"] == {"seen": 1}
    assert status["spec"]["size"] == 2  # a /status write changes only status
    main = http.patch(f"{WIDGETS}/g", content=json.dumps({"status": {"seen": 2}}), **merge).json()
    assert main["status"] == {"seen": 1}  # a main-resource write ignores status

    before = main["metadata"]["resourceVersion"]
    noop = http.patch(f"{WIDGETS}/g", content=json.dumps({"spec": {"size": 2}}), **merge).json()
    assert noop["metadata"]["resourceVersion"] == before  # no-op writes change nothing
    assert watch_events(http, WIDGETS, resourceVersion=before) == []


def test_watch_honours_resource_version_and_streams_changes(widgets: Kube, http: httpx.Client):
    merge = {"headers": {"Content-Type": "application/merge-patch+json"}}
    for name in ("a", "b"):
        http.post(WIDGETS, json=widget(name))
    since = http.get(WIDGETS).json()["metadata"]["resourceVersion"]
    http.post(WIDGETS, json=widget("c"))
    http.patch(f"{WIDGETS}/a", content=json.dumps({"spec": {"size": 5}}), **merge)
    http.delete(f"{WIDGETS}/b")

    after = watch_events(http, WIDGETS, resourceVersion=since)
    assert [(t, n) for t, n, _ in after] == [("ADDED", "c"), ("MODIFIED", "a"), ("DELETED", "b")]
    rvs = [int(rv) for _, _, rv in after]
    assert rvs == sorted(rvs) and rvs[0] > int(since)

    fresh = watch_events(http, WIDGETS, 2)  # no resourceVersion: the current state as ADDED first
    assert sorted((t, n) for t, n, _ in fresh) == [("ADDED", "a"), ("ADDED", "c")]

    initial = watch_events(http, WIDGETS, 3, sendInitialEvents="true", resourceVersionMatch="NotOlderThan")
    assert initial[-1][0] == "BOOKMARK" and [t for t, _, _ in initial[:-1]] == ["ADDED", "ADDED"]

    # A label-selector watch sees objects entering and leaving the selection as ADDED/DELETED.
    since = http.get(WIDGETS).json()["metadata"]["resourceVersion"]
    http.patch(f"{WIDGETS}/a", content=json.dumps({"metadata": {"labels": {"tier": "x"}}}), **merge)
    http.patch(f"{WIDGETS}/a", content=json.dumps({"spec": {"size": 6}}), **merge)
    http.patch(f"{WIDGETS}/a", content=json.dumps({"metadata": {"labels": {"tier": None}}}), **merge)
    selected = watch_events(http, WIDGETS, 3, resourceVersion=since, labelSelector="tier=x")
    assert [t for t, _, _ in selected] == ["ADDED", "MODIFIED", "DELETED"]
    one = watch_events(http, f"{WIDGETS}/c", 1)  # watching one object by its URL
    assert [(t, n) for t, n, _ in one] == [("ADDED", "c")]

    widgets.compact()
    gone = http.get(WIDGETS, params={"watch": "true", "resourceVersion": since, "timeoutSeconds": "1"})
    event = json.loads(gone.text.splitlines()[0])
    assert event["type"] == "ERROR" and event["object"]["code"] == 410


def test_watch_streams_live_events(widgets: Kube, http: httpx.Client):
    seen: list[tuple[str, str]] = []

    def consume() -> None:
        with httpx.Client(base_url=widgets.url, timeout=30) as client:
            with client.stream("GET", WIDGETS, params={"watch": "true", "timeoutSeconds": "30"}) as response:
                for line in response.iter_lines():
                    if line.strip():
                        event = json.loads(line)
                        seen.append((event["type"], event["object"]["metadata"]["name"]))
                        if event["type"] == "DELETED":
                            return

    since = len(widgets.requests_for(verb="watch", resource="widgets"))
    thread = threading.Thread(target=consume)
    thread.start()
    watching(widgets, "widgets", since)
    widgets.apply(widget("live"))
    widgets.patch("widgets", "live", {"spec": {"size": 3}})
    widgets.delete("widgets", "live")
    thread.join(30)  # (it returns at the DELETED event)
    assert not thread.is_alive(), seen
    assert seen == [("ADDED", "live"), ("MODIFIED", "live"), ("DELETED", "live")]


def test_patches_replace_conflicts_and_dry_run(widgets: Kube, http: httpx.Client):
    http.post(WIDGETS, json=widget("p", 1))
    rv = http.get(f"{WIDGETS}/p").json()["metadata"]["resourceVersion"]
    jp = {"Content-Type": "application/json-patch+json"}
    ok = http.patch(
        f"{WIDGETS}/p",
        headers=jp,
        content=json.dumps(
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "replace", "path": "/spec/size", "value": 4},
            ]
        ),
    )
    assert ok.status_code == 200 and ok.json()["spec"]["size"] == 4
    failed = http.patch(
        f"{WIDGETS}/p",
        headers=jp,
        content=json.dumps(
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "replace", "path": "/spec/size", "value": 5},
            ]
        ),
    )
    assert failed.status_code == 422 and failed.json()["kind"] == "Status"  # not a 500: clients must not retry
    smp = http.patch(f"{WIDGETS}/p", headers={"Content-Type": "application/strategic-merge-patch+json"}, content="{}")
    assert smp.status_code == 415  # as for real custom resources

    current = http.get(f"{WIDGETS}/p").json()
    stale = dict(current, metadata=dict(current["metadata"], resourceVersion=rv), spec={"size": 7})
    conflict = http.put(f"{WIDGETS}/p", json=stale)
    assert conflict.status_code == 409 and conflict.json()["reason"] == "Conflict"
    unconditional = http.put(f"{WIDGETS}/p", json=dict(current, metadata={"name": "p"}, spec={"size": 7}))
    assert unconditional.status_code == 422  # custom resources need a resourceVersion on PUT
    assert unconditional.json()["details"]["causes"][0]["field"] == "metadata.resourceVersion"
    replaced = http.put(f"{WIDGETS}/p", json=dict(current, spec={"size": 7}))
    assert replaced.status_code == 200 and replaced.json()["spec"] == {"size": 7, "color": "red"}
    assert replaced.json()["metadata"]["generation"] == 3

    before = widgets.resource_version
    assert http.post(WIDGETS, params={"dryRun": "All"}, json=widget("dry")).status_code == 201
    assert (
        http.patch(
            f"{WIDGETS}/p",
            params={"dryRun": "All"},
            headers={"Content-Type": "application/merge-patch+json"},
            content=json.dumps({"spec": {"size": 9}}),
        ).json()["spec"]["size"]
        == 9
    )
    assert http.delete(f"{WIDGETS}/p", params={"dryRun": "All"}).status_code == 200
    assert widgets.get("widgets", "dry") is None and widgets.get("widgets", "p")["spec"]["size"] == 7
    assert widgets.resource_version == before
    assert widgets.count_writes("widgets", name="dry") == 0  # dry runs are not counted as writes


def test_server_side_apply_creates_merges_and_forgets_dropped_fields(widgets: Kube, http: httpx.Client):
    apply = {"Content-Type": "application/apply-patch+yaml"}
    doc = {**widget("s", 2), "metadata": {"name": "s", "labels": {"a": "1", "b": "2"}}}
    created = http.patch(f"{WIDGETS}/s", params={"fieldManager": "me"}, headers=apply, content=yaml.safe_dump(doc))
    assert created.status_code == 201 and created.json()["metadata"]["labels"] == {"a": "1", "b": "2"}
    http.patch(
        f"{WIDGETS}/s",
        headers={"Content-Type": "application/merge-patch+json"},
        content=json.dumps({"metadata": {"annotations": {"other": "x"}}}),
    )
    doc["metadata"]["labels"] = {"a": "1"}
    doc["spec"]["maxSize"] = 10
    updated = http.patch(
        f"{WIDGETS}/s", params={"fieldManager": "me"}, headers=apply, content=yaml.safe_dump(doc)
    ).json()
    assert updated["metadata"]["labels"] == {"a": "1"}  # dropped by the same manager: removed
    assert updated["metadata"]["annotations"] == {"other": "x"}  # another writer's field stays
    assert updated["spec"]["maxSize"] == 10 and updated["metadata"]["generation"] == 2
    no_manager = http.patch(f"{WIDGETS}/s", headers=apply, content=yaml.safe_dump(doc))
    assert no_manager.status_code == 400


def test_finalizers_hold_deletion_until_removed(widgets: Kube, http: httpx.Client):
    merge = {"Content-Type": "application/merge-patch+json"}
    http.post(WIDGETS, json={**widget("f"), "metadata": {"name": "f", "finalizers": ["x/y"]}})
    since = http.get(WIDGETS).json()["metadata"]["resourceVersion"]
    deleting = http.delete(f"{WIDGETS}/f").json()
    assert deleting["metadata"]["deletionTimestamp"] and deleting["metadata"]["finalizers"] == ["x/y"]
    assert http.get(f"{WIDGETS}/f").status_code == 200
    more = http.patch(f"{WIDGETS}/f", headers=merge, content=json.dumps({"metadata": {"finalizers": ["x/y", "x/z"]}}))
    assert more.status_code == 422 and "no new finalizers" in more.json()["message"]
    http.patch(f"{WIDGETS}/f", headers=merge, content=json.dumps({"metadata": {"finalizers": None}}))
    assert http.get(f"{WIDGETS}/f").status_code == 404
    assert [t for t, _, _ in watch_events(http, WIDGETS, 2, resourceVersion=since)] == ["MODIFIED", "DELETED"]


def test_garbage_collection_by_owner_references(kube: Kube):
    owner = kube.apply(cm("owner"))[0]
    other = kube.apply(cm("other"))[0]

    def ref(o: dict) -> dict:
        return {"apiVersion": "v1", "kind": "ConfigMap", "name": o["metadata"]["name"], "uid": o["metadata"]["uid"]}

    kube.apply(cm("child", ownerReferences=[ref(owner)]))
    grandchild_owner = kube.get("configmaps", "child")
    kube.apply(cm("grandchild", ownerReferences=[ref(grandchild_owner)]))
    kube.apply(cm("shared", ownerReferences=[ref(owner), ref(other)]))
    kube.apply(cm("held", ownerReferences=[ref(owner)], finalizers=["x/y"]))

    kube.delete("configmaps", "owner")  # background cascade
    assert kube.get("configmaps", "child") is None and kube.get("configmaps", "grandchild") is None
    assert kube.get("configmaps", "shared") is not None  # another owner is alive
    assert kube.get("configmaps", "held")["metadata"]["deletionTimestamp"]  # finalizers still hold
    kube.delete("configmaps", "other")
    assert kube.get("configmaps", "shared") is None

    parent = kube.apply(cm("parent"))[0]
    kube.apply(cm("orphan", ownerReferences=[ref(parent)]))
    kube.delete("configmaps", "parent", propagation="Orphan")
    assert "ownerReferences" not in kube.get("configmaps", "orphan")["metadata"]


def test_namespaces_can_be_created_and_deleted_with_their_content(kube: Kube):
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    kube.apply(cm("a"), namespace="team")
    kube.apply(cm("b", finalizers=["x/y"]), namespace="team")
    kube.delete("namespaces", "team")
    assert kube.get("namespaces", "team")["status"]["phase"] == "Terminating"
    assert kube.get("configmaps", "a", "team") is None
    kube.patch("configmaps", "b", {"metadata": {"finalizers": []}}, "team")
    assert kube.get("namespaces", "team") is None


def test_admission_rejects_invalid_custom_resources_with_the_kubernetes_status(widgets: Kube, http: httpx.Client):
    bad = http.post(WIDGETS, json=widget("bad", 0))
    assert bad.status_code == 422
    status = bad.json()
    assert status["kind"] == "Status" and status["status"] == "Failure"
    assert status["reason"] == "Invalid" and status["code"] == 422
    assert status["message"] == (
        'Widget.emulator.pdfleet.io "bad" is invalid: spec.size: Invalid value: 0: '
        "spec.size in body should be greater than or equal to 1"
    )
    assert status["details"] == {
        "name": "bad",
        "group": "emulator.pdfleet.io",
        "kind": "Widget",
        "causes": [
            {
                "reason": "FieldValueInvalid",
                "field": "spec.size",
                "message": "Invalid value: 0: spec.size in body should be greater than or equal to 1",
            }
        ],
    }

    cel = http.post(WIDGETS, json=widget("cel", 5, maxSize=3)).json()
    assert cel["code"] == 422
    assert cel["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "field": "spec.size",
            "message": 'Invalid value: "object": size must not exceed maxSize',
        }
    ]
    enum = http.post(WIDGETS, json=widget("enum", 1, color="pink")).json()
    assert enum["details"]["causes"][0]["reason"] == "FieldValueNotSupported"
    name = http.post(WIDGETS, json=widget("Bad_Name")).json()
    assert name["details"]["causes"][0]["field"] == "metadata.name"

    strict = http.post(WIDGETS, params={"fieldValidation": "Strict"}, json=widget("u", 1, foo=1))
    assert strict.status_code == 400 and strict.json()["message"] == 'strict decoding error: unknown field "spec.foo"'
    warned = http.post(WIDGETS, params={"fieldValidation": "Warn"}, json=widget("u", 1, foo=1))
    assert warned.status_code == 201 and "foo" not in warned.json()["spec"]
    assert 'unknown field \\"spec.foo\\"' in warned.headers["warning"]
    invalid_update = http.patch(
        f"{WIDGETS}/u",
        headers={"Content-Type": "application/merge-patch+json"},
        content=json.dumps({"spec": {"size": -1}}),
    )
    assert invalid_update.status_code == 422 and widgets.get("widgets", "u")["spec"]["size"] == 1


def test_tables_use_printer_columns(widgets: Kube, http: httpx.Client):
    widgets.apply(widget("t", 3, color="blue"))
    widgets.patch_status("widgets", "t", {"conditions": [{"type": "Ready", "status": "True"}]})
    table = http.get(WIDGETS, headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}).json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Color", "Ready", "Age"]
    cells = table["rows"][0]["cells"]
    assert cells[:4] == ["t", 3, "blue", "True"] and cells[4].endswith("s")
    builtin = http.get("/api/v1/namespaces", headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}).json()
    assert [c["name"] for c in builtin["columnDefinitions"]] == ["Name", "Status", "Age"]


def test_label_and_field_selectors(kube: Kube, http: httpx.Client):
    kube.apply([cm("a", labels={"app": "x", "tier": "1"}), cm("b", labels={"app": "y"}), cm("c")])

    def names(**params: str) -> list[str]:
        items = http.get("/api/v1/namespaces/default/configmaps", params=params).json()["items"]
        return [i["metadata"]["name"] for i in items]

    assert names(labelSelector="app=x") == ["a"]
    assert names(labelSelector="app in (x,y),tier!=2") == ["a", "b"]
    assert names(labelSelector="!app") == ["c"]
    assert names(fieldSelector="metadata.name=b") == ["b"]
    assert (
        http.get("/api/v1/configmaps", params={"labelSelector": "app"}).json()["items"][0]["metadata"]["namespace"]
        == "default"
    )


def test_request_log_counts_writes_and_user_reactions_take_precedence(widgets: Kube, http: httpx.Client):
    widgets.clear_requests()
    http.post(WIDGETS, json=widget("r"))
    http.patch(f"{WIDGETS}/r", headers={"Content-Type": "application/merge-patch+json"}, content=b'{"spec":{"size":2}}')
    http.get(WIDGETS)
    assert widgets.count_writes("widgets") == 2
    assert widgets.verbs("widgets") == {"create", "patch", "list"}
    patch = widgets.requests_for(verb="patch")[0]
    assert (patch.name, patch.namespace, patch.patch_type, patch.body) == (
        "r",
        "default",
        "merge",
        {"spec": {"size": 2}},
    )

    widgets.emulator["get", kmock.resource("emulator.pdfleet.io", "v1", "widgets"), kmock.name("r")] << 503
    assert http.get(f"{WIDGETS}/r").status_code == 503
    assert http.get(WIDGETS).status_code == 200


# ----------------------------------------------------------------------------------------------
# Real clients
# ----------------------------------------------------------------------------------------------


def test_kubernetes_python_client(widgets: Kube):
    kubernetes = _need("kubernetes")
    api_client = kubernetes.config.new_client_from_config(config_file=str(widgets.kubeconfig))
    core = kubernetes.client.CoreV1Api(api_client)
    custom = kubernetes.client.CustomObjectsApi(api_client)

    created = core.create_namespaced_config_map("default", {"metadata": {"name": "py"}, "data": {"a": "1"}})
    assert created.metadata.uid and created.metadata.resource_version
    assert core.read_namespaced_config_map("py", "default").data == {"a": "1"}
    core.patch_namespaced_config_map("py", "default", {"data": {"b": "2"}})
    current = core.read_namespaced_config_map("py", "default")
    current.data = {"c": "3"}
    assert core.replace_namespaced_config_map("py", "default", current).data == {"c": "3"}
    assert [c.metadata.name for c in core.list_namespaced_config_map("default").items] == ["py"]
    assert "default" in [n.metadata.name for n in core.list_namespace().items]

    group, version, plural = "emulator.pdfleet.io", "v1", "widgets"
    custom.create_namespaced_custom_object(group, version, "default", plural, widget("w", 2))
    custom.patch_namespaced_custom_object_status(group, version, "default", plural, "w", {"status": {"ok": True}})
    obj = custom.get_namespaced_custom_object(group, version, "default", plural, "w")
    assert obj["status"] == {"ok": True} and obj["metadata"]["generation"] == 1
    with pytest.raises(kubernetes.client.ApiException) as error:
        custom.patch_namespaced_custom_object(group, version, "default", plural, "w", {"spec": {"size": 0}})
    assert error.value.status == 422 and "spec.size" in json.loads(error.value.body)["message"]

    since = core.list_namespaced_config_map("default").metadata.resource_version
    core.delete_namespaced_config_map("py", "default")
    stream = kubernetes.watch.Watch().stream(
        core.list_namespaced_config_map, "default", resource_version=since, timeout_seconds=1
    )
    assert [(e["type"], e["object"].metadata.name) for e in stream] == [("DELETED", "py")]
    api_client.close()


def test_kubectl(kube: Kube, tmp_path: pathlib.Path):
    kube.kubectl("version")  # fails the test in CI if kubectl is missing, skips locally
    crd_file = tmp_path / "widget-crd.yaml"
    crd_file.write_text(yaml.safe_dump(WIDGET_CRD))
    kube.kubectl("apply", "-f", str(crd_file))
    kube.kubectl("wait", "--for=condition=Established", "crd/widgets.emulator.pdfleet.io", "--timeout=5s")

    w1 = tmp_path / "w1.yaml"
    w1.write_text(yaml.safe_dump(widget("w1", 2, color="green")))
    assert "widget.emulator.pdfleet.io/w1 created" in kube.kubectl("apply", "-f", str(w1)).stdout
    assert "unchanged" in kube.kubectl("apply", "-f", str(w1)).stdout
    out = kube.kubectl("get", "wd").stdout.splitlines()
    assert out[0].split() == ["NAME", "SIZE", "COLOR", "READY", "AGE"]
    assert out[1].split()[:3] == ["w1", "2", "green"]

    dry = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(widget("dry"))).stdout
    assert "created (server dry run)" in dry
    assert kube.get("widgets", "dry") is None
    assert (
        "serverside-applied"
        in kube.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(widget("ssa", 4))).stdout
    )
    assert kube.get("widgets", "ssa")["spec"]["size"] == 4

    since = len(kube.requests_for(verb="watch", resource="widgets"))
    watcher = subprocess.Popen(
        [_kubectl(), "get", "widgets", "-w", "--no-headers"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kube.env,
    )
    printed: list[list[str]] = []
    reader = threading.Thread(target=lambda: printed.extend(line.split() for line in watcher.stdout if line.strip()))
    reader.start()
    try:
        # The change must reach kubectl through its watch: it lists first (w1 at size 2) and then watches.
        watching(kube, "widgets", since)
        kube.kubectl("patch", "widget", "w1", "--type=merge", "-p", '{"spec":{"size":3}}')
        kube.kubectl(
            "patch",
            "widget",
            "w1",
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status":{"conditions":[{"type":"Ready","status":"True"}]}}',
        )
        kube.kubectl("wait", "--for=condition=Ready", "widget/w1", "--timeout=5s")
        kube.wait_for(
            lambda: ["w1", "3", "green", "True"] in [line[:4] for line in printed],
            timeout=20,
            message=f"kubectl get -w to print w1 at size 3 and Ready (printed {printed})",
        )
    finally:
        watcher.terminate()
        watcher.communicate(timeout=5)
        reader.join(5)
    assert [line[:3] for line in printed if line[0] == "w1"][0] == ["w1", "2", "green"], printed  # (listed)

    current = kube.kubectl("get", "widget", "w1", "-o", "yaml").stdout
    replaced = current.replace("color: green", "color: blue")
    assert "replaced" in kube.kubectl("replace", "-f", "-", input=replaced).stdout
    stale = kube.kubectl("replace", "-f", "-", input=replaced, check=False)
    assert stale.returncode != 0 and "the object has been modified" in stale.stderr

    invalid = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(widget("bad", 0)), check=False)
    assert invalid.returncode != 0 and "spec.size" in invalid.stderr and "greater than or equal to 1" in invalid.stderr
    unknown = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(widget("bad", 1, foo=1)), check=False)
    assert unknown.returncode != 0 and 'unknown field "spec.foo"' in unknown.stderr

    since = len(kube.requests_for(verb="watch", resource="widgets"))
    waiter = subprocess.Popen(
        [_kubectl(), "wait", "--for=delete", "widget/w1", "--timeout=30s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kube.env,
    )
    watching(kube, "widgets", since)  # kubectl wait waits on a watch: the delete must reach it there
    kube.kubectl("delete", "widget", "w1")
    assert waiter.wait(timeout=15) == 0, waiter.stderr.read() if waiter.stderr else ""
    assert kube.get("widgets", "w1") is None
    assert {"create", "patch", "get", "list", "watch", "update", "delete"} <= kube.verbs("widgets")

    kube.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}}),
    )
    kube.kubectl("apply", "-n", "team", "-f", "-", input=yaml.safe_dump(widget("tw")))
    assert kube.kubectl("get", "ns", "team", "--no-headers").stdout.split()[:2] == ["team", "Active"]
    kube.kubectl("delete", "ns", "team", "--wait=true", "--timeout=10s")
    assert kube.get("namespaces", "team") is None and kube.get("widgets", "tw", "team") is None


def _kubectl() -> str:
    from tests.support.k8s_fixtures import find_kubectl

    binary = find_kubectl()
    assert binary is not None
    return binary


# ----------------------------------------------------------------------------------------------
# kopf
# ----------------------------------------------------------------------------------------------


def _exercise_operator(kube: Kube) -> None:
    kube.apply(widget("op", 3))
    kube.wait_for(
        lambda: (kube.get("widgets", "op") or {}).get("status", {}).get("create_fn"),
        timeout=20,
        message="kopf's create handler",
    )
    data = kube.get("configmaps", "op-data")
    assert data["data"] == {"size": "3"}
    assert data["metadata"]["ownerReferences"][0]["uid"] == kube.get("widgets", "op")["metadata"]["uid"]
    assert "emulator.pdfleet.io/finalizer" in kube.get("widgets", "op")["metadata"]["finalizers"]

    kube.patch("widgets", "op", {"spec": {"size": 5}})
    kube.wait_for(
        lambda: kube.get("configmaps", "op-data")["data"]["size"] == "5", timeout=20, message="kopf's update handler"
    )
    kube.wait_for(
        lambda: kube.get("widgets", "op").get("status", {}).get("size") == 5, timeout=10, message="status.size"
    )

    kube.delete("widgets", "op")
    kube.wait_for(lambda: kube.get("widgets", "op") is None, timeout=20, message="kopf to release its finalizer")
    assert kube.get("configmaps", "op-deleted")["data"] == {"by": "kopf"}
    assert kube.get("configmaps", "op-data") is None  # garbage-collected with its owner

    statuses = [r.status for r in kube.requests]
    assert all(s is not None and s < 500 for s in statuses), [r for r in kube.requests if (r.status or 500) >= 500]
    assert {"list", "watch", "patch"} <= kube.verbs("widgets")
    kube.wait_for(lambda: kube.count_writes("events"), timeout=10, message="kopf to post Kubernetes Events")


def test_kopf_run_subprocess(widgets: Kube, tmp_path: pathlib.Path):
    _need("kopf")
    log = (tmp_path / "kopf.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kopf", "run", "--standalone", "-A", "--verbose", str(OPERATOR)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=widgets.env,
        cwd=REPO,
    )
    try:
        _exercise_operator(widgets)
    except BaseException:
        log.seek(0)
        print(log.read()[-8000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.seek(0)
    output = log.read()
    assert "Traceback" not in output, output[-8000:]


def test_kopf_runner_in_process(widgets: Kube):
    testing = _need("kopf.testing")
    kopf = _need("kopf")
    # NOTE: kopf registers handlers in a process-wide default registry; other tests in this process
    # import pdfleet's own handlers into it. A fresh registry runs only the tiny test operator.
    previous = kopf.get_default_registry()
    kopf.set_default_registry(kopf.OperatorRegistry())
    try:
        with testing.KopfRunner(["run", "--standalone", "-A", "--verbose", str(OPERATOR)], timeout=30) as runner:
            _exercise_operator(widgets)
    finally:
        kopf.set_default_registry(previous)
    assert runner.exit_code == 0, runner.output[-8000:]
    assert runner.exception is None
    assert "Traceback" not in runner.output, runner.output[-8000:]


# ----------------------------------------------------------------------------------------------
# RBAC, opt-in per token
# ----------------------------------------------------------------------------------------------


def test_rbac_authorizes_a_service_account_by_the_stored_roles(widgets: Kube, http: httpx.Client):
    rbac = "rbac.authorization.k8s.io/v1"
    widgets.apply(
        [
            {
                "apiVersion": rbac,
                "kind": "Role",
                "metadata": {"name": "r", "namespace": "default"},
                "rules": [
                    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "patch"]},
                    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": ["mine"]},
                ],
            },
            {
                "apiVersion": rbac,
                "kind": "RoleBinding",
                "metadata": {"name": "r", "namespace": "default"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "r"},
                "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "ops"}],
            },
            {
                "apiVersion": rbac,
                "kind": "ClusterRole",
                "metadata": {"name": "w"},
                "rules": [{"apiGroups": ["emulator.pdfleet.io"], "resources": ["widgets"], "verbs": ["list"]}],
            },
            {
                "apiVersion": rbac,
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "w"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "w"},
                "subjects": [{"kind": "Group", "name": "system:serviceaccounts:ops"}],
            },
            cm("mine"),
            cm("other"),
            widget("owner"),
        ]
    )
    token = widgets.call(widgets.emulator.service_account, "ops", "op")
    auth = {"Authorization": f"Bearer {token}"}
    base = "/api/v1/namespaces/default/configmaps"
    assert http.get(base, headers=auth).status_code == 200
    assert http.get(f"{base}/mine", headers=auth).status_code == 200
    denied = http.get(f"{base}/other", headers=auth)
    assert denied.status_code == 403 and denied.json()["reason"] == "Forbidden"
    denied_message = (
        'configmaps "other" is forbidden: User "system:serviceaccount:ops:op" cannot get '
        'resource "configmaps" in API group "" in the namespace "default"'
    )
    assert denied.json()["message"] == denied_message
    assert (
        http.get("/api/v1/namespaces/kube-system/configmaps", headers=auth).status_code == 403
    )  # a Role is one namespace
    assert http.get("/api/v1/configmaps", headers=auth).status_code == 403  # ... not the cluster scope
    assert http.get("/apis/emulator.pdfleet.io/v1/widgets", headers=auth).status_code == 200  # the group's ClusterRole
    assert http.get("/apis", headers=auth).status_code == 200  # discovery: everyone
    assert http.get(base).status_code == 200  # no registered token: the tests' administrator
    # A server-side apply that would create needs create as well as patch.
    apply = {"Authorization": f"Bearer {token}", "Content-Type": "application/apply-patch+yaml"}
    created = http.patch(f"{base}/new", params={"fieldManager": "t"}, headers=apply, content=json.dumps(cm("new")))
    assert created.status_code == 403 and "cannot create resource" in created.json()["message"]
    assert (
        http.patch(
            f"{base}/mine", params={"fieldManager": "t"}, headers=apply, content=json.dumps(cm("mine"))
        ).status_code
        == 200
    )
    # OwnerReferencesPermissionEnforcement: blockOwnerDeletion needs update on the owner's finalizers; changing the
    # references of an existing object needs delete on it.
    uid = widgets.get("widgets.emulator.pdfleet.io", "owner")["metadata"]["uid"]
    ref = {"apiVersion": "emulator.pdfleet.io/v1", "kind": "Widget", "name": "owner", "uid": uid, "controller": True}
    owned = cm("mine", ownerReferences=[{**ref, "blockOwnerDeletion": True}])
    refused = http.patch(f"{base}/mine", params={"fieldManager": "t"}, headers=apply, content=json.dumps(owned))
    assert (
        refused.status_code == 403
        and "cannot set an ownerRef on a resource you can't delete" in refused.json()["message"]
    )
    widgets.apply(
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": {"name": "r", "namespace": "default"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "patch", "delete"]}],
        }
    )
    refused = http.patch(f"{base}/mine", params={"fieldManager": "t"}, headers=apply, content=json.dumps(owned))
    assert refused.status_code == 403 and refused.json()["message"].endswith(
        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on: User "
        '"system:serviceaccount:ops:op" cannot update resource "widgets/finalizers" in API group "emulator.pdfleet.io" '
        'in the namespace "default"'
    )
    assert (
        http.patch(
            f"{base}/mine",
            params={"fieldManager": "t"},
            headers=apply,
            content=json.dumps(cm("mine", ownerReferences=[ref])),
        ).status_code
        == 200
    )  # not blocking: fine
    widgets.apply(
        {
            "apiVersion": rbac,
            "kind": "ClusterRole",
            "metadata": {"name": "w"},
            "rules": [
                {"apiGroups": ["emulator.pdfleet.io"], "resources": ["widgets"], "verbs": ["list"]},
                {"apiGroups": ["emulator.pdfleet.io"], "resources": ["widgets/finalizers"], "verbs": ["update"]},
            ],
        }
    )
    assert (
        http.patch(f"{base}/mine", params={"fieldManager": "t"}, headers=apply, content=json.dumps(owned)).status_code
        == 200
    )
    assert [(r.verb, r.status, r.user) for r in widgets.requests if r.user][:2] == [
        ("list", 200, "system:serviceaccount:ops:op"),
        ("get", 200, "system:serviceaccount:ops:op"),
    ]
    denied = [r.denied for r in widgets.requests if r.denied]  # what the RBAC refused, not other 403s
    assert denied[0] == denied_message and len(denied) == 6


def test_request_log_names_what_a_label_selected_watch_sent(kube: Kube, http: httpx.Client):
    kube.apply([cm("a", labels={"app": "x"}), cm("b")])
    events = watch_events(http, "/api/v1/namespaces/default/configmaps", labelSelector="app=x")
    assert [name for _, name, _ in events] == ["a"]
    (entry,) = kube.requests_for(verb="watch")
    assert entry.objects == ["default/a"] and entry.query["labelSelector"] == "app=x"
    http.get("/api/v1/namespaces/default/configmaps")
    assert kube.requests_for(verb="list")[-1].objects == ["default/a", "default/b"]


def test_a_call_the_loop_does_not_run_in_time_says_where_the_loop_is(monkeypatch):
    """A test's call into the emulator waits CALL_TIMEOUT_S at most, then fails with the emulator thread's stack:
    what held its loop (a flake's diagnosis: a loaded full suite once waited out the limit)."""
    import time

    from tests.support.k8s import server

    monkeypatch.setattr(server, "CALL_TIMEOUT_S", 0.5)
    with server.EmulatorThread() as emu:
        held = threading.Event()

        def hold_the_loop() -> None:
            held.set()
            time.sleep(1.5)

        emu.loop.call_soon_threadsafe(hold_the_loop)
        assert held.wait(5)
        with pytest.raises(TimeoutError, match=r"did not run .* in 0.5 s; its thread is at:\n(.|\n)*hold_the_loop"):
            emu.call(lambda: 1)
        monkeypatch.setattr(server, "CALL_TIMEOUT_S", 10)
        assert emu.call(lambda: 2) == 2, "the loop, free again, runs the next call"

"""The reconcile path's inputs (desired replicas, pinned revision, extra status), error classes and /metrics."""

from __future__ import annotations

import asyncio
import datetime as dt

import kopf
import pytest

from pdfleet_operator.api import Condition
from pdfleet_operator.decide import worker_images
from pdfleet_operator.kube import client, exporter, handlers, render
from tests.kube.cluster import EXAMPLES, example_deployments, spec_of
from tests.kube.harness import children, prepare_cluster, running_operator, settle, wait_reconciled

KEY = ("default", "llama31-8b")


def call_in_operator(fn, *args, **kwargs) -> None:
    loop = handlers.RECONCILER.loop
    assert loop is not None
    loop.call_soon_threadsafe(lambda: fn(*args, **kwargs))


def test_autoscaler_and_rollback_inputs_flow_through_the_one_reconcile(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(EXAMPLES / "llama31-8b-pd-mig.yaml")
        wait_reconciled(kube, "llama31-8b")
        settle(kube)
        # Issue 6: the autoscaler asks for sizes; placement caps them (the MIG node has 4 slices).
        call_in_operator(handlers.RECONCILER.set_desired, KEY, {"prefill": 2, "decode": 6})
        cr = wait_reconciled(kube, "llama31-8b", check=lambda cr: cr["status"]["decodeReplicas"] == 4)
        assert cr["status"]["prefillReplicas"] == 2
        limited = next(c for c in cr["status"]["conditions"] if c["type"] == "ScalingLimited")
        assert limited["status"] == "True" and "missing 2 x nvidia.com/mig-3g.40gb" in limited["message"]
        assert kube.get("deployments.apps", "llama31-8b-decode-h100-mig-3g-40gb")["spec"]["replicas"] == 4
        assert handlers.RECONCILER.capacity(KEY) == {"prefill": 4, "decode": 4}
        # Issue 7: serve an older revision's template (here: a different image) without touching the spec.
        old = spec_of(example_deployments()["llama31-8b"]).model_copy(deep=True)
        old.engine.image = "ghcr.io/pdfleet/pdfleet-worker:0.0.9"
        call_in_operator(handlers.RECONCILER.set_template, KEY, handlers.Template(revision=7, spec=old))
        cr = wait_reconciled(kube, "llama31-8b", check=lambda cr: cr["status"]["currentRevision"] == 7)
        pool = kube.get("deployments.apps", "llama31-8b-prefill-h100-80gb")
        assert pool["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/pdfleet/pdfleet-worker:0.0.9"
        assert pool["spec"]["template"]["metadata"]["labels"][render.LABEL_REVISION] == "7"
        assert pool["spec"]["replicas"] == 2  # sizes still come from the autoscaler
        # Conditions and fields owned by others ride on the same status write.
        rolled = Condition(
            type="RolledBack",
            status="True",
            reason="ErrorRatio",
            message="5xx 4% > 1%",
            last_transition_time=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
        )
        call_in_operator(handlers.RECONCILER.set_status, KEY, conditions=[rolled], failed_revision=8, stable_revision=7)
        cr = wait_reconciled(kube, "llama31-8b", check=lambda cr: cr["status"].get("failedRevision") == 8)
        assert {c["type"]: c["reason"] for c in cr["status"]["conditions"]}["RolledBack"] == "ErrorRatio"
        assert cr["status"]["stableRevision"] == 7
        call_in_operator(handlers.RECONCILER.set_template, KEY, None)
        # Back to the spec's template: a template the pools do not run yet is the next revision number.
        wait_reconciled(kube, "llama31-8b", check=lambda cr: cr["status"]["currentRevision"] == 8)
        pool = kube.get("deployments.apps", "llama31-8b-prefill-h100-80gb")
        assert pool["spec"]["template"]["spec"]["containers"][0]["image"] == worker_images.DEFAULTS.get("cuda")
        settle(kube)
        assert len(children(kube, "llama31-8b")) == 12  # 9 + 2 NetworkPolicies + the router PDB
    text = exporter.text().decode()
    assert (
        'pdfleet_pool_replicas{accelerator="h100-mig-3g-40gb",deployment="llama31-8b",namespace="default",'
        'role="decode"} 4.0' in text
    )
    # No pod of it runs here (the emulator's controllers are off): planned, not billed (tests/kube/test_billing.py).
    assert (
        'pdfleet_pool_cost_per_hour{accelerator="h100-80gb",deployment="llama31-8b",namespace="default",'
        'role="prefill"} 0.0' in text
    )


async def test_invalid_spec_is_permanent_and_api_trouble_is_temporary() -> None:
    handlers.RECONCILER = handlers.Reconciler()
    handlers.RECONCILER.api = client.Api("http://127.0.0.1:9")  # nothing listens on the discard port
    body = {
        "apiVersion": "pdfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "x", "namespace": "default", "uid": "u", "generation": 1},
        "spec": {"model": {"name": "m", "source": {"local": {"path": "/m"}}}, "disaggregation": False},
    }
    with pytest.raises(kopf.PermanentError, match="with disaggregation true set prefill and decode|colocated only"):
        await handlers._reconcile_from_handler("default", "x", body, "created", {})
    body["spec"]["colocated"] = {"acceleratorClasses": ["cpu"]}
    with pytest.raises(kopf.TemporaryError, match="API server: 503 Unreachable"):
        await handlers._reconcile_from_handler("default", "x", body, "created", {})
    await handlers.RECONCILER.api.close()


def test_metrics_are_classic_text_and_forget_vanished_pools() -> None:
    exporter.set_pools("ns", "d", [("prefill", "a", 2, 5.0), ("decode", "b", 3, 1.5)], 1.0, 0.05)
    exporter.set_pools("ns", "d", [("prefill", "a", 1, 2.5)], 1.0, 0.05)
    text = exporter.text().decode()
    assert 'pdfleet_pool_replicas{accelerator="a",deployment="d",namespace="ns",role="prefill"} 1.0' in text
    assert 'accelerator="b",deployment="d"' not in text
    assert 'pdfleet_slo_itl_seconds{namespace="ns",pdfleet_deployment="d"} 0.05' in text
    exporter.forget("ns", "d")
    assert 'deployment="d"' not in exporter.text().decode()


async def test_metrics_endpoint_ignores_openmetrics_accept() -> None:
    import aiohttp

    from tests.support.components import free_port

    port = free_port()
    runner = await exporter.serve("127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(
                f"http://127.0.0.1:{port}/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0"}
            ) as resp:
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                assert "# EOF" not in await resp.text()
    finally:
        await runner.cleanup()


async def test_first_reconcile_waits_for_classes_and_nodes_and_listed_children_stand_in_until_indexed() -> None:
    """At start-up kopf runs handlers while its indexes still fill; planning then would see a missing class or node
    and move or delete serving pools, so the first reconcile waits for both. Children take minutes to index at
    scale: what the API listed at start stands in for a child kopf has not indexed yet (a status computed without
    the router's Deployment said the deployment was not serving, and was written on every restart)."""
    import asyncio

    def deployment(name: str, owner: str | None, role: str = "router") -> dict:
        labels = {render.LABEL_DEPLOYMENT: owner, render.LABEL_ROLE: role} if owner else {}
        if role != "router":
            labels[render.LABEL_ACCELERATOR] = "h100-80gb"
        refs = [{"controller": True, "uid": f"uid-{owner}"}]
        return {
            "metadata": {"name": name, "namespace": "default", "labels": labels, "ownerReferences": refs},
            "spec": {"replicas": 2},
        }

    router, decode = deployment("chat-router", "chat"), deployment("chat-decode-h100-80gb", "chat", "decode")
    other = deployment("code-router", "code")

    class FakeApi:
        async def list(self, kind, namespace, label_selector=None):
            if kind == "Deployment":
                assert label_selector == "app.kubernetes.io/managed-by=pdfleet-operator"
                return [router, decode, other, deployment("hand-made", None)]  # (unlabelled: not ours)
            if kind in ("AcceleratorClass", "Node"):
                names = {"AcceleratorClass": ["h100-80gb", "h200-141gb"], "Node": ["n1", "n2"]}[kind]
                return [{"metadata": {"name": n}} for n in names]
            return []

    rec = handlers.Reconciler()
    rec.indexes = {"class_index": {"h100-80gb": [object()]}, "node_index": {"n1": [object()]}}
    waiting = asyncio.ensure_future(rec.sync(FakeApi()))
    await asyncio.sleep(0.2)
    assert not waiting.done(), "planned before h200-141gb and n2 were indexed"
    rec.indexes["class_index"]["h200-141gb"] = [object()]
    rec.indexes["node_index"]["n2"] = [object()]
    await asyncio.wait_for(waiting, timeout=2)
    await asyncio.wait_for(rec.sync(FakeApi()), timeout=0.1)  # once per process

    def names_of(key: tuple[str, str]) -> list[str]:
        return sorted(o["metadata"]["name"] for o in rec.children(key, f"uid-{key[1]}", {}))

    # Nothing indexed yet: the listing stands in, children and the capacity the pools hold alike.
    assert names_of(("default", "chat")) == ["chat-decode-h100-80gb", "chat-router"]
    assert [(p["deployment"], p["role"], p["replicas"]) for p in rec.pools()] == [("chat", "decode", 2)]
    # Indexed: kopf's objects win and the listing of that deployment is dropped.
    rec.indexes["deployment_children"] = {("default", "chat"): [router, decode]}
    rec.indexes["pool_index"] = {("default", "chat"): [handlers.pool_view(decode)]}
    assert names_of(("default", "chat")) == ["chat-decode-h100-80gb", "chat-router"]
    assert ("default", "chat") not in rec._listed and len(rec.pools()) == 1
    # A child deleted meanwhile (kopf's DELETED event) is no longer stood in for.
    assert names_of(("default", "code")) == ["code-router"]
    rec.child_gone(("default", "code"), "Deployment", "code-router")
    assert names_of(("default", "code")) == []


async def test_a_silent_api_server_is_a_temporary_error_not_a_crash() -> None:
    """A server that accepts and never answers: the read timeout becomes 504, which kopf retries soon.
    (It was an uncaught asyncio.TimeoutError, retried by kopf only after 60 s; 73 of 500 CRs in bench/operator.py.)"""
    import asyncio

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    api = client.Api(f"http://127.0.0.1:{port}")
    api.read_timeout_s = 0.2
    try:
        with pytest.raises(client.ApiError) as err:
            await api.list("Node", None)
        assert err.value.code == 504 and err.value.heals
        handlers.RECONCILER = handlers.Reconciler()
        handlers.RECONCILER.api = api
        body = {
            "apiVersion": "pdfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "x", "namespace": "default", "uid": "u", "generation": 1},
            "spec": {
                "model": {"name": "m", "source": {"local": {"path": "/m"}}},
                "disaggregation": False,
                "colocated": {"acceleratorClasses": ["cpu"]},
            },
        }
        with pytest.raises(kopf.TemporaryError, match="504 Timeout"):
            await handlers._reconcile_from_handler("default", "x", body, "created", {})
    finally:
        await api.close()
        server.close()


async def test_periodic_resync_starts_a_round_only_after_the_previous_one_finished(monkeypatch) -> None:
    # A round that takes longer than the interval (here 5x) must not have the next stacked on top of it.
    interval, reconcile_s = 0.02, 0.1
    running, peak, rounds = 0, 0, 0

    async def slow(key, why):  # stands in for one reconcile of `key`
        nonlocal running, peak, rounds
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(reconcile_s)
        running -= 1
        rounds += key == KEY

    monkeypatch.setattr(handlers.OPTIONS, "resync_interval", interval)
    monkeypatch.setattr(handlers.RECONCILER, "bodies", lambda: {KEY: {}, ("default", "other"): {}})
    monkeypatch.setattr(handlers.RECONCILER, "_background", slow)
    started = asyncio.get_running_loop().time()
    loop = asyncio.ensure_future(handlers._resync_loop())

    async def rounds_done(n: int) -> None:
        while rounds < n:
            await asyncio.sleep(0.01)

    # NOTE: synchronized on the rounds (a loaded machine may run fewer in any fixed time), then bounded by the
    # time they took: round k cannot end before k x (interval + reconcile) when rounds never overlap.
    await asyncio.wait_for(rounds_done(3), 30)
    elapsed = asyncio.get_running_loop().time() - started
    loop.cancel()
    assert peak == 2  # the two deployments of one round, never two rounds at once
    assert rounds <= elapsed / (interval + reconcile_s) + 1, (rounds, elapsed)


def test_the_autoscaler_reads_each_role_with_the_engines_its_pools_run(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(EXAMPLES / "qwen2-7b-vllm.yaml")
        kube.apply(EXAMPLES / "llama31-8b-pd-mig.yaml")
        wait_reconciled(kube, "qwen2-7b-vllm")
        wait_reconciled(kube, "llama31-8b")
        assert handlers.RECONCILER.engines(("default", "qwen2-7b-vllm")) == {"colocated": ["vllm"]}
        assert handlers.RECONCILER.engines(KEY) == {"prefill": ["pdfleet"], "decode": ["pdfleet"]}


def test_diff_base_is_kopfs_essence_of_an_inference_deployment_and_nothing_for_children() -> None:
    """kopf's own `DiffBaseStorage.build` is the oracle; the slim copy must give the same essence."""
    body = {
        "apiVersion": "pdfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {
            "name": "chat",
            "namespace": "default",
            "uid": "u1",
            "resourceVersion": "42",
            "generation": 3,
            "labels": {"team": "a"},
            "annotations": {
                "pdfleet.io/rollback-to": "2",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
            },
            "managedFields": [{"manager": "pdfleet-operator", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {"model": {"name": "m", "source": {"pvc": {"claimName": "x"}}}, "tier": "cost"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "pools": [{"name": "p"}]},
    }

    class KopfDefault(kopf.DiffBaseStorage):  # kopf's build, unchanged
        def fetch(self, *, body):
            return None

        def store(self, *, body, patch, essence):
            pass

    ours = handlers.MemoryDiffBaseStorage()
    assert ours.build(body=kopf.Body(body)) == KopfDefault().build(body=kopf.Body(body))
    assert ours.build(body=kopf.Body(body))["spec"] == body["spec"]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "uid": "u2"}, "spec": {}}
    assert ours.build(body=kopf.Body(deployment)) == {}
    # The shortcut holds only while no other kind has create/update/resume/delete handlers or daemons.
    registry = kopf._core.intents.registries.get_default_registry()
    changing = {h.selector.any_name for h in registry._changing.get_all_handlers()}
    assert changing == {"inferencedeployments"} and len(handlers.CHANGING_KINDS) == 1
    assert not list(registry._spawning.get_all_handlers())

"""Two operator replicas with leader election (processes, the chart's RBAC enforced by the emulator): one acts, the
other stands by without a single write; killed, the leader is replaced after the lease duration, never before, and
no object is written twice; stopped, a leader hands over at once."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest

from pdfleet_operator.kube import leader
from tests.kube import ha
from tests.kube.cluster import EXAMPLES
from tests.kube.ha import settle
from tests.kube.harness import children, prepare_cluster, wait_reconciled

LLAMA = EXAMPLES / "llama31-8b-pd-mig.yaml"
TINY = EXAMPLES / "local-tiny.yaml"


def _object_writes(requests: list) -> Counter:
    """Writes per object (kind, namespace, name, subresource): not the Lease, Events, or the token Secret's 409."""
    return Counter(
        (r.resource, r.namespace, r.name or ((r.body or {}).get("metadata") or {}).get("name"), r.subresource)
        for r in requests
        if r.is_write
        and r.pod is not None
        and r.resource not in ("leases", "events")
        and not (r.resource == "secrets" and r.status == 409)
    )


@pytest.mark.slow
def test_one_replica_acts_the_other_takes_over_when_it_dies_and_nothing_is_written_twice(kube, tmp_path) -> None:
    prepare_cluster(kube)
    ha.install_chart_rbac(kube)
    a = ha.Replica(kube, "pdfleet-operator-a", tmp_path)
    b = ha.Replica(kube, "pdfleet-operator-b", tmp_path)
    c = ha.Replica(kube, "pdfleet-operator-c", tmp_path, lease_duration=30.0, renew_deadline=20.0)
    try:
        a.start()
        kube.wait_for(lambda: ha.lease_holder(kube) == a.pod, timeout=20, message="a to take the Lease")
        b.start()
        kube.apply(LLAMA)
        kube.apply(TINY)
        wait_reconciled(kube, "llama31-8b", timeout=30)
        wait_reconciled(kube, "local-tiny", timeout=30)
        settle(kube)
        assert b.leader_gauge() == 0 and a.leader_gauge() == 1
        # The standby only reads the Lease: no watch, no list, no write.
        assert {(r.verb, r.resource) for r in kube.requests if r.pod == b.pod} == {("get", "leases")}, Counter(
            (r.pod, r.verb, r.resource) for r in kube.requests
        )
        assert not [r.denied for r in kube.requests if r.denied], "the chart's RBAC refused a request"
        created = _object_writes(kube.requests)
        assert created and set(created.values()) == {1}, created
        assert len(children(kube, "llama31-8b")) == 12  # 9 + 2 NetworkPolicies + the router PDB

        a.kill()
        kube.wait_for(lambda: ha.lease_holder(kube) == b.pod, timeout=10 * a.lease_duration, message="b to take over")
        kube.wait_for(lambda: b.leader_gauge() == 1, timeout=30, message="b's operator running")
        settle(kube, quiet=1.0)
        history = ha.lease_writes(kube.requests)
        last_renewal = max(spec["renewTime"] for pod, spec in history if pod == a.pod)
        takeover = next(spec for pod, spec in history if pod == b.pod)
        # never before a's lease ran out: b takes over on its own clock, lease_duration after it saw a's last renewal
        assert takeover["acquireTime"] > last_renewal and takeover["leaseTransitions"] == 1
        assert _seconds(takeover["acquireTime"]) - _seconds(last_renewal) >= a.lease_duration
        # b's start re-reconciled both CRs and found nothing to change: still every object written once.
        assert _object_writes(kube.requests) == created
        assert [w for w in ha.writes_outside_lease(kube.requests)] == []

        kube.patch("infdep", "llama31-8b", {"spec": {"decode": {"minReplicas": 3}}})
        wait_reconciled(kube, "llama31-8b", check=lambda cr: cr["status"]["decodeReplicas"] == 3)
        settle(kube)
        decode = ("deployments", "default", "llama31-8b-decode-h100-mig-3g-40gb", None)
        pdb = ("poddisruptionbudgets", "default", "llama31-8b-decode", None)  # (its minAvailable follows the size)
        after = _object_writes(kube.requests)
        assert after[decode] == 2 and {k: v for k, v in after.items() if k[3] != "status"} == {
            **{k: v for k, v in created.items() if k[3] != "status"},
            decode: 2,
            pdb: 2,
        }, "b applied the edit, once"
        assert {r.pod for r in kube.requests if r.is_write and r.resource == "deployments"} == {a.pod, b.pod}

        # A rolling update: a new standby, and the leader stopped by SIGTERM releases the Lease at once.
        c.start()
        assert b.stop() == 0
        assert ha.lease_holder(kube) in (None, c.pod)
        kube.wait_for(lambda: ha.lease_holder(kube) == c.pod, timeout=15, message="c to take the released Lease")
        released = [spec for pod, spec in ha.lease_writes(kube.requests) if pod == b.pod][-1]
        assert "holderIdentity" not in released
        settle(kube, quiet=1.0)
        assert c.stop() == 0
        assert ha.writes_outside_lease(kube.requests) == []
        assert not [r.denied for r in kube.requests if r.denied]
    finally:
        for replica in (a, b, c):
            replica.kill()
    assert {r.user for r in kube.requests if r.pod} == {f"system:serviceaccount:{ha.NAMESPACE}:{ha.SERVICE_ACCOUNT}"}


def _seconds(micro_time: str) -> float:
    import datetime as dt

    return dt.datetime.strptime(micro_time, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc).timestamp()


TOKEN = "alertmanager-bearer-token"
TRIGGERS = "pdfleet_operator_alert_triggers_total "


def _alert(deployment: str) -> str:
    return json.dumps(
        {
            "version": "4",
            "status": "firing",
            "receiver": "pdfleet",
            "groupKey": "{}",
            "alerts": [
                {
                    "status": "firing",
                    "startsAt": "2026-11-30T10:00:00Z",
                    "fingerprint": "f1",
                    "labels": {
                        "alertname": "PdfleetHigh5xxRatio",
                        "pdfleet_alert": "rollback",
                        "namespace": "default",
                        "pdfleet_deployment": deployment,
                    },
                }
            ],
        }
    )


def _until_relayed(replica: ha.Replica, body: str, timeout: float = 30.0):
    """Post as Alertmanager does: again after a 503 (the standby has not read the leader's URL yet, or the new leader's
    receiver is not bound yet: its port is closed between the relay's cleanup and the receiver's start), until another
    answer comes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = replica.post_alert(body, TOKEN)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        else:
            if resp.status_code != 503 or time.monotonic() > deadline:
                return resp
        time.sleep(0.1)


def _relayed(replica: ha.Replica, outcome: str) -> float:
    return replica.metric(f'pdfleet_operator_alerts_relayed_total{{outcome="{outcome}"}}') or 0.0


@pytest.mark.slow
def test_an_alert_sent_to_the_standby_reaches_the_leaders_receiver_and_nothing_unauthenticated_is_relayed(
    kube, tmp_path
) -> None:
    prepare_cluster(kube)
    ha.install_chart_rbac(kube)
    a = ha.Replica(kube, "pdfleet-operator-a", tmp_path, alertmanager_token=TOKEN)
    # b leads second with a long lease: once it is killed, c knows it as the (unreachable) leader for 30 s
    b = ha.Replica(
        kube, "pdfleet-operator-b", tmp_path, alertmanager_token=TOKEN, lease_duration=30.0, renew_deadline=20.0
    )
    c = ha.Replica(kube, "pdfleet-operator-c", tmp_path, alertmanager_token=TOKEN)
    try:
        a.start()
        kube.wait_for(lambda: ha.lease_holder(kube) == a.pod, timeout=20, message="a to take the Lease")
        lease = kube.get("leases.coordination.k8s.io", ha.LEASE, ha.NAMESPACE)
        assert (
            lease["metadata"]["annotations"][leader.ALERTMANAGER_URL_ANNOTATION]
            == f"http://127.0.0.1:{a.alertmanager_port}"
        )
        b.start()
        kube.apply(TINY)
        wait_reconciled(kube, "local-tiny", timeout=30)
        settle(kube)

        # Through the standby: a's receiver takes the alert in (its counter, and its answer passed back).
        resp = _until_relayed(b, _alert("local-tiny"))
        assert resp.status_code == 200 and resp.json() == {"accepted": 1}, (resp.status_code, resp.text, b.log())
        assert a.metric(TRIGGERS) == 1 and b.metric(TRIGGERS) == 0 and _relayed(b, "relayed") == 1
        assert "standby: relayed an Alertmanager payload to the leader" in b.log()

        # A wrong or missing token at the standby: 401, and nothing reaches the leader.
        for token in ("wrong", None):
            resp = b.post_alert(_alert("local-tiny"), token)
            assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer", token
        assert _relayed(b, "unauthorized") == 2 and _relayed(b, "relayed") == 1 and a.metric(TRIGGERS) == 1
        # The relay made the standby send nothing to the API server but its reads of the Lease.
        assert {(r.verb, r.resource) for r in kube.requests if r.pod == b.pod} == {("get", "leases")}

        # A rolling update: a releases, b takes over; b's relay is gone and b's own receiver has the same port.
        assert a.stop() == 0
        kube.wait_for(lambda: ha.lease_holder(kube) == b.pod, timeout=15, message="b to take the released Lease")
        kube.wait_for(lambda: b.leader_gauge() == 1, timeout=30, message="b's operator running")
        resp = _until_relayed(b, _alert("local-tiny"))
        assert resp.status_code == 200 and resp.json() == {"accepted": 1}, (resp.status_code, resp.text, b.log())
        assert b.metric(TRIGGERS) == 1 and _relayed(b, "relayed") == 1
        lease = kube.get("leases.coordination.k8s.io", ha.LEASE, ha.NAMESPACE)
        assert (
            lease["metadata"]["annotations"][leader.ALERTMANAGER_URL_ANNOTATION]
            == f"http://127.0.0.1:{b.alertmanager_port}"
        )

        # c stands by and relays to b; b dies (its Lease unexpired for 30 s): c answers 503 with Retry-After.
        c.start()
        resp = _until_relayed(c, _alert("local-tiny"))
        assert resp.status_code == 200 and b.metric(TRIGGERS) == 2
        b.kill()
        resp = c.post_alert(_alert("local-tiny"), TOKEN)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", resp.text
        assert "cannot be reached" in resp.json()["error"] and _relayed(c, "unreachable") == 1
        assert ha.lease_holder(kube) == b.pod  # c did not take over: the 503 came from a known, unreachable leader
        assert "not relayed (503, Alertmanager retries)" in c.log()
        assert ha.writes_outside_lease(kube.requests) == []
        assert not [r.denied for r in kube.requests if r.denied]
    finally:
        for replica in (a, b, c):
            replica.kill()

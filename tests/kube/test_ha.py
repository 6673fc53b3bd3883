"""Two operator replicas with leader election (processes, the chart's RBAC enforced by the emulator): one acts, the
other stands by without a single write; killed, the leader is replaced after the lease duration, never before, and
no object is written twice; stopped, a leader hands over at once."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.kube import ha
from tests.kube.cluster import EXAMPLES
from tests.kube.ha import settle
from tests.kube.harness import children, prepare_cluster, wait_reconciled

LLAMA = EXAMPLES / "llama31-8b-pd-mig.yaml"
TINY = EXAMPLES / "local-tiny.yaml"


def _object_writes(requests: list) -> Counter:
    """Writes per object (kind, namespace, name, subresource): not the Lease, Events, or the token Secret's 409."""
    return Counter((r.resource, r.namespace, r.name or ((r.body or {}).get("metadata") or {}).get("name"), r.subresource)
                   for r in requests
                   if r.is_write and r.pod is not None and r.resource not in ("leases", "events")
                   and not (r.resource == "secrets" and r.status == 409))


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
        assert {(r.verb, r.resource) for r in kube.requests if r.pod == b.pod} == {("get", "leases")}, Counter((r.pod, r.verb, r.resource) for r in kube.requests)
        assert not [r.denied for r in kube.requests if r.denied], "the chart's RBAC refused a request"
        created = _object_writes(kube.requests)
        assert created and set(created.values()) == {1}, created
        assert len(children(kube, "llama31-8b")) == 11

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
        after = _object_writes(kube.requests)
        assert after[decode] == 2 and {k: v for k, v in after.items() if k[3] != "status"} == {**{
            k: v for k, v in created.items() if k[3] != "status"}, decode: 2}, "b applied the edit, once"
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

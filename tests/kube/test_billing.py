"""Bill what runs (issue 17): pdfleet_pool_cost_per_hour counts the pods bound to nodes, not the plan: Pending
replicas hold no accelerator and cost nothing until they bind. The operator against the emulator with its
Deployment controller and scheduler on."""

from __future__ import annotations

import re

from pdfleet_operator.kube import exporter
from tests.kube.harness import prepare_cluster, running_operator, wait_reconciled
from tests.kube.test_capacity import cluster, fleet, pending

PRICE = 0.99  # l40s-48gb, $/GPU-hour (examples/acceleratorclasses.yaml)


def billed(name: str) -> float | None:
    m = re.search(
        r'^pdfleet_pool_cost_per_hour\{accelerator="l40s-48gb",deployment="%s",namespace="default",'
        r'role="colocated"\} ([\d.e+-]+)$' % name,
        exporter.text().decode(),
        re.M,
    )
    return float(m.group(1)) if m else None


def test_pending_replicas_are_not_billed_until_they_bind(kube) -> None:
    prepare_cluster(kube, nodes=cluster(3))
    wl = kube.call(kube.emulator.enable_workloads)
    with running_operator(kube):
        kube.call(wl.hold)  # the scheduler lags: the pods exist, none is bound
        kube.apply([fleet("alpha", 2)])
        cr = wait_reconciled(kube, "alpha")
        assert cr["status"]["costPerHour"] >= 2 * PRICE, "the status keeps the plan's price"
        kube.wait_for(lambda: len(pending(kube, ["alpha"])) == 2, message="two Pending workers")
        kube.patch("infdep", "alpha", {"metadata": {"annotations": {"touch": "1"}}})  # one more reconcile
        kube.wait_for(lambda: billed("alpha") == 0.0, message="Pending workers billed at $0")
        kube.call(wl.hold, False)
        kube.wait_for(lambda: not pending(kube, ["alpha"]), message="the workers bound")
        kube.wait_for(
            lambda: billed("alpha") == round(2 * PRICE, 4) or billed("alpha") == 2 * PRICE,
            timeout=20,
            message=f"two bound workers billed: {billed('alpha')}",
        )

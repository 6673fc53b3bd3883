"""A rollback survives operator restarts: real Prometheus, kopf against the emulator, one new process after another.

The rollback state of a process (the revision served instead of the spec, the failed revision, a
standing page) is rebuilt from the status, the ControllerRevisions and the ConfigMap by the next process, so a
restart writes no Deployment, re-applies no failed revision and pages nobody again; a spec change
made while no operator ran rolls forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from pdfleet_operator.api import parse_duration
from pdfleet_operator.decide import rollback
from pdfleet_operator.kube import handlers, render
from tests.kube.harness import changing_writes, events, prepare_cluster, running_operator, settle, wait_reconciled
from tests.kube.test_rollback_wiring import BAD, FOR, GOOD, NAME, NEXT, WINDOW, Router, conditions, image_of, spec

ANALYSIS_S = 1.0
# Long enough for the analysis of a new process to have acted on anything it would act on.
ANALYSIS_SPAN_S = parse_duration(WINDOW) + parse_duration(FOR) + 2 * ANALYSIS_S


def reasons(kube: Any) -> list[str]:
    return [e["reason"] for e in events(kube, NAME)]


@contextlib.contextmanager
def restarted(kube: Any) -> Iterator[None]:
    """A new operator process, entered once it has reconciled the deployment and its analysis had time to act."""
    kube.clear_requests()
    with running_operator(kube, analysis_interval=ANALYSIS_S):
        kube.wait_for(
            lambda: handlers.RECONCILER.reconciles >= 1, timeout=30, message="the new process's first reconcile"
        )
        time.sleep(ANALYSIS_SPAN_S)
        settle(kube)
        yield


def test_rollback_state_survives_restarts_and_a_spec_change_made_while_down_rolls_forward(
    kube, prometheus_factory
) -> None:
    router = Router(kube.url)
    try:
        prom = prometheus_factory(
            interval="1s",
            extra_scrape_configs=[
                {
                    "job_name": "router",
                    "static_configs": [
                        {"targets": [router.target], "labels": {"namespace": "default", "pdfleet_deployment": NAME}}
                    ],
                }
            ],
        )
        prom.wait_for(f'pdfleet_router_requests_total{{pdfleet_deployment="{NAME}"}}')
        prepare_cluster(kube)

        # Process 1: revision 1 becomes stable, the bad revision 2 is rolled back by the analysis timer.
        with running_operator(kube, analysis_interval=ANALYSIS_S):
            kube.apply(spec(GOOD, prom.url))
            wait_reconciled(kube, NAME, timeout=30, check=lambda cr: cr["status"].get("stableRevision") == 1)
            kube.patch("infdep", NAME, {"spec": {"engine": {"image": BAD}}})
            kube.wait_for(lambda: router.failing_since is not None, timeout=10, message="the error burst")
            kube.wait_for(lambda: image_of(kube) == GOOD, timeout=40, message="the pools back on revision 1")
            wait_reconciled(
                kube,
                NAME,
                check=lambda cr: (
                    cr["status"].get("failedRevision") == 2 and conditions(cr)["RolledBack"]["status"] == "True"
                ),
            )
            settle(kube)
        assert reasons(kube).count("RolledBack") == 1

        # Process 2: keeps serving revision 1 (no Deployment written, revision 2 not re-applied), says nothing new.
        with restarted(kube):
            assert kube.count_writes("deployments") == 0, [(r.verb, r.name) for r in kube.writes("deployments")]
            assert image_of(kube) == GOOD
            cr = kube.get("infdep", NAME, "default")
            assert cr["spec"]["engine"]["image"] == BAD
            assert (
                cr["status"]["currentRevision"],
                cr["status"]["stableRevision"],
                cr["status"]["failedRevision"],
            ) == (1, 1, 2)
            assert (
                conditions(cr)["RolledBack"]["status"] == "True"
                and conditions(cr)["Degraded"]["reason"] == "RolledBack"
            )
            assert changing_writes(kube) == [], [(r.verb, r.resource, r.name) for r in changing_writes(kube)]
            assert reasons(kube).count("RolledBack") == 1 and "RollbackFailed" not in reasons(kube)

            # By hand back onto the broken revision: the rollback goes bad and pages once.
            kube.patch("infdep", NAME, {"metadata": {"annotations": {rollback.ANNOTATION_ROLLBACK_TO: "2"}}})
            kube.wait_for(lambda: image_of(kube) == BAD, timeout=15, message="manual rollback to revision 2")
            kube.wait_for(lambda: "RollbackFailed" in reasons(kube), timeout=30, message="the failed rollback paged")
            wait_reconciled(kube, NAME, check=lambda cr: conditions(cr)["Degraded"]["reason"] == "RollbackFailed")
            settle(kube)

        # Process 3: still serves revision 2 as the manual rollback chose, and does not page again.
        with restarted(kube):
            assert kube.count_writes("deployments") == 0 and image_of(kube) == BAD
            cr = kube.get("infdep", NAME, "default")
            assert conditions(cr)["RolledBack"]["reason"] == "ManualRollback"
            assert conditions(cr)["Degraded"]["reason"] == "RollbackFailed"
            assert reasons(kube).count("RollbackFailed") == 1

        # While no operator runs, the served revision's record is deleted: the ConfigMap still records revision 2,
        # so process 4 keeps serving it with no write and no page.
        kube.delete("controllerrevisions.apps", f"{NAME}-rev-2", "default")
        with restarted(kube):
            assert kube.count_writes("deployments") == 0 and image_of(kube) == BAD
            assert rollback.REASON_REVISION_MISSING not in reasons(kube)
            assert conditions(kube.get("infdep", NAME, "default"))["Degraded"]["reason"] == "RollbackFailed"
            assert reasons(kube).count("RollbackFailed") == 1

        # With the ConfigMap's record gone too (edited by hand), process 5 holds the pools and pages once;
        # process 6 does not page again.
        kube.patch(
            "configmaps",
            render.config_name(NAME),
            {"metadata": {"annotations": {render.ANNOTATION_REVISION_SPEC: None}}},
            "default",
        )
        for _ in range(2):
            with restarted(kube):
                assert kube.count_writes("deployments") == 0 and image_of(kube) == BAD
                assert reasons(kube).count(rollback.REASON_REVISION_MISSING) == 1
                cr = kube.get("infdep", NAME, "default")
                assert conditions(cr)["Degraded"]["reason"] == rollback.REASON_REVISION_MISSING
                assert "revision 2" in conditions(cr)["Degraded"]["message"]

        # The spec changes while no operator runs: process 7 rolls forward to revision 3.
        kube.patch("infdep", NAME, {"spec": {"engine": {"image": NEXT}}})
        kube.clear_requests()
        with running_operator(kube, analysis_interval=ANALYSIS_S):
            kube.wait_for(lambda: image_of(kube) == NEXT, timeout=30, message="roll forward to revision 3")
            cr = wait_reconciled(
                kube,
                NAME,
                check=lambda cr: (
                    cr["status"]["currentRevision"] == 3 and conditions(cr)["RolledBack"]["status"] == "False"
                ),
            )
            assert conditions(cr)["RolledBack"]["reason"] == "RolledForward"
            assert conditions(cr)["Degraded"]["status"] == "False"
            pools = [
                d
                for d in kube.list("deployments.apps", "default", label_selector=f"{render.LABEL_DEPLOYMENT}={NAME}")
                if d["metadata"]["labels"][render.LABEL_ROLE] != render.ROUTER_ROLE
            ]
            assert {p["spec"]["template"]["metadata"]["labels"][render.LABEL_REVISION] for p in pools} == {"3"}
            cr = wait_reconciled(kube, NAME, timeout=20, check=lambda cr: cr["status"].get("stableRevision") == 3)
    finally:
        router.close()

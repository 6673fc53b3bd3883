"""A new operator process takes over the rollback state the previous one left in the cluster (`rollback.resume`).

The inputs are what survives a restart: the status (RolledBack and its observedGeneration,
currentRevision, failedRevision, a standing page) and the ControllerRevisions; the answer is which
template to serve and what the analysis must not say again.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pdfleet_operator.api import Condition, InferenceDeploymentSpec, InferenceDeploymentStatus
from pdfleet_operator.decide import rollback
from pdfleet_operator.kube import render, revisions

GOOD, BAD, NEXT = "worker:good", "worker:broken", "worker:next"
OWNER = render.Owner("guarded", "default", "uid-1")
AT = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)


def spec(image: str, max_replicas: int = 2, soak: str = "2s") -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "tiny", "source": {"local": {"path": "/models/tiny"}}, "maxModelLen": 1024},
            "engine": {"image": image},
            "prefill": {"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": max_replicas},
            "decode": {"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": max_replicas},
            "rollback": {"soakTime": soak},
        }
    )


def stored(*images: str) -> list[dict[str, Any]]:
    """ControllerRevisions 1..n holding these images, as the operator stores them: from revision n's
    ConfigMap once revision n + 1 supersedes it."""
    out: list[dict[str, Any]] = []
    for n, image in enumerate(images, start=1):
        record = revisions.superseded(render.config_map(OWNER, spec(image), n), OWNER, n + 1, out)
        assert record is not None
        out.append(record)
    return out


def cond(type_: str, status: str, reason: str, message: str = "", generation: int | None = 2) -> Condition:
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=AT,
        observed_generation=generation,
    )


def rolled_back(
    current: int = 1, failed: int | None = 2, generation: int | None = 2, stable: int | None = 1
) -> InferenceDeploymentStatus:
    """The status a process writes after rolling revision `failed` back to `current` at `generation`."""
    return InferenceDeploymentStatus(
        observed_generation=generation,
        current_revision=current,
        stable_revision=stable,
        failed_revision=failed,
        conditions=[
            cond("RolledBack", "True", "HighErrorRatio", f"revision {failed} rolled back to {current}", generation),
            cond("Degraded", "True", "RolledBack", "", generation),
        ],
    )


def test_failed_spec_still_in_place_keeps_serving_the_stable_revision() -> None:
    got = rollback.resume(rolled_back(), 2, spec(BAD), stored(GOOD, BAD))
    assert got.kind == "stored" and got.template == 1
    assert got.spec is not None and got.spec.engine.image == GOOD
    assert got.failed == rollback.Failed(2, 2, rollback.fingerprint(rollback.template_spec(spec(BAD))))


def test_a_new_generation_with_the_same_template_is_still_rolled_back_and_keeps_the_new_policies() -> None:
    edited = spec(BAD, max_replicas=4, soak="9m")  # sizes and policies changed, not what the pods run
    got = rollback.resume(rolled_back(), 3, edited, stored(GOOD, BAD))
    assert got.kind == "stored" and got.template == 1
    assert got.spec.engine.image == GOOD and got.spec.prefill.max_replicas == 4 and got.spec.rollback.soak_time == "9m"


def test_spec_changed_while_no_process_watched_rolls_forward() -> None:
    got = rollback.resume(rolled_back(), 3, spec(NEXT), stored(GOOD, BAD))
    assert got.kind == "roll_forward" and got.template is None and got.failed.revision == 2
    # The in-process rule agrees: what resume rebuilt ends the rollback on the next reconcile.
    assert rollback.moved_on(got.failed, 3, rollback.fingerprint(rollback.template_spec(spec(NEXT))))


def test_no_status_or_no_rollback_in_force_serves_the_spec() -> None:
    assert rollback.resume(None, 1, spec(GOOD), []) == rollback.Resumed("spec")
    forward = InferenceDeploymentStatus(
        current_revision=3,
        stable_revision=1,
        failed_revision=2,
        conditions=[
            cond("RolledBack", "False", "RolledForward", "the spec changed after revision 2 was rolled back", 3)
        ],
    )
    assert rollback.resume(forward, 3, spec(NEXT), stored(GOOD, BAD, NEXT)).kind == "spec"
    healthy = InferenceDeploymentStatus(current_revision=1, stable_revision=1)
    assert rollback.resume(healthy, 1, spec(GOOD), stored(GOOD)).kind == "spec"


def test_stable_revision_record_gone_holds_the_pools_and_pages_instead_of_crashing() -> None:
    got = rollback.resume(rolled_back(), 2, spec(BAD), stored(GOOD, BAD)[1:])
    assert got.kind == "hold" and got.template is None
    assert "revision 1" in got.message and "cannot be rendered" in got.message and "(2)" in got.message
    # A record without the spec it came from is no better.
    broken = stored(GOOD, BAD)
    del broken[0]["data"]["spec"]
    assert rollback.resume(rolled_back(), 2, spec(BAD), broken).kind == "hold"
    # Once the user changes the spec there is nothing to hold: roll forward.
    assert rollback.resume(rolled_back(), 3, spec(NEXT), stored(GOOD, BAD)[1:]).kind == "roll_forward"


def test_served_record_gone_is_rebuilt_from_the_configmap_that_still_records_it() -> None:
    config = render.config_map(OWNER, spec(GOOD), 1)  # what the pools run: revision 1, served by the rollback
    serving = revisions.served_record(config, OWNER)
    got = rollback.resume(rolled_back(), 2, spec(BAD), stored(GOOD, BAD)[1:], serving)
    assert got.kind == "stored" and got.template == 1
    assert got.spec is not None and got.spec.engine.image == GOOD
    # The ConfigMap records another revision (or none): nothing to rebuild from, hold as before.
    other = revisions.served_record(render.config_map(OWNER, spec(BAD), 2), OWNER)
    assert rollback.resume(rolled_back(), 2, spec(BAD), stored(GOOD, BAD)[1:], other).kind == "hold"
    assert revisions.served_record({"metadata": {"labels": {render.LABEL_REVISION: "1"}}}, OWNER) is None


def test_failed_record_gone_ends_the_rollback_on_any_spec_change_only() -> None:
    revs = [stored(GOOD, BAD)[0]]
    assert rollback.resume(rolled_back(), 2, spec(BAD), revs).kind == "stored"
    assert rollback.resume(rolled_back(), 3, spec(BAD, max_replicas=4), revs).kind == "roll_forward"


def test_manual_rollback_resumes_the_revision_it_chose() -> None:
    # `rollback-to=2` while the spec is revision 3: revision 2 served, 3 not re-applied.
    status = InferenceDeploymentStatus(
        current_revision=2,
        stable_revision=3,
        failed_revision=3,
        conditions=[
            cond(
                "RolledBack",
                "True",
                "ManualRollback",
                "revision 3 rolled back to 2 by hand (pdfleet.io/rollback-to)",
                5,
            )
        ],
    )
    got = rollback.resume(status, 5, spec(NEXT), stored(GOOD, BAD, NEXT))
    assert got.kind == "stored" and got.template == 2 and got.spec.engine.image == BAD


def test_a_standing_page_and_a_stable_revision_are_not_said_again() -> None:
    page = rollback.conditions_for(
        rollback.RollbackAction("page", "RollbackFailed", "not rolling back again", 0.5), 2, 3, 5, AT
    )
    status = rolled_back(2, 3, 5, stable=1)
    status = status.model_copy(update={"conditions": [c for c in status.conditions if c.type != "Degraded"] + page})
    assert rollback.paged_revision(status) == 2
    health = rollback.health_for(2, 100.0, True, 1, status)
    assert health.done and not health.stable and health.rollback_target
    # Another revision served later is analysed afresh; the stable one does not soak again.
    assert not rollback.health_for(1, 100.0, True, 1, status).done
    assert rollback.health_for(1, 100.0, True, 1, status).stable
    assert rollback.paged_revision(rolled_back()) is None
    assert rollback.paged_revision(None) is None


def test_failed_record_is_kept_by_pruning_when_asked() -> None:
    # History limit 1 while revision 1 serves and 2 is the failed one: neither goes (the handler keeps both).
    assert rollback.revisions_to_prune([1, 2], 1, keep={1, 2}) == []
    assert rollback.revisions_to_prune([1, 2], 1, keep={1}) == [2]

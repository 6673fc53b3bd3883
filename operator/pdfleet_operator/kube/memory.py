"""What the operator process remembers of one InferenceDeployment, in one object.

The reconciler creates a `DeploymentMemory` the first time it sees a deployment (`Reconciler.memory`)
and drops it in one place when the deployment is deleted (`Reconciler.forget`): every per-deployment
input, cache and background task lives here, so nothing is left behind keyed by a deleted name.
Nothing here is persisted: after a restart it is rebuilt from the cluster (status, children,
ControllerRevisions).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pdfleet_operator.api import API_VERSION, Condition, InferenceDeployment, InferenceDeploymentStatus
from pdfleet_operator.decide import reconcile, rollback
from pdfleet_operator.decide.placement import FleetPlan
from pdfleet_operator.decide.rollback import Template
from pdfleet_operator.kube import scaling

__all__ = ["DeploymentMemory", "Template"]


@dataclasses.dataclass(eq=False)
class DeploymentMemory:
    """One InferenceDeployment as this process knows it."""

    # Reconcile bookkeeping: runs never overlap (lock); a request during a run folds into one more run
    # (tickets asked vs covered); failed runs back off (retries).
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    wanted: int = 0
    done: int = 0
    retries: int = 0
    # Inputs other pieces feed in: the autoscaler's sizes, the rollback state machine's state, and the
    # conditions and status fields they want written with the next status update.
    desired: dict[str, int] | None = None
    rollback: rollback.RollbackState = dataclasses.field(default_factory=rollback.RollbackState)
    extra_conditions: dict[str, Condition] = dataclasses.field(default_factory=dict)
    extra_status: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What this process last saw or wrote.
    parsed: tuple[tuple[Any, Any], InferenceDeployment] | None = (
        None  # ((uid, generation), model): CEL once per generation
    )
    plan: FleetPlan | None = None  # the last plan
    engines: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # role -> engines its planned pools run
    targets: dict[str, int] | None = None  # replicas per role the last plan was made for
    rendered: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # child -> digest: an unchanged rendering re-applied is a revert
    last_status: tuple[dict[str, Any], str | None, str | None] | None = (
        None  # (status, CR version before, after our write)
    )
    limited: bool = False  # the last plan fell short of accelerators (a freed pod re-plans it)
    # The two background loops and their memory.
    scaler: scaling.Scaler = dataclasses.field(default_factory=scaling.Scaler)
    analysis_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    autoscaler: asyncio.Task | None = None
    analyzer: asyncio.Task | None = None

    @property
    def template(self) -> Template | None:
        """The stored revision served instead of the spec (rollback), if any."""
        return self.rollback.template

    def inputs(self) -> reconcile.Inputs:
        """What the reconcile chain reads of this memory."""
        last, version = (self.last_status[0], self.last_status[1]) if self.last_status else (None, None)
        return reconcile.Inputs(
            desired=self.desired,
            targets=self.targets,
            rollback=self.rollback,
            extra_conditions=dict(self.extra_conditions),
            extra_status=dict(self.extra_status),
            last_status=last,
            last_status_version=version,
            rendered=dict(self.rendered),
        )

    def parse(self, body: dict[str, Any]) -> InferenceDeployment:
        """The CR as the API model; the spec (whose CEL rules are slow to evaluate) once per generation."""
        meta = body.get("metadata") or {}
        version = (meta.get("uid"), meta.get("generation"))
        if self.parsed is None or self.parsed[0] != version:
            dep = InferenceDeployment.model_validate(
                {
                    "apiVersion": body.get("apiVersion", API_VERSION),
                    "kind": "InferenceDeployment",
                    "metadata": {
                        k: meta.get(k) for k in ("name", "namespace", "uid", "generation") if meta.get(k) is not None
                    },
                    "spec": body.get("spec") or {},
                }
            )
            self.parsed = (version, dep)
        st = InferenceDeploymentStatus.model_validate(body["status"]) if body.get("status") else None
        return self.parsed[1].model_copy(update={"status": st})

    def stop(self) -> None:
        """Cancel the deployment's background loops."""
        for task in (self.autoscaler, self.analyzer):
            if task is not None:
                task.cancel()
        self.autoscaler = self.analyzer = None

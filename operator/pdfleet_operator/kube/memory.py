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

from pdfleet_operator.api import Condition, InferenceDeployment, InferenceDeploymentSpec
from pdfleet_operator.decide.placement import FleetPlan
from pdfleet_operator.kube import revisions, scaling


@dataclasses.dataclass(frozen=True)
class Template:
    """Which revision's pod template to serve (set by rollback); the spec is that revision's spec."""

    revision: int
    spec: InferenceDeploymentSpec


@dataclasses.dataclass(eq=False)
class DeploymentMemory:
    """One InferenceDeployment as this process knows it."""

    # Reconcile bookkeeping: runs never overlap (lock); a request during a run folds into one more run
    # (tickets asked vs covered); failed runs back off (retries).
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    wanted: int = 0
    done: int = 0
    retries: int = 0
    # Inputs other pieces feed in: the autoscaler's sizes, the revision rollback serves, and the
    # conditions and status fields they want written with the next status update.
    desired: dict[str, int] | None = None
    template: Template | None = None
    extra_conditions: dict[str, Condition] = dataclasses.field(default_factory=dict)
    extra_status: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What this process last saw or wrote.
    parsed: tuple[tuple[Any, Any], InferenceDeployment] | None = None  # ((uid, generation), model): CEL once per generation
    plan: FleetPlan | None = None             # the last plan
    engines: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # role -> engines its planned pools run
    targets: dict[str, int] | None = None     # replicas per role the last plan was made for
    rendered: dict[str, str] = dataclasses.field(default_factory=dict)  # child -> digest: an unchanged rendering re-applied is a revert
    last_status: tuple[dict[str, Any], str | None, str | None] | None = None  # (status, CR version before, after our write)
    limited: bool = False                     # the last plan fell short of accelerators (a freed pod re-plans it)
    # The two background loops and their memory.
    scaler: scaling.Scaler = dataclasses.field(default_factory=scaling.Scaler)
    rollback: revisions.RollbackMemory = dataclasses.field(default_factory=revisions.RollbackMemory)
    analysis_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    autoscaler: asyncio.Task | None = None
    analyzer: asyncio.Task | None = None

    def stop(self) -> None:
        """Cancel the deployment's background loops."""
        for task in (self.autoscaler, self.analyzer):
            if task is not None:
                task.cancel()
        self.autoscaler = self.analyzer = None

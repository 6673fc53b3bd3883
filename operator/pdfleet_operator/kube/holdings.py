"""What the process remembers of each deployment (`DeploymentMemory`) and what every deployment's pools hold: the
capacity one reconcile's placement must leave to the others.

A pool holds the larger of its deployment's last plan and the replicas its Deployment asks for, so after a restart
(no plans yet) capacity held by Deployments whose pods do not exist yet is still counted (issue 24, rule 7).
Holdings are kept per deployment and recomputed for those `Cluster.capacity_changed` names; everything is recomputed
at least every HELD_REFRESH_S, so a change no hook named is not held for long.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide import inventory, placement
from pdfleet_operator.kube.indexes import Cluster, Key, classes_listed
from pdfleet_operator.kube.memory import DeploymentMemory

# Every deployment's holdings are recomputed at least this often (`reservations`), whatever the hooks said.
HELD_REFRESH_S = 30.0


class Holdings(Cluster):
    """kopf's indexes (`Cluster`), one `DeploymentMemory` per deployment, and what each deployment's pools hold."""

    def __init__(self) -> None:
        super().__init__()
        self.deployments: dict[Key, DeploymentMemory] = {}  # created on first sight, dropped by `forget`
        # Kept per deployment, recomputed for those `capacity_changed` named, flattened in key order for the next
        # reconcile.
        self._held: dict[Key, tuple[inventory.Reservation, ...]] = {}
        self._held_flat: list[inventory.Reservation] | None = None
        self._held_refreshed = 0.0

    def memory(self, key: Key) -> DeploymentMemory:
        """The deployment's memory, created the first time anything asks."""
        m = self.deployments.get(key)
        if m is None:
            m = self.deployments[key] = DeploymentMemory()
        return m

    def known(self, key: Key) -> DeploymentMemory | None:
        """The deployment's memory if this process has one (never creates it)."""
        return self.deployments.get(key)

    def limited(self) -> list[Key]:
        """The deployments whose last plan fell short of accelerators."""
        return sorted(k for k, m in self.deployments.items() if m.limited)

    def last_plan(self, key: Key) -> placement.FleetPlan | None:
        """The deployment's last plan (None before the first): what runs and what is placeable (the autoscaler's
        tick)."""
        m = self.known(key)
        return None if m is None else m.plan

    def engines(self, key: Key) -> dict[str, list[str]]:
        """Per role, the engines its planned pools run (the autoscaler reads each with its metric names)."""
        m = self.known(key)
        return {} if m is None else dict(m.engines)

    def capacity(self, key: Key) -> dict[str, int]:
        """Per role, the most replicas placeable on free capacity as of the last plan."""
        plan = self.last_plan(key)
        return {} if plan is None else {role: plan.capacity(role) for role in plan.roles()}

    def reservations(self, exclude: Key | None = None) -> list[inventory.Reservation]:
        """What every other deployment's pools hold or will hold, per pool.

        NOTE: a plan is made and remembered in one step of the event loop (no await between gathering
        and `m.plan = plan`), so two reconciles running at once never plan onto the same units.
        NOTE: kept per deployment (every reconcile reads all deployments' holdings: recomputing them all was
        O(deployments) per reconcile, O(N^2) per wave of new CRs).
        """
        now = time.monotonic()
        if self._held_dirty is None or now - self._held_refreshed > HELD_REFRESH_S:
            self._held = {}
            dirty: set[Key] = set(self.pool_owners()) | set(self.deployments)
            self._held_refreshed = now
        else:
            dirty = self._held_dirty
        if dirty:
            classes = self.classes()
            for k in dirty:
                held = self.held_by(k, classes)
                if held:
                    self._held[k] = held
                else:
                    self._held.pop(k, None)
            self._held_dirty, self._held_flat = set(), None
        if self._held_flat is None:
            self._held_flat = [r for k in sorted(self._held) for r in self._held[k]]
        return [r for r in self._held_flat if (r.namespace, r.deployment) != exclude]

    def held_by(self, key: Key, classes: Mapping[str, AcceleratorClassSpec]) -> tuple[inventory.Reservation, ...]:
        """What one deployment's pools hold or will hold (its Deployments' replicas, its last plan's), per pool."""
        held: dict[tuple[str, str], int] = {}
        for p in self.pools_of(key):
            pk = (p["role"], p["class"])
            held[pk] = max(held.get(pk, 0), int(p["replicas"]))
        m = self.deployments.get(key)
        if m is not None and m.plan is not None and self.body(key) is not None:
            for p in m.plan.pools:
                pk = (p.role, p.accelerator_class)
                held[pk] = max(held.get(pk, 0), p.replicas)
        return tuple(
            inventory.Reservation(key[0], key[1], role, acc, classes[acc], n)
            for (role, acc), n in sorted(held.items())
            if acc in classes and n > 0
        )

    def freed_for(
        self, key: Key, before: placement.FleetPlan | None, after: placement.FleetPlan | None
    ) -> tuple[list[Key], list[str]]:
        """When `key`'s plan went from `before` to `after`: the deployments short of capacity that use a resource it
        gave units of back (to re-plan), and those resources."""
        if before is None:
            return [], []
        classes = self.classes()

        def units(plan: placement.FleetPlan | None) -> dict[str, int]:
            out: dict[str, int] = {}
            for p in plan.pools if plan is not None else ():
                cls = classes.get(p.accelerator_class)
                if cls is not None:
                    out[cls.resource_name] = out.get(cls.resource_name, 0) + p.replicas * cls.count
            return out

        was, now = units(before), units(after)
        freed = sorted(r for r, n in was.items() if n > now.get(r, 0))
        if not freed:
            return [], []
        waiting = []
        for other in (k for k in self.limited() if k != key):
            listed = classes_listed(self.body(other) or {})
            if any(classes[c].resource_name in freed for c in listed if c in classes):
                waiting.append(other)
        return waiting, freed

"""What other deployments hold (`Reconciler.reservations`), kept per deployment and recomputed for the ones a hook
names, against a from-scratch computation of the same state (the oracle) over a seeded random history."""

from __future__ import annotations

import random

import yaml

from pdfleet_operator.api import AcceleratorClass
from pdfleet_operator.decide import inventory, placement
from pdfleet_operator.kube import holdings, reconciler
from tests.kube.cluster import CLASSES_FILE

CLASSES = {
    d["metadata"]["name"]: AcceleratorClass.model_validate(d).spec
    for d in yaml.safe_load_all(CLASSES_FILE.read_text())
    if d and d.get("kind") == "AcceleratorClass"
}
NAMES = sorted(CLASSES)[:4]
KEYS = [(ns, f"d{i}") for ns in ("default", "team") for i in range(6)]


def from_scratch(rec: reconciler.Reconciler, exclude) -> list[inventory.Reservation]:
    """Every pool's larger of its Deployment's replicas and the last plan's, computed anew (the old algorithm)."""
    classes = rec.classes()
    held: dict[tuple[str, str, str, str], int] = {}
    for p in rec.pools():
        k = (p["namespace"], p["deployment"], p["role"], p["class"])
        held[k] = max(held.get(k, 0), int(p["replicas"]))
    for k, m in rec.deployments.items():
        if m.plan is None or rec.body(k) is None:
            continue
        for p in m.plan.pools:
            pk = (k[0], k[1], p.role, p.accelerator_class)
            held[pk] = max(held.get(pk, 0), p.replicas)
    return [
        inventory.Reservation(ns, dep, role, acc, classes[acc], n)
        for (ns, dep, role, acc), n in sorted(held.items())
        if (ns, dep) != exclude and acc in classes and n > 0
    ]


def test_kept_holdings_equal_a_fresh_computation_after_every_change() -> None:
    rng = random.Random(7)
    rec = reconciler.Reconciler()
    pools: dict[tuple[str, str], list[dict]] = {}
    bodies: dict[tuple[str, str], list[dict]] = {}
    classes = {n: [CLASSES[n]] for n in NAMES}
    rec.indexes = {"class_index": classes, "pool_index": pools, "infdep_index": bodies}

    def pool(key, role, acc, n):
        return {
            "namespace": key[0],
            "deployment": key[1],
            "name": f"{key[1]}-{role}-{acc}",
            "role": role,
            "class": acc,
            "replicas": n,
        }

    for step in range(600):
        key, op = rng.choice(KEYS), rng.randrange(6)
        if op == 0:  # a reconcile: the CR exists, a new plan is remembered (as _reconcile does)
            bodies[key] = [{"metadata": {"name": key[1], "namespace": key[0]}}]
            plan = placement.FleetPlan(
                pools=tuple(
                    placement.PlannedPool(role, rng.choice(NAMES), rng.randrange(0, 4))
                    for role in ("prefill", "decode")
                )
            )
            rec.memory(key).plan = plan
            rec.capacity_changed(key)
        elif op == 1:  # a pool Deployment created or scaled (kopf's index, then the child event's hook)
            views = [v for v in pools.get(key, []) if rng.random() < 0.5]
            views.append(pool(key, rng.choice(("prefill", "decode")), rng.choice(NAMES), rng.randrange(0, 5)))
            pools[key] = views
            rec.capacity_changed(key)
        elif op == 2 and pools.get(key):  # a pool Deployment deleted
            gone = pools[key].pop(rng.randrange(len(pools[key])))
            rec.child_gone(key, "Deployment", gone["name"])
        elif op == 3 and key in bodies:  # the CR deleted: kopf's index drops it, on_delete forgets the memory
            del bodies[key]
            rec.forget(key)
        elif op == 4:  # an AcceleratorClass edited or deleted and recreated
            name = rng.choice(NAMES)
            if name in classes and rng.random() < 0.5:
                del classes[name]
            else:
                classes[name] = [CLASSES[name].model_copy(update={"count": rng.randrange(1, 4)})]
            rec.capacity_changed()
        exclude = rng.choice([None, *KEYS])
        assert rec.reservations(exclude) == from_scratch(rec, exclude), f"step {step}, op {op}"


def test_a_change_no_hook_named_is_picked_up_by_the_periodic_recompute(monkeypatch) -> None:
    rec = reconciler.Reconciler()
    pools = {
        ("default", "a"): [
            {
                "namespace": "default",
                "deployment": "a",
                "name": "a-decode",
                "role": "decode",
                "class": NAMES[0],
                "replicas": 2,
            }
        ]
    }
    rec.indexes = {"class_index": {n: [CLASSES[n]] for n in NAMES}, "pool_index": pools, "infdep_index": {}}
    assert [r.replicas for r in rec.reservations()] == [2]
    pools[("default", "a")][0] = {**pools[("default", "a")][0], "replicas": 3}  # no hook told
    assert [r.replicas for r in rec.reservations()] == [2]
    monkeypatch.setattr(holdings, "HELD_REFRESH_S", 0.0)
    assert [r.replicas for r in rec.reservations()] == [3] == [r.replicas for r in from_scratch(rec, None)]

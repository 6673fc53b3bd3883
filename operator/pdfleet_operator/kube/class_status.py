"""AcceleratorClass status: how many nodes carry each class, how many of its units are allocatable and free, and
which pools run on it.

What `kubectl get acc -o wide` shows in its Free column, computed from the same inventory placement
plans with (`inventory.build`: Ready, schedulable nodes whose labels and taints admit the class,
minus what bound pods request and what Pending pods will take). `compute` is pure; `ClassStatusWriter.sync` lists the
classes once per round (spec, generation and the status last written, so a restarted operator
writes nothing that is already there) and patches only the classes whose numbers changed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import pydantic

from pdfleet_operator.api import AcceleratorClass
from pdfleet_operator.decide import inventory
from pdfleet_operator.kube import client

logger = logging.getLogger(__name__)

FIELDS = ("observedGeneration", "nodes", "allocatable", "free", "usedBy")


def compute(
    classes: Iterable[Mapping[str, Any]],
    nodes: Iterable[dict[str, Any]],
    pods: Iterable[dict[str, Any]],
    users: Mapping[str, list[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """{class name: {observedGeneration, nodes, allocatable, free, usedBy}} for every valid AcceleratorClass object
    (`users`: class -> the pools on it, `class_protection.users`)."""
    nodes = list(nodes)
    whole = inventory.build(nodes, [])
    left = inventory.build(nodes, pods)
    out: dict[str, dict[str, int]] = {}
    for obj in classes:
        meta = obj.get("metadata") or {}
        try:
            cls = AcceleratorClass.model_validate(
                {"metadata": {"name": meta.get("name")}, "spec": obj.get("spec") or {}}
            ).spec
        except pydantic.ValidationError:
            continue  # the reconcile ignores it too (logged by the class index)
        carrying = [n for n in whole.nodes_for(cls) if n.free.get(cls.resource_name, 0) > 0]
        status: dict[str, Any] = {
            "nodes": len(carrying),
            "allocatable": whole.free_units(cls),
            "free": left.free_units(cls),
            "usedBy": list((users or {}).get(meta["name"], [])),
        }
        if meta.get("generation") is not None:
            status = {"observedGeneration": int(meta["generation"]), **status}
        out[meta["name"]] = status
    return out


class ClassStatusWriter:
    """One round per interval: list the classes, compute, patch what differs (one status write per changed class)."""

    def __init__(self) -> None:
        self.writes = 0

    async def sync(
        self,
        api: client.Api,
        nodes: Iterable[dict[str, Any]],
        pods: Iterable[dict[str, Any]],
        users: Mapping[str, list[str]] | None = None,
    ) -> list[str]:
        """Patch the status of every class whose numbers or users changed; returns their names."""
        listed = await api.list("AcceleratorClass", None)
        wanted = compute(listed, nodes, pods, users)
        changed = []
        for obj in listed:
            name = obj["metadata"]["name"]
            have = obj.get("status") or {}
            want = wanted.get(name)
            if want is None or all(have.get(k, [] if k == "usedBy" else None) == want.get(k) for k in FIELDS):
                continue
            try:
                await api.patch_status_of("AcceleratorClass", None, name, want)
            except client.ApiError as exc:
                if exc.code == 404:
                    continue  # deleted since the list
                raise
            self.writes += 1
            changed.append(name)
        if changed:
            logger.info(
                "AcceleratorClass status updated: %s",
                ", ".join(f"{n} free {wanted[n]['free']}/{wanted[n]['allocatable']}" for n in changed),
            )
        return changed

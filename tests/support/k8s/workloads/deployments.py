"""The Deployment controller: each Deployment's ReplicaSets (one per pod template, named ``<deployment>-<hash>``),
rolled as Kubernetes' controller rolls them (RollingUpdate within maxSurge/maxUnavailable as pods become
available, Recreate once every old pod is gone), scaled proportionally mid-rollout, revisions and history
cleanup, and the status it writes (counts, Available and Progressing conditions, progress deadline)."""

from __future__ import annotations

import copy
from typing import Any

from tests.support.k8s.clock import parse_time
from tests.support.k8s.workloads.objects import (
    DEPLOYMENT_KEY,
    HASH_LABEL,
    POD_KEY,
    REPLICASET_KEY,
    Key,
    Store,
    condition,
    template_hash,
    with_condition,
)
from tests.support.k8s.workloads.rollout import (
    Set,
    is_rolling,
    max_surge,
    max_unavailable,
    new_set_replicas,
    old_scale_down,
    proportional,
    replicas_of,
)

REVISION = "deployment.kubernetes.io/revision"
DESIRED = "deployment.kubernetes.io/desired-replicas"
MAX_REPLICAS = "deployment.kubernetes.io/max-replicas"
DEFAULT_DEADLINE_S = 600  # spec.progressDeadlineSeconds as the API server defaults it
DEFAULT_HISTORY = 10  # spec.revisionHistoryLimit as the API server defaults it
COMPLETE = "NewReplicaSetAvailable"
TIMED_OUT = "ProgressDeadlineExceeded"

Owned = tuple[Key, dict]


def _spec_replicas(rs: dict) -> int:
    value = (rs.get("spec") or {}).get("replicas")
    return 1 if value is None else int(value)


def _status(obj: dict, field: str) -> int:
    return int((obj.get("status") or {}).get(field) or 0)


def _revision(rs: dict) -> int:
    try:
        return int((rs["metadata"].get("annotations") or {}).get(REVISION) or 0)
    except ValueError:
        return 0


def _as_set(rs: dict) -> Set:
    annotated = (rs["metadata"].get("annotations") or {}).get(MAX_REPLICAS)
    return Set(
        rs["metadata"]["name"],
        _spec_replicas(rs),
        _status(rs, "availableReplicas"),
        rs["metadata"].get("creationTimestamp") or "",
        int(annotated) if annotated and annotated.isdigit() else None,
    )


class DeploymentController:
    """Brings each Deployment one step closer to its spec per pass (the emulator repeats passes until nothing
    changes); `next_due` is the earliest progress deadline still running."""

    def __init__(self, store: Store) -> None:
        self.s = store

    def run(self) -> bool:
        changed = False
        for key, _ in self.s.objects(DEPLOYMENT_KEY):
            changed = self._sync(key) or changed
        return changed

    def next_due(self) -> float | None:
        due = []
        for _, d in self.s.objects(DEPLOYMENT_KEY):
            cond = condition(d, "Progressing")
            if cond is None or cond.get("status") != "True" or cond.get("reason") == COMPLETE:
                continue
            since = parse_time(cond.get("lastUpdateTime"))
            if since is not None:
                due.append(since + self._deadline(d) + 1)
        return min(due) if due else None

    # --- one step ---------------------------------------------------------------------------------
    def _sync(self, key: Key) -> bool:
        d = self.s.get(key)
        assert d is not None
        if d["metadata"].get("deletionTimestamp"):
            return self._write_status(key, rollout=False)
        new, old = self._split(d)
        if (d.get("spec") or {}).get("paused") or self._scaling_event(d, new, old):
            changed = self._scale(d, new, old)
            return self._write_status(key, rollout=False) or changed
        step = self._rolling if is_rolling(d) else self._recreate
        changed, hint = step(key, d, new, old)
        return self._write_status(key, rollout=True, hint=hint) or changed

    def _rolling(self, key: Key, d: dict, new: Owned | None, old: list[Owned]) -> tuple[bool, dict | None]:
        new, hint, changed = self._new_set(key, d, new, old)
        if changed:
            return True, hint
        assert new is not None
        replicas, spec = replicas_of(d), _spec_replicas(new[1])
        if spec > replicas:
            return self._resize(new, d, replicas), hint
        if spec < replicas:
            target = new_set_replicas(d, [_as_set(rs) for _, rs in old] + [_as_set(new[1])], spec)
            if target != spec:
                return self._resize(new, d, target), hint
        sizes = old_scale_down(d, _as_set(new[1]), [_as_set(rs) for _, rs in old])
        if sizes:
            return any(
                [self._resize(o, d, sizes[o[1]["metadata"]["name"]]) for o in old if o[1]["metadata"]["name"] in sizes]
            ), hint
        if self._complete(d, d.get("status") or {}):
            return self._cleanup(d, old), hint
        return False, hint

    def _recreate(self, key: Key, d: dict, new: Owned | None, old: list[Owned]) -> tuple[bool, dict | None]:
        running_old = [o for o in old if _spec_replicas(o[1]) > 0]
        if running_old:
            return any([self._resize(o, d, 0) for o in running_old]), None
        if self._old_pods_running(new, old):
            return False, None  # Recreate waits until every old pod is gone (terminating ones included)
        new, hint, changed = self._new_set(key, d, new, old)
        if changed:
            return True, hint
        assert new is not None
        if _spec_replicas(new[1]) != replicas_of(d):
            return self._resize(new, d, replicas_of(d)), hint
        if self._complete(d, d.get("status") or {}):
            return self._cleanup(d, old), hint
        return False, hint

    # --- ReplicaSets ------------------------------------------------------------------------------
    def _split(self, d: dict) -> tuple[Owned | None, list[Owned]]:
        want = template_hash((d.get("spec") or {}).get("template") or {})
        sets = [(k, rs) for k, rs in self.s.owned(REPLICASET_KEY, d) if not rs["metadata"].get("deletionTimestamp")]
        new = next(((k, rs) for k, rs in sets if (rs["metadata"].get("labels") or {}).get(HASH_LABEL) == want), None)
        return new, [(k, rs) for k, rs in sets if new is None or k != new[0]]

    def _new_set(
        self, key: Key, d: dict, new: Owned | None, old: list[Owned]
    ) -> tuple[Owned | None, dict | None, bool]:
        """Find or create the ReplicaSet of the current template; sync its revision and minReadySeconds and the
        Deployment's revision annotation. Returns it, the Progressing condition it calls for, and whether it wrote."""
        revision = max([_revision(rs) for _, rs in old], default=0) + 1
        min_ready = int((d.get("spec") or {}).get("minReadySeconds") or 0)
        hint: dict | None = None
        changed = False
        if new is None:
            rs = self._replica_set(d, new_set_replicas(d, [_as_set(rs) for _, rs in old], 0), revision)
            created = self.s.create(REPLICASET_KEY, key[2], rs)
            new = (REPLICASET_KEY + (key[2], created["metadata"]["name"]), created)
            hint = {
                "type": "Progressing",
                "status": "True",
                "reason": "NewReplicaSetCreated",
                "message": f'Created new replica set "{created["metadata"]["name"]}"',
            }
            changed = True
        else:
            rs = copy.deepcopy(new[1])
            annotations = rs["metadata"].setdefault("annotations", {})
            if _revision(rs) < revision:
                annotations[REVISION] = str(revision)
            rs["spec"]["minReadySeconds"] = min_ready
            if rs != new[1]:
                changed = self.s.update(new[0], rs) or changed
                new = (new[0], self.s.get(new[0]) or rs)
            if condition(d, "Progressing") is None:
                hint = {
                    "type": "Progressing",
                    "status": "True",
                    "reason": "FoundNewReplicaSet",
                    "message": f'Found new replica set "{rs["metadata"]["name"]}"',
                }
        current = (d["metadata"].get("annotations") or {}).get(REVISION)
        wanted = (new[1]["metadata"].get("annotations") or {}).get(REVISION)
        if wanted and current != wanted:
            updated = copy.deepcopy(d)
            updated["metadata"].setdefault("annotations", {})[REVISION] = wanted
            changed = self.s.update(key, updated) or changed
        return new, hint, changed

    def _replica_set(self, d: dict, replicas: int, revision: int) -> dict:
        spec = d.get("spec") or {}
        template = copy.deepcopy(spec.get("template") or {})
        hash_ = template_hash(spec.get("template") or {})
        labels = {**((template.get("metadata") or {}).get("labels") or {}), HASH_LABEL: hash_}
        template.setdefault("metadata", {})["labels"] = labels
        selector = copy.deepcopy(spec.get("selector") or {})
        selector["matchLabels"] = {**(selector.get("matchLabels") or {}), HASH_LABEL: hash_}
        name, ns = d["metadata"]["name"], d["metadata"]["namespace"]
        return {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{name}-{hash_}",
                "namespace": ns,
                "labels": labels,
                "annotations": {
                    REVISION: str(revision),
                    DESIRED: str(replicas_of(d)),
                    MAX_REPLICAS: str(replicas_of(d) + max_surge(d)),
                },
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": name,
                        "uid": d["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "replicas": replicas,
                "minReadySeconds": int(spec.get("minReadySeconds") or 0),
                "selector": selector,
                "template": template,
            },
        }

    def _resize(self, owned: Owned, d: dict, size: int) -> bool:
        """``scaleReplicaSet``: the new size and the replicas annotations of the Deployment it serves."""
        key, rs = owned
        new = copy.deepcopy(self.s.get(key) or rs)
        new["spec"]["replicas"] = max(0, size)
        annotations = new["metadata"].setdefault("annotations", {})
        annotations[DESIRED] = str(replicas_of(d))
        annotations[MAX_REPLICAS] = str(replicas_of(d) + max_surge(d))
        return self.s.update(key, new)

    def _scaling_event(self, d: dict, new: Owned | None, old: list[Owned]) -> bool:
        for _, rs in ([new] if new else []) + old:
            desired = (rs["metadata"].get("annotations") or {}).get(DESIRED)
            if _spec_replicas(rs) > 0 and desired is not None and desired != str(replicas_of(d)):
                return True
        return False

    def _scale(self, d: dict, new: Owned | None, old: list[Owned]) -> bool:
        sets = old + ([new] if new else [])
        running = [o for o in sets if _spec_replicas(o[1]) > 0]
        if len(running) <= 1:
            target = (
                running[0]
                if running
                else new or max(old, key=lambda o: o[1]["metadata"].get("creationTimestamp") or "", default=None)
            )
            return target is not None and self._resize(target, d, replicas_of(d))
        if (
            new is not None
            and _spec_replicas(new[1]) == replicas_of(d)
            and _status(new[1], "availableReplicas") == replicas_of(d)
        ):
            return any([self._resize(o, d, 0) for o in old if _spec_replicas(o[1]) > 0])
        if not is_rolling(d):
            return False
        newest_first = [
            o[1]["metadata"]["name"]
            for o in sorted(running, key=lambda o: o[1]["metadata"].get("creationTimestamp") or "", reverse=True)
        ]
        sizes = proportional(d, [_as_set(rs) for _, rs in running], _status(d, "replicas"), newest_first=newest_first)
        return any([self._resize(o, d, sizes[o[1]["metadata"]["name"]]) for o in running])

    def _old_pods_running(self, new: Owned | None, old: list[Owned]) -> bool:
        if any(_status(rs, "replicas") for _, rs in old):
            return True
        new_uid = new[1]["metadata"]["uid"] if new else None
        for _, rs in old:
            if rs["metadata"]["uid"] == new_uid:
                continue
            for _, pod in self.s.owned(POD_KEY, rs):
                if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                    return True
        return False

    def _cleanup(self, d: dict, old: list[Owned]) -> bool:
        limit = (d.get("spec") or {}).get("revisionHistoryLimit")
        limit = DEFAULT_HISTORY if limit is None else int(limit)
        cleanable = sorted(old, key=lambda o: _revision(o[1]))
        changed = False
        for key, rs in cleanable[: max(0, len(cleanable) - limit)]:
            st = rs.get("status") or {}
            if (
                st.get("replicas")
                or _spec_replicas(rs)
                or rs["metadata"].get("generation", 1) > st.get("observedGeneration", 0)
            ):
                continue
            self.s.delete(key)
            changed = True
        return changed

    # --- status -----------------------------------------------------------------------------------
    def _write_status(self, key: Key, *, rollout: bool, hint: dict | None = None) -> bool:
        d = self.s.get(key)
        assert d is not None
        new, old = self._split(d)
        sets = [rs for _, rs in old] + ([new[1]] if new else [])
        replicas = replicas_of(d)
        available = sum(_status(rs, "availableReplicas") for rs in sets)
        counts = {
            "observedGeneration": d["metadata"].get("generation", 1),
            "replicas": sum(_status(rs, "replicas") for rs in sets),
            "updatedReplicas": _status(new[1], "replicas") if new else 0,
            "readyReplicas": sum(_status(rs, "readyReplicas") for rs in sets),
            "availableReplicas": available,
            "unavailableReplicas": max(0, sum(_spec_replicas(rs) for rs in sets) - available),
        }
        before = d.get("status") or {}
        now = self.s.iso()
        conditions = list(before.get("conditions") or [])
        if available >= replicas - max_unavailable(d):
            avail = {
                "type": "Available",
                "status": "True",
                "reason": "MinimumReplicasAvailable",
                "message": "Deployment has minimum availability.",
            }
        else:
            avail = {
                "type": "Available",
                "status": "False",
                "reason": "MinimumReplicasUnavailable",
                "message": "Deployment does not have minimum availability.",
            }
        conditions = with_condition(conditions, avail, now, update_time=True)
        if hint is not None:
            conditions = with_condition(conditions, hint, now, update_time=True)
        if rollout and new is not None:
            conditions = self._progress(d, new[1], before, counts, conditions, now)
        status: dict[str, Any] = {k: v for k, v in counts.items() if v}  # (every count is omitempty in the API)
        if conditions:
            status["conditions"] = conditions
        if before.get("collisionCount") is not None:
            status["collisionCount"] = before["collisionCount"]
        if status == before:
            return False
        updated = copy.deepcopy(d)
        updated["status"] = status
        return self.s.write_status(key, updated)

    def _progress(self, d: dict, new: dict, before: dict, counts: dict, conditions: list[dict], now: str) -> list[dict]:
        """``syncRolloutStatus``: Progressing is True while the rollout moves, NewReplicaSetAvailable once complete,
        False with ProgressDeadlineExceeded when nothing moved for progressDeadlineSeconds."""
        current = next((c for c in conditions if c.get("type") == "Progressing"), None)
        name = new["metadata"]["name"]
        if (
            counts["replicas"] == counts["updatedReplicas"]
            and current is not None
            and current.get("reason") == COMPLETE
        ):
            return conditions
        if self._complete(d, counts):
            return with_condition(
                conditions,
                {
                    "type": "Progressing",
                    "status": "True",
                    "reason": COMPLETE,
                    "message": f'ReplicaSet "{name}" has successfully progressed.',
                },
                now,
                update_time=True,
            )
        if self._moved(before, counts):
            cond = {
                "type": "Progressing",
                "status": "True",
                "reason": "ReplicaSetUpdated",
                "message": f'ReplicaSet "{name}" is progressing.',
                "lastUpdateTime": now,
                "lastTransitionTime": current.get("lastTransitionTime", now)
                if current is not None and current.get("status") == "True"
                else now,
            }
            return [c for c in conditions if c.get("type") != "Progressing"] + [cond]
        if current is not None and self._timed_out(d, current):
            return with_condition(
                conditions,
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": TIMED_OUT,
                    "message": f'ReplicaSet "{name}" has timed out progressing.',
                },
                now,
                update_time=True,
            )
        return conditions

    @staticmethod
    def _complete(d: dict, status: dict) -> bool:
        replicas = replicas_of(d)
        return (
            int(status.get("updatedReplicas") or 0) == replicas
            and int(status.get("replicas") or 0) == replicas
            and int(status.get("availableReplicas") or 0) == replicas
            and int(status.get("observedGeneration") or 0) >= d["metadata"].get("generation", 1)
        )

    @staticmethod
    def _moved(before: dict, after: dict) -> bool:
        def get(st: dict, field: str) -> int:
            return int(st.get(field) or 0)

        old_before = get(before, "replicas") - get(before, "updatedReplicas")
        old_after = get(after, "replicas") - get(after, "updatedReplicas")
        return (
            get(after, "updatedReplicas") > get(before, "updatedReplicas")
            or old_after < old_before
            or get(after, "readyReplicas") > get(before, "readyReplicas")
            or get(after, "availableReplicas") > get(before, "availableReplicas")
        )

    def _timed_out(self, d: dict, current: dict) -> bool:
        if current.get("reason") == TIMED_OUT:
            return True
        since = parse_time(current.get("lastUpdateTime"))
        return since is not None and self.s.now() > since + self._deadline(d)

    @staticmethod
    def _deadline(d: dict) -> float:
        value = (d.get("spec") or {}).get("progressDeadlineSeconds")
        return float(DEFAULT_DEADLINE_S if value is None else value)

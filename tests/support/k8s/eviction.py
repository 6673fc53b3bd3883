"""The Eviction subresource (``POST /api/v1/namespaces/NS/pods/NAME/eviction``, a policy/v1 ``Eviction``), as
kube-apiserver's eviction handler answers it: a pod that is Pending, finished or already being deleted goes at
once; otherwise the one PodDisruptionBudget selecting it must allow a disruption (its status, which the
disruption controller of the workloads computes, must be current), which the eviction uses up
(``disruptionsAllowed`` - 1, the pod in ``disruptedPods``) before deleting the pod (with the Eviction's
``deleteOptions``: grace period, preconditions). A budget with nothing to spare answers 429 TooManyRequests
("Cannot evict pod as it would violate the pod's disruption budget."), as ``kubectl drain`` expects; an
unhealthy (not Ready) pod may go while the budget is met (``unhealthyPodEvictionPolicy`` IfHealthyBudget, or
always with AlwaysAllow). Mixed into the emulator."""

from __future__ import annotations

import copy
from typing import Any

from tests.support.k8s.errors import ApiError, Forbidden, bad_request, not_found, too_many_requests
from tests.support.k8s.selectors import selector_matches
from tests.support.k8s.workloads.objects import PDB_KEY, pod_ready, with_condition

MAX_DISRUPTED_PODS = 2000
VIOLATES = "Cannot evict pod as it would violate the pod's disruption budget."


class EvictionMixin:
    """``pods/eviction``."""

    def evict_pod(self, namespace: str, name: str, body: Any = None, *, dry_run: bool = False) -> dict:
        """Evict one pod (on the emulator's loop); returns the success Status, raises :class:`ApiError` (429 when a
        PodDisruptionBudget forbids it, 404 for a missing pod)."""
        res = self.resource_for("", "v1", "pods")
        body = {} if body is None else body
        if not isinstance(body, dict) or body.get("kind") not in (None, "Eviction"):
            raise bad_request("the body of an eviction must be a policy/v1 Eviction")
        if (body.get("metadata") or {}).get("name") not in (None, name):
            raise bad_request("name in URL does not match name in Eviction object")
        key = self._key(res, namespace, name)
        pod = self._store.get(key)
        if pod is None:
            raise not_found(res, name)
        options = dict(body.get("deleteOptions") or {})
        if not self._ignores_budgets(pod):
            pdb = self._budget_of(pod)
            if pdb is not None and not self._unhealthy_may_go(pod, pdb):
                self._use_disruption(pdb, name, dry_run)
        if not dry_run:
            self._mark_evicted(key)
            self._delete(res, namespace, name, options)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    @staticmethod
    def _ignores_budgets(pod: dict) -> bool:
        """``canIgnorePDB``: a pod that does not run (Pending, finished) or is already being deleted."""
        return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Pending") or bool(
            pod["metadata"].get("deletionTimestamp")
        )

    def _budget_of(self, pod: dict) -> tuple[tuple[str, str, str, str], dict] | None:
        ns = pod["metadata"]["namespace"]
        budgets = [
            (k, o)
            for k, o in sorted(self._store.items())
            if k[:2] == PDB_KEY
            and k[2] == ns
            and selector_matches((o.get("spec") or {}).get("selector"), pod["metadata"].get("labels"))
        ]
        if len(budgets) > 1:
            raise ApiError(
                500,
                "InternalError",
                "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
            )
        return budgets[0] if budgets else None

    @staticmethod
    def _unhealthy_may_go(pod: dict, budget: tuple[Any, dict]) -> bool:
        if pod_ready(pod):
            return False
        pdb = budget[1]
        if (pdb.get("spec") or {}).get("unhealthyPodEvictionPolicy") == "AlwaysAllow":
            return True
        st = pdb.get("status") or {}
        return int(st.get("currentHealthy") or 0) >= int(st.get("desiredHealthy") or 0) > 0

    def _use_disruption(self, budget: tuple[tuple[str, str, str, str], dict], pod_name: str, dry_run: bool) -> None:
        """``checkAndDecrement``: refuse (429/403) or take one allowed disruption from the budget."""
        key, pdb = budget
        st, name = pdb.get("status") or {}, pdb["metadata"]["name"]
        if int(st.get("observedGeneration") or 0) < pdb["metadata"].get("generation", 1):
            raise too_many_requests(
                VIOLATES,
                [
                    {
                        "type": "DisruptionBudget",
                        "message": f"The disruption budget {name} is still being processed by the server.",
                    }
                ],
            )
        allowed = int(st.get("disruptionsAllowed") or 0)
        if allowed < 0:
            raise Forbidden(403, "Forbidden", "pdb disruptions allowed is negative")
        if len(st.get("disruptedPods") or {}) > MAX_DISRUPTED_PODS:
            raise Forbidden(
                403, "Forbidden", "DisruptedPods map too big - too many evictions not confirmed by PDB controller"
            )
        if allowed == 0:
            raise too_many_requests(
                VIOLATES,
                [
                    {
                        "type": "DisruptionBudget",
                        "message": f"The disruption budget {name} needs {int(st.get('desiredHealthy') or 0)} "
                        f"healthy pods and has {int(st.get('currentHealthy') or 0)} currently",
                    }
                ],
            )
        if dry_run:
            return
        new = copy.deepcopy(pdb)
        new["status"]["disruptionsAllowed"] = allowed - 1
        new["status"].setdefault("disruptedPods", {})[pod_name] = self.clock.iso()
        self._put(key, new, "MODIFIED", pdb)

    def _mark_evicted(self, key: tuple[str, str, str, str]) -> None:
        pod = self._store[key]
        new = copy.deepcopy(pod)
        status = new.setdefault("status", {})
        status["conditions"] = with_condition(
            status.get("conditions") or [],
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
            },
            self.clock.iso(),
        )
        if new != pod:
            self._put(key, new, "MODIFIED", pod)

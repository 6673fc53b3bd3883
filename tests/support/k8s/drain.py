"""``kubectl drain`` for tests, against a served emulator: cordon the node, then evict every pod on it through the
Eviction subresource (so PodDisruptionBudgets hold), retrying the ones a budget refuses (429) until they go or
the timeout passes, and wait until they are gone. Called from the test's thread (``Kube.drain``), while the
emulator's controllers replace what is evicted.

As kubectl: mirror pods are skipped, DaemonSet pods are skipped with ``ignore_daemonsets`` (else refused), pods
without a controller need ``force``, pods with ``emptyDir`` volumes need ``delete_emptydir_data``; finished
pods are deleted without eviction. Unlike kubectl, every 429 is retried after ``retry_interval`` (kubectl
waits 5 s) and pods are evicted round-robin rather than from one goroutine each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.support.k8s.errors import ApiError

MIRROR = "kubernetes.io/config.mirror"


class DrainError(RuntimeError):
    """A pod kubectl drain would refuse to remove without a flag, or a timeout."""


def drain(
    call: Callable[..., Any],
    emulator: Any,
    node: str,
    *,
    timeout: float = 60.0,
    retry_interval: float = 0.1,
    grace_period: int | None = None,
    ignore_daemonsets: bool = True,
    delete_emptydir_data: bool = True,
    force: bool = False,
    wait: bool = True,
) -> list[str]:
    """Drain `node`; returns ``namespace/name`` of the pods evicted or deleted. `call` runs a function on the
    emulator's loop (``EmulatorThread.call``). With `wait`, returns once they are gone (pods terminating
    gracefully go when their grace period has passed on the emulator's clock: advance it)."""
    call(emulator.cordon, node)
    pods_res = call(emulator.resource_for, "", "v1", "pods")
    pods = call(emulator.list_objects, pods_res, None, None, f"spec.nodeName={node}")
    targets = [p for p in pods if _removable(p, ignore_daemonsets, delete_emptydir_data, force)]
    options = {"gracePeriodSeconds": grace_period} if grace_period is not None else {}
    deadline = time.monotonic() + timeout
    remaining = {(p["metadata"]["namespace"], p["metadata"]["name"]): p["metadata"]["uid"] for p in targets}
    last: dict[tuple[str, str], str] = {}
    while True:
        for ns, name in list(remaining):
            try:
                call(
                    emulator.evict_pod,
                    ns,
                    name,
                    {
                        "apiVersion": "policy/v1",
                        "kind": "Eviction",
                        "metadata": {"name": name, "namespace": ns},
                        "deleteOptions": options,
                    },
                )
                del remaining[(ns, name)]
            except ApiError as exc:
                if exc.code == 404:
                    del remaining[(ns, name)]
                elif exc.code == 429:
                    last[(ns, name)] = exc.message
                else:
                    raise
        if not remaining:
            break
        if time.monotonic() > deadline:
            refused = sorted(f"{ns}/{n}: {last.get((ns, n), '')}" for ns, n in remaining)
            raise DrainError(f"drain {node}: timed out after {timeout} s evicting {refused}")
        time.sleep(retry_interval)
    evicted = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in targets]
    if wait:
        _wait_gone(call, emulator, pods_res, targets, deadline, node)
    return evicted


def _removable(pod: dict, ignore_daemonsets: bool, delete_emptydir_data: bool, force: bool) -> bool:
    meta, name = pod["metadata"], f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
    if MIRROR in (meta.get("annotations") or {}):
        return False
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    if owner is not None and owner.get("kind") == "DaemonSet":
        if ignore_daemonsets:
            return False
        raise DrainError(f"cannot delete DaemonSet-managed Pods (use ignore_daemonsets): {name}")
    if owner is None and not force and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
        raise DrainError(f"cannot delete Pods that declare no controller (use force): {name}")
    if not delete_emptydir_data and any("emptyDir" in v for v in (pod.get("spec") or {}).get("volumes") or []):
        raise DrainError(f"cannot delete Pods with local storage (use delete_emptydir_data): {name}")
    return True


def _wait_gone(
    call: Callable[..., Any], emulator: Any, pods_res: Any, targets: list[dict], deadline: float, node: str
) -> None:
    def still_there() -> list[str]:
        out = []
        for p in targets:
            try:
                now = call(emulator.get_object, pods_res, p["metadata"]["namespace"], p["metadata"]["name"])
            except ApiError as exc:
                if exc.code == 404:
                    continue
                raise
            if now["metadata"]["uid"] == p["metadata"]["uid"]:
                out.append(f"{p['metadata']['namespace']}/{p['metadata']['name']}")
        return out

    while left := still_there():
        if time.monotonic() > deadline:
            raise DrainError(f"drain {node}: evicted pods still there (terminating?): {left}")
        time.sleep(0.05)

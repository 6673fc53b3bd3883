"""The Kubernetes objects one InferenceDeployment becomes, from its spec and its FleetPlan (pure).

The reconcile path (`kube.reconciler`, then `client.apply_children`) calls `render(...)`; golden-file tests and
`kubernetes-validate` check its output. Per pool (role x AcceleratorClass) a worker Deployment; per
role a headless Service (worker discovery) and a PodDisruptionBudget; a router Deployment and its
Service (the endpoint); a ConfigMap with the engine config; a PodMonitor and a PrometheusRule when
the monitoring.coreos.com CRDs exist. Names derive from the deployment name only, so a restarted
operator finds what it created instead of creating twins.

The deployment token (`auth_secret`) is not among them: it is created once, when missing, and never
applied over (kube.client.create_if_missing), so no reconcile replaces a token the pods hold. Router
and pdfleet worker pods mount it (`--auth-token-file`); the router also mounts the optional Secret of
client API keys an admin may create (`--api-key-file`), and decode workers pull KV only from the
prefill role's Service (`--kv-peers`).

Pods start on the hardware they are placed on (issue 26): the image of the class's platform
(`decide.worker_images`), no device-visibility variable of ours (the device plugin's), the class's read-only
host-path volumes (the vendor's driver userland) and env, HCCL_IF_IP on Ascend, vLLM as the non-root uid with
HOME, USER and writable cache directories under a read-only root, torch threads sized from the container
(`--num-threads auto` and the pod's CPU request), memory that covers weights, host KV, the offload tier and swap
(`decide.pod_memory`), and the ports each KV connector needs between the deployment's pods.
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdfleet_operator import engine_args
from pdfleet_operator.api import (
    API_VERSION,
    AcceleratorClassSpec,
    InferenceDeploymentSpec,
)
from pdfleet_operator.api.names import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_REVISION_SPEC,
    ANNOTATION_TEMPLATE_HASH,
    LABEL_ACCELERATOR,
    LABEL_DEPLOYMENT,
    LABEL_ENGINE,
    LABEL_REVISION,
    LABEL_ROLE,
    MANAGER,
    PART_OF,
    ROUTER_ROLE,
    ROUTER_SERVICE_PORT,
    child_name,
    config_name,
    pool_name,
    role_service_name,
    router_name,
)
from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.decide import pd_threshold, pod_memory, rollback, runtimes, worker_images
from pdfleet_operator.decide.kv_connectors import Connector
from pdfleet_operator.decide.placement import FleetPlan, PlannedPool
from pdfleet_operator.decide.worker_images import WorkerImages

HTTP_PORT = 8000
KV_PORT = 8001  # the pdfleet prefill worker's KV endpoint, fixed so that the NetworkPolicy can name it
MODEL_MOUNT = "/models"
CONFIG_MOUNT = "/etc/pdfleet"
CONFIG_KEY = "engine.json"
RUN_AS = 10001  # the image's user (Dockerfile: useradd --uid 10001); vendors' vLLM images have no such user
USER = "pdfleet"  # $USER and $LOGNAME: a uid without a passwd entry makes getpass.getuser() (torch's caches) fail
# vLLM pods: a writable home and cache tree (emptyDirs) under the read-only root filesystem.
HOME_MOUNT = "/home/pdfleet"
CACHE_MOUNT = "/var/cache/pdfleet"
VLLM_CACHE_ENV = (
    ("XDG_CACHE_HOME", ""),
    ("VLLM_CACHE_ROOT", "vllm"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
    ("TRITON_CACHE_DIR", "triton"),
    ("HF_HOME", "huggingface"),
    ("NUMBA_CACHE_DIR", "numba"),
)
# The pdfleet worker's torch threads: sized in the pod from its CPU quota, affinity mask and this (its request).
CPU_REQUEST_ENV = "PDFLEET_CPU_REQUEST"
# The deployment token: a Secret per InferenceDeployment (created by the operator when missing) in every router
# and pdfleet worker pod; the client API keys: an optional Secret the admin creates, in the router pod only.
AUTH_MOUNT = "/var/run/pdfleet/auth"
AUTH_TOKEN_KEY = "token"
API_KEYS_MOUNT = "/var/run/pdfleet/api-keys"
API_KEYS_KEY = "api-keys"
SECRET_MODE = 0o440  # root:fsGroup (the pod's group), read-only, nobody else
# (apiVersion, kind) of everything render() may produce; kube.py maps them to API paths.
KINDS = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
)
MONITORING_KINDS = frozenset({"PodMonitor", "PrometheusRule"})


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment that owns the children (and is garbage-collected with them)."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": "InferenceDeployment",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def template_hash(spec: InferenceDeploymentSpec) -> str:
    """Identity of what the pods run: the rollback fingerprint of the spec's template (`rollback.template_spec`:
    model, engine, disaggregation, the roles' classes and resources, the router's image and resources).

    One definition for the pods' annotation, revision numbering and rollback: a change of it is a new revision
    (issue 7); replica counts, autoscaling, rollback, SLO and tier edits are not, and restart nothing.
    """
    return rollback.fingerprint(rollback.template_spec(spec))


def labels(
    owner: Owner,
    component: str,
    *,
    role: str | None = None,
    accelerator: str | None = None,
    revision: int | None = None,
    engine: str | None = None,
) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "pdfleet-router" if component == ROUTER_ROLE else "pdfleet-worker",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGER,
        LABEL_DEPLOYMENT: owner.name,
    }
    if role is not None:
        out[LABEL_ROLE] = role
    if accelerator is not None:
        out[LABEL_ACCELERATOR] = accelerator
    if revision is not None:
        out[LABEL_REVISION] = str(revision)
    if engine is not None:
        out[LABEL_ENGINE] = engine
    return out


def selector(owner: Owner, role: str, accelerator: str | None = None) -> dict[str, str]:
    """Immutable Deployment selectors: never the revision (a new revision rolls pods, not selectors)."""
    out = {LABEL_DEPLOYMENT: owner.name, LABEL_ROLE: role}
    if accelerator is not None:
        out[LABEL_ACCELERATOR] = accelerator
    return out


def _meta(owner: Owner, name: str, lbls: dict[str, str], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": lbls,
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def _quantity(value: str | int | float) -> str:
    return str(value)


def model_dir(spec: InferenceDeploymentSpec) -> str:
    src = spec.model.source
    if src.pvc is not None:
        return posixpath.join(MODEL_MOUNT, src.pvc.path) if src.pvc.path else MODEL_MOUNT
    if src.host_path is not None:
        return MODEL_MOUNT
    assert src.local is not None, "validated model.source without pvc, hostPath or local"
    # NOTE: a relative local path is relative to the worker's working directory (the image's), as
    # `pdfleet up` resolves it relative to the spec file.
    return src.local.path


def _model_volume(spec: InferenceDeploymentSpec) -> tuple[list[dict], list[dict]]:
    src = spec.model.source
    if src.pvc is not None:
        vol = {"name": "model", "persistentVolumeClaim": {"claimName": src.pvc.claim_name, "readOnly": True}}
    elif src.host_path is not None:
        vol = {"name": "model", "hostPath": {"path": src.host_path.path, "type": "Directory"}}
    else:
        return [], []
    return [vol], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]


def auth_secret_name(deployment: str) -> str:
    return child_name(deployment, "auth")


def api_keys_secret_name(deployment: str) -> str:
    return child_name(deployment, "api-keys")


def auth_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The deployment token between its router, workers and KV endpoints. Created only when missing (a 409 keeps the
    one that exists); rotated by deleting it and annotating the CR pdfleet.io/recreate-token (the operator creates a
    new one, pods re-read the file)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(owner, auth_secret_name(owner.name), labels(owner, "auth")),
        "type": "Opaque",
        "data": {AUTH_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _secret_volume(name: str, secret: str, key: str, *, optional: bool = False) -> dict[str, Any]:
    source: dict[str, Any] = {"secretName": secret, "defaultMode": SECRET_MODE, "items": [{"key": key, "path": key}]}
    if optional:
        source["optional"] = True
    return {"name": name, "secret": source}


def _auth_volume(owner: Owner) -> tuple[dict[str, Any], dict[str, Any]]:
    # NOTE: no subPath: kubelet updates a Secret volume in place only without one (the rotation needs that).
    return (
        _secret_volume("auth", auth_secret_name(owner.name), AUTH_TOKEN_KEY),
        {"name": "auth", "mountPath": AUTH_MOUNT, "readOnly": True},
    )


def kv_peers(owner: Owner) -> str:
    """What a decode worker may pull KV from: the prefill role's headless Service (every ready prefill pod), KV port."""
    return f"{role_service_name(owner.name, 'prefill')}.{owner.namespace}.svc:{KV_PORT}"


def worker_args(
    spec: InferenceDeploymentSpec,
    role: str,
    runtime: runtimes.PoolRuntime | None = None,
    accelerator: str | None = None,
    owner: Owner | None = None,
) -> list[str]:
    """`pdfleet worker` flags in a pod (issue 4's contract plus the engine config file and extra args); with a
    pool's runtime, the device it must compute on and its class (a worker without the device exits, loudly);
    with its owner, the deployment token and (decode) the prefill peers it may pull from."""
    flags = []
    if owner is not None:
        flags += ["--auth-token-file", posixpath.join(AUTH_MOUNT, AUTH_TOKEN_KEY)]
        if role == "decode":
            flags += ["--kv-peers", kv_peers(owner)]
    if role == "prefill":
        flags += ["--kv-port", str(KV_PORT)]
    if runtime is not None and runtime.device is not None:
        flags += ["--device", runtime.device]
    if accelerator is not None:
        flags += ["--accelerator", accelerator]
    # torch threads from the container's CPUs (quota, affinity, $PDFLEET_CPU_REQUEST), one core kept for the server
    flags += ["--num-threads", "auto"]
    return engine_args.worker_args(
        spec,
        role,
        model_dir=model_dir(spec),
        host="0.0.0.0",
        port=HTTP_PORT,
        engine_config=posixpath.join(CONFIG_MOUNT, CONFIG_KEY),
        flags=flags,
    )


def vllm_args(spec: InferenceDeploymentSpec, role: str, runtime: runtimes.PoolRuntime) -> list[str]:
    """`vllm serve` arguments in a pod: the model directory, then the spec's engine settings."""
    return [
        model_dir(spec),
        *engine_args.vllm_args(
            spec,
            role,
            host="0.0.0.0",
            port=HTTP_PORT,
            tensor_parallel=runtime.tensor_parallel,
            kv_connector=runtime.kv_connector,
            block_size=runtime.block_size,
        ),
    ]


# Seconds a draining router keeps answering new requests (kube-proxy and ingress controllers stop sending to a
# terminating pod within a few seconds of its endpoint leaving the EndpointSlice).
ROUTER_DRAIN_ACCEPT_S = 5.0


def router_args(owner: Owner, roles: list[str], engines: Mapping[str, str] | None = None) -> list[str]:
    """`pdfleet router` flags: each role's headless Service, whose DNS name resolves to every ready worker;
    a role whose pools run vLLM is named `vllm@URL` (the router probes and drives each engine its own way)."""

    def url(role: str) -> str:
        engine = (engines or {}).get(role, runtimes.PDFLEET)
        prefix = "" if engine == runtimes.PDFLEET else f"{engine}@"
        return f"{prefix}http://{role_service_name(owner.name, role)}.{owner.namespace}.svc:{HTTP_PORT}"

    args = ["router"]
    if "colocated" in roles:
        args += ["--workers", url("colocated")]
    else:
        args += ["--prefill", url("prefill"), "--decode", url("decode")]
    return args + [
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--auth-token-file",
        posixpath.join(AUTH_MOUNT, AUTH_TOKEN_KEY),
        "--api-key-file",
        posixpath.join(API_KEYS_MOUNT, API_KEYS_KEY),
        "--api-key-file-optional",
        # endpoint removal lags SIGTERM: what the Service still sends for a moment is answered
        "--drain-accept",
        f"{ROUTER_DRAIN_ACCEPT_S:g}",
    ]


def _probes(ready: str = "/ready") -> dict[str, Any]:
    """The pdfleet worker and router: ready at /ready (after warm-up); vLLM serves only /health."""

    def get(path: str) -> dict[str, Any]:
        return {"path": path, "port": "http"}

    return {
        # NOTE: loading weights can take minutes; the startup probe holds liveness off until /health answers.
        "startupProbe": {"httpGet": get("/health"), "periodSeconds": 10, "failureThreshold": 90},
        "readinessProbe": {"httpGet": get(ready), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": get("/health"), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT), "prometheus.io/path": "/metrics"}


# CPU cores per accelerator unit a worker requests: tokenization, HTTP and the scheduling loop.
CORES_PER_UNIT = 2


def derived_resources(
    spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec, memory: pod_memory.PodMemory | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """CPU and memory requests and limits of one worker, from the model and the class (the role's own win).

    Memory: `decide.pod_memory` (weights, host KV, the offload tier, swap and the runtime, both engines). CPU on an
    accelerator: CORES_PER_UNIT cores per unit, no CPU limit (a throttled engine loop stalls every sequence); on
    the `cpu` class its count (in `_resources`).
    """
    memory = memory or pod_memory.budget(spec, cls, runtimes.engine_of(spec, cls))
    requests, limits = {"memory": f"{memory.request_gib}Gi"}, {"memory": f"{memory.limit_gib}Gi"}
    if cls.resource_name != "cpu":
        requests["cpu"] = str(CORES_PER_UNIT * cls.count)
    return requests, limits


def _resources(
    role_resources: Any, cls: AcceleratorClassSpec | None, derived: tuple[dict[str, str], dict[str, str]] = ({}, {})
) -> dict[str, Any]:
    own_requests, own_limits = role_resources.requests, role_resources.limits
    requests = {**derived[0], **{k: _quantity(v) for k, v in own_requests.items()}}
    # A derived limit goes only with a derived request: next to a request of the user's own it could be lower.
    limits = {
        **{k: v for k, v in derived[1].items() if k not in own_requests},
        **{k: _quantity(v) for k, v in own_limits.items()},
    }
    if cls is not None:
        units = str(cls.count)
        requests[cls.resource_name] = units
        if cls.resource_name != "cpu":  # extended resources must have limit == request; cpu is not capped
            limits[cls.resource_name] = units
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    return out


def _pod_env(
    owner: Owner, role: str, accelerator: str | None, extra: list[dict[str, str]], home: str = "/tmp"
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "PDFLEET_DEPLOYMENT", "value": owner.name},
        {"name": "PDFLEET_ROLE", "value": role},
    ]
    if accelerator is not None:
        env.append({"name": "PDFLEET_ACCELERATOR", "value": accelerator})
    if role != ROUTER_ROLE:
        # The revision the pod runs (its template's label): the worker reports it in /load and the router labels
        # each answer with the revision that served it, which rollback analysis reads.
        env.append(
            {
                "name": "PDFLEET_REVISION",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_REVISION}']"}},
            }
        )
    env += [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": home},
        {"name": "USER", "value": USER},
        {"name": "LOGNAME", "value": USER},
    ]
    return env + extra


def _pod_ip(name: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _class_volumes(cls: AcceleratorClassSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The class's host paths (the vendor's driver userland), read-only; runtimes refused unsafe ones already."""
    volumes = [
        {"name": f"class-{v.name}", "hostPath": {"path": v.host_path.path, "type": v.host_path.type}}
        for v in cls.volumes
    ]
    mounts = [{"name": f"class-{m.name}", "mountPath": m.mount_path, "readOnly": True} for m in cls.volume_mounts]
    return volumes, mounts


def _vllm_container(
    spec: InferenceDeploymentSpec,
    role: str,
    runtime: runtimes.PoolRuntime,
    cls: AcceleratorClassSpec,
    env: list[dict[str, Any]],
    memory: pod_memory.PodMemory,
) -> tuple[dict[str, Any], list, list]:
    """vLLM as the pod runs it: the non-root uid with no passwd entry (USER, LOGNAME), a writable HOME and cache
    tree (emptyDirs) for its compile and model caches under the read-only root, no usage reports and no hub
    (weights come from the volume), the connector's ports and host, and on the `cpu` class its KV space."""
    env = [e for e in env if e["name"] != "HOME"] + [
        {"name": "HOME", "value": HOME_MOUNT},
        {"name": "TMPDIR", "value": "/tmp"},
    ]
    env += [
        {"name": name, "value": posixpath.join(CACHE_MOUNT, sub) if sub else CACHE_MOUNT}
        for name, sub in VLLM_CACHE_ENV
    ]
    env += [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "DO_NOT_TRACK", "value": "1"},
    ]
    if cls.resource_name == "cpu":
        env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(memory.vllm_cpu_kv_gib)})
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if runtime.connector is not None:
        ports += [{"name": n, "containerPort": port, "protocol": "TCP"} for n, port in runtime.connector.ports]
        env += [{"name": k, "value": v} for k, v in runtime.connector.port_env]
    mounts = [{"name": "home", "mountPath": HOME_MOUNT}, {"name": "cache", "mountPath": CACHE_MOUNT}]
    volumes = [{"name": "home", "emptyDir": {"sizeLimit": "1Gi"}}, {"name": "cache", "emptyDir": {"sizeLimit": "8Gi"}}]
    return (
        {
            "name": "vllm",
            "image": runtime.image,
            "command": ["vllm", "serve"],
            "args": vllm_args(spec, role, runtime),
            "ports": ports,
            "env": env,
            **_probes(ready="/health"),
        },
        volumes,
        mounts,
    )


def _worker_container(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    role: str,
    acc: str,
    runtime: runtimes.PoolRuntime,
    env: list[dict[str, Any]],
) -> tuple[dict[str, Any], list, list]:
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if role == "prefill":
        ports.append({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"})
    auth_volume, auth_mount = _auth_volume(owner)
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}, auth_mount]
    volumes = [{"name": "config", "configMap": {"name": config_name(owner.name)}}, auth_volume]
    offload = spec.engine.kv_offload
    if offload is not None and offload.disk is not None:  # the disk tier's memory-mapped file
        mounts.append({"name": "kv-offload", "mountPath": offload.disk_path})
        volumes.append({"name": "kv-offload", "emptyDir": {"sizeLimit": _quantity(offload.disk)}})
    # The pod's CPU request, for --num-threads auto (a pod without a CPU limit has no quota to read).
    env = env + [
        {
            "name": CPU_REQUEST_ENV,
            "valueFrom": {"resourceFieldRef": {"containerName": "worker", "resource": "requests.cpu", "divisor": "1m"}},
        }
    ]
    return (
        {
            "name": "worker",
            "image": runtime.image,
            "command": ["pdfleet"],
            "args": worker_args(spec, role, runtime, acc, owner),
            "ports": ports,
            "env": env,
            **_probes(),
        },
        volumes,
        mounts,
    )


def pool_deployment(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    pool: PlannedPool,
    cls: AcceleratorClassSpec,
    *,
    revision: int,
    images: WorkerImages = worker_images.DEFAULTS,
    surge: bool = False,
) -> dict[str, Any]:
    role, acc = pool.role, pool.accelerator_class
    role_spec = spec.roles()[role]
    runtime = runtimes.for_pool(spec, role, acc, cls, images=images)
    memory = pod_memory.budget(spec, cls, runtime.name)
    name = pool_name(owner.name, role, acc)
    model_vols, model_mounts = _model_volume(spec)
    class_vols, class_mounts = _class_volumes(cls)
    env = _pod_env(owner, role, acc, [{"name": k, "value": v} for k, v in runtime.env])
    env += [_pod_ip(n) for n in runtime.pod_ip_env]
    if runtime.name == runtimes.VLLM:
        container, own_vols, own_mounts = _vllm_container(spec, role, runtime, cls, env, memory)
    else:
        container, own_vols, own_mounts = _worker_container(owner, spec, role, acc, runtime, env)
    container["securityContext"] = _container_security()
    container["volumeMounts"] = [
        *own_mounts,
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
        *model_mounts,
        *class_mounts,
    ]
    resources = _resources(role_spec.resources, cls, derived_resources(spec, cls, memory))
    if resources:
        container["resources"] = resources
    volumes = [
        *own_vols,
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": _quantity(spec.engine.shm_size)}},
        *model_vols,
        *class_vols,
    ]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # a draining worker finishes in-flight requests and serves its open KV leases (engine_args.drain_seconds)
        "terminationGracePeriodSeconds": engine_args.grace_seconds(spec),
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": volumes,
    }
    if cls.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(cls.node_selector.items()))
    if cls.tolerations:
        pod_spec["tolerations"] = [t.wire() for t in cls.tolerations]
    pod_labels = labels(owner, role, role=role, accelerator=acc, revision=revision, engine=runtime.name)
    annotations = _scrape_annotations()
    if runtime.name == runtimes.PDFLEET:
        annotations[ANNOTATION_CONFIG_HASH] = _digest(engine_args.config_text(spec))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(
            owner,
            name,
            labels(owner, role, role=role, accelerator=acc, revision=revision),
            {ANNOTATION_TEMPLATE_HASH: template_hash(spec)},
        ),
        "spec": {
            "replicas": pool.replicas,
            "revisionHistoryLimit": 2,
            "selector": {"matchLabels": selector(owner, role, acc)},
            # NOTE: accelerators are scarce: with a spare replica's room (`surge`, placement.surge_room) a rolling
            # update starts the new pod before stopping an old one, so the pool never shrinks; without it one
            # pod goes first (a surge pod would sit Pending and stall the rollout).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}
                if surge
                else {"maxSurge": 0, "maxUnavailable": 1},
            },
            "template": {
                "metadata": {"labels": pod_labels, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def routing_target_url(owner: Owner, spec: InferenceDeploymentSpec) -> str | None:
    """The router Service of `spec.routing.target` (same namespace), where simple requests go."""
    if spec.routing is None:
        return None
    return f"http://{spec.routing.target}.{owner.namespace}.svc:{ROUTER_SERVICE_PORT}"


def router_image(spec: InferenceDeploymentSpec, images: WorkerImages) -> str:
    """The router's image: the spec's, else the CPU worker build (the router computes nothing on an accelerator)."""
    default = images.get("cpu") or (images.images[0][1] if images.images else None)
    image = spec.router.image or spec.engine.image or default
    if image is None:
        raise ValueError(
            "spec.router.image: the operator has no worker image to run the router in (--worker-image "
            "cpu=IMAGE); name one"
        )
    return image


def router_deployment(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    engines: Mapping[str, str] | None = None,
    images: WorkerImages = worker_images.DEFAULTS,
    classes: Mapping[str, AcceleratorClassSpec] | None = None,
) -> dict[str, Any]:
    roles = list(spec.roles())
    # rules.maxPromptTokens: the router counts tokens with the model's tokenizer, so it mounts the model too
    tokenizer = spec.routing is not None and spec.routing.rules.max_prompt_tokens is not None
    model_volumes, model_mounts = _model_volume(spec) if tokenizer else ([], [])
    container: dict[str, Any] = {
        "name": "router",
        "image": router_image(spec, images),
        "command": ["pdfleet"],
        "args": router_args(owner, roles, engines)
        + engine_args.router_args(
            spec,
            route_to=routing_target_url(owner, spec),
            tokenizer_dir=model_dir(spec) if tokenizer else None,
            pd_min_prompt_tokens=pd_threshold.threshold(spec, classes or {}),
        ),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": _pod_env(owner, ROUTER_ROLE, None, []),
        **_probes(),
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            _auth_volume(owner)[1],
            {"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True},
            *model_mounts,
        ],
    }
    resources = _resources(spec.router.resources, None)
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        # NOTE: no revision here: a new worker revision must not restart the router, whose pods only
        # change with the router's own image, resources or the roles it routes to.
        "metadata": _meta(owner, router_name(owner.name), labels(owner, ROUTER_ROLE, role=ROUTER_ROLE)),
        "spec": {
            "replicas": spec.router.replicas,
            "revisionHistoryLimit": 2,
            "selector": {"matchLabels": selector(owner, ROUTER_ROLE)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": labels(owner, ROUTER_ROLE, role=ROUTER_ROLE),
                    "annotations": _scrape_annotations(),
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": engine_args.grace_seconds(spec),
                    "securityContext": _pod_security(),
                    # One router per node where the nodes allow: a node drain or failure takes one of them.
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": selector(owner, ROUTER_ROLE)},
                        }
                    ],
                    "containers": [container],
                    "volumes": [
                        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
                        _auth_volume(owner)[0],
                        # absent until an admin creates it: then /v1/* needs a key (no restart)
                        _secret_volume("api-keys", api_keys_secret_name(owner.name), API_KEYS_KEY, optional=True),
                        *model_volumes,
                    ],
                },
            },
        },
    }


def role_service(owner: Owner, role: str) -> dict[str, Any]:
    """Headless: its DNS name answers every ready worker's IP, which is how the router finds them."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, role_service_name(owner.name, role), labels(owner, role, role=role)),
        "spec": {
            "clusterIP": "None",
            "selector": selector(owner, role),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
            "publishNotReadyAddresses": False,
        },
    }


def router_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, owner.name, labels(owner, ROUTER_ROLE, role=ROUTER_ROLE)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(owner, ROUTER_ROLE),
            "ports": [{"name": "http", "port": ROUTER_SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pdb_min_available(size: int, minimum: int) -> int:
    """A role's PodDisruptionBudget: one voluntary disruption at a time, never below the role's minReplicas (nor
    below one replica while it runs any).

    NOTE: a role of one replica (or at its minimum) allows no eviction until its replacement serves: the operator
    starts one elsewhere when the node is cordoned (decide.transition), and `kubectl drain` waits for it instead
    of taking the role's only replica down; with no capacity anywhere for a replacement the drain waits, and
    PlacementDrift says why.
    """
    if size <= 0:
        return 0
    return max(minimum, size - 1, 1)


def role_pdb(owner: Owner, role: str, size: int = 1, minimum: int = 1) -> dict[str, Any]:
    """`size`: the role's planned replicas (its target); `minimum`: its minReplicas."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, role_service_name(owner.name, role), labels(owner, role, role=role)),
        "spec": {
            "minAvailable": pdb_min_available(size, minimum),
            "selector": {"matchLabels": selector(owner, role)},
            # A worker that never got ready (no device, bad weights) must not block node drains.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def router_pdb(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The router's PodDisruptionBudget: a drain takes one router at a time while another serves."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, router_name(owner.name), labels(owner, ROUTER_ROLE, role=ROUTER_ROLE)),
        "spec": {
            "minAvailable": max(1, spec.router.replicas - 1),
            "selector": {"matchLabels": selector(owner, ROUTER_ROLE)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def network_policies(
    owner: Owner, spec: InferenceDeploymentSpec, scrapers: Sequence[str], connectors: Sequence[Connector] = ()
) -> list[dict[str, Any]]:
    """Who may talk to this deployment's pods. Workers: only its own router and workers (HTTP, the pdfleet KV
    endpoint, and what the vLLM pools' KV `connectors` need: their fixed ports, or every port between the
    deployment's own pods where a transfer also uses ports chosen at run time, as UCX over TCP and Mooncake's
    transfer engine do) and pods of the scraper namespaces (HTTP, for /metrics). The router: `spec.router.allowFrom`
    (plus the scraper namespaces, so that Prometheus keeps scraping it: rollback analysis reads its answers), or any
    source when empty. Enforced by the cluster's CNI, where it enforces any."""
    roles = sorted(spec.roles())
    own = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name}}}
    fixed = sorted({HTTP_PORT, KV_PORT} | {port for c in connectors for _, port in c.ports})
    ingress: list[dict[str, Any]] = [
        {"from": [own]}
        if any(c.dynamic_ports for c in connectors)
        else {"from": [own], "ports": [{"protocol": "TCP", "port": p} for p in fixed]}
    ]
    scraper_peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}} for ns in scrapers]
    if scrapers:
        ingress.append({"from": scraper_peers, "ports": [{"protocol": "TCP", "port": HTTP_PORT}]})
    workers = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, child_name(owner.name, "workers"), labels(owner, "network")),
        "spec": {
            "podSelector": {
                "matchLabels": {LABEL_DEPLOYMENT: owner.name},
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": roles}],
            },
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
    router_rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": HTTP_PORT}]}
    peers = []
    for p in spec.router.allow_from:
        if p.cidr is not None:
            peers.append({"ipBlock": {"cidr": p.cidr}})
        else:
            peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": p.namespace}}}
            if p.pod_labels:
                peer["podSelector"] = {"matchLabels": dict(sorted(p.pod_labels.items()))}
            peers.append(peer)
    router_ingress = [router_rule]
    if peers:
        router_rule["from"] = peers
        if scrapers:  # NOTE: the same port as /v1 (the router has one); /v1 still asks for a key once keys exist
            router_ingress.append({"from": scraper_peers, "ports": [{"protocol": "TCP", "port": HTTP_PORT}]})
    router = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, router_name(owner.name), labels(owner, "network")),
        "spec": {
            "podSelector": {"matchLabels": selector(owner, ROUTER_ROLE)},
            "policyTypes": ["Ingress"],
            "ingress": router_ingress,
        },
    }
    if spec.routing is None:
        return [workers, router]
    # NOTE: owned by this deployment, selecting the target's router pods: policies add up, so the target's own
    # allowFrom stays whatever it is and this deployment's routers may reach it too (query routing).
    target = Owner(spec.routing.target, owner.namespace, "")
    routing = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, child_name(owner.name, "routing"), labels(owner, "network")),
        "spec": {
            "podSelector": {"matchLabels": selector(target, ROUTER_ROLE)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector(owner, ROUTER_ROLE)}}],
                    "ports": [{"protocol": "TCP", "port": HTTP_PORT}],
                }
            ],
        },
    }
    return [workers, router, routing]


def config_map(owner: Owner, spec: InferenceDeploymentSpec, revision: int) -> dict[str, Any]:
    """The engine config, labelled with the revision it belongs to and carrying that revision's template
    (the record the operator turns into a ControllerRevision once the revision is superseded)."""
    revision_spec = json.dumps(rollback.revision_wire(spec), sort_keys=True, separators=(",", ":"))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            owner,
            config_name(owner.name),
            labels(owner, "config", revision=revision),
            {ANNOTATION_TEMPLATE_HASH: template_hash(spec), ANNOTATION_REVISION_SPEC: revision_spec},
        ),
        "data": {CONFIG_KEY: engine_args.config_text(spec)},
    }


def pod_monitor(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """Scrapes workers and router; pod labels become the pdfleet_* target labels the autoscaler queries."""

    def relabel(label: str, target: str) -> dict[str, Any]:
        source = "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)
        return {"sourceLabels": [source], "targetLabel": target, "action": "replace"}

    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(owner, owner.name, labels(owner, "monitoring")),
        "spec": {
            "selector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name}},
            "podMetricsEndpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": spec.autoscaling.interval,
                    "relabelings": [
                        relabel(LABEL_DEPLOYMENT, names.LABEL_DEPLOYMENT),
                        relabel(LABEL_ROLE, names.LABEL_ROLE),
                        relabel(LABEL_ACCELERATOR, names.LABEL_ACCELERATOR),
                        {
                            "sourceLabels": ["__meta_kubernetes_namespace"],
                            "targetLabel": names.LABEL_NAMESPACE,
                            "action": "replace",
                        },
                    ],
                }
            ],
        },
    }


def prometheus_rule(owner: Owner) -> dict[str, Any]:
    """This deployment's $ per 1M generated tokens, from the operator's cost gauge and the workers' token rate."""
    own = f'namespace="{owner.namespace}",{names.LABEL_DEPLOYMENT_OWN}="{owner.name}"'
    workers = f'{names.LABEL_NAMESPACE}="{owner.namespace}",{names.LABEL_DEPLOYMENT}="{owner.name}"'
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _meta(owner, owner.name, labels(owner, "monitoring")),
        "spec": {
            "groups": [
                {
                    "name": f"pdfleet-{owner.namespace}-{owner.name}",
                    "rules": [
                        {
                            "record": "pdfleet:cost_per_million_tokens",
                            "expr": f"sum({names.POOL_COST_PER_HOUR}{{{own}}}) / "
                            f"(sum(rate({names.GENERATION_TOKENS_TOTAL}{{{workers}}}[5m])) * 3600 / 1e6)",
                            "labels": {names.LABEL_NAMESPACE: owner.namespace, names.LABEL_DEPLOYMENT: owner.name},
                        }
                    ],
                }
            ]
        },
    }


def render(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    plan: FleetPlan,
    classes: Mapping[str, AcceleratorClassSpec],
    *,
    revision: int,
    monitoring: bool = False,
    scrapers: Sequence[str] = ("monitoring",),
    images: WorkerImages = worker_images.DEFAULTS,
    own_pod_monitor: bool = True,
    surge: Collection[tuple[str, str]] = (),
) -> list[dict[str, Any]]:
    """Every child object, in apply order (config and discovery before the pods that use them).
    `images`: the operator's pdfleet worker image per platform (a class's spec.runtimes.pdfleet.image and the spec's
    engine.image win; one the class's platform cannot use is refused, as is a platform without one).
    `monitoring`: the monitoring CRDs exist; then the PrometheusRule, and this deployment's own PodMonitor unless
    `surge`: the pools (role, class) with room for one more replica: they roll without shrinking.
    `own_pod_monitor` is off (the chart's one PodMonitor scrapes every deployment's pods: two would double each series).

    `spec` is the revision being served (rollback passes the stable revision's spec); `plan` gives the
    replicas. Pools with a class missing from `classes` are a wrong call: ValueError.
    """
    if revision < 1:
        raise ValueError(f"revision must be >= 1, got {revision}")
    roles = list(spec.roles())
    for pool in plan.pools:
        if pool.role not in roles:
            raise ValueError(f"plan has a {pool.role} pool but the spec's roles are {roles}")
        if pool.accelerator_class not in classes:
            raise ValueError(f"plan uses AcceleratorClass {pool.accelerator_class!r}, not among {sorted(classes)}")
    problems = runtimes.check(spec, classes, images)
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    engines = {role: runtimes.role_engine(spec, role, classes) for role in roles}
    out: list[dict[str, Any]] = [config_map(owner, spec, revision)]
    out += [role_service(owner, role) for role in roles]
    out.append(router_service(owner))
    role_specs = spec.roles()
    out += [
        role_pdb(
            owner,
            role,
            min(plan.targets.get(role, plan.replicas(role)), plan.replicas(role)),
            role_specs[role].min_replicas,
        )
        for role in roles
    ]
    out.append(router_pdb(owner, spec))
    connectors = [
        rt.connector
        for p in plan.pools
        if (
            rt := runtimes.for_pool(spec, p.role, p.accelerator_class, classes[p.accelerator_class], images=images)
        ).connector
        is not None
    ]
    out += network_policies(owner, spec, scrapers, connectors)
    out += [
        pool_deployment(
            owner,
            spec,
            pool,
            classes[pool.accelerator_class],
            revision=revision,
            images=images,
            surge=(pool.role, pool.accelerator_class) in surge,
        )
        for pool in plan.pools
    ]
    out.append(router_deployment(owner, spec, engines, images, classes))
    if monitoring:
        out += ([pod_monitor(owner, spec)] if own_pod_monitor else []) + [prometheus_rule(owner)]
    names_seen = [(o["kind"], o["metadata"]["name"]) for o in out]
    assert len(set(names_seen)) == len(names_seen), f"rendered two objects with one name: {names_seen}"
    return out

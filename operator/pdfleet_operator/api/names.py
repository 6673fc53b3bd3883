"""The names and labels of the objects an InferenceDeployment owns: part of the API (users, dashboards and
PodMonitors select by them), so the Kubernetes backend, the status and `pdfleet up` share them.

Names derive from the deployment name only, so a restarted operator finds what it created instead of
creating twins.
"""

from __future__ import annotations

import hashlib

MAX_NAME = 63
HASH_LEN = 8
ROUTER_SERVICE_PORT = 80

MANAGER = "pdfleet-operator"
PART_OF = "pdfleet"

LABEL_DEPLOYMENT = "pdfleet.io/deployment"
LABEL_ROLE = "pdfleet.io/role"
LABEL_ACCELERATOR = "pdfleet.io/accelerator"
LABEL_REVISION = "pdfleet.io/revision"
LABEL_ENGINE = "pdfleet.io/engine"  # on worker pods: pdfleet | vllm (the metrics profile of each pool)
ANNOTATION_TEMPLATE_HASH = "pdfleet.io/template-hash"
# NOTE: the pdfleet worker image a pool runs when neither the deployment (spec.engine.image) nor its class
# (spec.runtimes.pdfleet.image) names one is the operator's default for the class's platform
# (decide.worker_images, --worker-image PLATFORM=IMAGE), kept out of the CRD schema so that a CRD upgrade never
# rolls the fleets that relied on it.
ANNOTATION_CONFIG_HASH = "pdfleet.io/config-hash"
# On every child: a digest of what the operator last applied to it. A field the render stops producing (a
# toleration or env var dropped from a class) leaves the digest changed, so the child is applied again and
# server-side apply prunes the field this manager no longer sends (containment alone cannot see a removal).
ANNOTATION_APPLIED_HASH = "pdfleet.io/applied-hash"
# On the ConfigMap: the served revision's template (`rollback.revision_wire`, JSON). The served revision is
# not a ControllerRevision yet; the operator stores it from here when another revision supersedes it.
ANNOTATION_REVISION_SPEC = "pdfleet.io/revision-spec"
ROUTER_ROLE = "router"
# On an AcceleratorClass while a pool uses it: a deleted class stays (with a deletionTimestamp) until its pools
# have moved to other classes, as Kubernetes holds a PersistentVolumeClaim in use.
FINALIZER_CLASS_IN_USE = "pdfleet.io/in-use"


def child_name(*parts: str) -> str:
    """`a-b-c`, or when longer than 63 characters a 54-character prefix plus a hash of the whole name."""
    if not parts or any(not p for p in parts):
        raise ValueError(f"child name parts must be non-empty, got {parts!r}")
    full = "-".join(parts)
    if len(full) <= MAX_NAME:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:HASH_LEN]
    return full[: MAX_NAME - HASH_LEN - 1].rstrip("-") + "-" + digest


def pool_name(deployment: str, role: str, accelerator_class: str) -> str:
    return child_name(deployment, role, accelerator_class)


def role_service_name(deployment: str, role: str) -> str:
    return child_name(deployment, role)


def router_name(deployment: str) -> str:
    return child_name(deployment, "router")


def config_name(deployment: str) -> str:
    return child_name(deployment, "engine")


def endpoint(deployment: str, namespace: str) -> str:
    """The OpenAI API base URL clients use: the router Service."""
    return f"http://{deployment}.{namespace}.svc:{ROUTER_SERVICE_PORT}/v1"

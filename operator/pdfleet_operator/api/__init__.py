"""The pdfleet.io/v1alpha1 API as pydantic models: the one source of the CRDs, validation and defaults."""

from pdfleet_operator.api.accelerator_class import AcceleratorClass, AcceleratorClassSpec, AcceleratorClassStatus
from pdfleet_operator.api.inference_deployment import (
    ROLES,
    WORKER_ROLE,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    NetworkPeer,
    PoolStatus,
    RoleSpec,
    ScalingDecisionStatus,
)
from pdfleet_operator.api.meta import Condition, parse_duration, parse_quantity, set_condition

GROUP = "pdfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# kind -> model; the order is the order of `crds/`.
KINDS = {"AcceleratorClass": AcceleratorClass, "InferenceDeployment": InferenceDeployment}

__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "ROLES",
    "VERSION",
    "WORKER_ROLE",
    "AcceleratorClass",
    "AcceleratorClassSpec",
    "AcceleratorClassStatus",
    "Condition",
    "InferenceDeployment",
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
    "NetworkPeer",
    "PoolStatus",
    "RoleSpec",
    "ScalingDecisionStatus",
    "parse_duration",
    "parse_quantity",
    "set_condition",
]

"""A stateful Kubernetes API emulator for tests, built on kmock (the package; `tests.support.k8s_emulator` and
`tests.support.k8s_workloads` re-export it for the modules that import it from there).

``KubernetesApiEmulator`` extends kmock's ``KubernetesEmulator`` (and is served by ``kmock.Server``)
into something kopf, the ``kubernetes`` Python client and ``kubectl`` can run against for real:

* objects get ``uid``, ``resourceVersion`` (one global monotonic counter, as etcd's revision),
  ``generation`` (bumped on changes outside ``metadata``/``status`` only), ``creationTimestamp``
  and ``namespace``; no-op writes change nothing and send no watch event;
* list (``kind: XList`` + ``metadata.resourceVersion``), get, create, replace (PUT, with
  resourceVersion conflicts → 409), patch (JSON patch with ``test`` failures → 422, merge patch,
  strategic merge as an approximation, server-side apply), delete, deletecollection, ``dryRun=All``;
* watches: without ``resourceVersion`` (or with ``0``/``sendInitialEvents``) the current objects
  come as ADDED first, with a resourceVersion only the events after it; MODIFIED/DELETED follow,
  label/field selectors translate changes into ADDED/DELETED as the real API does;
  ``timeoutSeconds`` ends the stream; :meth:`KubernetesApiEmulator.compact` makes older
  resourceVersions answer ``410 Gone``;
* ``/status`` subresources (writes there change only ``status``; main writes ignore ``status``),
  ``metadata.finalizers`` + ``deletionTimestamp``, garbage collection by ``ownerReferences``
  (background cascade, ``Foreground`` approximated, ``Orphan`` honoured), namespace termination;
* namespaces (``default``, ``kube-system``, ``kube-public``, ``kube-node-lease`` exist; objects in
  a missing namespace are refused with 404 as on a real cluster);
* applied CustomResourceDefinitions become served resources with discovery (group/version, short
  names, categories, scope, subresources), CR admission against the served version's
  ``openAPIV3Schema`` and CEL ``x-kubernetes-validations`` (422 ``Invalid`` Status with causes),
  unknown fields per ``fieldValidation`` (Strict → 400, Warn → pruned + ``Warning`` header,
  Ignore → pruned), schema defaults, and Table responses from ``additionalPrinterColumns``;
* discovery (``/api``, ``/apis``, ``/api/v1``, ``/apis/<g>/<v>``), ``/version``, an empty
  ``/openapi/v2`` (kubectl then skips client-side validation), ``/healthz``/``/readyz``;
* a request log (:class:`LoggedRequest`) to count writes and list the verbs a client used, who sent each
  request, and which objects each list answered and each watch streamed (``objects``), so a test can show
  that a server-side ``labelSelector`` kept unlabelled objects from ever reaching a client;
* RBAC, opt-in per token: a bearer token registered in ``users`` (``service_account(ns, name)`` makes one
  for a ServiceAccount) is authorized by the Roles, ClusterRoles, RoleBindings and ClusterRoleBindings
  stored in the emulator (apiGroups/resources/subresources/verbs/resourceNames, ``*`` wildcards,
  ServiceAccount/User/Group subjects, ``system:masters``); a request no rule allows gets kube-apiserver's
  403 Forbidden Status; a server-side apply that creates needs ``create`` too; and the
  OwnerReferencesPermissionEnforcement admission plugin: changing an existing object's ownerReferences
  needs ``delete`` on it, ``blockOwnerDeletion: true`` needs ``update`` on the owner's ``finalizers``.

What a real kube-apiserver does that this does NOT:

* no authentication: a token not registered in ``users`` (the tests' own kubeconfig) may do anything;
  RBAC knows no aggregated ClusterRoles (``aggregationRule``), no built-in roles or bindings
  (non-resource URLs such as discovery are allowed to everyone instead), no escalation/bind checks on
  writes of RBAC objects, no impersonation, no SubjectAccessReviews; no admission webhooks, no
  ValidatingAdmissionPolicy, no quota/LimitRange, no validation of built-in kinds beyond the object
  name (a Deployment with a bad spec is stored as sent);
* controllers only when a test turns them on (:meth:`KubernetesApiEmulator.enable_workloads`, see
  :mod:`tests.support.k8s_workloads`): Deployments then get Pods (directly: no ReplicaSets, a changed
  template replaces every old pod at once, no maxSurge/maxUnavailable pacing, no progress deadline),
  a scheduler binds them to Nodes by their requests (nodeSelector, required node affinity on labels,
  taints, free allocatable of every resource: nvidia.com/gpu, MIG and other extended resources, cpu,
  memory, pods) and leaves the rest ``Pending`` with ``PodScheduled=False``/``Unschedulable`` until
  capacity frees; bound pods turn Running and Ready at once. Not emulated even then: preemption and
  priorities, pod (anti-)affinity and topology spread, preferred affinity and scoring beyond
  "fullest node first", node-affinity on fields, taint-based eviction, resource quotas, device
  plugins (allocatable is what the Node says), probes, restarts, image pulls, Services' endpoints,
  Jobs. Off (the default), nothing makes Pods or readiness — patch ``status`` in tests;
* garbage collection is synchronous and approximate (Foreground deletion deletes dependents first
  instead of using the ``foregroundDeletion`` finalizer; Orphan removes the owner references at
  once); deleting a CRD deletes its objects without waiting for their finalizers;
* server-side apply merges the applied configuration into the object (maps merge, lists are
  replaced) and forgets fields the same manager stopped applying; there is no ``managedFields``
  bookkeeping, no conflict detection between managers; strategic merge patch knows only a few
  merge keys (``name``, ``containerPort``, ``mountPath``, ``type``, ...) and ``$patch`` directives;
* no protobuf (requests in protobuf get 415; so ``kubectl create <typed resource>`` and Helm's
  Secret storage do not work), no CBOR, no aggregated discovery (clients fall back to legacy
  discovery), no OpenAPI documents, no ``kubectl explain``;
* lists ignore ``limit``/``continue`` (everything comes in one page) and ``resourceVersion``
  parameters (lists are always current); no watch bookmarks except the one that ends
  ``sendInitialEvents``; field selectors accept any dotted path (the real API allows only a few
  per kind); no ``/scale``, ``/log``, ``/exec``, ``/eviction``, ``/token`` or ``/proxy``
  subresources; CRD conversion webhooks are not called (versions differ only in ``apiVersion``);
* graceful deletion periods are ignored (objects without finalizers go at once), ``Event``
  aggregation, TTLs and ``generateName`` retries are not emulated (Leases are stored objects like any
  other: leader election is the clients' protocol over them, which works as on a cluster).
"""

from tests.support.k8s.clock import Clock, human_duration
from tests.support.k8s.emulator import KubernetesApiEmulator
from tests.support.k8s.errors import ApiError, Forbidden
from tests.support.k8s.jsonpath import jsonpath
from tests.support.k8s.patches import json_merge_patch, json_patch, strategic_merge_patch
from tests.support.k8s.rbac import Requester, rule_allows, service_account_user
from tests.support.k8s.requestlog import LoggedRequest
from tests.support.k8s.resources import ApiResource
from tests.support.k8s.selectors import parse_field_selector, parse_label_selector, selector_matches
from tests.support.k8s.server import EmulatorThread, write_kubeconfig

__all__ = [
    "ApiError", "Forbidden", "Requester", "ApiResource", "LoggedRequest", "KubernetesApiEmulator", "EmulatorThread",
    "write_kubeconfig", "Clock", "human_duration", "jsonpath", "json_merge_patch", "json_patch",
    "strategic_merge_patch", "rule_allows", "service_account_user", "parse_field_selector", "parse_label_selector",
    "selector_matches",
]

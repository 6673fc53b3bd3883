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
  needs ``delete`` on it, ``blockOwnerDeletion: true`` needs ``update`` on the owner's ``finalizers``;
* admission plugins of kube-apiserver's default set that matter to workloads: DefaultTolerationSeconds (new pods
  tolerate ``node.kubernetes.io/not-ready``/``unreachable`` NoExecute for 300 s unless they say otherwise) and
  the Deployment strategy's validation (maxSurge/maxUnavailable ints or percents, not both 0: 422);
* the Eviction subresource (``POST pods/NAME/eviction``, :mod:`.eviction`): PodDisruptionBudgets are enforced
  from the status the disruption controller writes; 429 TooManyRequests when a budget has nothing to spare;
* a clock (:class:`Clock`, ``emulator.clock``): every timestamp the emulator writes and every due time of its
  controllers; ``emulator.advance(seconds)`` (``kube.advance``) moves it forward and runs what fell due;
* controllers, when a test turns them on (:meth:`KubernetesApiEmulator.enable_workloads`, see
  :mod:`tests.support.k8s.workloads`): Deployments → ReplicaSets → Pods with RollingUpdate pacing
  (maxSurge/maxUnavailable as pods become available), Recreate, revisions, status and conditions with the
  progress deadline; a scheduler binding pods by requests, selectors, required node affinity and taints
  (``Pending``/``Unschedulable`` otherwise); kubelets starting pods and reporting them Ready at once unless a
  test holds or fails readiness; node lifecycle (cordon and NotReady/Unknown taints, pods marked not ready,
  NoExecute eviction after ``tolerationSeconds``); pod GC of deleted nodes' pods; the disruption controller;
  opt-in graceful pod termination (``graceful_termination``: a deleted pod stays ``Terminating`` for its
  grace period). ``kube.drain(node)`` (:mod:`.drain`) does what ``kubectl drain`` does, which works too.

Modules: :mod:`.store` (objects, events, deletion, garbage collection, namespaces), :mod:`.registry` (served
resources, CRDs), :mod:`.admission`, :mod:`.verbs`, :mod:`.eviction`, :mod:`.rbac`, :mod:`.http`,
:mod:`.discovery`, :mod:`.tables`, :mod:`.watches`, :mod:`.selectors`, :mod:`.patches`, :mod:`.jsonpath`,
:mod:`.clock`, :mod:`.errors`, :mod:`.requestlog`, :mod:`.resources`, :mod:`.emulator` (the class),
:mod:`.server` (:class:`EmulatorThread`), :mod:`.drain`, :mod:`.workloads` (one controller per module).


What a real cluster does that this does NOT:

* no authentication: a token not registered in ``users`` (the tests' own kubeconfig) may do anything;
  RBAC knows no aggregated ClusterRoles (``aggregationRule``), no built-in roles or bindings
  (non-resource URLs such as discovery are allowed to everyone instead), no escalation/bind checks on
  writes of RBAC objects, no impersonation, no SubjectAccessReviews; no admission webhooks, no
  ValidatingAdmissionPolicy, no quota/LimitRange, no validation of built-in kinds beyond the object
  name and a Deployment's strategy, and no API defaulting of built-in kinds (a stored Deployment has no
  ``strategy``, ``revisionHistoryLimit`` or ``progressDeadlineSeconds`` unless sent; the controllers read
  Kubernetes' defaults where they are missing);
* controllers only when a test turns them on; off (the default), nothing makes Pods, readiness, taints or
  budget status — patch ``status`` in tests. On, still not emulated: real scheduler plugins (no preemption
  or priorities, no pod (anti-)affinity or topology spread, no preferred affinity, no scoring beyond
  "fullest node first", no node affinity on fields), resource quotas, device plugins (allocatable is what
  the Node says), probes (readiness is what tests say), container restarts, image pulls, Services'
  endpoints, StatefulSets, DaemonSets, Jobs, HPAs; ReplicaSets adopt no orphan pods; the node lifecycle
  controller does not turn a silent node ``Unknown`` (tests set its Ready condition), has no zone-wide
  rate limits and no pressure taints; the Deployment controller has no rollback (``kubectl rollout undo``),
  no ``terminatingReplicas``, and proportional scaling is approximate at the edges; a deployment's pods
  with graceful termination off go at once;
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
  per kind); no ``/scale``, ``/log``, ``/exec``, ``/binding``, ``/token`` or ``/proxy`` subresources;
  CRD conversion webhooks are not called (versions differ only in ``apiVersion``);
* graceful deletion periods apply to pods only, and only with the workloads' ``graceful_termination``
  (other objects without finalizers go at once); ``Event`` aggregation, TTLs and ``generateName`` retries
  are not emulated (Leases are stored objects like any other: leader election is the clients' protocol over
  them, which works as on a cluster).
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
    "ApiError",
    "Forbidden",
    "Requester",
    "ApiResource",
    "LoggedRequest",
    "KubernetesApiEmulator",
    "EmulatorThread",
    "write_kubeconfig",
    "Clock",
    "human_duration",
    "jsonpath",
    "json_merge_patch",
    "json_patch",
    "strategic_merge_patch",
    "rule_allows",
    "service_account_user",
    "parse_field_selector",
    "parse_label_selector",
    "selector_matches",
]

"""RBAC, opt-in per token: who a request comes from (:class:`Requester`), PolicyRule matching as kube-apiserver's
RBAC authorizer does it over the Roles/ClusterRoles and bindings the emulator stores, kube-apiserver's 403
Status, and the OwnerReferencesPermissionEnforcement admission plugin. Mixed into the emulator."""

from __future__ import annotations

import contextvars
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp.web

from tests.support.k8s.errors import ApiError, Forbidden

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.requestlog import LoggedRequest
    from tests.support.k8s.resources import ApiResource


@dataclass(frozen=True)
class Requester:
    """Who sent a request: the user name and groups its token stands for (``KubernetesApiEmulator.users``), and
    the pod a bound ServiceAccount token names (the ``authentication.kubernetes.io/pod-name`` extra; not used by
    RBAC, only logged, which tells replicas of one ServiceAccount apart)."""

    user: str
    groups: tuple[str, ...] = ()
    pod: str | None = None


# The requester of the request being served (a context variable: each request is its own aiohttp task).
REQUESTER: contextvars.ContextVar[Requester | None] = contextvars.ContextVar("emulator_requester", default=None)
RBAC_GROUP = "rbac.authorization.k8s.io"


def service_account_user(namespace: str, name: str, pod: str | None = None) -> Requester:
    """What a ServiceAccount token (bound to `pod`, when given) authenticates as on a real cluster."""
    return Requester(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
        pod,
    )


def rule_allows(rule: dict, group: str, resource: str, subresource: str | None, verb: str, name: str | None) -> bool:
    """One PolicyRule against one request, as kube-apiserver's RBAC authorizer matches them."""
    groups = rule.get("apiGroups") or []
    if "*" not in groups and group not in groups:
        return False
    resources = rule.get("resources") or []
    full = f"{resource}/{subresource}" if subresource else resource
    if "*" not in resources and full not in resources and not (subresource and f"*/{subresource}" in resources):
        return False
    verbs = rule.get("verbs") or []
    if "*" not in verbs and verb not in verbs:
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)


def subject_matches(subject: dict, who: Requester) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        return who.user == f"system:serviceaccount:{subject.get('namespace')}:{subject.get('name')}"
    if kind == "User":
        return who.user == subject.get("name")
    if kind == "Group":
        return subject.get("name") in who.groups
    return False


def forbidden(
    who: Requester,
    verb: str,
    group: str,
    resource: str,
    subresource: str | None,
    namespace: str | None,
    name: str | None,
    prefix: str = "",
) -> ApiError:
    """kube-apiserver's 403 Status for a request no rule allows."""
    full = f"{resource}/{subresource}" if subresource else resource
    group_resource = f"{resource}.{group}" if group else resource
    what = f'{group_resource} "{name}"' if name else group_resource
    where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    details: dict[str, Any] = {"group": group, "kind": resource}
    if name:
        details["name"] = name
    return Forbidden(
        403,
        "Forbidden",
        f'{what} is forbidden: {prefix}User "{who.user}" cannot {verb} resource '
        f'"{full}" in API group "{group}" {where}',
        details,
    )


class RbacMixin:
    """Authorization of the emulator's requests (``users`` maps tokens to requesters)."""

    def service_account(self, namespace: str, name: str, pod: str | None = None) -> str:
        """Register (or find) a token for ServiceAccount ``namespace/name`` (bound to `pod`); its requests are then
        authorized by RBAC."""
        who = service_account_user(namespace, name, pod)
        for token, known in self.users.items():
            if known == who:
                return token
        token = f"sa-{namespace}-{name}-{secrets.token_hex(8)}"
        self.users[token] = who
        return token

    def _requester(self, raw: aiohttp.web.BaseRequest) -> Requester | None:
        scheme, _, token = (raw.headers.get("Authorization") or "").partition(" ")
        return self.users.get(token.strip()) if scheme.lower() == "bearer" else None

    def _rules_for(self, who: Requester, namespace: str | None) -> list[dict]:
        """Every PolicyRule granted to `who` that applies in `namespace` (None: cluster scope only); cached until
        an RBAC object changes."""
        cached = self._rbac_rules.get((who, namespace))
        if cached is None:
            cached = self._rbac_rules[(who, namespace)] = list(self._find_rules(who, namespace))
        return cached

    def _find_rules(self, who: Requester, namespace: str | None) -> Iterable[dict]:
        def role_rules(kind: str, role_ns: str, name: str) -> list[dict]:
            plural = "clusterroles" if kind == "ClusterRole" else "roles"
            role = self._store.get((RBAC_GROUP, plural, role_ns if kind == "Role" else "", name))
            return list((role or {}).get("rules") or [])

        for (group, plural, _, _), binding in self._store.items():
            if group != RBAC_GROUP or plural != "clusterrolebindings":
                continue
            if any(subject_matches(s, who) for s in binding.get("subjects") or []):
                yield from role_rules("ClusterRole", "", binding["roleRef"]["name"])
        if namespace:
            for (group, plural, ns, _), binding in self._store.items():
                if group != RBAC_GROUP or plural != "rolebindings" or ns != namespace:
                    continue
                if any(subject_matches(s, who) for s in binding.get("subjects") or []):
                    yield from role_rules(binding["roleRef"]["kind"], namespace, binding["roleRef"]["name"])

    def allowed(
        self,
        who: Requester,
        verb: str,
        group: str,
        resource: str,
        subresource: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
    ) -> bool:
        """Whether the stored Roles/ClusterRoles and their bindings let `who` do this (system:masters may do
        anything)."""
        if "system:masters" in who.groups:
            return True
        return any(rule_allows(r, group, resource, subresource, verb, name) for r in self._rules_for(who, namespace))

    def _authorize(self, who: Requester, entry: LoggedRequest) -> None:
        """RBAC for one request; non-resource URLs (discovery, /version, /healthz) are allowed to everyone, as the
        system:discovery and system:public-info-viewer ClusterRoles do on a cluster."""
        if entry.verb is None or entry.resource is None:
            return
        group = entry.group or ""
        verbs = [entry.verb]
        if entry.patch_type == "apply" and entry.subresource is None:
            res = self._api.get((group, entry.version or "", entry.resource))
            if res is not None and self._key(res, entry.namespace, entry.name or "") not in self._store:
                verbs.append("create")  # an apply that creates is authorized as create as well
        for verb in verbs:
            if not self.allowed(who, verb, group, entry.resource, entry.subresource, entry.namespace, entry.name):
                raise forbidden(who, verb, group, entry.resource, entry.subresource, entry.namespace, entry.name)

    def _check_owner_references(self, res: ApiResource, obj: dict, old: dict | None) -> None:
        """The OwnerReferencesPermissionEnforcement admission plugin, for requests authorized by RBAC: changing
        an existing object's ownerReferences needs `delete` on it, and setting `blockOwnerDeletion: true` on a
        reference needs `update` on the owner's `finalizers` subresource."""
        who = REQUESTER.get()
        if who is None:
            return
        refs = list((obj.get("metadata") or {}).get("ownerReferences") or [])
        before = list(((old or {}).get("metadata") or {}).get("ownerReferences") or [])
        if refs == before:
            return
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace"), meta.get("name")
        if old is not None and not self.allowed(who, "delete", res.group, res.plural, None, namespace, name):
            raise forbidden(
                who,
                "delete",
                res.group,
                res.plural,
                None,
                namespace,
                name,
                prefix="cannot set an ownerRef on a resource you can't delete: ",
            )
        blocking_before = {r.get("uid") for r in before if r.get("blockOwnerDeletion")}
        for ref in refs:
            if not ref.get("blockOwnerDeletion") or ref.get("uid") in blocking_before:
                continue
            group, _, version = str(ref.get("apiVersion") or "").rpartition("/")
            owners = [
                r for r in self._api.values() if r.group == group and r.version == version and r.kind == ref.get("kind")
            ]
            if not owners:
                raise Forbidden(
                    403,
                    "Forbidden",
                    f'{res.group_resource} "{name}" is forbidden: cannot set '
                    f"blockOwnerDeletion in this case because cannot find RESTMapping for APIVersion "
                    f"{ref.get('apiVersion')} Kind {ref.get('kind')}",
                )
            for owner in owners:
                owner_ns = namespace if owner.namespaced else None
                if not self.allowed(who, "update", owner.group, owner.plural, "finalizers", owner_ns, ref.get("name")):
                    raise forbidden(
                        who,
                        "update",
                        owner.group,
                        owner.plural,
                        "finalizers",
                        owner_ns,
                        ref.get("name"),
                        prefix="cannot set blockOwnerDeletion if an ownerReference refers to a resource "
                        "you can't set finalizers on: ",
                    )

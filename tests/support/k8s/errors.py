"""Errors the emulator answers as Kubernetes ``Status`` objects, and the constructors for the usual ones
(NotFound, Conflict, BadRequest, Invalid, Forbidden, TooManyRequests); raised by every part of the emulator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdfleet_operator.api import admission as crd_admission

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.resources import ApiResource


class ApiError(Exception):
    """An error answered as a Kubernetes ``Status`` (``kind: Status``, ``status: Failure``)."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(res: ApiResource, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{res.group_resource} "{name}" not found',
        {"name": name, "group": res.group, "kind": res.plural},
    )


def conflict(res: ApiResource, name: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {res.group_resource} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        {"name": name, "group": res.group, "kind": res.plural},
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(res: ApiResource, name: str, errors: list[crd_admission.FieldError]) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        crd_admission.status_message(res.kind, res.group, name, errors),
        {
            "name": name,
            "group": res.group,
            "kind": res.kind,
            "causes": [{"reason": e.reason, "message": e.message, "field": e.field} for e in errors],
        },
    )


def unprocessable(message: str) -> ApiError:
    return ApiError(422, "Invalid", message)


class Forbidden(ApiError):
    """403 from the emulator's RBAC or its OwnerReferencesPermissionEnforcement (``LoggedRequest.denied``)."""


def too_many_requests(message: str, causes: list[dict] | None = None, retry_after: int = 0) -> ApiError:
    """429, as the Eviction subresource answers when a PodDisruptionBudget would be broken."""
    details: dict[str, Any] = {"causes": causes} if causes else {}
    if retry_after:
        details["retryAfterSeconds"] = retry_after
    return ApiError(429, "TooManyRequests", message, details or None)

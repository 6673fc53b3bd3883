"""Each deployment's token Secret (the key its router and workers share), with least privilege: the operator may only
create Secrets, so a POST that finds one answers 409.

It is created when status.tokenSecret does not record it, and checked again only when something needs it: a new pod
of the deployment (at most AUTH_SECRET_CHECK_S apart per deployment: a missing Secret leaves the pod waiting to
mount it) or the pdfleet.io/recreate-token annotation (rotation, SECURITY.md). A steady fleet, a restart and a
resync write nothing for it.
"""

from __future__ import annotations

import asyncio
import logging

from pdfleet_operator.api import InferenceDeploymentStatus
from pdfleet_operator.kube import client, exporter, render
from pdfleet_operator.kube.indexes import Key

logger = logging.getLogger("pdfleet.operator")
AUTH_SECRET_CHECK_S = 60.0
ANNOTATION_RECREATE_TOKEN = "pdfleet.io/recreate-token"


class TokenSecrets:
    """When this process last checked each deployment's Secret (loop time of the create POST)."""

    def __init__(self) -> None:
        self._checked: dict[Key, float] = {}

    def forget(self, key: Key) -> None:
        self._checked.pop(key, None)

    async def ensure(
        self, api: client.Api, key: Key, owner: render.Owner, st: InferenceDeploymentStatus | None
    ) -> None:
        """Created unless this process checked it or status.tokenSecret says it was (so a restart writes nothing)."""
        if key in self._checked or (st is not None and st.token_secret == render.auth_secret_name(owner.name)):
            return
        await self.check(api, key, owner, "first reconcile")

    async def check(
        self, api: client.Api, key: Key, owner: render.Owner, why: str, *, at_most_every: float = 0.0
    ) -> bool | None:
        """Create the Secret if it is missing (True), find it there (False), or skip a check made less than
        `at_most_every` seconds ago (None)."""
        now = asyncio.get_running_loop().time()
        last = self._checked.get(key)
        if at_most_every and last is not None and now - last < at_most_every:
            return None
        self._checked[key] = now
        created = await client.ensure_auth_secret(api, owner)
        if created:
            logger.info(
                "created the deployment token Secret %s/%s (%s)", key[0], render.auth_secret_name(owner.name), why
            )
            exporter.API_WRITES.labels("Secret").inc()
        return created

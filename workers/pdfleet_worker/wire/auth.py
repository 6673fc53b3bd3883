"""Shared secrets read from files and re-read when the files change (the deployment token between router, workers and KV
endpoints; the router's client API keys), constant-time checks, and the ASGI middleware that answers 401 in OpenAI's
shape; the worker, the router and the KV connector use it. No torch.

A secret file holds one value per line (blank lines and `#` comments ignored). A token file's first
value is the one sent; every value in it is accepted. When the file changes (a Kubernetes Secret
volume is updated in place: kubelet swaps a symlink, so the inode changes), the values it held before
stay accepted, and are tried after the new one when sending, for `grace_s`: components see a
rotated Secret at different moments (kubelet's sync period) and keep talking meanwhile.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from pdfleet_worker.wire import errors

log = logging.getLogger("pdfleet.auth")

ROTATION_GRACE_S = 300.0  # how long a rotated-out token stays valid (longer than kubelet's Secret sync)
RECHECK_S = 1.0  # at most one stat() of a secret file per second
MIN_TOKEN_CHARS = 16  # a deployment token shorter than this is refused (not a secret)


def matches(presented: str | None, accepted: Sequence[str]) -> bool:
    """Whether `presented` is one of `accepted`, in time that does not depend on where they differ."""
    if presented is None:
        return False
    given = presented.encode("utf-8", "surrogateescape")
    ok = False
    for value in accepted:
        ok |= hmac.compare_digest(given, value.encode("utf-8"))
    return ok


def bearer(value: str | None) -> str | None:
    """The credential of an `Authorization: Bearer X` header value; None when absent or another scheme."""
    if not value:
        return None
    scheme, _, cred = value.strip().partition(" ")
    return cred.strip() or None if scheme.lower() == "bearer" else None


class SecretFile:
    """Values of one secret file, re-read (at most every `recheck_s`) when its inode, size or mtime change.
    Thread-safe. A file that cannot be read or holds nothing usable after it once did keeps the last
    values (logged): a Secret volume caught mid-update must not open or close the door."""

    def __init__(
        self,
        path: str,
        what: str,
        *,
        optional: bool = False,
        min_chars: int = 1,
        grace_s: float = 0.0,
        recheck_s: float = RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path, self.what, self.optional = path, what, optional
        self.min_chars, self.grace_s, self.recheck_s, self._clock = min_chars, grace_s, recheck_s, clock
        self._lock = threading.Lock()
        self._values: list[str] | None = None  # None: an optional file that never existed
        self._previous: list[str] = []
        self._previous_until = 0.0
        self._signature: tuple[int, int, int] | None = None
        self._checked = clock()
        try:
            self._signature, self._values = self._read()
        except FileNotFoundError:
            if not optional:
                raise ValueError(f"{what} file {path} does not exist") from None
            log.warning("%s file %s does not exist (yet): not required until it does", what, path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{what} file {path}: {e}") from None

    def _read(self) -> tuple[tuple[int, int, int], list[str]]:
        st = os.stat(self.path)
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        values = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not values:
            raise ValueError("holds no value")
        short = [v for v in values if len(v) < self.min_chars]
        if short:
            raise ValueError(f"a value of {len(short[0])} characters is too short (at least {self.min_chars})")
        return (st.st_ino, st.st_size, st.st_mtime_ns), values

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < self.recheck_s:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
        except OSError:
            return  # keep what we have (optional and never there: still not required)
        if (st.st_ino, st.st_size, st.st_mtime_ns) == self._signature:
            return
        try:
            signature, values = self._read()
        except (OSError, ValueError) as e:
            log.error(
                "%s file %s changed but cannot be used (%s); keeping the values read before", self.what, self.path, e
            )
            return
        if values != self._values:
            if self._values:
                self._previous, self._previous_until = [v for v in self._values if v not in values], now + self.grace_s
            log.info(
                "%s file %s changed: %d value(s)%s",
                self.what,
                self.path,
                len(values),
                f"; the previous ones stay valid for {self.grace_s:g}s" if self._previous and self.grace_s else "",
            )
        self._signature, self._values = signature, values

    @property
    def configured(self) -> bool:
        """False only for an optional file that has never existed."""
        with self._lock:
            self._refresh()
            return self._values is not None

    def accepted(self) -> list[str]:
        with self._lock:
            self._refresh()
            values = list(self._values or [])
            if self._previous and self._clock() < self._previous_until:
                values += self._previous
            return values

    def for_sending(self) -> list[str]:
        """The value to send first, then (mid-rotation) the ones a peer that has not seen the change accepts."""
        with self._lock:
            self._refresh()
            first = (self._values or [])[:1]
            if self._previous and self._clock() < self._previous_until:
                return first + self._previous
            return first

    def accepts(self, presented: str | None) -> bool:
        return matches(presented, self.accepted())


def token_file(path: str, what: str = "auth token") -> SecretFile:
    """The deployment token (`--auth-token-file`): must exist, at least MIN_TOKEN_CHARS, rotation grace."""
    return SecretFile(path, what, min_chars=MIN_TOKEN_CHARS, grace_s=ROTATION_GRACE_S)


def unauthorized_body(presented: str | None, what: str) -> dict:
    message = (
        f"You didn't provide {what}: send it as `Authorization: Bearer ...`"
        if presented is None
        else f"Incorrect {what} provided"
    )
    return errors.error_body(message, "invalid_request_error", None, "invalid_api_key")


class RequireBearer:
    """ASGI middleware: an HTTP request to a path `protected` selects needs `Authorization: Bearer V` with
    a value of `secret` (while it is configured), else 401 in OpenAI's error shape. `what` names the
    credential in the message ("an API key", "the deployment token")."""

    def __init__(self, app: ASGIApp, secret: SecretFile, protected: Callable[[str], bool], what: str):
        self.app, self.secret, self.protected, self.what = app, secret, protected, what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protected(scope["path"]) or not self.secret.configured:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        presented = bearer(header)
        if self.secret.accepts(presented):
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("?",))[0]
        log.info(
            "401 on %s %s from %s: %s",
            scope.get("method"),
            scope["path"],
            client,
            "no credential" if presented is None else "a wrong credential",
        )
        body = json.dumps(unauthorized_body(presented, self.what)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

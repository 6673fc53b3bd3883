"""Which prefill and decode workers may serve one request together (pure): the same revision and the same KV layout
(whose hash covers the weights), so a rollout never hands KV computed by old weights to a decode worker of new ones; the
proxy calls plan() before the prefill and key() after it. No torch.

pdfleet workers report `revision` (--revision, $PDFLEET_REVISION) and `compat_hash` (the KV layout hash) in /load.
A worker that reports no layout (vLLM, whose /load this router does not read) leaves the tier unpaired: any prefill
worker with any decode worker, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

Key = tuple[str | None, str]  # (revision, KV layout hash)


def key(load: Mapping[str, Any]) -> Key | None:
    """A worker's pairing key from its last /load; None when it reports no KV layout."""
    compat = load.get("compat_hash")
    if not isinstance(compat, str) or not compat:
        return None
    revision = load.get("revision")
    return (None if revision is None else str(revision), compat)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The prefill workers a request may use: `keys` (None: any worker, the tier is not paired)."""

    keys: frozenset[Key] | None

    @property
    def paired(self) -> bool:
        """Some prefill worker has a decode worker of its revision and layout (or the tier is not paired)."""
        return self.keys is None or bool(self.keys)

    def allows(self, load: Mapping[str, Any]) -> bool:
        return self.keys is None or key(load) in self.keys


def plan(prefill: Iterable[Mapping[str, Any]], decode: Iterable[Mapping[str, Any]]) -> Plan:
    """From the /load of the healthy prefill and decode workers: the keys both roles have, or no constraint when a
    worker reports none or a role has no worker (nothing to pair: the caller's fallbacks, or its 503). An empty set:
    no pair exists (the decode worker computes the prompt itself)."""
    prefill_keys, decode_keys = [key(ld) for ld in prefill], [key(ld) for ld in decode]
    if None in prefill_keys or None in decode_keys or not prefill_keys or not decode_keys:
        return Plan(None)
    return Plan(frozenset(prefill_keys) & frozenset(decode_keys))


def same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether the decode worker whose /load is `b` pairs with the prefill worker whose /load is `a`."""
    ka = key(a)
    return ka is None or key(b) is None or ka == key(b)

"""SLA tier names in worker lists (`[TIER=]URL`): shared by the router's flags and its workers file. No torch."""

from __future__ import annotations

DEFAULT_TIER = "default"


def split_tier(value: str) -> tuple[str, str]:
    """'latency=http://x:8000' -> ('latency', 'http://x:8000'); a bare URL -> (DEFAULT_TIER, url)."""
    head, sep, rest = value.partition("=")
    if sep and "://" not in head:
        if not head:
            raise ValueError(f"{value!r}: empty tier name")
        return head, rest
    return DEFAULT_TIER, value

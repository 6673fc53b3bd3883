"""The emulator's clock: the wall clock plus an offset tests move forward (``KubernetesApiEmulator.advance``),
so that tolerationSeconds, grace periods, minReadySeconds and progress deadlines elapse without waiting; and
the time formats of the API (RFC 3339 timestamps, the AGE column's human durations)."""

from __future__ import annotations

import datetime
import time


class Clock:
    """Wall-clock time plus `offset` seconds; every timestamp the emulator writes and every due time of its
    controllers is read from it."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        """Seconds since the epoch, as the emulator's clock says."""
        return time.time() + self.offset

    def iso(self, at: float | None = None) -> str:
        """An RFC 3339 timestamp (seconds), as the API writes them: now, or `at` (emulator seconds)."""
        moment = self.time() if at is None else at
        return datetime.datetime.fromtimestamp(moment, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the emulator's clock only goes forward (advance by {seconds} s)")
        self.offset += seconds


def parse_time(timestamp: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 timestamp; None when absent or malformed."""
    if not timestamp:
        return None
    try:
        return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """apimachinery's duration.HumanDuration, used for AGE columns."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def age(timestamp: str | None, now: float) -> str:
    """The AGE column of a timestamp at emulator time `now`."""
    if not timestamp:
        return "<unknown>"
    then = parse_time(timestamp)
    if then is None:
        return "<invalid>"
    return human_duration(now - then)

"""The worker reads a duration exactly as the operator's API does (a spec's `1m30s` reaches it verbatim)."""

from __future__ import annotations

import pytest

from pdfleet_operator.api.meta import parse_duration as api_duration
from pdfleet_worker.server.worker_config import parse_duration as worker_duration


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("1m30s", 90.0),
        ("500ms", 0.5),
        ("10s", 10.0),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1h2m3.5s", 3723.5),
        ("0.25s", 0.25),
        ("0s", 0.0),
    ],
)
def test_the_worker_and_the_api_agree(text, seconds):
    assert worker_duration(text) == api_duration(text) == seconds


def test_plain_seconds_are_the_workers_own_and_bad_text_is_refused():
    assert worker_duration("2.5") == worker_duration(2.5) == 2.5
    for bad in ("1m30", "s", "10 minutes", "-1s", "1d", ""):
        with pytest.raises(ValueError, match="not a duration"):
            worker_duration(bad)

"""The live view and the summary as text: pools with queues and KV usage, the P:D ratio, decisions with reasons,
tokens/s, $/h and $ per 1M tokens."""

from __future__ import annotations

from rich.console import Console

from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot, RoleMetrics
from pdfleet_operator.local import view
from pdfleet_operator.local.supervisor import Event, Replica


def test_a_frame_shows_pools_queues_ratio_decisions_and_money():
    workers = [
        Replica("prefill-0", "prefill", "cpu", 1, state="ready"),
        Replica("decode-0", "decode", "cpu", 2, state="ready"),
        Replica("decode-1", "decode", "cpu", 3, state="starting"),
    ]
    snap = MetricsSnapshot(
        taken_at=10.0,
        source="scrape",
        roles={
            "prefill": RoleMetrics(
                waiting=1,
                running=0,
                replicas_reporting=1,
                sample_time=10.0,
                kv_usage=0.02,
                prompt_tokens_rate=400.0,
                generation_tokens_rate=5.0,
            ),
            "decode": RoleMetrics(
                waiting=12,
                running=30,
                replicas_reporting=1,
                sample_time=10.0,
                kv_usage=0.25,
                generation_tokens_rate=1200.0,
            ),
        },
    )
    change = view.Change(
        9.5, "decode", 1, 2, "QueueAboveTarget", "42 running+waiting requests (target 8/replica): needs 6"
    )
    status = view.Status(
        "local-tiny",
        "http://127.0.0.1:8000",
        12.0,
        "serving",
        workers,
        ["prefill", "decode"],
        snap,
        {"prefill": "WithinTolerance: 1 waiting requests"},
        [change],
        [Event(9.5, "started", "decode-1", "pid 7, :3 on cpu")],
        0.7,
        0.0012,
        {"cpu": 0.2},
        {"sent": 50, "completed": 20, "rejected": 0, "failed": 0, "inflight": 30, "ttft_p50_s": 0.12},
    )
    console = Console(record=True, width=160, force_terminal=False)
    console.print(view.render(status))
    text = console.export_text()
    for needle in (
        "pdfleet up local-tiny",
        "http://127.0.0.1:8000/v1",
        "metrics: scrape ok",
        "1/2 +1 starting",
        "25%",
        "1,200",
        "P:D 1:2",
        "$/h 0.70",
        "tokens/s 1,200",
        "$ per 1M tokens 0.162",
        "decode    1 -> 2  QueueAboveTarget: 42 running+waiting",
        "decode-1    started: pid 7",
        "WithinTolerance",
        "50 sent, 20 completed",
        "TTFT p50 0.120s",
    ):
        assert needle in text, (needle, text)
    assert view.tokens_per_s(snap) == 1200.0, "prefill's one discarded token per request is not output"
    assert view.tokens_per_s(MetricsSnapshot.unavailable(1.0, "down")) is None


def test_the_summary_lists_every_change_with_its_reason_and_the_crashes():
    changes = [
        view.Change(9.5, "decode", 1, 3, "QueueGrowing", "sized for the next"),
        view.Change(40.0, "decode", 3, 2, "QueueBelowTarget", "needs 0"),
    ]
    events = [
        Event(20.0, "crashed", "prefill-0", "pid 9 killed by SIGKILL; restarting in 1s"),
        Event(21.0, "restarted", "prefill-0", "pid 10"),
    ]
    fleet = {
        "ready_after_s": 3.0,
        "ran_s": 50.0,
        "endpoint": "http://127.0.0.1:8000",
        "run_dir": "/tmp/x",
        "cost_usd": 0.01,
        "mean_cost_per_hour": 0.72,
        "prices": "cpu $0.1/unit-h x 2",
        "cost_per_1m_tokens": 0.25,
    }
    text = view.summary_text("local-tiny", fleet, None, changes, events)
    lines = text.splitlines()
    assert lines[0] == "== pdfleet up local-tiny: summary ==" and "$0.2500 per 1M generated tokens" in text
    assert "scaling   1 up, 1 down:" in lines
    assert "  + 40.0s  decode    3 -> 2  QueueBelowTarget: needs 0" in lines
    assert lines[-1] == "  + 20.0s  prefill-0   crashed: pid 9 killed by SIGKILL; restarting in 1s"

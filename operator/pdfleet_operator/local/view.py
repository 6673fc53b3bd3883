"""What `pdfleet up` shows: a live rich view of pools, queues, KV usage, P:D ratio, decisions with reasons, tokens/s and
$/h on a terminal, plain lines elsewhere, and the summary at the end."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot
from pdfleet_operator.local.load import summary_lines
from pdfleet_operator.local.supervisor import Event, Replica

SHOWN = 7  # decisions and events kept on screen


@dataclass(frozen=True)
class Change:
    """A scaling decision that changed a role's size (or a notable hold), for the view and the summary."""

    at: float
    role: str
    current: int
    desired: int
    reason: str
    message: str

    def line(self) -> str:
        return f"+{self.at:5.1f}s  {self.role:<9} {self.current} -> {self.desired}  {self.reason}: {self.message}"


@dataclass
class Status:
    """Everything one frame shows."""

    name: str
    endpoint: str
    elapsed: float
    phase: str  # starting, serving, settling, stopping
    workers: Sequence[Replica]
    roles: Sequence[str]
    snapshot: MetricsSnapshot | None
    holds: Mapping[str, str]  # role -> why it holds (last decision)
    changes: Sequence[Change]
    events: Sequence[Event]
    cost_per_hour: float
    spent_usd: float
    per_class_hour: Mapping[str, float]  # class -> $/h of one replica
    load: Mapping[str, Any] | None = None  # sent, completed, failed, inflight, ttft_p50_s
    notes: list[str] = field(default_factory=list)


def ratio(workers: Sequence[Replica], roles: Sequence[str]) -> str:
    if "prefill" not in roles:
        return "- (colocated)"
    p = sum(1 for r in workers if r.role == "prefill" and r.state != "draining")
    d = sum(1 for r in workers if r.role == "decode" and r.state != "draining")
    return f"{p}:{d}"


def tokens_per_s(snapshot: MetricsSnapshot | None) -> float | None:
    """Generated tokens/s of the fleet: decode (or colocated) workers' counters; prefill's one token is dropped."""
    if snapshot is None or not snapshot.ok:
        return None
    rates = [m.generation_tokens_rate for role, m in snapshot.roles.items() if role != "prefill"]
    return None if not rates or any(r is None for r in rates) else sum(r for r in rates if r is not None)


def render(s: Status) -> Group:
    head = Text.assemble((f"pdfleet up {s.name}", "bold"), f"  ·  {s.endpoint}/v1  ·  {s.elapsed:5.1f}s  ·  {s.phase}")
    if s.snapshot is not None:
        head.append(f"  ·  metrics: {s.snapshot.source or '-'} ")
        head.append(
            "ok" if s.snapshot.ok else f"unavailable ({s.snapshot.error[:60]})",
            style="green" if s.snapshot.ok else "red",
        )
    pools = Table(expand=True, box=None, padding=(0, 1))
    for col in ("pool", "class", "replicas", "waiting", "running", "KV", "tok/s", "$/h", "holds because"):
        pools.add_column(
            col,
            justify="left" if col in ("pool", "class", "holds because") else "right",
            overflow="fold",
            ratio=4 if col == "holds because" else None,
        )
    for role in s.roles:
        mine = [r for r in s.workers if r.role == role]
        classes = sorted({r.accelerator_class for r in mine}) or ["-"]
        m = s.snapshot.roles.get(role) if s.snapshot is not None and s.snapshot.ok else None
        states = {st: sum(1 for r in mine if r.state == st) for st in ("ready", "starting", "backoff", "draining")}
        reps = f"{states['ready']}/{len(mine) - states['draining']}" + "".join(
            f" +{n} {st}" for st, n in states.items() if n and st != "ready"
        )
        rate = None if m is None else (m.prompt_tokens_rate if role == "prefill" else m.generation_tokens_rate)
        per_hour = sum(s.per_class_hour.get(r.accelerator_class, 0.0) for r in mine if r.state != "backoff")
        pools.add_row(
            role,
            ", ".join(classes),
            reps,
            _num(m.waiting if m else None),
            _num(m.running if m else None),
            "-" if m is None or m.kv_usage is None else f"{m.kv_usage:.0%}",
            _num(rate, "{:,.0f}"),
            f"{per_hour:.2f}",
            s.holds.get(role, ""),
        )
    tps = tokens_per_s(s.snapshot)
    per_1m = s.cost_per_hour / (tps * 3600 / 1e6) if tps else None
    totals = Text(
        f"P:D {ratio(s.workers, s.roles)}   $/h {s.cost_per_hour:.2f}   spent ${s.spent_usd:.4f}   "
        f"tokens/s {_num(tps, '{:,.0f}')}   $ per 1M tokens {_num(per_1m, '{:.3f}')}"
    )
    parts: list[Any] = [head, Panel(Group(pools, totals), title="pools", title_align="left")]
    if s.load is not None:
        parts.append(
            Text(
                f"load: {s.load['sent']} sent, {s.load['completed']} completed, {s.load['rejected']} rejected, "
                f"{s.load['failed']} failed, {s.load['inflight']} open; TTFT p50 "
                f"{_num(s.load.get('ttft_p50_s'), '{:.3f}s')}"
            )
        )
    parts.append(
        Panel(
            "\n".join(c.line() for c in s.changes[-SHOWN:]) or "(none yet)",
            title="scaling decisions",
            title_align="left",
        )
    )
    parts.append(
        Panel("\n".join(event_line(e) for e in s.events[-SHOWN:]) or "-", title="processes", title_align="left")
    )
    for note in s.notes:
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def _num(x: float | None, pattern: str = "{:g}") -> str:
    return "-" if x is None else pattern.format(x)


def event_line(e: Event) -> str:
    return f"+{e.at:5.1f}s  {e.subject:<11} {e.kind}: {e.message}"


class View:
    """A live frame on a terminal; elsewhere (a pipe, a CI log) one line per event and a status line now and then."""

    def __init__(self, console: Console, live: bool | None = None, status_every: float = 5.0):
        self.console = console
        self.live_mode = console.is_terminal if live is None else live
        self.status_every = status_every
        self._live: Live | None = None
        self._last_status = -1e9

    def start(self) -> None:
        if self.live_mode:
            self._live = Live(console=self.console, auto_refresh=False, transient=False, redirect_stdout=False)
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def line(self, text: str) -> None:
        """An event worth a line of its own (plain mode only; the live frame lists it)."""
        if self._live is None:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def update(self, s: Status) -> None:
        if self._live is not None:
            self._live.update(render(s), refresh=True)
        elif s.elapsed - self._last_status >= self.status_every:
            self._last_status = s.elapsed
            parts = []
            for role in s.roles:
                m = s.snapshot.roles.get(role) if s.snapshot is not None and s.snapshot.ok else None
                n = sum(1 for r in s.workers if r.role == role and r.state == "ready")
                parts.append(f"{role} {n} ready" + (f" (waiting {m.waiting:g}, running {m.running:g})" if m else ""))
            load = f"; load {s.load['completed']}/{s.load['sent']} done" if s.load else ""
            self.line(
                f"+{s.elapsed:5.1f}s  status      {'; '.join(parts)}; P:D {ratio(s.workers, s.roles)}; "
                f"$/h {s.cost_per_hour:.2f}{load}"
            )


def summary_text(
    name: str,
    fleet: Mapping[str, Any],
    load: Mapping[str, Any] | None,
    changes: Sequence[Change],
    events: Sequence[Event],
) -> str:
    """The summary `pdfleet up` prints last: requests, TTFT, scaling decisions with reasons, $ per 1M tokens."""
    lines = [
        f"== pdfleet up {name}: summary ==",
        f"fleet     ready after {fleet['ready_after_s']:.1f}s, ran {fleet['ran_s']:.1f}s; "
        f"router {fleet['endpoint']}; logs in {fleet['run_dir']}",
    ]
    if load is not None:
        lines += summary_lines(load)
    per_1m = fleet.get("cost_per_1m_tokens")
    lines.append(
        f"cost      ${fleet['cost_usd']:.5f} over the run (mean ${fleet['mean_cost_per_hour']:.3f}/h at "
        f"{fleet['prices']}); "
        + (
            f"${per_1m:.4f} per 1M generated tokens"
            if per_1m is not None
            else "no tokens generated, no $ per 1M tokens"
        )
    )
    ups = [c for c in changes if c.desired > c.current]
    downs = [c for c in changes if c.desired < c.current]
    lines.append(f"scaling   {len(ups)} up, {len(downs)} down" + (":" if changes else " (no change of size)"))
    lines += [f"  {c.line()}" for c in changes]
    crashes = [e for e in events if e.kind in ("crashed", "killed")]
    if crashes:
        lines.append(f"processes {len(crashes)} crash(es) or kill(s):")
        lines += [f"  {event_line(e)}" for e in crashes]
    return "\n".join(lines)

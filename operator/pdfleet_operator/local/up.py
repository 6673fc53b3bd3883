"""`pdfleet up`: plan an InferenceDeployment on this machine with the operator's placement, run it as router and worker
processes (the pdfleet worker or vLLM, per pool), scale them with the operator's autoscaler, show it live, and stop
every child on Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from pdfleet_operator.api import parse_duration
from pdfleet_operator.decide import autoscaler, placement, runtimes, tick
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot
from pdfleet_operator.local import load as loadgen
from pdfleet_operator.local import machine as mach
from pdfleet_operator.local import spec as specs
from pdfleet_operator.local import vllm_runtime
from pdfleet_operator.local.supervisor import Event, Supervisor
from pdfleet_operator.local.view import Change, Status, View, summary_text

SUPERVISE_EVERY_S = 0.25
VIEW_EVERY_S = 0.5


@dataclass
class Options:
    file: str
    classes: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    prometheus: str | None = None
    load: str | None = None  # steady, bursty or a CSV trace
    rate: float = 3.0
    burst: float = 5.0
    duration: float | None = None
    settle: float | None = None
    prompt_tokens: int = 64
    output_tokens: int = 128
    threads: int = 1
    run_dir: str | None = None
    report: str | None = None
    ready_timeout: float = 180.0
    seed: int = 0
    live: bool | None = None
    vllm_python: str | None = None  # the vLLM runtime's interpreter (vllm_runtime.find's order otherwise)
    auth: bool = False  # the router requires a client API key (generated, printed, RUN_DIR/api-key)
    routing_target: str | None = None  # spec.routing: the URL of the target deployment's router


class Up:
    """One `pdfleet up` run, from the checks that start nothing to the summary printed last."""

    def __init__(self, opts: Options, console: Console):
        self.opts, self.console = opts, console
        self.stop = asyncio.Event()
        self.signals = 0
        self.changes: list[Change] = []
        self.holds: dict[str, str] = {}
        self.snapshot: MetricsSnapshot | None = None
        self.phase = "starting"
        self.generator: loadgen.LoadGenerator | None = None
        self.load_summary: dict[str, Any] | None = None
        self.ready_after: float | None = None
        self.sup: Supervisor | None = None
        self.vllm: vllm_runtime.VllmPython | None = None
        self.api_key = f"sk-pdfleet-{secrets.token_urlsafe(24)}" if opts.auth else None

    # -- checks that start nothing --------------------------------------------------------------------
    def preflight(self) -> None:
        o = self.opts
        self.local = specs.load(o.file, o.classes)
        self.machine = mach.Machine.detect()
        self.plan = mach.check_placeable(self.local.spec, self.local.classes, self.machine, o.file)
        mach.check_port(o.port, o.host)
        if o.threads < 1:
            raise specs.UpError(f"--threads-per-worker {o.threads}: must be at least 1")
        if o.prometheus is not None and not o.prometheus.startswith(("http://", "https://")):
            raise specs.UpError(f"--prometheus {o.prometheus}: expected an http(s) URL")
        routing = self.local.spec.routing
        if routing is not None and o.routing_target is None:
            raise specs.UpError(
                f"{o.file}: spec.routing.target is {routing.target!r}: `pdfleet up` runs one deployment; "
                f"start {routing.target} with its own `pdfleet up` (another --port) and pass its router "
                "as --routing-target http://127.0.0.1:PORT"
            )
        if o.routing_target is not None:
            if routing is None:
                raise specs.UpError(f"--routing-target {o.routing_target}: {o.file} has no spec.routing to use it")
            if not o.routing_target.startswith(("http://", "https://")):
                raise specs.UpError(f"--routing-target {o.routing_target}: expected an http(s) URL")
        # The pools this machine can run (placement skips the others), and the vLLM runtime when one runs vLLM.
        here = {k: rt for k, rt in self.local.pools.items() if self.machine.provides(self.local.classes[k[1]])}
        if any(rt.name == runtimes.VLLM for rt in here.values()):
            vllm_runtime.check_pools(self.local.spec, here, self.local.classes, o.file)
            self.vllm = vllm_runtime.find(o.vllm_python)
            vllm_runtime.check_runtime(here, self.local.classes, self.vllm, o.file)
        self.usable = {n: c for n, c in mach.local_classes(self.local.classes).items() if self.machine.provides(c)}
        self.inventory = mach.inventory(self.local.spec, self.usable, self.machine)
        self.arrivals = self._arrivals()

    def _arrivals(self) -> list[loadgen.Arrival] | None:
        o = self.opts
        if o.load is None:
            return None
        try:
            if o.load in ("steady", "bursty"):
                duration = o.duration or 60.0
                burst = loadgen.default_burst(o.burst, duration) if o.load == "bursty" else None
                return loadgen.poisson(
                    o.rate,
                    duration,
                    prompt_tokens=o.prompt_tokens,
                    output_tokens=o.output_tokens,
                    burst=burst,
                    seed=o.seed,
                )
            return loadgen.from_trace(o.load, duration=o.duration)
        except ValueError as exc:
            raise specs.UpError(f"--load {o.load}: {exc}") from None

    # -- the run --------------------------------------------------------------------------------------
    async def run(self) -> int:
        o = self.opts
        loop = asyncio.get_running_loop()
        self.view = View(self.console, o.live)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        run_dir = Path(o.run_dir) if o.run_dir else Path(tempfile.mkdtemp(prefix=f"pdfleet-up-{self.local.name}-"))
        self.sup = Supervisor(
            self.local,
            run_dir,
            o.port,
            threads=o.threads,
            machine=self.machine,
            router_host=o.host,
            vllm=self.vllm,
            on_event=self._on_event,
            api_key=self.api_key,
            route_to=o.routing_target,
        )
        self.endpoint = f"http://{o.host}:{o.port}"
        code = 0
        try:
            self.sup.start(self.plan)
            self.view.line(f"pdfleet up {self.local.name}: {self._plan_text()}; logs in {run_dir / 'logs'}")
            if self.vllm is not None:
                self.view.line(f"vLLM runtime: {self.vllm.describe()}")
            ready = asyncio.create_task(self.sup.wait_ready(o.ready_timeout))
            stopper = asyncio.create_task(self.stop.wait())
            await asyncio.wait([ready, stopper], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not ready.done():
                ready.cancel()
                await asyncio.gather(ready, return_exceptions=True)
                raise specs.UpError("stopped by a signal while the fleet was starting")
            ready.result()
            self.ready_after = self.sup.elapsed()
            self.phase = "serving"
            self._banner()
            self.view.start()
            await self._serve()
        except specs.UpError as exc:
            self.view.stop()
            print(f"pdfleet up: {exc}", file=sys.stderr, flush=True)
            code = 1
        finally:
            self.phase = "stopping"
            if self.generator is not None and self.load_summary is None:
                self.load_summary = self._load_summary()
            await self.sup.shutdown()
            self.view.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if code == 0:
            self._finish(run_dir)
        return code

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        if self.signals == 1:
            self.view.line(f"{signal.Signals(sig).name}: draining and stopping every process (again to kill them now)")
            self.stop.set()
        elif self.sup is not None:
            self.sup.kill_all()

    def _on_event(self, e: Event) -> None:
        from pdfleet_operator.local.view import event_line

        self.view.line(event_line(e))

    def _plan_text(self) -> str:
        return (
            ", ".join(
                f"{p.replicas} {p.role} on {p.accelerator_class}"
                + (
                    f" ({engine})"
                    if (engine := self.local.engine(p.role, p.accelerator_class)) != runtimes.PDFLEET
                    else ""
                )
                for p in self.plan.pools
            )
            + f" + router on {self.opts.host}:{self.opts.port}"
        )

    def _banner(self) -> None:
        url, model, key = self.endpoint, self.local.spec.model.name, self.api_key
        lines = [f"fleet ready after {self.ready_after:.1f}s: {self._plan_text()}"]
        if key is not None:
            lines.append(f"client API key: {key} (in {self.sup.api_key_path}; requests without it get 401)")
        lines += [
            "try it:",
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
            + (f"-H 'Authorization: Bearer {key}' " if key else "")
            + f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\'',
            f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key or '-'}'); "
            f"print(c.completions.create(model='{model}', prompt='Hello', max_tokens=16).choices[0].text)\"",
            f"  {f'PDFLEET_API_KEY={key} ' if key else ''}pdfleet load --url {url} --rate 3 --duration 40 --burst 5",
        ]
        if self.opts.prometheus is None:
            lines.append(f"Prometheus can scrape the workers from {self.sup.targets_path} (file_sd_configs)")
        for line in lines:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    async def _serve(self) -> None:
        """Supervise, autoscale, refresh the view and drive the load until it is time to stop."""
        tasks = [
            asyncio.create_task(self._supervise()),
            asyncio.create_task(self._autoscale()),
            asyncio.create_task(self._refresh()),
        ]
        ends = [asyncio.create_task(self.stop.wait())]
        if self.arrivals is not None:
            ends.append(asyncio.create_task(self._drive_load()))
        elif self.opts.duration is not None:
            ends.append(asyncio.create_task(asyncio.sleep(self.opts.duration)))
        try:
            done, _ = await asyncio.wait(tasks + ends, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                error = t.exception()
                if isinstance(error, specs.UpError):
                    raise error
                if error is not None:
                    raise specs.UpError(f"{type(error).__name__}: {error}") from error
        finally:
            for t in tasks + ends:
                t.cancel()
            await asyncio.gather(*tasks, *ends, return_exceptions=True)

    async def _supervise(self) -> None:
        while True:
            await self.sup.tick()
            await asyncio.sleep(SUPERVISE_EVERY_S)

    async def _refresh(self) -> None:
        while True:
            self.view.update(self._status())
            await asyncio.sleep(VIEW_EVERY_S)

    async def _drive_load(self) -> None:
        gen = self.generator = loadgen.LoadGenerator(
            self.endpoint, self.arrivals, model=self.local.spec.model.name, api_key=self.api_key
        )
        self.view.line(
            f"+{self.sup.elapsed():5.1f}s  load        {len(self.arrivals)} requests over "
            f"{self.arrivals[-1].t if self.arrivals else 0:.0f}s ({self.opts.load})"
        )
        await gen.run(self.stop)
        self.load_summary = self._load_summary()
        self.phase = "settling"
        self.view.line(
            f"+{self.sup.elapsed():5.1f}s  load        done: {self.load_summary['completed']} of "
            f"{self.load_summary['requests']} completed; waiting for the pools to settle"
        )
        await self._settle()

    def _settle_budget(self) -> float:
        if self.opts.settle is not None:
            return self.opts.settle
        a = self.local.spec.autoscaling
        window = parse_duration(a.scale_down_stabilization) + parse_duration(a.scale_down_delay_after_scale_up)
        steps = max(rs.max_replicas - rs.min_replicas for rs in self.local.spec.roles().values())
        return window + (steps + 2) * self.local.spec.interval_seconds() + 10.0

    async def _settle(self) -> None:
        """Until every role is back at its minimum and nothing drains (the scale-down shows), within a budget."""
        deadline = time.monotonic() + self._settle_budget()
        mins = {role: rs.min_replicas for role, rs in self.local.spec.roles().items()}
        while time.monotonic() < deadline:
            if self.sup.replicas() == mins and all(r.state == "ready" for r in self.sup.workers):
                return
            await asyncio.sleep(0.25)
        self.view.line(
            f"+{self.sup.elapsed():5.1f}s  settle      not back at minReplicas after "
            f"{self._settle_budget():.0f}s (now {self.sup.replicas()}); stopping anyway"
        )

    def _load_summary(self) -> dict[str, Any]:
        gen = self.generator
        assert gen is not None and gen.started_at is not None, "load summary before the load started"
        span = (gen.finished_at or time.monotonic()) - gen.started_at
        slo = self.local.spec.slo
        return loadgen.summarize(gen.results, span, slo_ttft=parse_duration(slo.ttft), slo_itl=parse_duration(slo.itl))

    # -- autoscaling -----------------------------------------------------------------------------------
    def _source(self):
        """Prometheus (each role read with its pools' engines' profile), or the workers' /metrics scraped
        with the target labels the targets file gives Prometheus."""
        from pdfleet_operator import prometheus

        if self.opts.prometheus:
            engines = {e for role in self.local.engines().values() for e in role}
            return prometheus.PrometheusSource(self.opts.prometheus, profile=names_of(engines))
        sup = self.sup
        assert sup is not None, "the source reads the supervisor's workers"
        return prometheus.ScrapeSource(lambda deployment, namespace: sup.scrape_targets())

    def _snapshot(self, source, roles: list[str]) -> MetricsSnapshot:
        if self.opts.prometheus:
            return source.snapshot(self.local.name, self.local.namespace, roles, engines=self.local.engines())
        return source.snapshot(self.local.name, self.local.namespace, roles)

    async def _autoscale(self) -> None:
        spec, sup = self.local.spec, self.sup
        roles = list(spec.roles())
        source = self._source()
        state = autoscaler.ScalerState.initial(spec, sup.replicas())
        interval = spec.interval_seconds()
        was_ok: bool | None = None
        while True:
            await asyncio.sleep(interval)
            self.snapshot = await asyncio.to_thread(self._snapshot, source, roles)
            if self.snapshot.ok != was_ok:
                was_ok = self.snapshot.ok
                self.view.line(
                    f"+{sup.elapsed():5.1f}s  metrics     {source.name}: "
                    + ("available" if was_ok else f"unavailable, holding sizes ({self.snapshot.error})")
                )
            current = sup.replicas()
            # The room to grow: what this machine could place with the pools as they run now.
            room = placement.plan(spec, self.usable, self.inventory, desired=current)
            step = tick.scale(spec, state, self.snapshot, time.time(), room, current=current)
            state = step.state
            self.holds = {r: f"{d.reason}: {d.message}" for r, d in step.decisions.items() if d.direction == "hold"}
            moved = step.moved
            if not moved:
                continue
            plan = placement.plan(spec, self.usable, self.inventory, desired=step.desired)
            at = round(sup.elapsed(), 1)
            for d in moved:
                change = Change(at, d.role, d.current, d.desired, d.reason, d.message)
                self.changes.append(change)
                self.view.line(
                    f"+{at:5.1f}s  scale       {change.role} {d.current} -> {d.desired} ({d.reason}: {d.message})"
                )
            sup.scale_to(plan, why=", ".join(f"{d.role} {d.current}->{d.desired} {d.reason}" for d in moved))

    # -- frames and the end -------------------------------------------------------------------------------
    def _status(self) -> Status:
        sup = self.sup
        load = None
        if self.generator is not None:
            results = self.generator.results
            done = [r.ttft for r in results if r.status == loadgen.OK and r.ttft is not None]
            load = {
                "sent": self.generator.sent,
                "completed": len(done),
                "rejected": sum(1 for r in results if r.status == loadgen.REJECTED),
                "failed": sum(1 for r in results if r.status == loadgen.FAILED),
                "inflight": self.generator.inflight,
                "ttft_p50_s": loadgen.percentile(done, 50),
            }
        return Status(
            self.local.name,
            self.endpoint,
            sup.elapsed(),
            self.phase,
            list(sup.workers),
            list(self.local.spec.roles()),
            self.snapshot,
            self.holds,
            self.changes,
            sup.events,
            sup.cost_per_hour(),
            sup.spent_usd,
            {n: c.count * c.cost_per_hour for n, c in sup.classes.items()},
            load,
        )

    def _finish(self, run_dir: Path) -> None:
        sup = self.sup
        ran = sup.elapsed()
        generated = (self.load_summary or {}).get("generated_tokens") or 0
        per_1m = None
        if generated:
            per_1m = sup.spent_usd / (generated / 1e6)
        prices = ", ".join(
            f"{n} ${c.cost_per_hour:g}/unit-h x {c.count}"
            for n, c in sorted(sup.classes.items())
            if any(p.accelerator_class == n for p in self.plan.pools)
        )
        logs = str(run_dir / "logs") if self.opts.run_dir else "(removed; --run-dir DIR keeps them)"
        fleet = {
            "deployment": self.local.name,
            "endpoint": self.endpoint,
            "run_dir": logs,
            "ready_after_s": round(self.ready_after or 0.0, 1),
            "ran_s": round(ran, 1),
            "cost_usd": round(sup.spent_usd, 6),
            "cost_per_1m_tokens": None if per_1m is None else round(per_1m, 5),
            "mean_cost_per_hour": sup.spent_usd / (ran / 3600.0) if ran > 0 else 0.0,
            "prices": prices + (f", router ${sup.router_per_hour:g}/h" if sup.router_per_hour else ""),
        }
        if self.opts.report:
            by_reason: dict[str, int] = {}
            for c in self.changes:
                by_reason[c.reason] = by_reason.get(c.reason, 0) + 1
            doc = {
                **fleet,
                **(self.load_summary or {}),
                "scale_events": {
                    "up": sum(c.desired > c.current for c in self.changes),
                    "down": sum(c.desired < c.current for c in self.changes),
                    "by_reason": by_reason,
                    "changes": [c.__dict__ for c in self.changes],
                },
                "events": [e.__dict__ for e in sup.events],
            }
            Path(self.opts.report).write_text(json.dumps(doc, indent=2) + "\n")
        self.console.print(
            summary_text(self.local.name, fleet, self.load_summary, self.changes, sup.events),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        if not self.opts.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def names_of(engines: set[str]) -> str:
    """The source's own profile name: the one engine every pool runs, else pdfleet (each role then takes its own)."""
    return next(iter(engines)) if len(engines) == 1 else runtimes.PDFLEET


def run(opts: Options, console: Console | None = None) -> int:
    """Check, run, stop; the exit status (0, or 1 with a one-line reason and nothing left running)."""
    console = console or Console()
    up = Up(opts, console)
    try:
        up.preflight()
    except specs.SpecInvalid as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        print(f"pdfleet up: {len(exc.problems)} error(s) in {opts.file}; nothing started", file=sys.stderr)
        return 1
    except specs.UpError as exc:
        print(f"pdfleet up: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(up.run())

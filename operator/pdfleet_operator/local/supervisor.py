"""The local fleet's processes: the router and worker replicas per pool (the pdfleet worker or vLLM, as the pool's
runtime says) on free loopback ports, restarted with back-off when they crash, drained when the plan shrinks;
`pdfleet up` drives it."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdfleet_operator import engine_args
from pdfleet_operator.api import WORKER_ROLE, AcceleratorClassSpec
from pdfleet_operator.decide import cost, pd_threshold, runtimes
from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.decide.placement import FleetPlan
from pdfleet_operator.local import machine as mach
from pdfleet_operator.local import ports, vllm_runtime
from pdfleet_operator.local.process import Child, describe_exit
from pdfleet_operator.local.spec import LocalSpec, UpError
from pdfleet_operator.prometheus import ScrapeTarget
from pdfleet_worker.router import workers_file

# A crashed process waits 1 s, then 2, 4, ... up to 30 s before it is started again; once it has
# served (ready) for 30 s, its next crash starts over at 1 s (as kubelet's CrashLoopBackOff does).
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 30.0
# The router re-reads its workers file and probes workers this often.
ROUTER_DISCOVERY_S = 0.5
ROUTER_HEALTH_S = 0.5
# A drained worker leaves the router's file this long before its SIGTERM (two discovery rounds).
LEAVE_ROUTER_S = 2 * ROUTER_DISCOVERY_S + 0.2
# A pdfleet worker drains as its pods do (engine_args.drain_seconds: the spec's maxModelLen at its ITL target, within
# bounds); a vLLM replica's --shutdown-timeout stays this. SIGKILL comes KILL_GRACE_S after a replica's drain.
VLLM_DRAIN_S = 30.0
KILL_GRACE_S = 10.0

STARTING, READY, BACKOFF, DRAINING = "starting", "ready", "backoff", "draining"
PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]


@dataclass(frozen=True)
class Event:
    """Something that happened to a process, for the live view and the summary."""

    at: float  # seconds since the fleet started
    kind: str  # started, ready, crashed, restarted, draining, stopped, killed
    subject: str  # replica name, e.g. decode-1, or router
    message: str


@dataclass
class Replica:
    """One process slot (a worker of one pool, or the router) and where it is in its life."""

    name: str
    role: str  # prefill, decode, colocated, or router
    accelerator_class: str  # "" for the router
    port: int
    devices: tuple[int, ...] = ()  # GPU indices (CUDA_VISIBLE_DEVICES)
    child: Child | None = None
    state: str = STARTING
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float = 0.0
    ready_since: float | None = None
    term_at: float | None = None  # when a draining replica gets its SIGTERM
    kill_at: float | None = None  # when a draining replica that has not exited gets SIGKILL
    load: dict = field(default_factory=dict)  # the worker's last /load answer
    host: str = "127.0.0.1"  # where we reach it
    engine: str = runtimes.PDFLEET  # what the pool runs: pdfleet or vllm
    index: int = 0  # the n of role-n (which cores a vLLM replica binds)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Supervisor:
    """Starts, watches, restarts and drains the processes of one local fleet. Single-threaded: every
    method runs on the event loop of `pdfleet up`'s main thread (children die with that thread)."""

    def __init__(
        self,
        local: LocalSpec,
        run_dir: Path,
        router_port: int,
        *,
        threads: int,
        machine: mach.Machine,
        router_host: str = "127.0.0.1",
        vllm: vllm_runtime.VllmPython | None = None,
        on_event: Callable[[Event], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        api_key: str | None = None,
        route_to: str | None = None,
        drain_s: float | None = None,
    ):
        self.local, self.run_dir, self.threads, self.machine = local, run_dir, threads, machine
        self.drain_override = drain_s  # every worker's drain instead of its own (tests)
        self.route_to = route_to  # spec.routing: the target deployment's router
        self.vllm = vllm  # the vLLM runtime, when a pool here runs vLLM (up.preflight finds it)
        self.cores = sorted(os.sched_getaffinity(0))
        self.preload = mach.malloc_preload()  # into pdfleet's workers (None: off, or not installed)
        self.memory_bytes = vllm_runtime.available_memory()
        self.router_host = router_host
        self.on_event = on_event or (lambda e: None)
        self.clock = clock
        self.started_at = clock()
        self.events: list[Event] = []
        self.workers: list[Replica] = []
        reach = "127.0.0.1" if router_host in ("0.0.0.0", "::", "") else router_host
        self.router = Replica("router", "router", "", router_port, host=reach)
        self.counters: dict[str, int] = {}
        self.startup = True  # any exit before the fleet was first ready is fatal
        self.spent_usd = 0.0
        self._cost_at = clock()
        self.classes = mach.local_classes(local.classes)
        # NOTE: one router process runs here whatever spec.router.replicas says (a cluster's spread and PDB have
        # no meaning on one machine): it is what is billed.
        self.router_per_hour = cost.router_cores(local.spec.router.resources.requests) * cost.cpu_core_price(
            self.classes
        )
        self.engine_config = run_dir / "engine.json"
        self.workers_path = run_dir / "workers.json"
        self.targets_path = run_dir / "prometheus-targets.json"
        # The deployment token between the router and the pdfleet workers, new every run (0600 in the run directory);
        # the client API key, when the router requires one.
        self.token = secrets.token_urlsafe(32)
        self.token_path = run_dir / "auth-token"
        self.api_key = api_key
        self.api_key_path = run_dir / "api-key"
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0))

    # -- events -----------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.started_at

    def event(self, kind: str, subject: str, message: str) -> None:
        ev = Event(round(self.elapsed(), 1), kind, subject, message)
        self.events.append(ev)
        self.on_event(ev)

    # -- what runs ----------------------------------------------------------------------------------
    def active(self, role: str | None = None) -> list[Replica]:
        """Workers the fleet counts (not draining), optionally of one role."""
        return [r for r in self.workers if r.state != DRAINING and (role is None or r.role == role)]

    def replicas(self) -> dict[str, int]:
        """Replicas per role as the autoscaler's `current` (what the Deployments would ask for)."""
        return {role: len(self.active(role)) for role in self.local.spec.roles()}

    def ready(self, role: str) -> list[Replica]:
        return [r for r in self.active(role) if r.state == READY]

    def target_labels(self, r: Replica) -> dict[str, str]:
        """The labels Prometheus (from the targets file) and the direct-scrape source put on a worker's series."""
        return {
            **names.target_labels(self.local.namespace, self.local.name, r.role, r.accelerator_class),
            "replica": r.name,
        }

    def scrape_targets(self) -> list[ScrapeTarget]:
        """The ready workers' /metrics, labelled (a starting or crashed one has no queue yet)."""
        return [
            ScrapeTarget(f"{r.url}/metrics", self.target_labels(r), r.engine)
            for role in self.local.spec.roles()
            for r in self.ready(role)
        ]

    def cost_per_hour(self) -> float:
        """$/h of every worker process alive now (starting and draining ones too) plus the router."""
        per_hour = self.router_per_hour if self.router.child and self.router.child.alive() else 0.0
        for r in self.workers:
            if r.child is not None and r.child.alive():
                cls = self.classes[r.accelerator_class]
                per_hour += cls.count * cls.cost_per_hour
        return per_hour

    def _account(self) -> None:
        now = self.clock()
        self.spent_usd += self.cost_per_hour() * (now - self._cost_at) / 3600.0
        self._cost_at = now

    # -- files the router and Prometheus read -----------------------------------------------------------
    def write_files(self) -> None:
        self.engine_config.write_text(engine_args.config_text(self.local.spec))
        self._write_worker_lists()

    def _write_worker_lists(self) -> None:
        lists: dict[str, list[str]] = {}
        for role in self.local.spec.roles():
            key = workers_file.KEY_OF_ROLE[WORKER_ROLE[role]]
            lists[key] = [workers_file.entry(r.url, engine=r.engine) for r in self.active(role)]
        workers_file.write(self.workers_path, lists)
        groups = [{"targets": [f"127.0.0.1:{r.port}"], "labels": self.target_labels(r)} for r in self.active()]
        tmp = self.targets_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=1))
        os.replace(tmp, self.targets_path)

    # -- commands -------------------------------------------------------------------------------------
    def _pool(self, r: Replica) -> tuple[runtimes.PoolRuntime, AcceleratorClassSpec]:
        return self.local.pools[(r.role, r.accelerator_class)], self.classes[r.accelerator_class]

    def _worker_argv(self, r: Replica) -> list[str]:
        rt, cls = self._pool(r)
        if rt.name == runtimes.VLLM:
            assert self.vllm is not None, f"{r.name} runs vllm and no vLLM runtime was found"
            return vllm_runtime.argv(
                self.vllm,
                self.local.spec,
                r.role,
                rt,
                cls,
                model_dir=str(self.local.model_dir),
                port=r.port,
                drain_s=self.drain_s(r),
            )
        # (--kv-peers: the default, loopback: every prefill worker of this fleet advertises 127.0.0.1)
        flags = [
            "--kv-host",
            "127.0.0.1",
            "--num-threads",
            str(self.threads),
            "--accelerator",
            r.accelerator_class,
            "--log-level",
            "warning",
            "--auth-token-file",
            str(self.token_path),
        ]
        if self.drain_override is not None:  # (worker_args passes the spec's)
            flags += ["--drain-timeout", f"{self.drain_override:g}s"]
        if rt.device:
            flags += ["--device", rt.device]
        offload = self.local.spec.engine.kv_offload
        if offload is not None and offload.disk is not None:  # the disk tier's file under the run directory
            flags += ["--kv-offload-disk-path", str(self.engine_config.parent / "kv-offload")]
        return PDFLEET + engine_args.worker_args(
            self.local.spec,
            r.role,
            model_dir=str(self.local.model_dir),
            host="127.0.0.1",
            port=r.port,
            engine_config=str(self.engine_config),
            flags=flags,
        )

    def _router_argv(self) -> list[str]:
        return (
            PDFLEET
            + [
                "router",
                "--workers-file",
                str(self.workers_path),
                "--discovery",
                "static",
                "--host",
                self.router_host,
                "--port",
                str(self.router.port),
                "--discovery-interval",
                f"{ROUTER_DISCOVERY_S:g}",
                "--health-interval",
                f"{ROUTER_HEALTH_S:g}",
                "--log-level",
                "warning",
                "--auth-token-file",
                str(self.token_path),
            ]
            + (["--api-key-file", str(self.api_key_path)] if self.api_key is not None else [])
            + engine_args.router_args(
                self.local.spec,
                route_to=self.route_to,
                tokenizer_dir=str(self.local.model_dir),
                pd_min_prompt_tokens=pd_threshold.threshold(self.local.spec, self.classes),
            )
        )

    def _env(self, r: Replica) -> dict[str, str]:
        env = dict(os.environ)
        threads = str(self.threads)
        env.update(
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            CUDA_VISIBLE_DEVICES=",".join(str(d) for d in r.devices),
        )
        if not r.accelerator_class:
            return env
        rt, cls = self._pool(r)
        if rt.name == runtimes.VLLM:
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # VLLM_CPU_OMP_THREADS_BIND decides its threads
                env.pop(name, None)
            env.update(vllm_runtime.env(rt, cls, vllm_runtime.cores(r.index, cls, self.cores), self._kv_gib(cls)))
        else:
            env["PDFLEET_ACCELERATOR"] = r.accelerator_class
            env.update(dict(rt.env))
            if self.preload and not r.devices:
                env["LD_PRELOAD"] = ":".join(p for p in (env.get("LD_PRELOAD"), self.preload) if p)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in r.devices)  # ours, whatever the class's env says
        return env

    def _kv_gib(self, cls: AcceleratorClassSpec) -> int:
        """A vLLM replica's KV space: its share of this machine's memory over every vLLM replica the spec allows."""
        vllm_pools = {role for (role, _), rt in self.local.pools.items() if rt.name == runtimes.VLLM}
        most = sum(self.local.spec.roles()[role].max_replicas for role in vllm_pools)
        return vllm_runtime.kv_cache_gib(self.local.spec, cls, most, self.memory_bytes)

    def _spawn(self, r: Replica) -> None:
        if not ports.port_free(r.port, self.router_host if r.role == "router" else "127.0.0.1"):
            if r.role == "router":
                raise UpError(f"router port {r.port} was taken by another process while pdfleet up ran")
            r.port = mach.free_port(avoid=self._ports())
            self._write_worker_lists()
        argv = self._router_argv() if r.role == "router" else self._worker_argv(r)
        r.child = Child(r.name, argv, self.run_dir / "logs" / f"{r.name}.log", self._env(r)).start()
        r.state, r.ready_since, r.load = STARTING, None, {}

    def drain_s(self, r: Replica) -> float:
        """How long a worker SIGTERMed lets its open requests (and a prefill worker its KV leases) finish."""
        if self.drain_override is not None:
            return self.drain_override
        return VLLM_DRAIN_S if r.engine == runtimes.VLLM else engine_args.drain_seconds(self.local.spec)

    def _ports(self) -> set[int]:
        return {self.router.port} | {r.port for r in self.workers}

    def _gpus_for(self, cls_name: str) -> tuple[int, ...]:
        cls = self.classes[cls_name]
        if cls.resource_name != mach.GPU:
            return ()
        taken = {d for r in self.workers for d in r.devices}
        free = [d for d in range(self.machine.gpus) if d not in taken]
        if len(free) < cls.count:
            raise UpError(f"{cls_name}: {cls.count} GPU(s) per replica, {len(free)} free")
        return tuple(free[: cls.count])

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self, plan: FleetPlan) -> None:
        """Write the files, start every worker of the plan and the router (readiness: `wait_ready`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_secret(self.token_path, self.token)  # before any child reads it
        if self.api_key is not None:
            _write_secret(self.api_key_path, self.api_key)
        self.scale_to(plan, why="initial plan")
        self.write_files()
        self._spawn(self.router)
        self.event("started", "router", f"pid {self.router.child.pid}, {self.router_host}:{self.router.port}")

    async def wait_ready(self, timeout: float) -> None:
        """Until the router and every worker answer ready; UpError (with the log tail) if one exits first."""
        deadline = self.clock() + timeout
        while True:
            await self.tick()
            if self.router.state == READY and all(r.state == READY for r in self.active()) and await self._routing():
                self.startup = False
                return
            if self.clock() > deadline:
                waiting = [r.name for r in [self.router, *self.active()] if r.state != READY]
                raise UpError(f"not ready after {timeout:g}s: {', '.join(waiting)} (logs in {self.run_dir / 'logs'})")
            await asyncio.sleep(0.2)

    async def _routing(self) -> bool:
        """Whether the router has found a ready worker for every role (its /ready)."""
        try:
            return (await self.http.get(f"{self.router.url}/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    def scale_to(self, plan: FleetPlan, why: str = "") -> None:
        """Start or drain workers so that each (role, class) pool runs what the plan asks."""
        wanted = {(p.role, p.accelerator_class): p.replicas for p in plan.pools}
        keys = set(wanted) | {(r.role, r.accelerator_class) for r in self.active()}
        changed = False
        for role, cls_name in sorted(keys):
            have = [r for r in self.active(role) if r.accelerator_class == cls_name]
            want = wanted.get((role, cls_name), 0)
            for _ in range(want - len(have)):
                n = self.counters.get(role, 0)
                self.counters[role] = n + 1
                r = Replica(
                    f"{role}-{n}",
                    role,
                    cls_name,
                    mach.free_port(avoid=self._ports()),
                    self._gpus_for(cls_name),
                    engine=self.local.engine(role, cls_name),
                    index=n,
                )
                self.workers.append(r)
                self._spawn(r)
                self.event(
                    "started", r.name, f"pid {r.child.pid}, :{r.port} on {cls_name}" + (f" ({why})" if why else "")
                )
                changed = True
            # Drain what serves least first: a crashed one, then one still starting, then the newest.
            order = {BACKOFF: 0, STARTING: 1, READY: 2}
            victims = sorted(have, key=lambda r: (order[r.state], -self.workers.index(r)))[: max(0, len(have) - want)]
            for r in victims:
                self._drain(r, why)
                changed = True
        if changed and self.workers_path.parent.exists():
            self._write_worker_lists()

    def _drain(self, r: Replica, why: str) -> None:
        if r.child is None or not r.child.alive():
            self.workers.remove(r)
            self.event("stopped", r.name, "removed while waiting to restart" + (f" ({why})" if why else ""))
            return
        r.state, r.term_at = DRAINING, self.clock() + LEAVE_ROUTER_S
        self.event("draining", r.name, "out of the router's list; SIGTERM follows" + (f" ({why})" if why else ""))

    async def tick(self) -> None:
        """One supervision round: exits, restarts due, readiness, drains, cost."""
        self._account()
        now = self.clock()
        for r in [self.router, *self.workers]:
            code = r.child.poll() if r.child is not None else None
            if r.child is not None and code is not None and r.state != BACKOFF:
                self._exited(r, code, now)
            elif r.state == BACKOFF and now >= r.restart_at:
                r.restarts += 1
                self._spawn(r)
                self.event("restarted", r.name, f"pid {r.child.pid}, :{r.port} (restart {r.restarts})")
            elif r.state == DRAINING and r.child is not None:
                if r.term_at is not None and now >= r.term_at:
                    r.child.terminate()
                    r.term_at, r.kill_at = None, now + self.drain_s(r) + KILL_GRACE_S
                elif r.kill_at is not None and now >= r.kill_at:
                    r.child.kill()
                    r.kill_at = None
                    self.event("killed", r.name, f"did not drain within {self.drain_s(r) + KILL_GRACE_S:g}s: SIGKILL")
        await self._probe([r for r in [self.router, *self.workers] if r.state in (STARTING, READY)])

    def _exited(self, r: Replica, code: int, now: float) -> None:
        how = describe_exit(code)
        if r.state == DRAINING:
            self.workers.remove(r)
            self.event("stopped", r.name, "drained and exited" if code == 0 else how)
            return
        tail = r.child.log_tail(3) if r.child else ""
        if self.startup:
            why = tail.splitlines()[-1] if tail else ""
            if r.engine == runtimes.VLLM and r.child is not None:
                why = vllm_runtime.root_cause(r.child.log_tail(400)) or why
            raise UpError(
                f"{r.name} {how} while the fleet was starting"
                + (f": {why}" if why else "")
                + f" (log: {r.child.log_path if r.child else '-'})"
            )
        served = r.ready_since is not None and now - r.ready_since >= BACKOFF_RESET_S
        r.backoff_s = BACKOFF_FIRST_S if served or r.backoff_s == 0 else min(BACKOFF_MAX_S, r.backoff_s * 2)
        r.state, r.restart_at, r.ready_since, r.load = BACKOFF, now + r.backoff_s, None, {}
        self.event("crashed", r.name, f"pid {r.child.pid} {how}; restarting in {r.backoff_s:g}s")

    async def _probe(self, replicas: list[Replica]) -> None:
        async def one(r: Replica) -> None:
            # Readiness: the router's /health, the pdfleet worker's /load {"ready": true}, vLLM's /health
            # (it serves no /ready; healthy once the engine is up).
            plain = r.role == "router" or r.engine == runtimes.VLLM
            try:
                resp = await self.http.get(
                    f"{r.url}{'/health' if plain else '/load'}",
                    headers={} if plain else {"Authorization": f"Bearer {self.token}"},
                )
                body = resp.json() if not plain else {}
                ok = resp.status_code == 200 and (plain or body.get("ready") is True)
            except (httpx.HTTPError, ValueError):
                ok, body = False, {}
            if body:
                r.load = body
            if ok and r.state == STARTING and r.child is not None and r.child.alive():
                r.state, r.ready_since = READY, self.clock()
                self.event(
                    "ready", r.name, f"serving on :{r.port}" + (f" after restart {r.restarts}" if r.restarts else "")
                )

        await asyncio.gather(*(one(r) for r in replicas))

    async def shutdown(self, timeout: float | None = None) -> None:
        """The router drains first (open requests finish), then every worker; SIGKILL for what lingers."""
        if timeout is None:
            timeout = max((self.drain_s(r) for r in self.workers), default=0.0) + KILL_GRACE_S
        # (the router's drain is the spec's, engine_args.router_args)
        for group, grace in (
            ([self.router], engine_args.drain_seconds(self.local.spec) + KILL_GRACE_S),
            (list(self.workers), timeout),
        ):
            live = [r for r in group if r.child is not None and r.child.alive()]
            for r in live:
                # NOTE: not twice: a worker already draining would take a second SIGTERM as "exit now" and cut the
                # requests it is finishing.
                if not (r.state == DRAINING and r.term_at is None):
                    r.child.terminate()
            deadline = self.clock() + grace
            while any(r.child.alive() for r in live) and self.clock() < deadline:
                self._account()
                await asyncio.sleep(0.1)
            for r in live:
                if r.child.alive():
                    r.child.kill()
                    self.event("killed", r.name, f"still running {grace:g}s after SIGTERM: SIGKILL")
                r.child.wait(10)
        self._account()
        self.workers.clear()
        await self.http.aclose()

    def kill_all(self) -> None:
        """SIGKILL every child now and reap it (a second Ctrl-C, or an error path)."""
        for r in [self.router, *self.workers]:
            if r.child is not None and r.child.proc is not None:
                r.child.kill()
                r.child.wait(10)

    def pids(self) -> list[int]:
        return [r.child.pid for r in [self.router, *self.workers] if r.child is not None and r.child.alive()]


def _write_secret(path: Path, value: str) -> None:
    """A file only this user can read, created so (never world-readable for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")

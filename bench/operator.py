"""Operator scale benchmark: reconcile N InferenceDeployments (2 pools each) against the API emulator.

Runs the real operator (`pdfleet operator`, a subprocess) against the test API emulator (a thread of
this process), creates N CRs, plays the Deployment controller (marks every Deployment ready), then
restarts the operator with a short resync interval. Reports wall times, API calls and writes per CR,
writes on resync and the operator's peak RSS. Then a race for the last GPUs on an emulator that schedules
pods (`race_scenario`: the Pending pods no ScalingLimited explains, want 0), and day 2 at scale on an emulator
with its controllers on (`day2_scenario`: pools deleted while their role had no replacement serving after a
cordon, a NotReady node and a deleted class, want 0; deployments whose move to a cheaper class on the same full
hardware never finished, want 0). Ends with one JSON line.

    python bench/operator.py --crs 500
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse
import atexit
import copy
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.kube.cluster import CLASSES_FILE, node  # noqa: E402
from tests.support.components import free_port  # noqa: E402
from tests.support.k8s_emulator import EmulatorThread, write_kubeconfig  # noqa: E402

NAMESPACE = "default"


# Every CR asks for 2 prefill + 2 decode replicas. The preferred class of each role (h100, MIG) has no
# free node, so each role lands on its second class: 2 pools per CR. Capacity is shared: every CR's plan
# holds its units (issue 17), so the nodes have room for all N CRs (and the HA phase's 3 decode replicas).
def nodes(n: int) -> list[dict]:
    return [node("h200-0", "h200", 4 * n), node("a100-0", "a100", 4 * n)]


POOLS_PER_CR = 2
SPEC = {
    "model": {
        "name": "llama-3.1-8b",
        "source": {"pvc": {"claimName": "models", "path": "llama"}},
        "maxModelLen": 8192,
        "architecture": {"parametersBillions": 8.03, "layers": 32, "kvHeads": 8, "headDim": 128},
    },
    "prefill": {"acceleratorClasses": ["h100-80gb", "h200-141gb"], "minReplicas": 2, "maxReplicas": 8},
    "decode": {"acceleratorClasses": ["h100-mig-3g-40gb", "a100-80gb"], "minReplicas": 2, "maxReplicas": 8},
    "tier": "cost",
}


def cr(i: int) -> dict:
    spec = copy.deepcopy(SPEC)
    # Each CR's own weights: no two specs are equal, so nothing the operator keeps per spec content (its CEL rule
    # results) is reused across CRs where a real fleet's specs would differ (sub-objects still repeat, as they do).
    spec["model"]["source"]["pvc"]["path"] = f"llama/{i:04d}"
    return {
        "apiVersion": "pdfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": f"bench-{i:04d}", "namespace": NAMESPACE},
        "spec": spec,
    }


class Bench:
    def __init__(self, server: EmulatorThread, kubeconfig: pathlib.Path, workdir: pathlib.Path) -> None:
        self.server, self.kubeconfig, self.workdir = server, kubeconfig, workdir
        self.emu = server.emulator
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0

    def call(self, fn, *args, **kwargs):
        return self.server.call(fn, *args, **kwargs)

    def res(self, name: str):
        return self.call(self.emu.find_resource, name)

    def list(self, name: str) -> list[dict]:
        return self.call(self.emu.list_objects, self.res(name), NAMESPACE, None, None)

    def every(self, name: str, predicate, n: int | None = None) -> bool:
        """Whether `predicate` holds for every stored object of `name` (and there are `n`), read in place on the
        emulator's loop: the polls must not spend the CPU the benchmark measures on copying 500 CRs."""
        held, count = self.call(self.emu.count_objects, self.res(name), NAMESPACE, predicate)
        return held == count and (n is None or count == n)

    def writes(self) -> list:
        return [r for r in self.call(lambda: list(self.emu.log)) if r.is_write]

    def requests(self) -> list:
        return self.call(lambda: list(self.emu.log))

    verbose = False

    def start_operator(self, resync: float) -> None:
        self.metrics_port = free_port()
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        log = open(self.workdir / "operator.log", "a")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdfleet_operator.kube.operator_cli",
                "operator",
                "--metrics-port",
                str(self.metrics_port),
                "--liveness-port",
                "0",
                "--resync-interval",
                str(resync),
                *(["-v"] if self.verbose else []),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        atexit.register(_kill, self.proc)  # a timeout (SystemExit) must not leave an operator behind

    def peak_rss_mb(self) -> float:
        assert self.proc is not None
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        """CPU time the operator process used so far."""
        assert self.proc is not None
        fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def reconciles(self) -> int:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).read().decode()
        except OSError:
            return 0
        return int(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("pdfleet_operator_reconciles_total{")
            )
        )

    def stop_operator(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def wait(self, predicate, timeout: float, what: str, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"operator exited: see {self.workdir / 'operator.log'}")
            time.sleep(interval)
        seen: dict[tuple, int] = {}
        for r in self.requests():
            seen[(r.verb, r.resource, r.subresource, r.status)] = (
                seen.get((r.verb, r.resource, r.subresource, r.status), 0) + 1
            )
        print("requests so far (verb, resource, subresource, status): count", file=sys.stderr)
        for k, v in sorted(seen.items(), key=str):
            print(f"  {k}: {v}", file=sys.stderr)
        raise SystemExit(f"timed out after {timeout} s waiting for {what}")

    def quiet(self, seconds: float = 2.0, timeout: float = 120.0) -> None:
        last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = len(self.requests())
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= seconds:
                return
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crs", type=int, default=500, help="InferenceDeployments to create (default 500)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds per phase")
    parser.add_argument("--verbose", action="store_true", help="debug logging of the operator (to its log file)")
    parser.add_argument(
        "--day2-crs", type=int, default=28, help="InferenceDeployments in the day-2 scenario (default 28)"
    )
    parser.add_argument(
        "--ready-only",
        action="store_true",
        help="stop once every CR is Ready (creation and readiness only: for profiling; the JSON line has those keys)",
    )
    args = parser.parse_args(argv)
    n = args.crs

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="pdfleet-bench-operator-"))
    with EmulatorThread() as server:
        kubeconfig = write_kubeconfig(workdir / "kubeconfig", server.url)
        b = Bench(server, kubeconfig, workdir)
        b.verbose = args.verbose
        print(f"operator log: {workdir / 'operator.log'}", file=sys.stderr)
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                b.call(b.emu.apply_object, doc)
        for doc in yaml.safe_load_all(CLASSES_FILE.read_text()):
            b.call(b.emu.apply_object, doc)
        for doc in nodes(n):
            b.call(b.emu.apply_object, doc)

        b.start_operator(resync=0)
        b.wait(lambda: b.metrics_port and b.reconciles() == 0 and _up(b), 60, "the operator to start", 0.2)
        # The operator's first round of AcceleratorClass status (per class, not per CR) lands before the count.
        b.wait(lambda: all("free" in (c.get("status") or {}) for c in b.list("acc")), 60, "AcceleratorClass status")
        b.quiet(0.5)
        b.call(b.emu.log.clear)

        # Phase 1: create N CRs; wait until each has a status with its pools.
        t0 = time.monotonic()
        for i in range(n):
            b.call(b.emu.apply_object, cr(i))
        t_created = time.monotonic() - t0

        def reconciled() -> bool:
            return b.every("infdep", lambda o: len((o.get("status") or {}).get("pools") or []) == POOLS_PER_CR, n)

        b.wait(reconciled, args.timeout, "every CR reconciled")
        t_reconciled = time.monotonic() - t0
        b.quiet(1.0)
        creation = b.requests()
        writes = [r for r in creation if r.is_write]
        event_writes = [r for r in writes if r.resource == "events"]
        object_writes = len(writes) - len(event_writes)
        print("writes while reconciling new CRs: " + _by_kind(writes), file=sys.stderr)

        # Phase 2: play the Deployment controller; wait until every CR is Ready.
        deployments = b.res("deployments.apps")

        def controller() -> None:  # on the emulator's loop, in one go: the controller is not what is measured
            for dep in b.emu.list_objects(deployments, NAMESPACE, None, None):
                replicas = dep["spec"].get("replicas", 1)
                b.emu.patch_object(
                    deployments,
                    dep["metadata"]["name"],
                    {
                        "status": {
                            "replicas": replicas,
                            "readyReplicas": replicas,
                            "availableReplicas": replicas,
                            "updatedReplicas": replicas,
                        }
                    },
                    NAMESPACE,
                    subresource="status",
                )

        t_controller = time.monotonic()
        b.call(controller)
        t_controller = time.monotonic() - t_controller

        def all_ready() -> bool:
            return b.every(
                "infdep",
                lambda o: any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (o.get("status") or {}).get("conditions", [])
                ),
            )

        b.wait(all_ready, args.timeout, "every CR Ready")
        ready_seconds = time.monotonic() - t0

        # The autoscaler's first tick waits for ready pods; with no Prometheus here it reports
        # MetricsAvailable=False (one status write and one Event per CR). Let that land before the restart.
        def all_reported() -> bool:
            return b.every(
                "infdep",
                lambda o: any(c["type"] == "MetricsAvailable" for c in (o.get("status") or {}).get("conditions", [])),
            )

        b.wait(all_reported, args.timeout, "every CR's first autoscaler report")
        b.quiet(1.0)
        ready_writes = len(b.writes()) - len(writes)
        peak_rss = b.peak_rss_mb()
        operator_cpu = b.cpu_seconds()
        emulator_cpu = time.process_time()
        b.stop_operator()
        if args.ready_only:
            print(f"all reconciled, {POOLS_PER_CR} pools each (s): {t_reconciled:.1f}")
            print(f"all Ready after Deployments ready (s): {ready_seconds:.1f}")
            print(f"object writes per new CR: {object_writes / n:.2f}; on becoming Ready: {ready_writes / n:.2f}")
            print(f"CPU s to all Ready: operator / emulator+bench: {operator_cpu:.0f} / {emulator_cpu:.0f}")
            partial = {"crs": n, "partial": True, "writes_per_cr": round(object_writes / n, 2)}
            partial |= {"reconciled_seconds": round(t_reconciled, 1), "ready_seconds": round(ready_seconds, 1)}
            print(json.dumps(partial | {"operator_cpu_s": round(operator_cpu, 1)}))
            return 0

        # Phase 3: restart (every CR re-created in kopf's eyes) plus periodic resyncs; count writes.
        b.call(b.emu.log.clear)
        b.start_operator(resync=10)
        t1 = time.monotonic()
        b.wait(lambda: b.reconciles() >= 2 * n, args.timeout, "a restart and one full resync")
        resync_seconds = time.monotonic() - t1
        b.quiet(1.0)
        resync_writes = len(b.writes())
        print("requests on restart + resync: " + _by_kind(b.requests()), file=sys.stderr)
        if resync_writes:
            print("writes on restart + resync: " + _by_kind(b.writes()), file=sys.stderr)
            if args.verbose:
                for w in b.writes():
                    print(f"  {w.verb} {w.resource} {w.name}: {json.dumps(w.body)[:2000]}", file=sys.stderr)
        resync_reads = len(b.requests())
        peak_rss = max(peak_rss, b.peak_rss_mb())
        b.stop_operator()

        # Phase 4: two replicas with leader election (the chart's RBAC enforced); kill the leader between two edits.
        ha = ha_scenario(b, n, args.timeout)

    race = race_scenario(workdir, args.timeout)
    day2 = day2_scenario(workdir, args.timeout, args.day2_crs)
    rows = [
        ("CRs", f"{n}"),
        ("create N CRs (s)", f"{t_created:.1f}"),
        (f"all reconciled, {POOLS_PER_CR} pools each (s)", f"{t_reconciled:.1f}"),
        ("(emulated controller marking Deployments ready (s))", f"{t_controller:.1f}"),
        ("all Ready after Deployments ready (s)", f"{ready_seconds:.1f}"),
        ("API requests per new CR", f"{len(creation) / n:.1f}"),
        ("object writes per new CR (children + status)", f"{object_writes / n:.2f}"),
        ("Event writes per new CR", f"{len(event_writes) / n:.2f}"),
        ("writes per CR on becoming Ready (status, autoscaler)", f"{ready_writes / n:.2f}"),
        ("restart + full resync: writes / requests / s", f"{resync_writes} / {resync_reads} / {resync_seconds:.1f}"),
        ("operator peak RSS (MiB)", f"{peak_rss:.0f}"),
        (
            f"race: {race['crs']} CRs x 2 GPUs for {race['gpus']}: placed / Pending without ScalingLimited / ever "
            "Unschedulable",
            f"{race['placed']} / {race['pending_pileup']} / {race['unschedulable']}",
        ),
        ("HA: writes by a replica not holding the Lease + rewrites on takeover", f"{ha['duplicate_writes']}"),
        (
            f"day 2, {day2['crs']} CRs: pools deleted with no replacement serving (cordon, NotReady, class deleted) / "
            "moves to a cheaper class on full hardware not finished",
            f"{day2['drift_deletions']} / {day2['migration_stuck']}",
        ),
        ("HA: leader killed -> standby holds the Lease (s; lease 15 s)", f"{ha['takeover_seconds']:.1f}"),
        ("CPU s to all Ready: operator / emulator+bench", f"{operator_cpu:.0f} / {emulator_cpu:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(
        json.dumps(
            {
                "crs": n,
                "writes_per_cr": round(object_writes / n, 2),
                "event_writes_per_cr": round(len(event_writes) / n, 2),
                "api_calls_per_cr": round(len(creation) / n, 1),
                "resync_writes": resync_writes,
                "reconciled_seconds": round(t_reconciled, 1),
                "ready_seconds": round(ready_seconds, 1),
                "peak_rss_mb": round(peak_rss, 1),
                "pending_pileup": race["pending_pileup"],
                "ha_duplicate_writes": ha["duplicate_writes"],
                "drift_deletions": day2["drift_deletions"],
                "migration_stuck": day2["migration_stuck"],
            }
        )
    )
    return 0


def ha_scenario(b: Bench, n: int, timeout: float) -> dict:
    """Two replicas (`--leader-elect`, the chart's timings: lease 15 s) as the chart's ServiceAccount, each with its
    own pod-bound token: an edit of every CR while both run, the leader SIGKILLed, the standby takes over, a second
    edit. Duplicate writes: every write a replica sent while it did not hold the Lease, plus every write on takeover
    (the new leader re-reconciling what is already applied must change nothing)."""
    from tests.gen.chart import helm
    from tests.kube.ha import LEASE, RBAC_KINDS, SERVICE_ACCOUNT, Replica, writes_outside_lease
    from tests.kube.ha import NAMESPACE as RELEASE_NAMESPACE

    b.call(b.emu.apply_object, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": RELEASE_NAMESPACE}})
    for doc in helm.render({}):
        if doc["kind"] in RBAC_KINDS:
            b.call(b.emu.apply_object, doc)
    leases = b.res("leases.coordination.k8s.io")

    def holder() -> str | None:
        try:
            spec = b.call(b.emu.get_object, leases, RELEASE_NAMESPACE, LEASE).get("spec") or {}
        except Exception:  # not created yet
            return None
        return spec["holderIdentity"].rsplit("_", 1)[0] if spec.get("holderIdentity") else None

    def replica(pod: str) -> Replica:
        token = b.call(b.emu.service_account, RELEASE_NAMESPACE, SERVICE_ACCOUNT, pod)
        kubeconfig = write_kubeconfig(b.workdir / f"kubeconfig-{pod}", b.server.url, token=token)
        return Replica(
            None, pod, b.workdir, kubeconfig=kubeconfig, lease_duration=15.0, renew_deadline=10.0, retry_period=2.0
        )  # the chart's defaults

    def edit(decode: int) -> None:
        for i in range(n):
            b.call(
                b.emu.patch_object,
                b.res("infdep"),
                f"bench-{i:04d}",
                {"spec": {"decode": {"minReplicas": decode}}},
                NAMESPACE,
            )
        b.wait(
            lambda: b.every(
                "infdep",
                lambda o: (
                    (o.get("status") or {}).get("decodeReplicas") == decode
                    and o["status"].get("observedGeneration") == o["metadata"]["generation"]
                ),
            ),
            timeout,
            f"every CR at {decode} decode replicas",
        )
        quiet_objects()

    def quiet_objects(seconds: float = 2.0) -> None:
        last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            count = sum(1 for r in b.requests() if r.is_write and r.resource != "leases")
            if count != last:
                last, since = count, time.monotonic()
            elif time.monotonic() - since >= seconds:
                return
            time.sleep(0.2)

    b.proc = None  # (b.wait watches the single-replica operator's process; that one is stopped)
    b.call(b.emu.log.clear)
    a, s = replica("operator-a"), replica("operator-b")
    try:
        a.start()
        b.wait(lambda: holder() == a.pod, 60, "replica a to lead")
        b.wait(lambda: a.leader_gauge() == 1, 60, "replica a running")
        s.start()
        quiet_objects()
        edit(3)
        a.kill()
        killed = time.monotonic()
        b.wait(lambda: holder() == s.pod, timeout, "replica b to take over", 0.05)
        takeover = time.monotonic() - killed
        mark = len(b.requests())
        b.wait(lambda: s.leader_gauge() == 1, 60, "replica b running")
        quiet_objects(3.0)
        rewrites = [r for r in b.requests()[mark:] if r.is_write and r.resource != "leases" and r.status != 409]
        edit(4)  # (up: without Prometheus the autoscaler holds a pool's size rather than shrink it)
        duplicates = writes_outside_lease(b.requests()) + rewrites
        if duplicates:
            print("HA duplicate writes: " + _by_kind(duplicates), file=sys.stderr)
        forbidden = [r for r in b.requests() if r.status == 403]
        if forbidden:
            raise SystemExit("the chart's RBAC refused the operator: " + _by_kind(forbidden))
    finally:
        a.kill()
        s.stop()
    return {"duplicate_writes": len(duplicates), "takeover_seconds": takeover}


def race_scenario(workdir: pathlib.Path, timeout: float, crs: int = 8, gpus: int = 10) -> dict:
    """`crs` InferenceDeployments of 2 colocated workers (1 GPU each) created at once for `gpus` GPUs, on an
    emulator whose scheduler lags behind (held while they plan, as kube-scheduler does under load). Right
    after it binds what fits, `pending_pileup` counts the worker pods left Pending whose CR does not say
    ScalingLimited=True (the double-booking of issue 17); `unschedulable` counts the worker pods the scheduler
    ever had to leave Pending, by the end (after the operator reacted)."""
    from tests.kube.cluster import EXAMPLES
    from tests.support.k8s_emulator import KubernetesApiEmulator

    base = yaml.safe_load((EXAMPLES / "qwen2-7b.yaml").read_text())
    with EmulatorThread(KubernetesApiEmulator()) as server:
        b = Bench(server, write_kubeconfig(workdir / "kubeconfig-race", server.url), workdir)
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                b.call(b.emu.apply_object, doc)
        for doc in [
            *yaml.safe_load_all(CLASSES_FILE.read_text()),
            node("l40s-0", "l40s", gpus),
            node("cpu-0", "cpu", 64),
        ]:
            if doc:
                b.call(b.emu.apply_object, doc)
        wl = b.call(b.emu.enable_workloads)
        b.call(wl.hold)
        b.start_operator(resync=0)
        b.wait(lambda: b.metrics_port and _up(b), 60, "the race operator to start", 0.2)
        for i in range(crs):
            doc = copy.deepcopy(base)
            doc["metadata"]["name"] = f"race-{i}"
            doc["spec"]["colocated"].update(minReplicas=2, maxReplicas=2)
            doc["spec"]["autoscaling"] = {"enabled": False}
            b.call(b.emu.apply_object, doc)
        b.wait(
            lambda: (
                all(
                    (o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"]
                    for o in b.list("infdep")
                )
                and len(b.list("infdep")) == crs
            ),
            timeout,
            "every race CR planned",
        )
        b.quiet(1.0)
        pods_res, crs_res = b.res("pods"), b.res("infdep")

        def bind_and_count() -> tuple[int, int]:  # on the emulator's loop: before the operator can react
            wl.hold(False)
            limited = {
                o["metadata"]["name"]
                for o in b.emu.list_objects(crs_res, NAMESPACE, None, None)
                if any(
                    c["type"] == "ScalingLimited" and c["status"] == "True"
                    for c in (o.get("status") or {}).get("conditions") or []
                )
            }
            workers = b.emu.list_objects(pods_res, NAMESPACE, "pdfleet.io/role=colocated", None)
            waiting = [p for p in workers if not p["spec"].get("nodeName")]
            pileup = [p for p in waiting if p["metadata"]["labels"]["pdfleet.io/deployment"] not in limited]
            return len(pileup), len(workers) - len(waiting)

        pileup, placed = b.call(bind_and_count)
        b.quiet(2.0)
        unschedulable = len([p for p in wl.unschedulable_pods if "-router-" not in p])
        b.stop_operator()
    return {"crs": crs, "gpus": gpus, "pending_pileup": pileup, "placed": placed, "unschedulable": unschedulable}


def day2_scenario(workdir: pathlib.Path, timeout: float, crs: int) -> dict:
    """Day 2 at scale, on an emulator whose controllers run (scheduler, ReplicaSets, node lifecycle, disruption
    budgets) and a cluster with no spare accelerator: `crs` colocated deployments of 2 replicas, four of them on the
    one a100 node (the class they list first), the rest filling L40S nodes exactly.

    Phase 1: an L40S node cordoned, another NotReady, the a100-80gb class deleted under its pools; nowhere has room
    for a replacement. `drift_deletions`: worker Deployments deleted while the rest of their role served fewer than
    its 2 replicas (capacity taken away), read from the emulator's event history. Phase 2 (nodes back): l40s-spot, a
    class naming the same full L40S nodes, is made the cheapest; `migration_stuck`: L40S deployments not all on it, at
    their full size, once the operator is quiet (the move goes one replica at a time, in the units the old pool
    frees)."""
    from tests.kube.cluster import EXAMPLES, class_objects
    from tests.support.k8s_emulator import KubernetesApiEmulator

    base = yaml.safe_load((EXAMPLES / "qwen2-7b.yaml").read_text())
    on_a100 = 4
    crs = max(crs - (crs - on_a100) % 4, on_a100 + 8)  # the L40S deployments fill whole 8-GPU nodes (at least 2)
    l40s = [node(f"l40s-{i}", "l40s", 8) for i in range(2 * (crs - on_a100) // 8)]
    spot = copy.deepcopy(next(d for d in class_objects() if d["metadata"]["name"] == "l40s-48gb"))
    spot["metadata"] = {"name": "l40s-spot"}
    spot["spec"]["costPerHour"] = 9.0
    with EmulatorThread(KubernetesApiEmulator()) as server:
        b = Bench(server, write_kubeconfig(workdir / "kubeconfig-day2", server.url), workdir)
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                b.call(b.emu.apply_object, doc)
        for doc in [*class_objects(), spot, *l40s, node("a100-0", "a100", 2 * on_a100), node("cpu-0", "cpu", 4 * crs)]:
            b.call(b.emu.apply_object, doc)
        b.call(b.emu.enable_workloads)
        b.start_operator(resync=0)
        b.wait(lambda: b.metrics_port and _up(b), 60, "the day-2 operator to start", 0.2)
        names = [f"day2-{i:03d}" for i in range(crs)]
        for i, name in enumerate(names):
            doc = copy.deepcopy(base)
            doc["metadata"]["name"] = name
            listed = ["a100-80gb", "l40s-48gb"] if i < on_a100 else ["l40s-48gb", "l40s-spot"]
            doc["spec"]["colocated"].update(acceleratorClasses=listed, minReplicas=2, maxReplicas=2)
            doc["spec"]["autoscaling"] = {"enabled": True}  # (no Prometheus: the plan's sizes stay put)
            b.call(b.emu.apply_object, doc)
        deployments = b.res("deployments.apps")

        def pools() -> dict[str, dict[str, int]]:
            """deployment -> class -> ready replicas."""
            out: dict[str, dict[str, int]] = {}
            for d in b.call(b.emu.list_objects, deployments, NAMESPACE, "pdfleet.io/role=colocated", None):
                labels = d["metadata"]["labels"]
                out.setdefault(labels["pdfleet.io/deployment"], {})[labels["pdfleet.io/accelerator"]] = int(
                    (d.get("status") or {}).get("readyReplicas") or 0
                )
            return out

        b.wait(
            lambda: len(pools()) == crs and all(sum(p.values()) == 2 for p in pools().values()),
            timeout,
            "every day-2 CR serving 2 replicas",
        )
        for name in names:  # minimum 1 from now on: a replica may move without a replacement first (phase 2)
            b.call(b.emu.patch_object, b.res("infdep"), name, {"spec": {"colocated": {"minReplicas": 1}}}, NAMESPACE)
        b.quiet(2.0, timeout)
        mark = b.call(lambda: b.emu.resource_version)

        # Phase 1: a cordon, a NotReady node, a class deleted under its pools; no room anywhere for a replacement.
        b.call(b.emu.cordon, "l40s-0")
        b.call(b.emu.set_node_ready, "l40s-1", "False")
        b.call(b.emu.delete_object, b.res("acc"), "a100-80gb")
        b.quiet(3.0, timeout)
        drift = _capacity_taking_deletions(b.call(lambda: list(b.emu._events)), mark, target=2)
        b.call(b.emu.cordon, "l40s-0", False)
        b.call(b.emu.set_node_ready, "l40s-1", "True")
        # The four deployments of the deleted class wait for room that does not exist; they go, so that phase 2
        # measures moves, not a race with waiting neighbours (NOTE: with such neighbours a released unit can go
        # to an older Pending pod of theirs, which the scheduler binds first; the mover then stays at its
        # smaller size, never below its minimum, with ScalingLimited saying why).
        for name in names[:on_a100]:
            b.call(b.emu.delete_object, b.res("infdep"), name, NAMESPACE)
        b.quiet(3.0, timeout)

        # Phase 2: l40s-spot (the same full nodes) made the cheapest: every L40S deployment moves, one at a time.
        b.call(b.emu.patch_object, b.res("acc"), "l40s-spot", {"spec": {"costPerHour": 0.25}}, None)
        movers = set(names[on_a100:])

        def moved() -> int:
            return sum(
                1 for name, p in pools().items() if name in movers and set(p) == {"l40s-spot"} and p["l40s-spot"] == 2
            )

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and moved() < len(movers):
            b.quiet(3.0, timeout)
            if moved() < len(movers):
                time.sleep(1.0)
        stuck = len(movers) - moved()
        b.stop_operator()
    return {"crs": crs, "drift_deletions": len(drift), "migration_stuck": stuck}


def _absent(b: Bench, resource: str, name: str) -> bool:
    res = b.res(resource)
    try:
        b.call(b.emu.get_object, res, None, name)
    except Exception:  # not found
        return True
    return False


def _capacity_taking_deletions(events: list, since: int, target: int) -> list[str]:
    """Worker Deployments deleted (after resourceVersion `since`) while the other pools of their deployment's role
    served fewer than `target` ready replicas: a deletion that took serving capacity away."""
    ready: dict[tuple[str, str], dict[str, int]] = {}
    out = []
    for e in events:
        if e.plural != "deployments":
            continue
        labels = e.obj["metadata"].get("labels") or {}
        role, owner = labels.get("pdfleet.io/role"), labels.get("pdfleet.io/deployment")
        if not owner or role in (None, "router"):
            continue
        pools = ready.setdefault((owner, role), {})
        name = e.obj["metadata"]["name"]
        if e.type == "DELETED":
            pools.pop(name, None)
            if e.rv > since and sum(pools.values()) < target:
                out.append(name)
        else:
            pools[name] = int((e.obj.get("status") or {}).get("readyReplicas") or 0)
    return out


def _by_kind(writes: list) -> str:
    counts: dict[str, int] = {}
    for w in writes:
        k = f"{w.verb} {w.resource}{'/' + w.subresource if w.subresource else ''}"
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _up(b: Bench) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{b.metrics_port}/metrics", timeout=1)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())

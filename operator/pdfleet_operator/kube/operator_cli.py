"""`pdfleet operator`: runs the kopf handlers of `pdfleet_operator.kube.handlers` (cli.py calls register())."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from pdfleet_operator.decide import guardrails, metric_names, worker_images
from pdfleet_operator.gen import generated
from pdfleet_operator.kube import alertmanager, exporter, handlers, leader


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("operator", help="run the operator (kopf) against the cluster in kubeconfig / in-cluster")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch InferenceDeployments in this namespace (repeatable; globs allowed)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--metrics-port", type=int, default=8080, help="port of /metrics (default 8080; 0 disables)")
    p.add_argument("--liveness-port", type=int, default=8081, help="port of /healthz (default 8081; 0 disables)")
    p.add_argument("--bind", default="0.0.0.0", help="address for /metrics and /healthz (default 0.0.0.0)")
    p.add_argument(
        "--resync-interval",
        type=float,
        default=300.0,
        help="seconds between full re-reconciles of every InferenceDeployment (0: never; default 300)",
    )
    p.add_argument(
        "--prometheus-url",
        default=None,
        metavar="URL",
        help="Prometheus the autoscaler reads when a spec sets no autoscaling.prometheusUrl "
        "(without either, autoscaled deployments hold their size with MetricsAvailable=False)",
    )
    p.add_argument(
        "--metrics-profile",
        default="pdfleet",
        choices=sorted(metric_names.PROFILES),
        help="the queue queries of the worker engine: pdfleet or vllm (default pdfleet)",
    )
    p.add_argument(
        "--no-autoscaler",
        dest="autoscaler",
        action="store_false",
        help="do not run the autoscaler (pools stay at what the spec and placement give)",
    )
    p.add_argument(
        "--alertmanager-port",
        type=int,
        default=0,
        help="serve the Alertmanager webhook receiver (POST /alerts) on this port (default 0: off)",
    )
    p.add_argument(
        "--alertmanager-token-file",
        default=None,
        metavar="FILE",
        help="require Authorization: Bearer <the file's content> on POST /alerts (Alertmanager's "
        "http_config.authorization; a mounted Secret). Required with --alertmanager-port",
    )
    p.add_argument(
        "--alertmanager-unauthenticated",
        action="store_true",
        help="serve the receiver without a token (anyone who reaches it can trigger rollback analysis); "
        "refused otherwise",
    )
    p.add_argument(
        "--analysis-interval",
        type=float,
        default=15.0,
        help="seconds between rollback analyses from Prometheus (0: only on alerts; default 15)",
    )
    p.add_argument(
        "--class-status-interval",
        type=float,
        default=15.0,
        help="seconds between updates of AcceleratorClass status (nodes, allocatable, free units; "
        "0: never; default 15)",
    )
    p.add_argument(
        "--scraper-namespace",
        action="append",
        default=None,
        metavar="NS",
        help="namespace whose pods may scrape worker /metrics through the workers' NetworkPolicy "
        "(repeatable; default: monitoring)",
    )
    p.add_argument(
        "--allow-prometheus-url",
        action="append",
        default=[],
        metavar="PREFIX",
        help="a spec.autoscaling.prometheusUrl the operator may read: under this URL prefix (repeatable; "
        "default: only --prometheus-url; others are not fetched and say so in status)",
    )
    tls = p.add_mutually_exclusive_group()
    tls.add_argument(
        "--prometheus-ca", metavar="FILE", help="CA bundle verifying https Prometheus (default: the system's)"
    )
    tls.add_argument("--prometheus-insecure", action="store_true", help="do not verify https Prometheus certificates")
    p.add_argument(
        "--allow-host-path",
        action="append",
        default=[],
        metavar="PREFIX",
        help="allow model.source.hostPath under this absolute path of the nodes (repeatable; default: "
        "hostPath models are refused)",
    )
    p.add_argument(
        "--allow-host-path-namespace",
        action="append",
        default=[],
        metavar="NS",
        help="allow any model.source.hostPath in this namespace (repeatable)",
    )
    p.add_argument(
        "--worker-image",
        action="append",
        default=[],
        metavar="PLATFORM=IMAGE",
        help="the pdfleet worker image built for PLATFORM (cpu, cuda, dtk, npu, mlu, ...; an IMAGE alone: "
        "its tag's -PLATFORM suffix) for pools on classes of that platform whose InferenceDeployment "
        "(spec.engine.image) and AcceleratorClass (spec.runtimes.pdfleet.image) name none; a class "
        "whose platform has no image is refused (repeatable; default $PDFLEET_WORKER_IMAGE, "
        f"space-separated, or {worker_images.DEFAULTS.describe()}); recorded in each status.workerImage",
    )
    p.add_argument(
        "--no-pod-monitors",
        dest="pod_monitors",
        action="store_false",
        help="render no PodMonitor per InferenceDeployment (the chart passes it while its own PodMonitor, "
        "monitoring.podMonitor, scrapes every deployment's pods: both would double every series)",
    )
    ha = p.add_argument_group("leader election (several replicas: one acts, the others stand by)")
    ha.add_argument(
        "--leader-elect",
        action="store_true",
        help="act only while holding a coordination.k8s.io Lease; wait as a standby otherwise",
    )
    ha.add_argument(
        "--leader-election-namespace",
        default=None,
        metavar="NS",
        help="namespace of the Lease (default: the pod's own, POD_NAMESPACE or the service account's)",
    )
    ha.add_argument(
        "--leader-election-name",
        default="pdfleet-operator",
        metavar="NAME",
        help="name of the Lease (default pdfleet-operator)",
    )
    ha.add_argument(
        "--leader-election-lease-duration",
        type=float,
        default=15.0,
        metavar="S",
        help="a standby takes over after seeing the Lease unrenewed this long (default 15)",
    )
    ha.add_argument(
        "--leader-election-renew-deadline",
        type=float,
        default=10.0,
        metavar="S",
        help="the leader exits when it could not renew for this long (default 10)",
    )
    ha.add_argument(
        "--leader-election-retry-period",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between attempts on the Lease (default 2)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import kopf

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:  # kopf logs every handler call at INFO: one line per watch event of every child
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    handlers.OPTIONS.resync_interval = args.resync_interval
    handlers.OPTIONS.metrics_host = args.bind
    handlers.OPTIONS.metrics_port = args.metrics_port or None
    handlers.OPTIONS.prometheus_url = args.prometheus_url
    handlers.OPTIONS.metrics_profile = args.metrics_profile
    handlers.OPTIONS.autoscaler = args.autoscaler
    handlers.OPTIONS.alertmanager_host = args.bind
    handlers.OPTIONS.alertmanager_port = args.alertmanager_port or None
    try:
        alertmanager.check_receiver(
            args.alertmanager_port, args.alertmanager_token_file, args.alertmanager_unauthenticated
        )
    except ValueError as exc:
        raise SystemExit(f"pdfleet operator: {exc}") from None
    if args.alertmanager_token_file:
        token = Path(args.alertmanager_token_file).read_text().strip()
        if not token:
            raise SystemExit(f"pdfleet operator: --alertmanager-token-file {args.alertmanager_token_file} is empty")
        handlers.OPTIONS.alertmanager_token = token
    handlers.OPTIONS.analysis_interval = args.analysis_interval
    handlers.OPTIONS.class_status_interval = args.class_status_interval
    handlers.OPTIONS.scraper_namespaces = tuple(args.scraper_namespace or ("monitoring",))
    handlers.OPTIONS.namespaces = tuple(args.namespace)
    try:
        handlers.OPTIONS.host_path_prefixes = tuple(guardrails.normalize_prefix(p) for p in args.allow_host_path)
    except ValueError as exc:
        raise SystemExit(f"pdfleet operator: --allow-host-path: {exc}") from None
    handlers.OPTIONS.host_path_namespaces = tuple(args.allow_host_path_namespace)
    try:
        flags = args.worker_image or os.environ.get("PDFLEET_WORKER_IMAGE", "").split()
        handlers.OPTIONS.worker_images = worker_images.WorkerImages.parse(flags) if flags else worker_images.DEFAULTS
        for prefix in args.allow_prometheus_url:
            guardrails.check_url_prefix(prefix)
    except ValueError as exc:
        raise SystemExit(f"pdfleet operator: {exc}") from None
    handlers.OPTIONS.pod_monitors = args.pod_monitors
    handlers.OPTIONS.prometheus_allowed = tuple(args.allow_prometheus_url)
    handlers.OPTIONS.prometheus_verify = False if args.prometheus_insecure else (args.prometheus_ca or True)
    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None
    clusterwide = not args.namespace
    election = None
    if args.leader_elect:
        namespace = args.leader_election_namespace or leader.default_namespace()
        if not namespace:
            raise SystemExit("pdfleet operator: --leader-elect needs --leader-election-namespace outside a pod")
        try:
            # the leader publishes its receiver's URL in the Lease (the chart passes POD_IP): standbys relay to it
            election = leader.LeaseConfig(
                namespace,
                args.leader_election_name,
                leader.default_identity(),
                args.leader_election_lease_duration,
                args.leader_election_renew_deadline,
                args.leader_election_retry_period,
                leader.receiver_url(os.environ.get("POD_IP"), args.alertmanager_port),
            )
        except ValueError as exc:
            raise SystemExit(f"pdfleet operator: {exc}") from None
    # NOTE: standalone: kopf's peering would freeze replicas of equal priority; the Lease decides who acts.
    operate = kopf.operator(
        clusterwide=clusterwide, namespaces=args.namespace, standalone=True, liveness_endpoint=liveness
    )
    if election is None:
        exporter.LEADER.set(1)
        asyncio.run(operate)
    else:
        asyncio.run(
            _operate_when_leading(
                operate,
                election,
                args.bind,
                args.liveness_port or None,
                args.metrics_port or None,
                handlers.OPTIONS.alertmanager_port,
                handlers.OPTIONS.alertmanager_token,
            )
        )
    return 0


async def _operate_when_leading(
    operate: Coroutine[Any, Any, Any],
    election: leader.LeaseConfig,
    bind: str,
    liveness_port: int | None,
    metrics_port: int | None,
    alertmanager_port: int | None = None,
    alertmanager_token: str | None = None,
) -> None:
    """Stand by until this replica holds the Lease, then run kopf while a thread of its own renews it (its own event
    loop and API session: a busy operator loop never delays a renewal); release it on the way out. While standing by,
    the Alertmanager port relays authenticated alerts to the receiver URL the leader published in the Lease."""
    import kopf

    from pdfleet_operator.kube import client

    info = kopf.login_with_service_account(settings=kopf.OperatorSettings()) or kopf.login_with_kubeconfig(
        settings=kopf.OperatorSettings()
    )
    if info is None:
        raise SystemExit("pdfleet operator: no credentials (neither a service account nor a kubeconfig)")
    lease = leader.LeaseThread(lambda: client.Api.from_connection(info), election)
    exporter.LEADER.set(0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    standby = await leader.serve_standby(
        bind,
        liveness_port,
        metrics_port,
        alertmanager_port,
        alertmanager_token,
        lease.leader_url,
        election.retry_period,
    )
    lease.start()
    try:
        while not lease.acquired.is_set() and not stop.is_set() and not lease.done.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for runner in standby:
            await runner.cleanup()
    if not lease.acquired.is_set():
        operate.close()
        await asyncio.to_thread(lease.stop)
        return
    exporter.LEADER.set(1)
    try:
        await operate
    finally:
        await asyncio.to_thread(lease.stop)


def main(argv: list[str] | None = None) -> int:
    return generated.standalone(register, argv)


if __name__ == "__main__":
    raise SystemExit(main())

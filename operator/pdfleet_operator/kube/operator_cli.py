"""`pdfleet operator`: runs the kopf handlers of `pdfleet_operator.kube.handlers` (cli.py calls register())."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from pdfleet_operator.decide import metric_names
from pdfleet_operator.gen import generated
from pdfleet_operator.kube import handlers


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("operator", help="run the operator (kopf) against the cluster in kubeconfig / in-cluster")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch InferenceDeployments in this namespace (repeatable; globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--metrics-port", type=int, default=8080, help="port of /metrics (default 8080; 0 disables)")
    p.add_argument("--liveness-port", type=int, default=8081, help="port of /healthz (default 8081; 0 disables)")
    p.add_argument("--bind", default="0.0.0.0", help="address for /metrics and /healthz (default 0.0.0.0)")
    p.add_argument("--resync-interval", type=float, default=300.0,
                   help="seconds between full re-reconciles of every InferenceDeployment (0: never; default 300)")
    p.add_argument("--prometheus-url", default=None, metavar="URL",
                   help="Prometheus the autoscaler reads when a spec sets no autoscaling.prometheusUrl "
                        "(without either, autoscaled deployments hold their size with MetricsAvailable=False)")
    p.add_argument("--metrics-profile", default="pdfleet", choices=sorted(metric_names.PROFILES),
                   help="the queue queries of the worker engine: pdfleet or vllm (default pdfleet)")
    p.add_argument("--no-autoscaler", dest="autoscaler", action="store_false",
                   help="do not run the autoscaler (pools stay at what the spec and placement give)")
    p.add_argument("--alertmanager-port", type=int, default=0,
                   help="serve the Alertmanager webhook receiver (POST /alerts) on this port (default 0: off)")
    p.add_argument("--alertmanager-token-file", default=None, metavar="FILE",
                   help="require Authorization: Bearer <the file's content> on POST /alerts (Alertmanager's "
                        "http_config.authorization; a mounted Secret)")
    p.add_argument("--analysis-interval", type=float, default=15.0,
                   help="seconds between rollback analyses from Prometheus (0: only on alerts; default 15)")
    p.add_argument("--class-status-interval", type=float, default=15.0,
                   help="seconds between updates of AcceleratorClass status (nodes, allocatable, free units; "
                        "0: never; default 15)")
    p.add_argument("--scraper-namespace", action="append", default=None, metavar="NS",
                   help="namespace whose pods may scrape worker /metrics through the workers' NetworkPolicy "
                        "(repeatable; default: monitoring)")
    p.add_argument("--allow-prometheus-url", action="append", default=[], metavar="PREFIX",
                   help="a spec.autoscaling.prometheusUrl the operator may read: under this URL prefix (repeatable; "
                        "default: only --prometheus-url; others are not fetched and say so in status)")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--prometheus-ca", metavar="FILE", help="CA bundle verifying https Prometheus (default: the system's)")
    tls.add_argument("--prometheus-insecure", action="store_true", help="do not verify https Prometheus certificates")
    p.add_argument("--allow-host-path", action="append", default=[], metavar="PREFIX",
                   help="allow model.source.hostPath under this absolute path of the nodes (repeatable; default: "
                        "hostPath models are refused)")
    p.add_argument("--allow-host-path-namespace", action="append", default=[], metavar="NS",
                   help="allow any model.source.hostPath in this namespace (repeatable)")
    p.add_argument("--peering", default=None,
                   help="kopf peering object for running several replicas (default: standalone)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import kopf

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    if args.alertmanager_token_file:
        token = Path(args.alertmanager_token_file).read_text().strip()
        if not token:
            raise SystemExit(f"pdfleet operator: --alertmanager-token-file {args.alertmanager_token_file} is empty")
        handlers.OPTIONS.alertmanager_token = token
    handlers.OPTIONS.analysis_interval = args.analysis_interval
    handlers.OPTIONS.class_status_interval = args.class_status_interval
    handlers.OPTIONS.scraper_namespaces = tuple(args.scraper_namespace or ("monitoring",))
    from pdfleet_operator.decide import guardrails
    try:
        handlers.OPTIONS.host_path_prefixes = tuple(guardrails.normalize_prefix(p) for p in args.allow_host_path)
    except ValueError as exc:
        raise SystemExit(f"pdfleet operator: --allow-host-path: {exc}") from None
    handlers.OPTIONS.host_path_namespaces = tuple(args.allow_host_path_namespace)
    handlers.OPTIONS.prometheus_allowed = tuple(args.allow_prometheus_url)
    handlers.OPTIONS.prometheus_verify = False if args.prometheus_insecure else (args.prometheus_ca or True)
    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None
    clusterwide = not args.namespace
    asyncio.run(kopf.operator(
        clusterwide=clusterwide,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=liveness,
    ))
    return 0


def main(argv: list[str] | None = None) -> int:
    return generated.standalone(register, argv)


if __name__ == "__main__":
    raise SystemExit(main())

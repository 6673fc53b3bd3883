"""`pdfleet operator`'s settings, shared by the kopf triggers and the reconciler; set before kopf starts."""

from __future__ import annotations

import dataclasses

from pdfleet_operator.decide import worker_images


@dataclasses.dataclass
class Options:
    """Set by `pdfleet operator` before kopf starts."""

    resync_interval: float = 300.0  # seconds between full re-reconciles (0: never)
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
    monitoring_check_interval: float = 300.0
    autoscaler: bool = True  # run the autoscaler loops (tests of the reconcile alone switch them off)
    prometheus_url: str | None = None  # the autoscaler's Prometheus when a spec names none
    metrics_profile: str = "pdfleet"  # metric_names.PROFILES: the PromQL of the engine kind
    analysis_interval: float = 15.0  # seconds between rollback analyses from Prometheus (0: only on alerts)
    alertmanager_host: str = "0.0.0.0"
    alertmanager_port: int | None = None  # the Alertmanager webhook receiver (POST /alerts)
    alertmanager_token: str | None = None  # its bearer token (None: unauthenticated; the chart always sets one)
    class_status_interval: float = 15.0  # seconds between AcceleratorClass status rounds (0: never written)
    scraper_namespaces: tuple[str, ...] = ("monitoring",)
    prometheus_allowed: tuple[str, ...] = ()  # URL prefixes a CR's prometheusUrl may name (decide.guardrails)
    prometheus_verify: bool | str = True  # TLS verification of https Prometheus: True, a CA file, or False
    host_path_prefixes: tuple[str, ...] = ()  # model.source.hostPath allowed under these (decide.guardrails)
    host_path_namespaces: tuple[
        str, ...
    ] = ()  # ... or in these namespaces  # whose pods may scrape workers (their NetworkPolicy)
    # The namespaces (globs) kopf watches; empty: every namespace. When set, the pods of the other namespaces
    # (which hold accelerators too) are listed cluster-wide at most every `foreign_pods_interval` seconds.
    namespaces: tuple[str, ...] = ()
    foreign_pods_interval: float = 10.0
    # pdfleet workers' image per platform when neither the CR nor its class names one (decide.worker_images)
    worker_images: worker_images.WorkerImages = worker_images.DEFAULTS
    pod_monitors: bool = True  # a PodMonitor per deployment (off when the chart's own PodMonitor scrapes them all)


OPTIONS = Options()

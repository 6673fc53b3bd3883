"""RouterConfig: `pdfleet router` flags (pools per SLA tier and engine, discovery, retries, aliases); the CLI and tests
build it. No torch."""

from __future__ import annotations

import argparse
import dataclasses
from urllib.parse import urlsplit

from pdfleet_worker.router import engines, routing
from pdfleet_worker.router import workers_file as wf
from pdfleet_worker.router.tiers import DEFAULT_TIER, split_tier

DISCOVERY = ("auto", "static", "dns", "endpointslices")


@dataclasses.dataclass
class TierConfig:
    """One SLA tier's pools: prefill + decode (disaggregated) or workers (colocated)."""

    name: str
    prefill: list[str] = dataclasses.field(default_factory=list)
    decode: list[str] = dataclasses.field(default_factory=list)
    workers: list[str] = dataclasses.field(default_factory=list)
    engines: dict[str, str] = dataclasses.field(default_factory=dict)  # URL -> engine; absent: pdfleet

    def engine_of(self, url: str) -> str:
        return self.engines.get(url, engines.PDFLEET)

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def pd_engine(self) -> str:
        """The one engine of a disaggregated tier's prefill and decode workers (checked by RouterConfig)."""
        assert self.disaggregated, f"tier {self.name!r} is colocated"
        return self.engine_of(self.prefill[0])

    def pools(self) -> dict[str, list[str]]:
        """role -> URLs ('both' for colocated workers)."""
        return {"prefill": self.prefill, "decode": self.decode} if self.disaggregated else {"both": self.workers}


@dataclasses.dataclass
class RouterConfig:
    tiers: dict[str, TierConfig]
    default_tier: str
    host: str = "127.0.0.1"
    port: int = 8000
    discovery: str = "auto"
    workers_file: str | None = None  # re-read every discovery round (pdfleet up rewrites it)
    engine: str = engines.PDFLEET  # the engine of worker entries that name none (`ENGINE@URL`)
    namespace: str | None = None
    discovery_interval_s: float = 5.0
    health_interval_s: float = 1.0
    max_retries: int = 2
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0
    tier_header: str = "x-pdfleet-tier"
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # model alias -> tier
    max_request_bytes: int = 4 << 20
    retry_after_s: int = 1
    drain_timeout_s: float = 25.0
    drain_accept_s: float = 0.0  # after SIGTERM, keep taking new requests this long (a Service stops sending late)
    auth_token_file: str | None = None  # the deployment token, sent to pdfleet workers; guards /workers
    api_key_file: str | None = None  # client API keys required on /v1/*
    api_key_file_optional: bool = False  # a missing api_key_file requires no key until it appears
    heartbeat_interval_s: float = 10.0  # SSE `: keep-alive` while a stream waits this long; 0: none
    pd_min_prompt_tokens: int = 0  # PD requests with fewer prompt tokens go straight to a decode worker; 0: none do
    # query routing to a smaller model's router (router/routing.py): None: every request stays here
    route_to: str | None = None
    route_rules: routing.Rules = dataclasses.field(default_factory=routing.Rules)
    route_classifier: str | None = None  # module:function
    route_confidence_floor: float = 0.5
    route_classifier_timeout_s: float = 1.0
    route_tokenizer: str | None = None  # a model directory whose tokenizer.json counts prompt tokens

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("no workers: give --prefill and --decode, or --workers")
        for tier in self.tiers.values():
            if tier.workers and (tier.prefill or tier.decode):
                raise ValueError(f"tier {tier.name!r}: use either --prefill/--decode or --workers, not both")
            if bool(tier.prefill) != bool(tier.decode):
                raise ValueError(f"tier {tier.name!r}: --prefill and --decode go together")
            for url in tier.prefill + tier.decode + tier.workers:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ValueError(f"tier {tier.name!r}: {url!r} is not an http(s) URL")
            for url, engine in tier.engines.items():
                engines.check(engine)
            if tier.disaggregated:
                first = (tier.pd_engine, tier.prefill[0])
                for url in tier.prefill + tier.decode:
                    if tier.engine_of(url) != first[0]:
                        raise ValueError(engines.mixed_pd_error(tier.name, first, (tier.engine_of(url), url)))
        if self.default_tier not in self.tiers:
            raise ValueError(f"default tier {self.default_tier!r} has no workers; tiers: {sorted(self.tiers)}")
        for alias, tier in self.aliases.items():
            if tier not in self.tiers:
                raise ValueError(
                    f"model alias {alias!r} names tier {tier!r}, which has no workers; tiers: {sorted(self.tiers)}"
                )
        engines.check(self.engine)
        if self.discovery not in DISCOVERY:
            raise ValueError(f"discovery must be one of {DISCOVERY}, got {self.discovery!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.api_key_file_optional and not self.api_key_file:
            raise ValueError("--api-key-file-optional needs --api-key-file")
        if self.heartbeat_interval_s < 0:
            raise ValueError(f"--heartbeat-interval must be >= 0 (0: no heartbeats), got {self.heartbeat_interval_s:g}")
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(
                f"--pd-min-prompt-tokens must be >= 0 (0: every PD request prefills in the prefill "
                f"pool), got {self.pd_min_prompt_tokens}"
            )
        if self.route_to is None:
            if not self.route_rules.empty or self.route_classifier or self.route_tokenizer:
                raise ValueError("the --route-* rules need --route-to URL (the router of the deployment they send to)")
        else:
            parts = urlsplit(self.route_to)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--route-to {self.route_to!r} is not an http(s) URL")
            if self.route_rules.empty and not self.route_classifier:
                raise ValueError(
                    "--route-to needs a rule (--route-max-prompt-tokens, --route-max-prompt-chars, "
                    "--route-max-tokens, --route-pattern, --route-exclude-pattern) or --route-classifier"
                )
            if not 0.0 <= self.route_confidence_floor <= 1.0:
                raise ValueError(f"--route-confidence-floor must be in [0, 1], got {self.route_confidence_floor:g}")
            if self.route_classifier_timeout_s <= 0:
                raise ValueError("--route-classifier-timeout must be > 0")
            if self.route_rules.max_prompt_tokens is not None and not self.route_tokenizer:
                raise ValueError(
                    "--route-max-prompt-tokens needs --route-tokenizer DIR (the model directory whose "
                    "tokenizer.json counts the prompt)"
                )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="[TIER=][ENGINE@]URL",
        help="prefill worker URLs (a hostname is resolved to every address it has: a headless Service); "
        "a tier's prefill and decode workers run one engine, e.g. vllm@http://p:8000 (driven with "
        "vLLM's own kv_transfer_params: its workers need a KV connector, NixlConnector for one)",
    )
    p.add_argument("--decode", nargs="+", default=[], metavar="[TIER=][ENGINE@]URL", help="decode worker URLs")
    p.add_argument(
        "--workers",
        nargs="+",
        default=[],
        metavar="[TIER=][ENGINE@]URL",
        help="colocated (role both) worker URLs; ENGINE (default --engine) is pdfleet or vllm, e.g. "
        "fast=vllm@http://vllm:8000",
    )
    p.add_argument(
        "--workers-file",
        metavar="FILE",
        help='instead of the three flags above: a JSON file {"prefill": [...], "decode": [...], "workers": '
        "[...]} (entries as the flags take them), re-read every discovery interval; the roles present "
        "at start are the router's pools",
    )
    p.add_argument(
        "--engine",
        choices=engines.ENGINES,
        default=engines.PDFLEET,
        help="engine of the workers whose entry names none: pdfleet (probed at /load) or vllm (vLLM and "
        "its vendor builds: /health, /v1/models and /metrics)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--default-tier", help=f"tier for requests that name none (default: {DEFAULT_TIER!r}, else the first)"
    )
    p.add_argument("--tier-header", default="x-pdfleet-tier", help="request header that selects a tier")
    p.add_argument(
        "--model-alias",
        nargs="+",
        default=[],
        metavar="ALIAS=TIER",
        help="a `model` value that selects a tier (rewritten to the model that tier serves)",
    )
    p.add_argument(
        "--discovery",
        choices=DISCOVERY,
        default="auto",
        help="auto: DNS for hostnames, as-is for IPs; static: URLs as given; dns: always resolve; "
        "endpointslices: read the Service's EndpointSlices (needs the kubernetes client)",
    )
    p.add_argument("--namespace", help="endpointslices: namespace of Services named without one")
    p.add_argument("--discovery-interval", type=float, default=5.0, help="seconds between re-resolving workers")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between load/health probes")
    p.add_argument("--max-retries", type=int, default=2, help="other workers tried before any byte reached the client")
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--upstream-timeout", type=float, default=600.0, help="longest wait for a worker's next bytes")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20)
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 503")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=25.0,
        help="on SIGTERM, seconds open requests may take to finish (keep under the pod's grace period)",
    )
    p.add_argument(
        "--drain-accept",
        type=float,
        default=0.0,
        help="on SIGTERM, seconds to keep answering new requests while /ready says 503, so that a load "
        "balancer still sending to this pod (endpoint removal lags the signal) loses nothing",
    )
    a = p.add_argument_group("authentication")
    a.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="the deployment token its pdfleet workers require (the first line is sent; re-read when the "
        "file changes); also required on /workers, which lists worker addresses",
    )
    a.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="client API keys, one per line (re-read when the file changes): /v1/* needs "
        "`Authorization: Bearer KEY` (401 invalid_api_key otherwise, counted); /health, /ready and "
        "/metrics stay open",
    )
    a.add_argument(
        "--api-key-file-optional",
        action="store_true",
        help="a missing --api-key-file requires no key until it appears (a Kubernetes Secret volume "
        "marked optional); without this flag a missing file is an error",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=10.0,
        help="seconds a stream may wait for its next event (a worker, a prefill, a queue) before the client "
        "gets an SSE comment `: keep-alive`, repeated each interval (0: never); the first token's "
        "status waits up to one interval, so a fast error still gets its real code",
    )
    p.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="a disaggregated tier's request whose prompt has fewer than N tokens goes straight to a "
        "decode worker, which computes the prompt itself (PD buys nothing for a short prompt and "
        "pays the KV hand-off); counted by pdfleet_router_pd_routes_total. Tokens: the model's "
        "tokenizer with --route-tokenizer, else an estimate of 4 characters per token (0: off)",
    )
    r = p.add_argument_group("query routing (to a smaller model's router)")
    r.add_argument(
        "--route-to",
        metavar="URL",
        help="the router of the deployment that serves requests judged simple (every rule given holds, "
        "and the classifier, if any, is confident enough); it answers them, and what it refuses "
        "before a byte reached the client is served here",
    )
    r.add_argument("--route-max-prompt-tokens", type=int, metavar="N", help="simple: a prompt of at most N tokens")
    r.add_argument("--route-max-prompt-chars", type=int, metavar="N", help="simple: a prompt of at most N characters")
    r.add_argument(
        "--route-max-tokens",
        type=int,
        metavar="N",
        help="simple: max_tokens (or max_completion_tokens) set and at most N",
    )
    r.add_argument(
        "--route-pattern",
        action="append",
        default=[],
        metavar="REGEX",
        help="simple: the prompt matches one of these (Python re.search; repeat the flag)",
    )
    r.add_argument(
        "--route-exclude-pattern",
        action="append",
        default=[],
        metavar="REGEX",
        help="never simple: the prompt matches one of these",
    )
    r.add_argument(
        "--route-classifier",
        metavar="MODULE:FUNCTION",
        help="called with a routing.RouteRequest for requests that pass the rules; returns the confidence "
        "in [0, 1] that the request is simple",
    )
    r.add_argument(
        "--route-confidence-floor",
        type=float,
        default=0.5,
        help="a classifier confidence below this is served here (default 0.5)",
    )
    r.add_argument("--route-classifier-timeout", type=float, default=1.0, help="seconds the classifier may take")
    r.add_argument("--route-tokenizer", metavar="DIR", help="model directory whose tokenizer.json counts prompt tokens")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def from_args(args: argparse.Namespace) -> RouterConfig:
    listed = {role: getattr(args, role) for role in ("prefill", "decode", "workers")}
    workers_file = getattr(args, "workers_file", None)
    if workers_file:
        if any(listed.values()):
            raise ValueError("--workers-file replaces --prefill/--decode/--workers: give one or the other")
        listed = {role: wf.read(workers_file).get(role, []) for role in listed}
    tiers: dict[str, TierConfig] = {}
    for role, values in listed.items():
        for value in values:
            name, rest = split_tier(value)
            engine, url = engines.split_engine(rest, args.engine)
            url = url.rstrip("/")
            tier = tiers.setdefault(name, TierConfig(name))
            if tier.engines.setdefault(url, engine) != engine:
                raise ValueError(f"tier {name!r}: {url} is listed as both {tier.engines[url]} and {engine}")
            getattr(tier, role).append(url)
    aliases = {}
    for value in args.model_alias:
        alias, sep, tier = value.partition("=")
        if not sep or not alias or not tier:
            raise ValueError(f"--model-alias {value!r}: expected ALIAS=TIER")
        aliases[alias] = tier
    default = args.default_tier or (DEFAULT_TIER if DEFAULT_TIER in tiers else next(iter(tiers), DEFAULT_TIER))
    return RouterConfig(
        tiers=tiers,
        default_tier=default,
        host=args.host,
        port=args.port,
        discovery=args.discovery,
        workers_file=workers_file,
        engine=args.engine,
        namespace=args.namespace,
        discovery_interval_s=args.discovery_interval,
        health_interval_s=args.health_interval,
        max_retries=args.max_retries,
        connect_timeout_s=args.connect_timeout,
        upstream_timeout_s=args.upstream_timeout,
        tier_header=args.tier_header.lower(),
        aliases=aliases,
        max_request_bytes=args.max_request_bytes,
        retry_after_s=args.retry_after,
        drain_timeout_s=args.drain_timeout,
        drain_accept_s=getattr(args, "drain_accept", 0.0),
        auth_token_file=getattr(args, "auth_token_file", None),
        api_key_file=getattr(args, "api_key_file", None),
        api_key_file_optional=getattr(args, "api_key_file_optional", False),
        heartbeat_interval_s=getattr(args, "heartbeat_interval", 10.0),
        pd_min_prompt_tokens=getattr(args, "pd_min_prompt_tokens", 0),
        route_to=getattr(args, "route_to", None),
        route_rules=routing.Rules(
            max_prompt_tokens=getattr(args, "route_max_prompt_tokens", None),
            max_prompt_chars=getattr(args, "route_max_prompt_chars", None),
            max_tokens=getattr(args, "route_max_tokens", None),
            patterns=tuple(getattr(args, "route_pattern", None) or ()),
            exclude_patterns=tuple(getattr(args, "route_exclude_pattern", None) or ()),
        ),
        route_classifier=getattr(args, "route_classifier", None),
        route_confidence_floor=getattr(args, "route_confidence_floor", 0.5),
        route_classifier_timeout_s=getattr(args, "route_classifier_timeout", 1.0),
        route_tokenizer=getattr(args, "route_tokenizer", None),
    )

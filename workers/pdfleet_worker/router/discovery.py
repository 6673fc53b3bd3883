"""Worker discovery: a URL as given, every address DNS has for its host (a headless Service), or a Service's ready
EndpointSlice endpoints, each source of one engine; the upstream set refreshes them."""

from __future__ import annotations

import abc
import ipaddress
import os
import socket
from typing import Any
from urllib.parse import urlsplit

from pdfleet_worker.router import engines

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def base_url(scheme: str, host: str, port: int) -> str:
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _split(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    assert parts.hostname, f"{url!r} has no host"
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class Source(abc.ABC):
    """Where the workers behind one configured URL are, and which engine they run; resolve() blocks (run it
    in a thread)."""

    def __init__(self, url: str, engine: str = engines.PDFLEET):
        self.url = url
        self.engine = engine

    @abc.abstractmethod
    def resolve(self) -> set[str]:
        """Base URLs (scheme://host:port) of the workers now; raises OSError when it cannot tell."""


class Static(Source):
    def resolve(self) -> set[str]:
        scheme, host, port = _split(self.url)
        return {base_url(scheme, host, port)}


class Dns(Source):
    """Every A/AAAA record of the host: a headless Service answers with each ready pod's IP."""

    def resolve(self) -> set[str]:
        scheme, host, port = _split(self.url)
        if is_ip(host):
            return {base_url(scheme, host, port)}
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        return {base_url(scheme, info[4][0], port) for info in infos}


def endpoints_from_slices(slices: list[dict[str, Any]], port: int, scheme: str = "http") -> set[str]:
    """Ready endpoints of EndpointSlices (as JSON dicts). The port is the slice's `http` port, its
    only port, or else the URL's (a headless Service's port and target port are usually equal)."""
    out: set[str] = set()
    for sl in slices:
        ports = sl.get("ports") or []
        chosen = next((p.get("port") for p in ports if p.get("name") == "http"), None)
        if chosen is None and len(ports) == 1:
            chosen = ports[0].get("port")
        for ep in sl.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for addr in ep.get("addresses") or []:
                out.add(base_url(scheme, addr, chosen or port))
    return out


class EndpointSlices(Source):
    """The Service's EndpointSlices through the Kubernetes API (in-cluster config, else kubeconfig)."""

    def __init__(self, url: str, namespace: str | None = None, engine: str = engines.PDFLEET):
        super().__init__(url, engine)
        try:
            import kubernetes
        except ImportError:
            raise ValueError(
                "--discovery endpointslices needs the kubernetes Python client, which is not installed "
                "(pip install kubernetes), or use --discovery dns with the headless Service"
            ) from None
        scheme, host, port = _split(url)
        labels = host.split(".")
        self.service = labels[0]
        self.namespace = labels[1] if len(labels) > 1 and labels[1] != "svc" else (namespace or _own_namespace())
        self.scheme, self.port = scheme, port
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        self._api = kubernetes.client.DiscoveryV1Api()
        self._client = kubernetes.client.ApiClient()

    def resolve(self) -> set[str]:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self._api.list_namespaced_endpoint_slice(
                self.namespace, label_selector=f"kubernetes.io/service-name={self.service}"
            )
        except ApiException as e:
            raise OSError(f"listing EndpointSlices of {self.namespace}/{self.service}: {e.status} {e.reason}") from e
        slices = [self._client.sanitize_for_serialization(item) for item in resp.items]
        return endpoints_from_slices(slices, self.port, self.scheme)


def _own_namespace() -> str:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip()
    except OSError:
        return "default"


def make_source(url: str, mode: str, namespace: str | None = None, engine: str = engines.PDFLEET) -> Source:
    if mode == "endpointslices":
        return EndpointSlices(url, namespace, engine)
    if mode == "auto":
        _, host, _ = _split(url)
        mode = "static" if is_ip(host) else "dns"
    return Static(url, engine) if mode == "static" else Dns(url, engine)

"""Fake workers for metrics tests: each serves one replica's vLLM-compatible queue series, set by the test, and names
the target labels Prometheus (static_config) and the scrape source (ScrapeTarget) attach to them."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.prometheus import ScrapeTarget
from tests.support.components import free_port


class WorkerExporter:
    """One worker replica's /metrics (classic text format), whose queue numbers the test plays."""

    def __init__(
        self,
        deployment: str,
        role: str,
        namespace: str = "default",
        model: str = "tiny",
        prompt_tokens_gauge: bool = True,
        accelerator: str | None = None,
    ) -> None:
        """`accelerator`: the AcceleratorClass a PodMonitor (or `pdfleet up`) puts on the target as
        `pdfleet_accelerator`; None for a target without it. The series themselves carry only `model_name`,
        as vLLM's do: every label the sources select on is a target label."""
        self.deployment, self.role, self.namespace, self.accelerator = deployment, role, namespace, accelerator
        self.registry = CollectorRegistry()
        labels, values = [names.LABEL_MODEL], [model]
        self.waiting = Gauge(names.NUM_REQUESTS_WAITING, "waiting", labels, registry=self.registry).labels(*values)
        self.running = Gauge(names.NUM_REQUESTS_RUNNING, "running", labels, registry=self.registry).labels(*values)
        self.kv = Gauge(names.KV_CACHE_USAGE, "kv usage", labels, registry=self.registry).labels(*values)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS_TOTAL, "prompt tokens", labels, registry=self.registry).labels(
            *values
        )
        self.generation_tokens = Counter(
            names.GENERATION_TOKENS_TOTAL, "generated tokens", labels, registry=self.registry
        ).labels(*values)
        self.prompt_tokens_waiting = (
            Gauge(names.PROMPT_TOKENS_WAITING, "prompt tokens waiting", labels, registry=self.registry).labels(*values)
            if prompt_tokens_gauge
            else None
        )
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def play(self, waiting: float, running: float = 0.0, kv: float = 0.0, prompt_tokens_waiting: float = 0.0) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv.set(kv)
        if self.prompt_tokens_waiting is not None:
            self.prompt_tokens_waiting.set(prompt_tokens_waiting)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def target_labels(self) -> dict[str, str]:
        """The target labels a PodMonitor puts on a worker pod (no accelerator label when it has none)."""
        labels = names.target_labels(self.namespace, self.deployment, self.role, self.accelerator or "")
        return {k: v for k, v in labels.items() if v}

    def static_config(self) -> dict:
        """A Prometheus static_config with those target labels."""
        return {"targets": [self.address], "labels": self.target_labels()}

    def scrape_target(self, engine: str = "pdfleet") -> ScrapeTarget:
        """The same replica for the direct-scrape source."""
        return ScrapeTarget(self.url, self.target_labels(), engine)


def scrape_config(exporters: list[WorkerExporter], interval: str = "1s") -> dict:
    return {
        "job_name": "pdfleet-workers",
        "scrape_interval": interval,
        "static_configs": [e.static_config() for e in exporters],
    }

"""The worker's Prometheus registry: engine snapshots become gauges and counters at scrape time, step stats feed
histograms; the server and PD code record into it."""

from __future__ import annotations

from collections.abc import Callable

from pdfleet_worker import metrics as m
from pdfleet_worker.engine.stats import EngineStats, IterationStats
from pdfleet_worker.kv_transfer import connector as c


class WorkerMetrics:
    def __init__(
        self,
        model_name: str,
        role: str,
        accelerator: str,
        stats: Callable[[], EngineStats],
        leases: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
    ):
        """stats: the latest EngineStats; leases: (active, expired total, released total)."""
        self.registry = m.new_registry()
        self.base = {m.LABEL_MODEL: model_name, m.LABEL_ROLE: role, m.LABEL_ACCELERATOR: accelerator}
        self._stats = stats
        self._leases = leases
        self._hist = {
            spec.name: m.make(spec, self.registry).labels(**self.base)
            for spec in (
                m.TIME_TO_FIRST_TOKEN,
                m.INTER_TOKEN_LATENCY,
                m.E2E_REQUEST_LATENCY,
                m.REQUEST_QUEUE_TIME,
                m.REQUEST_PROMPT_TOKENS,
                m.REQUEST_GENERATION_TOKENS,
                m.KV_TRANSFER_SECONDS,
            )
        }
        self._kv_bytes = m.make(m.KV_TRANSFER_BYTES_TOTAL, self.registry)
        self._kv_failures = m.make(m.KV_TRANSFER_FAILURES_TOTAL, self.registry)
        self._rejections = m.make(m.ADMISSION_REJECTIONS_TOTAL, self.registry)
        # Series that exist from the start, so rate() and absent() behave before the first event.
        for direction in ("sent", "received"):
            self._kv_bytes.labels(**self.base, direction=direction)
        for reason in (
            c.CONNECT,
            c.TIMEOUT,
            c.PEER_CLOSED,
            c.INCOMPATIBLE,
            c.WEIGHTS_MISMATCH,
            c.UNKNOWN_REQUEST,
            c.PROMPT_MISMATCH,
            c.BAD_RESPONSE,
            c.UNSUPPORTED,
            c.UNAUTHORIZED,
            c.UNTRUSTED_PEER,
        ):
            self._kv_failures.labels(**self.base, reason=reason)
        for reason in ("queue_full", "draining"):
            self._rejections.labels(**self.base, reason=reason)
        self.registry.register(m.SnapshotCollector(self._snapshot))

    # -- recording (any thread) -----------------------------------------------------------------
    def observe(self, it: IterationStats) -> None:
        h = self._hist
        for v in it.ttfts_s:
            h[m.TIME_TO_FIRST_TOKEN.name].observe(v)
        for v in it.inter_token_latencies_s:
            h[m.INTER_TOKEN_LATENCY.name].observe(v)
        for f in it.finished:
            h[m.E2E_REQUEST_LATENCY.name].observe(f.e2e_latency_s)
            h[m.REQUEST_QUEUE_TIME.name].observe(f.queue_time_s)
            h[m.REQUEST_PROMPT_TOKENS.name].observe(f.num_prompt_tokens)
            h[m.REQUEST_GENERATION_TOKENS.name].observe(f.num_output_tokens)

    def kv_pulled(self, nbytes: int, seconds: float) -> None:
        self._kv_bytes.labels(**self.base, direction="received").inc(nbytes)
        self._hist[m.KV_TRANSFER_SECONDS.name].observe(seconds)

    def kv_sent(self, nbytes: int) -> None:
        self._kv_bytes.labels(**self.base, direction="sent").inc(nbytes)

    def kv_failure(self, reason: str) -> None:
        self._kv_failures.labels(**self.base, reason=reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejections.labels(**self.base, reason=reason).inc()

    def exposition(self) -> bytes:
        return m.exposition(self.registry)

    # -- scrape time ----------------------------------------------------------------------------
    def _snapshot(self) -> list:
        s = self._stats()
        active, expired, released = self._leases()
        labels = list(self.base)
        values = list(self.base.values())
        out = []

        def one(spec: m.MetricSpec, value: float) -> None:
            fam = m.family(spec, labels)
            fam.add_metric(values, value)
            out.append(fam)

        one(m.NUM_REQUESTS_WAITING, s.num_requests_waiting)
        one(m.NUM_REQUESTS_RUNNING, s.num_requests_running)
        one(m.KV_CACHE_USAGE, s.kv_cache_usage)
        one(m.PROMPT_TOKENS_TOTAL, s.prompt_tokens_total)
        one(m.GENERATION_TOKENS_TOTAL, s.generation_tokens_total)
        one(m.NUM_PREEMPTIONS_TOTAL, s.num_preemptions_total)
        one(m.DEFERRED_PREFILLS_TOTAL, s.num_deferred_prefills_total)
        one(m.PREFIX_CACHE_QUERIES_TOTAL, s.prefix_cache_queries_total)
        one(m.PREFIX_CACHE_HITS_TOTAL, s.prefix_cache_hits_total)
        one(m.PROMPT_TOKENS_WAITING, s.num_prompt_tokens_waiting)
        one(m.NUM_REQUESTS_WAITING_FOR_REMOTE_KV, s.num_requests_waiting_for_remote_kv)
        one(m.KV_BLOCKS_HELD, s.num_held_blocks)
        one(m.KV_LEASES_ACTIVE, active)
        one(m.KV_LEASES_EXPIRED_TOTAL, expired)
        one(m.KV_LEASES_RELEASED_TOTAL, released)
        self._offload_families(s, labels, values, out)
        fam = m.family(m.REQUEST_SUCCESS_TOTAL)
        for reason, count in sorted(s.request_success_total.items()):
            fam.add_metric(values + [reason], count)
        out.append(fam)
        return out

    @staticmethod
    def _offload_families(s, labels: list[str], values: list[str], out: list) -> None:
        """Tiered KV offload and swap series, every tier always (zeros when off)."""

        def per_tier(spec: m.MetricSpec, value) -> None:
            fam = m.family(spec, labels + [m.LABEL_TIER])
            for tier in ("host", "disk"):
                st = s.kv_offload.get(tier)
                fam.add_metric(values + [tier], value(tier, st))
            out.append(fam)

        per_tier(m.KV_OFFLOAD_HITS_TOTAL, lambda t, st: st.hits if st else 0)
        per_tier(m.KV_OFFLOAD_RECOMPUTED_TOTAL, lambda t, st: st.recomputed if st else 0)
        per_tier(m.KV_OFFLOAD_EVICTIONS_TOTAL, lambda t, st: st.evictions if st else 0)
        per_tier(m.KV_OFFLOAD_USAGE, lambda t, st: s.kv_offload_usage.get(t, 0.0))
        per_tier(m.KV_OFFLOAD_CAPACITY_BYTES, lambda t, st: s.kv_offload_blocks.get(t, 0) * s.kv_block_bytes)
        fam = m.family(m.KV_OFFLOAD_BYTES_TOTAL, labels + [m.LABEL_TIER, m.LABEL_DIRECTION])
        for tier in ("host", "disk"):
            st = s.kv_offload.get(tier)
            fam.add_metric(values + [tier, "stored"], st.bytes_in if st else 0)
            fam.add_metric(values + [tier, "loaded"], st.bytes_out if st else 0)
        out.append(fam)
        for spec, value in (
            (m.PREEMPTIONS_SWAPPED_TOTAL, s.swap.swapped_out),
            (m.PREEMPTION_SWAP_FALLBACKS_TOTAL, s.swap.fallbacks),
            (m.SWAP_SPACE_USAGE, s.swap_space_usage),
            (m.NUM_REQUESTS_SWAPPED, s.num_requests_swapped),
        ):
            fam = m.family(spec, labels)
            fam.add_metric(values, value)
            out.append(fam)
        fam = m.family(m.SWAP_BYTES_TOTAL, labels + [m.LABEL_DIRECTION])
        fam.add_metric(values + ["sent"], s.swap.blocks_out * s.kv_block_bytes)
        fam.add_metric(values + ["received"], s.swap.blocks_in * s.kv_block_bytes)
        out.append(fam)

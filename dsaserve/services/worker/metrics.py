"""Prometheus metrics of a prefill or decode worker, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from dsaserve.engine.load import Load
from dsaserve.engine.prefix_cache.cache import CacheStats
from dsaserve.engine.speculative.stats import SpecDecodeStats
from dsaserve.services.metrics import E2E_BUCKETS

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class WorkerMetrics:
    def __init__(
        self,
        role: str,
        load: Callable[[], Load],
        cache: Callable[[], CacheStats],
        spec: SpecDecodeStats | None = None,
        model: Callable[[], Mapping[str, tuple[str, int]]] | None = None,
    ) -> None:
        """load: the engine's load after its last step; cache: its prefix cache's counts (read
        on the scraping thread: plain ints the engine thread only adds to); spec: speculative
        decoding's counters (None: off); model: the model's own counters (engine.runner.Model
        .counters: V4.1's Engram lookups and device-cache hits)."""
        self.registry = r = CollectorRegistry()
        labels = {"role": role}
        for name, doc, field in (
            ("dsaserve_requests_running", "Requests in the running batch", "running"),
            ("dsaserve_requests_waiting", "Requests queued for admission", "waiting"),
            ("dsaserve_requests_held", "Prefilled requests whose KV waits for a reader", "held"),
            ("dsaserve_kv_pages_free", "Free KV pages over all pools", "free_pages"),
            ("dsaserve_kv_pages_total", "KV pages over all pools", "total_pages"),
            (
                "dsaserve_kv_pages_cached",
                "KV pages held only by the prefix cache (free + cached = total when idle)",
                "cached_pages",
            ),
        ):
            Gauge(name, doc, labels.keys(), registry=r).labels(**labels).set_function(
                _reader(load, field)
            )
        self.requests = Counter(
            "dsaserve_worker_requests_total",
            "Requests handled, by outcome",
            ["role", "outcome"],
            registry=r,
        )
        self.tokens = Counter(
            "dsaserve_worker_tokens_total", "Tokens computed, by kind", ["role", "kind"], registry=r
        )
        self.latency = Histogram(
            "dsaserve_worker_request_seconds",
            "Time a request spends on this worker",
            ["role"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "dsaserve_kv_transfer_bytes_total", "KV bytes pulled from prefill workers", registry=r
        )
        self.pulled_pages = Counter(
            "dsaserve_kv_pulled_pages_total",
            "KV pages pulled from prefill workers (every pool group; slab rows not counted)",
            registry=r,
        )
        self.reused_pages = Counter(
            "dsaserve_kv_reused_pages_total",
            "KV pages of pulled requests shared from this worker's prefix cache instead (a "
            "conversation's earlier turns decoded here)",
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "dsaserve_kv_transfer_seconds",
            "Duration of one KV pull",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "dsaserve_worker_failures_total",
            "Failed requests, by cause",
            ["role", "cause"],
            registry=r,
        )
        r.register(PrefixCacheCollector(role, cache))
        if spec is not None:
            r.register(SpecDecodeCollector(role, spec))
        if model is not None:
            r.register(ModelCollector(role, model))
        self.role = role

    def fail(self, cause: str) -> None:
        self.failures.labels(role=self.role, cause=cause).inc()


class PrefixCacheCollector:
    """The prefix cache's counters, as vLLM counts its own: prompt tokens looked up, of those
    resumed from the cache, and checkpoints evicted."""

    def __init__(self, role: str, stats: Callable[[], CacheStats]) -> None:
        self._role, self._stats = role, stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, value in (
            (
                "dsaserve_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats.queries,
            ),
            (
                "dsaserve_prefix_cache_hits",
                "Prompt tokens resumed from the prefix cache",
                stats.hits,
            ),
            (
                "dsaserve_prefix_cache_evictions",
                "Prefix-cache checkpoints evicted",
                stats.evictions,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self._role], value)
            yield family


class ModelCollector:
    """A model's own counters (engine.runner.Model.counters) as dsaserve_<name>_total."""

    def __init__(self, role: str, counters: Callable[[], Mapping[str, tuple[str, int]]]) -> None:
        self._role, self._counters = role, counters

    def collect(self) -> Iterator[Metric]:
        for name, (doc, value) in self._counters().items():
            family = CounterMetricFamily(f"dsaserve_{name}", doc, labels=["role"])
            family.add_metric([self._role], value)
            yield family


class SpecDecodeCollector:
    """Speculative decoding's counters in vLLM's shape (its spec_decode_* metrics): steps that
    verified drafts (per request), draft tokens, accepted tokens, acceptances per position.
    Mean acceptance length = 1 + accepted / drafts."""

    def __init__(self, role: str, stats: SpecDecodeStats) -> None:
        self._role, self._stats = role, stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        for name, doc, value in (
            ("num_drafts", "Verifications of a request's drafts", stats.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed", stats.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens),
        ):
            family = CounterMetricFamily(f"dsaserve_spec_decode_{name}", doc, labels=["role"])
            family.add_metric([self._role], value)
            yield family
        for name, doc, values in (
            (
                "num_accepted_tokens_per_pos",
                "Draft tokens accepted, by their position in the draft (0 = the first)",
                stats.accepted_per_pos,
            ),
            (
                "num_draft_tokens_per_pos",
                "Draft tokens verified, by their position in the draft (fewer than the drafts "
                "when adaptive verification cuts them)",
                stats.drafts_per_pos,
            ),
        ):
            family = CounterMetricFamily(
                f"dsaserve_spec_decode_{name}", doc, labels=["role", "position"]
            )
            for position, value in enumerate(list(values)):
                family.add_metric([self._role, str(position)], value)
            yield family


def _reader(load: Callable[[], Load], field: str) -> Callable[[], float]:
    """What a gauge reads: one field of the engine's load, read when scraped."""
    return lambda: getattr(load(), field)

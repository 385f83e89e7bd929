"""Prometheus metrics of one engine: latencies, queue depths, KV pages, prefix-cache hits."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)
# A request's phases (engine/phase_timing.py, router/phases.py): tens of microseconds to seconds.
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0)
HOST_LOAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class EngineMetrics:
    """Owns a registry (one per engine, so several engines can live in one process)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model"]
        r = self.registry
        self.ttft = Histogram("splitserve_time_to_first_token_seconds", "Time to first token",
                              labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("splitserve_inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("splitserve_request_latency_seconds", "Arrival to finish",
                             labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.running = Gauge("splitserve_requests_running", "Requests in the batch", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge("splitserve_requests_waiting", "Requests queued for admission", labels,
                             registry=r).labels(model_name)
        self.kv_used = Gauge("splitserve_kv_pages_used", "KV pages held by requests", labels,
                             registry=r).labels(model_name)
        self.kv_free = Gauge("splitserve_kv_pages_free", "KV pages free or evictable", labels,
                             registry=r).labels(model_name)
        self.kv_fenced = Gauge("splitserve_kv_pages_fenced", "KV pages of failed transfers held until no write "
                               "for them can land (decode)", labels, registry=r).labels(model_name)
        self.prefix_hit_rate = Gauge("splitserve_prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens queried",
                                     labels, registry=r).labels(model_name)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens admitted", labels,
                                     registry=r).labels(model_name)
        self.prompt_tokens_computed = Counter(
            "splitserve_prompt_tokens_computed", "Prompt tokens run through the model (not taken from the prefix "
            "cache; a preempted request's recomputed prompt counts again)", labels, registry=r).labels(model_name)
        self.preemptions = Counter("splitserve_preemptions", "Running requests preempted to free KV pages (each "
                                   "computed again from the prefix cache when readmitted)", labels,
                                   registry=r).labels(model_name)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens generated", labels,
                                         registry=r).labels(model_name)
        # Speculative decoding (a verifier: decode, or unified with drafters).
        self.spec_draft_tokens = Counter("splitserve_spec_draft_tokens", "Draft tokens received and verified",
                                         labels, registry=r).labels(model_name)
        self.spec_accepted_tokens = Counter("splitserve_spec_accepted_tokens", "Draft tokens accepted",
                                            labels, registry=r).labels(model_name)
        self.spec_acceptance_length = Histogram(
            "splitserve_spec_acceptance_length", "Draft tokens accepted per verified request and step", labels,
            buckets=tuple(range(17)), registry=r).labels(model_name)
        self.spec_fallbacks = Counter("splitserve_spec_fallbacks",
                                      "Requests dropped to plain decoding because their drafter was lost",
                                      labels, registry=r).labels(model_name)
        self.spec_quarantines = Counter("splitserve_spec_quarantines",
                                        "Requests a drafter quarantined after a protocol violation",
                                        labels, registry=r).labels(model_name)
        # The speculation gate's decisions (draft_mesh/speculation_gate.py; its per-bucket state on /health).
        self.spec_gate_speculating = Gauge("splitserve_spec_gate_speculating",
                                           "1 while the speculation gate speculates, 0 while it decodes plainly",
                                           labels, registry=r).labels(model_name)
        self.spec_gate_switches = Counter("splitserve_spec_gate_switches",
                                          "Switches of the speculation gate, by the mode switched to and why",
                                          [*labels, "mode", "reason"], registry=r)
        self.spec_gate_saved_seconds = Gauge(
            "splitserve_spec_gate_saved_seconds", "Decoding seconds speculating saved against plain decoding's "
            "measured rate, all batch buckets (negative: lost)", labels, registry=r).labels(model_name)
        # The host-memory KV tier (--host-kv-tokens; engine/host_kv.py).
        self.host_kv_hit_tokens = Counter("splitserve_host_kv_hit_tokens", "Prompt tokens whose KV pages were "
                                          "loaded from the host tier instead of computed", labels,
                                          registry=r).labels(model_name)
        self.host_kv_written_bytes = Counter("splitserve_host_kv_written_bytes", "Bytes of evicted KV pages "
                                             "written back to the host tier", labels, registry=r).labels(model_name)
        self.host_kv_loaded_bytes = Counter("splitserve_host_kv_loaded_bytes", "Bytes of KV pages loaded from the "
                                            "host tier into device pages", labels, registry=r).labels(model_name)
        self.host_kv_load_seconds = Histogram("splitserve_host_kv_load_seconds", "A host-tier load, issued to done "
                                              "(as the engine loop saw it)", labels, buckets=HOST_LOAD_BUCKETS,
                                              registry=r).labels(model_name)
        self.host_kv_pages = Gauge("splitserve_host_kv_pages", "KV pages the host tier holds", labels,
                                   registry=r).labels(model_name)
        self.host_kv_capacity_pages = Gauge("splitserve_host_kv_capacity_pages", "KV pages the host tier can hold",
                                            labels, registry=r).labels(model_name)
        # The shared store tier (--kv-store; engine/store_kv.py).
        self.kv_store_hit_tokens = Counter("splitserve_kv_store_hit_tokens", "Prompt tokens whose KV pages were "
                                           "loaded from the shared store instead of computed", labels,
                                           registry=r).labels(model_name)
        self.kv_store_written_bytes = Counter("splitserve_kv_store_written_bytes", "Bytes of KV pages written "
                                              "through to the store", labels, registry=r).labels(model_name)
        self.kv_store_read_bytes = Counter("splitserve_kv_store_read_bytes", "Bytes of KV pages read from the store "
                                           "into device pages", labels, registry=r).labels(model_name)
        self.kv_store_load_seconds = Histogram("splitserve_kv_store_load_seconds", "A store load: lookup, read and "
                                               "copy into device pages", labels, buckets=HOST_LOAD_BUCKETS,
                                               registry=r).labels(model_name)
        self.kv_store_failures = Counter("splitserve_kv_store_failures", "Store calls that failed or timed out "
                                         "(each takes the store out of use for a backoff)", labels,
                                         registry=r).labels(model_name)
        self.kv_store_dropped_pages = Counter("splitserve_kv_store_dropped_pages", "Write-throughs dropped: the store "
                                              "out of use, or the staging buffer full", labels,
                                              registry=r).labels(model_name)
        self.kv_store_up = Gauge("splitserve_kv_store_up", "1 while the store is set up and its last call "
                                 "succeeded", labels, registry=r).labels(model_name)
        self.kv_store_busy = Gauge("splitserve_kv_store_busy", "1 while the store worker has calls queued or "
                                   "running (write-throughs are asynchronous: a page put is readable once it is 0)",
                                   labels, registry=r).labels(model_name)
        self._phase_seconds = Histogram("splitserve_phase_seconds", "A request's time to first token as this engine "
                                        "saw it, by phase (engine/phase_timing.py)", [*labels, "phase"],
                                        buckets=PHASE_BUCKETS, registry=r)
        self._finished = Counter("splitserve_requests_finished", "Requests finished, by reason",
                                 [*labels, "reason"], registry=r)
        self.model_name = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def phase(self, phase: str, seconds: float) -> None:
        self._phase_seconds.labels(self.model_name, phase).observe(seconds)


def observe_times(histogram: Histogram, amount: float, times: int) -> None:
    """`histogram.observe(amount)` `times` times over, as one update of its sum and bucket (a step's
    inter-token gaps are mostly one value: a few hundred observations cost one). Falls back to
    observing one by one if the client library's histogram is not laid out as expected."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for _ in range(times):
            histogram.observe(amount)
        return
    total.inc(amount * times)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(times)
            break

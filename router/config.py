"""``RouterConfig``: where the engines are, how hard to try them, and the router's limits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterConfig:
    """Where the engines are and how to reach them."""

    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    prefill: list[str] = field(default_factory=list, metadata={"help": "prefill engine URLs"})
    decode: list[str] = field(default_factory=list, metadata={"help": "decode engine URLs"})
    unified: list[str] = field(default_factory=list, metadata={"help": "unified engine URLs (data parallel)"})
    encode: list[str] = field(default_factory=list, metadata={
        "help": "encode engine URLs: each image goes to one (by a hash of its bytes) before prefill"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "upstream read timeout"})
    connect_timeout_s: float = field(default=3.0, metadata={"help": "upstream connect timeout"})
    upstream_keepalive_expiry_s: float = field(default=3.0, metadata={
        "help": "seconds an idle connection to an engine stays pooled for reuse; keep it below the engines' "
                "keep-alive timeout (uvicorn's 5 s) so the router never reuses a connection the "
                "engine is closing"})
    client_keepalive_s: float = field(default=65.0, metadata={
        "help": "seconds the router keeps a client's idle connection open: longer than clients keep idle connections "
                "in their pools (httpx and the OpenAI SDK: 5 s), so a client never reuses one the router is closing"})
    retries: int = field(default=2, metadata={
        "help": "retries on other backends (another decode and another prefill) before the first token"})
    transfer_control_key: str = field(default="", metadata={
        "help": "the group's key (the engines' --transfer-control-key): signs each pair's bootstrap fields "
                "(bootstrap_signature); empty: unsigned, for engines without a key"})
    health_interval_s: float = field(default=1.0, metadata={"help": "seconds between /health probes"})
    health_timeout_s: float = field(default=2.0, metadata={"help": "a probe with no answer by then fails"})
    eject_backoff_s: float = field(default=0.5, metadata={
        "help": "first wait before an ejected backend is probed again (doubles per failure)"})
    eject_backoff_max_s: float = field(default=5.0, metadata={"help": "longest wait between probes of one"})
    backend_wait_s: float = field(default=30.0, metadata={
        "help": "seconds a request waits for a healthy engine of its role when there is none (engines still "
                "loading, an engine restarting after a crash, a failed request's probe pending), then 503 with "
                "Retry-After; a request that failed before its first token may go back to an engine that failed "
                "it once that engine passes a probe again; 0: the 503 at once"})
    max_in_flight: int = field(default=1024, metadata={
        "help": "requests the router takes at once; past it, 503 with Retry-After"})
    max_in_flight_per_backend: int = field(default=256, metadata={
        "help": "requests in flight on one engine; when every healthy one is full, a request waits for a slot "
                "(--queue-timeout-s)"})
    queue_timeout_s: float = field(default=60.0, metadata={
        "help": "seconds a request waits for a slot when every healthy engine of its role is full (first come, "
                "first served; those waiting count against --max-in-flight), then 503 with Retry-After; 0: the 503 "
                "at once"})
    retry_after_s: int = field(default=1, metadata={"help": "the Retry-After of a 503 for a full router"})
    routing: str = field(default="cache-aware", metadata={
        "help": "how a unified replica or a prefill engine is chosen: cache-aware (where the longest cached prefix "
                "of the prompt is, balanced against load; see docs/routing.md) or least-loaded (fewest requests in "
                "flight, ties in turn)", "choices": ("cache-aware", "least-loaded")})
    cache_aware_max_load_tokens: int = field(default=16384, metadata={
        "help": "cache-aware: a backend whose in-flight prompt tokens (uncached) reach this is saturated and "
                "loses its stickiness; the request goes where it adds least work"})
    kv_events_interval_s: float = field(default=0.05, metadata={
        "help": "cache-aware: seconds between polls of each engine's page events"})
    approximate_cache_pages: int = field(default=1 << 17, metadata={
        "help": "cache-aware, for engines that publish no page events: pages remembered per engine from the "
                "prompts sent to it"})
    api_key: str = field(default="", metadata={
        "help": "a key clients must send as 'Authorization: Bearer KEY' on /v1/* (empty, and no --api-key-file: "
                "open); prefer the environment variable to the flag, which other local users can read"})
    api_key_file: str = field(default="", metadata={
        "help": "a file of client keys, one per line (a mounted Kubernetes Secret); read again when it changes"})
    kube_group: str = field(default="", metadata={
        "help": "in a Kubernetes pod: find the prefill and decode engines by watching the Endpoints of this "
                "ServingGroup's role Services (instead of --prefill/--decode URLs)"})
    kube_namespace: str = field(default="", metadata={
        "help": "the group's namespace (default: the pod's own, from its service account)"})
    otel_endpoint: str = field(default="", metadata={
        "help": "an OTLP/HTTP collector (http://host:4318) to export each request's phases to as OpenTelemetry spans "
                "(needs splitserve[otel]); unset: OTEL_EXPORTER_OTLP_ENDPOINT's, else no spans"})

    def __post_init__(self) -> None:
        if self.kube_group and (self.unified or self.prefill or self.decode):
            raise ValueError("--kube-group finds the engines itself: give no engine URLs with it")
        if self.unified and (self.prefill or self.decode):
            raise ValueError("give either --unified URLs or --prefill and --decode URLs, not both")
        if self.encode and self.unified:
            raise ValueError("--encode engines serve prefill engines; a unified engine encodes its images itself")
        if not self.kube_group and not self.unified and not (self.prefill and self.decode):
            raise ValueError("need --prefill and --decode URLs (or --unified URLs, or --kube-group)")
        for name in ("request_timeout_s", "connect_timeout_s", "health_interval_s", "health_timeout_s",
                     "eject_backoff_s", "eject_backoff_max_s", "upstream_keepalive_expiry_s", "client_keepalive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_events_interval_s <= 0 or self.cache_aware_max_load_tokens < 1 or self.approximate_cache_pages < 1:
            raise ValueError("kv_events_interval_s, cache_aware_max_load_tokens and approximate_cache_pages "
                             "must be > 0")
        if self.queue_timeout_s < 0:
            raise ValueError(f"queue_timeout_s must be >= 0, got {self.queue_timeout_s}")
        if self.backend_wait_s < 0:
            raise ValueError(f"backend_wait_s must be >= 0, got {self.backend_wait_s}")
        if self.max_in_flight < 1 or self.max_in_flight_per_backend < 1:
            raise ValueError("max_in_flight and max_in_flight_per_backend must be >= 1")

    @property
    def disaggregated(self) -> bool:
        return not self.unified

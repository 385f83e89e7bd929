"""OpenTelemetry spans of requests' phases, exported over OTLP/HTTP: optional.

`--otel-endpoint URL` (or the standard OTEL_EXPORTER_OTLP_ENDPOINT when the flag is unset) names an OTLP/HTTP
collector; spans go to URL/v1/traces. Without either, nothing of OpenTelemetry is imported. With one and
without the packages (`pip install 'splitserve[otel]'`: opentelemetry-sdk and
opentelemetry-exporter-otlp-proto-http), the process fails at start and says so.

The router opens a request's root span when it receives the request (a child of the client's `traceparent`,
if it sent one), hands its context to the engines as a W3C `traceparent` header, and at the end adds one
child span per phase (router/phases.py). Each engine adds a span of its own part under it, with a child per
phase it saw (engine/phase_timing.py). Spans are built from the stamps after the fact (explicit start and
end times), so tracing adds nothing to the engine loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from splitserve.engine.phase_timing import engine_phases

logger = logging.getLogger(__name__)

STANDARD_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACEPARENT = "traceparent"
PACKAGES = "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http (pip install 'splitserve[otel]')"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for and cannot run (its packages are missing)."""


def otel_endpoint(flag: str, environ: Mapping[str, str] | None = None) -> str:
    """The collector to export to: the flag's, else the standard environment variable's, else none ("")."""
    environ = os.environ if environ is None else environ
    return (flag or environ.get(STANDARD_ENDPOINT_ENV, "")).strip()


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Tracing:
    """A tracer provider of its own (nothing global: several servers may share a process) that batches
    spans to one OTLP/HTTP collector."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise TracingUnavailable(f"--otel-endpoint {endpoint} asks for OpenTelemetry spans, but {PACKAGES} "
                                     f"are not installed ({exc})") from None
        self._trace = trace
        self.endpoint = endpoint.rstrip("/")
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{self.endpoint}/v1/traces")))
        self.tracer = self.provider.get_tracer("splitserve")
        self.propagator = TraceContextTextMapPropagator()
        logger.info("exporting request spans to %s/v1/traces as %s", self.endpoint, service_name)

    @classmethod
    def from_endpoint(cls, endpoint: str, service_name: str) -> Tracing | None:
        """Tracing to `endpoint`, or None without one; raises TracingUnavailable without the packages."""
        return cls(endpoint, service_name) if endpoint else None

    def start(self, name: str, start_s: float, headers: Mapping[str, str] | None = None,
              attributes: dict[str, Any] | None = None) -> Any:
        """A span begun at `start_s`, a child of the `traceparent` in `headers` if there is one."""
        parent = self.propagator.extract(carrier=headers) if headers is not None else None
        return self.tracer.start_span(name, context=parent, start_time=ns(start_s), attributes=attributes)

    def children(self, parent: Any, phases: list[tuple[str, float, float]]) -> None:
        """One ended child span of `parent` per (phase, start, end)."""
        context = self._trace.set_span_in_context(parent)
        for phase, start, end in phases:
            self.tracer.start_span(phase, context=context, start_time=ns(start)).end(end_time=ns(end))

    def headers(self, span: Any) -> dict[str, str]:
        """The W3C `traceparent` (and `tracestate`) that make a receiver's spans children of `span`."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    def end(self, span: Any, end_s: float, error: str | None = None) -> None:
        if error is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end(end_time=ns(end_s))

    def engine_spans(self, role: str, headers: Mapping[str, str], phases: list[tuple[str, float, float]]) -> None:
        """An engine's span of one request (under the router's, by `headers`), with its phases as children."""
        if not phases:
            return
        span = self.start(f"engine.{role}", phases[0][1], headers)
        self.children(span, phases)
        span.end(end_time=ns(max(end for _, _, end in phases)))

    def engine_sink(self, role: str, headers: Mapping[str, str]) -> Callable[[dict[str, float]], None]:
        """What turns one request's stamps (its first output's) into this engine's spans, under the span whose
        `traceparent` is in the request's `headers`."""
        parent = {name: headers[name] for name in (TRACEPARENT, "tracestate") if headers.get(name)}
        return lambda marks: self.engine_spans(role, parent, engine_phases(marks))

    def shutdown(self) -> None:
        """Exports what is batched, then stops."""
        self.provider.shutdown()

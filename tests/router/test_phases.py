"""Where a request's time to first token goes: the engines stamp the points a request passes
(engine/phase_timing.py), the router lays the stamps end to end (router/phases.py) and exports the phases as
Prometheus histograms, as an SSE comment a client asks for, and as OpenTelemetry spans (api/otel.py) under one
trace from the router through the prefill and the decode.

Real processes on the tiny model: a unified engine behind one router, a prefill+decode pair behind another,
every process exporting spans to an OTLP/HTTP collector this test runs on loopback.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from servers import TEST_CONTROL_KEY, LocalDeployment, ServerProcess, free_port

from splitserve.api.openai_protocol import FIRST_TOKEN_EVENT, first_token_marker, first_token_marks
from splitserve.engine.phase_timing import engine_phases
from splitserve.router.phases import COMPUTED_AHEAD, DISAGGREGATED, PHASES_HEADER, UNIFIED, RequestTiming, attribute
from splitserve.router.upstream import event_kind

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "8192", "--max-running-requests", "16", "--device", "cpu",
               "--transfer-control-key", TEST_CONTROL_KEY]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.5", "--transfer-bootstrap-timeout-s", "60"]
REQUESTS = 6

try:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )
    HAVE_OTEL = True
except ImportError:  # the optional extra (splitserve[otel]); scripts/install.sh --test installs it
    HAVE_OTEL = False


# ---- the pieces, on their own ----------------------------------------------------------------------------

def test_phases_are_laid_end_to_end_from_the_stamps() -> None:
    t = RequestTiming(10.0, sent=10.002, first_token=10.050, relayed=10.051,
                      prefill={"taken": 10.004, "bootstrapped": 10.006, "scheduled": 10.010, "shipped": 10.030,
                               "written": 10.034},
                      engine={"taken": 10.003, "admitted": 10.005, "arrived": 10.040, "first_token": 10.041})
    stamps = t.stamps(disaggregated=True)  # bootstrapped before scheduled: the prefill waited for the decode
    assert stamps is not None and [p for p, _ in stamps] == [p for p, _, _ in DISAGGREGATED]
    phases = attribute(t.received, stamps)
    seconds = {p: round(end - start, 6) for p, start, end in phases}
    assert seconds == {"router": 0.002, "intake": 0.002, "decode_admission": 0.002, "prefill_queue": 0.004,
                       "prefill_compute": 0.02, "transfer": 0.004, "kv_notice": 0.006, "first_step": 0.001,
                       "first_token": 0.009, "relay": 0.001}
    assert abs(sum(seconds.values()) - 0.051) < 1e-9
    # A prefill that sends no `written` stamp (an older one): no transfer phase, kv_notice covers it.
    del t.prefill["written"]
    seconds = {p: round(end - start, 6) for p, start, end in attribute(t.received, t.stamps(True) or [])}
    assert "transfer" not in seconds and seconds["kv_notice"] == 0.01 and abs(sum(seconds.values()) - 0.051) < 1e-9
    # The prompt computed while the decode reserved pages: admission is what the KV waited after shipping.
    for bootstrapped, admission in ((10.035, 0.005), (10.030, 0.0)):
        t.prefill = {"taken": 10.004, "scheduled": 10.006, "shipped": 10.030, "bootstrapped": bootstrapped,
                     "written": 10.036}
        stamps = t.stamps(disaggregated=True)
        assert stamps is not None and [p for p, _ in stamps] == [p for p, _, _ in COMPUTED_AHEAD]
        seconds = {p: round(end - start, 6) for p, start, end in attribute(t.received, stamps)}
        assert seconds["prefill_queue"] == 0.002 and seconds["prefill_compute"] == 0.024
        assert seconds["decode_admission"] == admission and seconds["transfer"] == round(0.006 - admission, 6)
        assert seconds["kv_notice"] == 0.004
        assert abs(sum(seconds.values()) - 0.051) < 1e-9
    assert RequestTiming(10.0, sent=10.1, first_token=10.2).stamps(disaggregated=True) is None  # no engine stamps
    unified = RequestTiming(0.0, sent=1.0, first_token=5.0, relayed=6.0,
                            engine={"taken": 2.0, "scheduled": 3.0, "first_token": 4.0})
    assert [p for p, _ in unified.stamps(False) or []] == [p for p, _, _ in UNIFIED]


def test_a_stamp_from_a_clock_behind_moves_up_so_no_phase_is_negative() -> None:
    phases = attribute(0.0, [("router", 1.0), ("intake", 0.5), ("prefill_queue", 3.0)])
    assert [(p, s, e) for p, s, e in phases] == [("router", 0.0, 1.0), ("intake", 1.0, 1.0),
                                                 ("prefill_queue", 1.0, 3.0)]


def test_each_role_has_its_own_engine_phases() -> None:
    unified = {"taken": 1.0, "scheduled": 1.5, "first_token": 3.0}
    assert [(p, e - s) for p, s, e in engine_phases(unified)] == [("prefill_queue", 0.5), ("prefill_compute", 1.5)]
    prefill = {"taken": 1.0, "bootstrapped": 2.0, "scheduled": 2.5, "first_token": 3.0, "shipped": 3.25,
               "written": 3.5}
    assert [(p, e - s) for p, s, e in engine_phases(prefill)] == [
        ("decode_admission", 1.0), ("prefill_queue", 0.5), ("prefill_compute", 0.75), ("transfer", 0.25)]
    ahead = {"taken": 1.0, "scheduled": 1.5, "first_token": 3.0, "shipped": 3.25, "bootstrapped": 3.5, "written": 4.0}
    assert [(p, e - s) for p, s, e in engine_phases(ahead)] == [
        ("prefill_queue", 0.5), ("prefill_compute", 1.75), ("decode_admission", 0.25), ("transfer", 0.5)]
    decode = {"taken": 1.0, "admitted": 1.25, "arrived": 4.0, "first_token": 4.5}
    assert [(p, e - s) for p, s, e in engine_phases(decode)] == [
        ("decode_admission", 0.25), ("kv_wait", 2.75), ("first_step", 0.5)]


def test_the_first_token_marker_carries_the_stamps_and_the_cached_tokens() -> None:
    marks = {"taken": 1.5, "first_token": 2.25}
    event = first_token_marker(marks)
    assert event_kind(event).first_token and first_token_marks(event) == (marks, None)
    assert first_token_marks(first_token_marker(marks, 96)) == (marks, 96)
    assert first_token_marks(first_token_marker(None, 0)) == (None, 0)
    assert first_token_marker(None) == FIRST_TOKEN_EVENT and first_token_marks(FIRST_TOKEN_EVENT) == (None, None)
    assert not event_kind(b": first_tokenish\n\n").first_token
    assert first_token_marks(b': first_token {"taken": "soon"}\n\n') == (None, None)  # not numbers: not stamps
    assert first_token_marks(b': first_token {"taken": 1, "cached_tokens": -3}\n\n') == ({"taken": 1}, None)


def test_tracing_without_its_packages_fails_at_start_and_says_what_to_install(tmp_path) -> None:
    """A process asked for spans where OpenTelemetry cannot be imported exits at once, naming the packages."""
    blocker = tmp_path / "sitecustomize.py"  # makes `import opentelemetry` fail in the child
    blocker.write_text("import sys\nsys.modules['opentelemetry'] = None\n")
    # No empty entry: it would put the working directory (the repo root, whose operator/ shadows the standard
    # library's) on the child's path.
    path = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    router = subprocess.run([sys.executable, "-P", "-m", "splitserve", "router", "--unified", "http://127.0.0.1:1",
                             "--otel-endpoint", "http://127.0.0.1:4318"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert router.returncode == 2 and "opentelemetry-sdk" in router.stderr and "splitserve[otel]" in router.stderr
    engine = subprocess.run([sys.executable, "-P", "-m", "splitserve", "serve", "--model", "tiny", "--device", "cpu",
                             "--port", str(free_port())], env={**env, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"},
                            capture_output=True, text=True, timeout=60)
    assert engine.returncode == 1 and "opentelemetry-sdk" in engine.stderr + engine.stdout


# ---- through real engines ----------------------------------------------------------------------------------

class Collector:
    """An OTLP/HTTP trace collector on loopback: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with collector.lock:
                    for resource_spans in request.resource_spans:
                        service = next(a.value.string_value for a in resource_spans.resource.attributes
                                       if a.key == "service.name")
                        for scope in resource_spans.scope_spans:
                            for s in scope.spans:
                                collector.spans.append({
                                    "service": service, "name": s.name, "trace": s.trace_id.hex(),
                                    "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                    "start": s.start_time_unix_nano / 1e9, "end": s.end_time_unix_nano / 1e9})
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("phases")
    collector = Collector() if HAVE_OTEL else None
    otel = ["--otel-endpoint", collector.url] if collector is not None else []
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"  # the processes export their spans every 50 ms
    d = LocalDeployment(tmp, "tiny", ENGINE_ARGS, TRANSFER_ARGS)
    try:
        unified = d.engine("unified", *otel)
        prefill, decode = d.engine("prefill", "--chunked-prefill-size", "512", *otel), d.engine("decode", *otel)
        d.wait([unified, prefill, decode])
        pd = d.router([prefill], [decode], *otel)
        port = free_port()
        routed = f"http://127.0.0.1:{port}"
        d.procs[routed] = ServerProcess(["router", "--port", str(port), "--transfer-control-key", TEST_CONTROL_KEY,
                                         "--unified", unified, *otel], tmp / f"router-{port}.log")
        d.ready_paths[routed] = "/ready"
        d.wait([pd, routed], timeout=60)
        yield {"pd": pd, "routed": routed, "unified": unified, "prefill": prefill, "decode": decode,
               "collector": collector}
    finally:
        d.stop()
        if collector is not None:
            collector.stop()
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


def timed_stream(client: httpx.Client, url: str, prompt: str | list[int],
                 phases: bool = True) -> tuple[float, dict | None]:
    """A streamed completion: the client's TTFT (request sent -> first chunk with a token) and the router's
    phases comment, if asked for."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "return_token_ids": True}
    headers = {PHASES_HEADER: "1"} if phases else {}
    comment, ttft = None, None
    sent_at = time.time()
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["token_ids"]:
                ttft = time.perf_counter() - start
                got_at = time.time()
            if line.startswith(": phases "):
                comment = json.loads(line[len(": phases "):])
    assert ttft is not None
    if comment is not None:  # the client's own part: to the router's receipt, and from its relay
        comment["client"] = {"before": comment["marks"][0][1] - sent_at, "after": got_at - comment["marks"][-1][1]}
    return ttft, comment


def metric_count(url: str, name: str, phase: str) -> float:
    """The sample count of one phase of a histogram on /metrics (0 before any)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}_count{{") and f'phase="{phase}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("shape", ["pd", "routed"])
def test_the_phases_account_for_the_ttft_of_every_request(group, shape) -> None:
    """Per request: the stamps come in order, no phase is negative, and the phases add up to at least 95% of the
    TTFT the client measured; the router's and the engines' /metrics have the phase histograms."""
    url = group[shape]
    names = [p for p, _, _ in (DISAGGREGATED if shape == "pd" else UNIFIED)]
    before = metric_count(url, "splitserve_phase_seconds", "router")
    fractions = []
    with httpx.Client(timeout=120) as client:
        timed_stream(client, url, "warm the connection", phases=False)
        for i in range(REQUESTS):
            # Prompts of 1,500 to 2,500 tokens: a TTFT of tenths of a second, next to which the client's own
            # milliseconds (its request to the router, its read of the answer) stay under 5% on a busy CPU.
            ttft, comment = timed_stream(client, url, [100 + (i * 7 + j) % 97 for j in range(1500 + 200 * i)])
            assert comment is not None and comment["phases"] is not None, comment
            marks = comment["marks"]
            assert [m[0] for m in marks] == ["received", *names]
            times = [m[1] for m in marks]
            assert times == sorted(times), marks  # one host's clock: the stamps come in the order of the path
            phases = comment["phases"]
            assert list(phases) == names and all(v >= 0 for v in phases.values()), phases
            assert phases["prefill_compute"] > 0 and phases["router"] > 0
            attributed = sum(phases.values())
            assert attributed <= ttft  # all of it inside what the client saw
            # Nothing goes missing: the client's TTFT is the phases plus its own time on either side of the
            # router's window (its request reaching the router, its read of the relayed chunk).
            client_side = comment["client"]["before"] + comment["client"]["after"]
            assert attributed + client_side >= 0.99 * ttft, (attributed, client_side, ttft, phases)
            fractions.append(attributed / ttft)
    # The client's own milliseconds are scheduling on a busy CPU: one request may lose a few per cent to them, the
    # typical one may not.
    assert sorted(fractions)[len(fractions) // 2] >= 0.95, fractions
    # The router records a stream as it ends; every one of them, the warm-up's too.
    deadline = time.monotonic() + 10
    while metric_count(url, "splitserve_phase_seconds", "router") < before + REQUESTS + 1:
        assert time.monotonic() < deadline, "the router's phase histogram did not count every request"
        time.sleep(0.05)
    for phase in names:
        assert metric_count(url, "splitserve_phase_seconds", phase) >= REQUESTS + 1, phase
    assert "splitserve_router_time_to_first_token_seconds_count" in httpx.get(f"{url}/metrics", timeout=10).text
    engines = {"pd": {"prefill": ["decode_admission", "prefill_queue", "prefill_compute", "transfer"],
                      "decode": ["decode_admission", "kv_wait", "first_step"]},
               "routed": {"unified": ["prefill_queue", "prefill_compute"]}}[shape]
    for role, engine_phase_names in engines.items():
        for phase in engine_phase_names:
            assert metric_count(group[role], "splitserve_phase_seconds", phase) >= REQUESTS + 1, (role, phase)


@pytest.mark.skipif(not HAVE_OTEL, reason="opentelemetry-proto is not installed (pip install 'splitserve[otel]')")
def test_one_trace_spans_the_router_the_prefill_and_the_decode(group) -> None:
    """A client's traceparent is the parent of the router's span; the router's phases are its children, and each
    engine's span (with its own phases as children) hangs under it, by the traceparent the router sent."""
    collector: Collector = group["collector"]
    client_trace, client_span = "ab" * 16, "cd" * 8
    headers = {"traceparent": f"00-{client_trace}-{client_span}-01"}
    body = {"model": "m", "prompt": "trace me", "max_tokens": 3, "temperature": 0, "stream": True}
    r = httpx.post(f"{group['pd']}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    deadline = time.monotonic() + 15

    def trace() -> list[dict]:
        with collector.lock:
            return [s for s in collector.spans if s["trace"] == client_trace]
    while len({s["service"] for s in trace()}) < 3 or len(trace()) < 1 + len(DISAGGREGATED) + 5 + 4:
        assert time.monotonic() < deadline, trace()
        time.sleep(0.05)
    spans = trace()
    root = next(s for s in spans if s["name"] == "router.request")
    assert root["service"] == "splitserve-router" and root["parent"] == client_span
    children = sorted((s for s in spans if s["parent"] == root["id"] and s["service"] == "splitserve-router"),
                      key=lambda s: s["start"])
    assert [s["name"] for s in children] == [p for p, _, _ in DISAGGREGATED]
    for a, b in itertools.pairwise(children):
        assert a["end"] == pytest.approx(b["start"], abs=1e-6) and a["start"] <= a["end"]
    for service, name, phases in (("splitserve-prefill", "engine.prefill",
                                   ["decode_admission", "prefill_queue", "prefill_compute", "transfer"]),
                                  ("splitserve-decode", "engine.decode",
                                   ["decode_admission", "kv_wait", "first_step"])):
        engine = next(s for s in spans if s["service"] == service and s["name"] == name)
        assert engine["parent"] == root["id"]
        assert [s["name"] for s in sorted((s for s in spans if s["parent"] == engine["id"]),
                                          key=lambda s: s["start"])] == phases

"""Chaos, measured: load a deployment while its processes are killed, and say what clients saw.

Each request ends one of these ways: ``ok`` (200 with every token asked for), ``clear_error``
(an OpenAI-style error body, or an SSE error event), ``unreachable`` (the router itself was not
there: only while the router is down), ``hung`` (no end within the deadline) or ``unclear``
(anything else: a truncated answer with no error, a broken connection). Per kill: the share of
the requests in flight without a token yet that still succeeded (they had to be retried
elsewhere), and the recovery time: from the kill to the start of the first request after which
every new request succeeded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "clear_error", "unreachable", "hung", "unclear")


@dataclass
class RequestRecord:
    """One request of the load, on the monotonic clock."""

    start: float
    end: float = 0.0
    first_token: float | None = None  # streamed: when its first token came; whole answers: at the end
    tokens: int = 0  # tokens received (a stream that broke after some had its first token before the break)
    outcome: str = "unclear"
    detail: str = ""


@dataclass
class Kill:
    at: float
    name: str
    role: str


def _error_message(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return str(err["message"]) if isinstance(err, dict) and err.get("message") else None


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      stream: bool, deadline_s: float) -> RequestRecord:
    rec = RequestRecord(start=time.monotonic())
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    message = _error_message(await r.aread())
                    rec.outcome, rec.detail = ("clear_error", message) if message else ("unclear", str(r.status_code))
                elif not stream:
                    answer = json.loads(await r.aread())
                    rec.first_token = time.monotonic()
                    rec.tokens = len(answer["choices"][0]["token_ids"])
                    rec.outcome = "ok" if rec.tokens == max_tokens else "unclear"
                    rec.detail = "" if rec.tokens == max_tokens else f"{rec.tokens} tokens"
                else:
                    error = None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"].get("message") or "error event"
                            continue
                        if event["choices"] and event["choices"][0].get("token_ids"):
                            rec.tokens += len(event["choices"][0]["token_ids"])
                            rec.first_token = rec.first_token or time.monotonic()
                    if error:
                        rec.outcome, rec.detail = "clear_error", error
                    else:
                        rec.outcome = "ok" if rec.tokens == max_tokens else "unclear"
                        rec.detail = "" if rec.tokens == max_tokens else f"{rec.tokens} tokens, no error event"
    except TimeoutError:
        rec.outcome, rec.detail = "hung", f"no end within {deadline_s:.0f} s"
    except httpx.ConnectError as exc:
        rec.outcome, rec.detail = "unreachable", repr(exc)
    except httpx.HTTPError as exc:
        rec.outcome, rec.detail = "unclear", repr(exc)
    rec.end = time.monotonic()
    return rec


async def load_until(url: str, stop_at: float, concurrency: int, prompt_len: int, max_tokens: int,
                     deadline_s: float, seed: int = 0) -> list[RequestRecord]:
    """Keeps `concurrency` requests in flight (streamed and whole, alternately) until `stop_at`."""
    records: list[RequestRecord] = []
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        model = (await client.get(f"{url}/v1/models", timeout=10)).json()["data"][0]["id"]

        async def worker(index: int) -> None:
            n = 0
            while time.monotonic() < stop_at:
                prompt = [rng.randrange(1, 250) for _ in range(prompt_len)]
                stream = (index + n) % 2 == 0
                records.append(await one_request(client, url, model, prompt, max_tokens, stream, deadline_s))
                n += 1
                if records[-1].outcome == "unreachable":
                    await asyncio.sleep(0.1)  # the router is restarting: don't spin
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return records


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: list[RequestRecord], kills: list[Kill]) -> dict:
    """The figures of one chaos run: outcomes, p99 latency, and what each kill did."""
    counts = {o: sum(r.outcome == o for r in records) for o in OUTCOMES}
    per_kill = []
    for i, kill in enumerate(kills):
        until = kills[i + 1].at if i + 1 < len(kills) else float("inf")
        # In flight at the kill with no token yet. A stream that broke after tokens had its first
        # token before the break, whatever the clocks say (the client reads a little behind).
        tokenless = [r for r in records if r.start < kill.at < r.end
                     and (r.first_token is None or r.first_token > kill.at)
                     and not (r.outcome != "ok" and r.tokens)]
        # Requests still in flight at the next kill are that kill's to explain.
        after = sorted((r for r in records if kill.at <= r.start < until and r.end <= until), key=lambda r: r.start)
        recovery = 0.0
        for j, r in enumerate(after):
            if r.outcome != "ok":
                recovery = after[j + 1].start - kill.at if j + 1 < len(after) else float("nan")
        per_kill.append({
            "at_s": kill.at, "name": kill.name, "role": kill.role,
            "in_flight_without_token": len(tokenless),
            "of_those_ok": sum(r.outcome == "ok" for r in tokenless),
            "new_requests": len(after), "new_requests_ok": sum(r.outcome == "ok" for r in after),
            "recovery_s": recovery,
        })
    engine_kills = [k for k in per_kill if k["role"] != "router"]
    targets = {  # the targets, over the kills of engines (a killed router drops its connections)
        "hung": counts["hung"],
        "tokenless_ok": sum(k["of_those_ok"] for k in engine_kills),
        "tokenless": sum(k["in_flight_without_token"] for k in engine_kills),
        "max_recovery_s": max((k["recovery_s"] for k in engine_kills), default=0.0),
    }
    return {"requests": len(records), **counts, "targets": targets,
            "latency_p50_s": percentile([r.end - r.start for r in records if r.outcome == "ok"], 0.5),
            "latency_p99_s": percentile([r.end - r.start for r in records if r.outcome == "ok"], 0.99),
            "longest_s": max((r.end - r.start for r in records), default=0.0),
            "kills": per_kill,
            "errors": sorted({f"{r.outcome}: {r.detail[:160]}" for r in records if r.outcome != "ok"})[:8]}


@dataclass
class ChaosConfig:
    """One bench --profile chaos run."""

    duration_s: float = 150.0
    kill_every_s: float = 20.0
    roles: list[str] = field(default_factory=lambda: ["prefill", "decode", "router"])
    concurrency: int = 4
    prompt_len: int = 32
    max_tokens: int = 32
    deadline_s: float = 30.0
    seed: int = 0


def run_chaos(deployment, cfg: ChaosConfig) -> dict:
    """Loads a started `splitserve up` Deployment for `duration_s` while killing (SIGKILL) a
    random process of the chosen roles every `kill_every_s` (± a third); the deployment's
    supervisor restarts them. Returns the summary, with the kills relative to the start."""
    router_url = next(c.url for c in deployment.children if c.name == "router")
    rng = random.Random(cfg.seed)
    kills: list[Kill] = []
    done = threading.Event()

    def supervise_and_kill() -> None:
        next_kill = time.monotonic() + cfg.kill_every_s * rng.uniform(0.67, 1.33)
        while not done.wait(0.1):
            deployment.supervise_once()
            if time.monotonic() < next_kill:
                continue
            up = [c for c in deployment.children if c.name.split("-")[0] in cfg.roles
                  and c.restart_at is None and c.proc.poll() is None]
            if up:
                victim = rng.choice(up)
                victim.proc.send_signal(signal.SIGKILL)
                kills.append(Kill(time.monotonic(), victim.name, victim.name.split("-")[0]))
                logger.warning("chaos: killed %s (pid %d)", victim.name, victim.proc.pid)
            next_kill = time.monotonic() + cfg.kill_every_s * rng.uniform(0.67, 1.33)

    thread = threading.Thread(target=supervise_and_kill, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        records = asyncio.run(load_until(router_url, started + cfg.duration_s, cfg.concurrency, cfg.prompt_len,
                                         cfg.max_tokens, cfg.deadline_s, cfg.seed))
    finally:
        done.set()
        thread.join()
    summary = summarize(records, kills)
    for k in summary["kills"]:
        k["at_s"] -= started
    summary["restarts"] = {c.name: c.restarts for c in deployment.children}
    summary["config"] = asdict(cfg)
    return summary


def print_chaos_report(s: dict) -> None:
    lines = [f"chaos: {s['requests']} requests: {s['ok']} ok, {s['clear_error']} clear errors, "
             f"{s['unreachable']} router unreachable, {s['hung']} hung, {s['unclear']} unclear",
             f"  latency of ok requests: p50 {s['latency_p50_s'] * 1e3:.0f} ms, p99 {s['latency_p99_s'] * 1e3:.0f} ms; "
             f"longest request {s['longest_s']:.1f} s"]
    for k in s["kills"]:
        share = f"{k['of_those_ok']}/{k['in_flight_without_token']}" if k["in_flight_without_token"] else "0/0"
        lines.append(f"  kill at {k['at_s']:6.1f} s of {k['name']:<9}: in flight without a token {share} ok; "
                     f"new requests {k['new_requests_ok']}/{k['new_requests']} ok; recovery {k['recovery_s']:.1f} s")
    t = s["targets"]
    share = t["tokenless_ok"] / t["tokenless"] if t["tokenless"] else float("nan")
    lines.append(f"  engine kills: {t['hung']} hung; in flight without a token {t['tokenless_ok']}/{t['tokenless']} ok "
                 f"({share:.0%}, target >= 95%); longest recovery {t['max_recovery_s']:.1f} s (target <= 10 s)")
    lines.append("  restarts: " + ", ".join(f"{n} {c}" for n, c in s["restarts"].items()))
    lines += [f"  {e}" for e in s["errors"]]
    for line in lines:
        print(line)  # the report is the command's output

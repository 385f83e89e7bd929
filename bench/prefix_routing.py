"""`splitserve bench --profile prefix`: cache-aware routing against least-loaded routing, in one run.

Three loads, each replayed through `splitserve up --unified N` twice (the router choosing by cached prefix,
then by load alone), and the shared-prefix load once more on one engine with N times the KV (the cache that
holds everything, the hit rate's ceiling):
- shared prefixes: `--prefixes` prompts' common prefixes of `--prefix-len` tokens, each request one of them
  plus a fresh `--question-len`-token question, open-loop at `--rate` req/s;
- no shared prefix: the same lengths with every prompt fresh (routing must not cost throughput);
- a multi-turn trace: seeded sessions of 2-10 turns whose prompts grow with the history (the last prompt,
  its answer and a new question), with think times between turns.
Per run: the prefix-hit rate (the usage's cached tokens over prompt tokens), TTFT and ITL percentiles,
throughput, failed requests, and the router's decision time. Ratios come from the same run.

    splitserve bench --profile prefix --model tiny --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from splitserve.bench.stats import percentiles
from splitserve.config_flags import add_config_flags, config_from_args

logger = logging.getLogger(__name__)


@dataclass
class PrefixBenchConfig:
    """The loads and the deployment they run on."""

    model: str = field(default="tiny", metadata={"help": "model of the engines"})
    shape: str = field(default="", metadata={
        "help": "a real model's shape with random weights instead of --model (e.g. llama-3.1-8b)"})
    device: str = field(default="auto", metadata={"help": "device of the engines"})
    engines: int = field(default=4, metadata={"help": "unified engines behind the router"})
    kv_tokens: int = field(default=2048, metadata={
        "help": "KV tokens per engine (the single-cache reference gets engines x this)"})
    prefixes: int = field(default=16, metadata={"help": "shared prefixes"})
    prefix_len: int = field(default=256, metadata={"help": "tokens per shared prefix"})
    question_len: int = field(default=32, metadata={"help": "fresh tokens after the prefix"})
    output_len: int = field(default=8, metadata={"help": "output tokens per request"})
    requests: int = field(default=400, metadata={"help": "requests per load"})
    rate: float = field(default=20.0, metadata={"help": "arrivals per second (Poisson)"})
    sessions: int = field(default=40, metadata={"help": "multi-turn trace: sessions"})
    think_s: float = field(default=0.5, metadata={"help": "multi-turn trace: mean think time between turns"})
    loads: list[str] = field(default_factory=lambda: ["shared", "fresh", "multiturn"], metadata={
        "help": "which loads to run", "choices": ("shared", "fresh", "multiturn")})
    engine_args: str = field(default="", metadata={"help": "extra flags for every engine"})
    seed: int = field(default=0, metadata={"help": "seed of the prompts, arrivals and sessions"})
    decision_backends: int = field(default=16, metadata={
        "help": "the decision-time measurement (in process, no servers): backends in the index"})
    decision_pages: int = field(default=100_000, metadata={
        "help": "the decision-time measurement: cached pages per backend"})
    decision_only: bool = field(default=False, metadata={"help": "measure the decision time only"})
    output: str = field(default="", metadata={"help": "write the figures as JSON here"})


@dataclass
class Turn:
    """One request of a load: when it may go (s after the start, or after its session's previous turn)."""

    prompt: list[int]
    after_s: float
    session: int = -1  # -1: an open-loop request; else its turns go in order


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    error: str = ""


def token(rng: random.Random) -> int:
    return rng.randrange(3, 250)


def shared_load(cfg: PrefixBenchConfig, fresh: bool) -> list[Turn]:
    rng = random.Random(cfg.seed)
    prefixes = [[token(rng) for _ in range(cfg.prefix_len)] for _ in range(cfg.prefixes)]
    turns, t = [], 0.0
    for _ in range(cfg.requests):
        t += rng.expovariate(cfg.rate)
        head = [token(rng) for _ in range(cfg.prefix_len)] if fresh else rng.choice(prefixes)
        turns.append(Turn(head + [token(rng) for _ in range(cfg.question_len)], t))
    return turns


def multiturn_load(cfg: PrefixBenchConfig) -> list[Turn]:
    """Sessions start open-loop at `rate`/4; each turn's prompt is the previous prompt plus a stand-in for its
    answer and a new question (the answer is not known before the run: a seeded stand-in keeps runs alike)."""
    rng = random.Random(cfg.seed + 1)
    turns, t = [], 0.0
    for s in range(cfg.sessions):
        t += rng.expovariate(cfg.rate / 4)
        prompt = [token(rng) for _ in range(cfg.prefix_len)]
        for turn in range(rng.randint(2, 10)):
            if turn:
                prompt = prompt + [token(rng) for _ in range(cfg.output_len + cfg.question_len)]
            turns.append(Turn(list(prompt), t if turn == 0 else rng.expovariate(1 / cfg.think_s), s))
    return turns


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res, last = Result(ok=False), start
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(ok=False, error=str(chunk["error"]))
                now = time.perf_counter()
                ids = chunk["choices"][0].get("token_ids", []) if chunk.get("choices") else []
                if ids:
                    if not res.output_ids:
                        res.ttft = now - start
                    else:
                        res.itls.append((now - last) / len(ids))
                    res.output_ids += ids
                    last = now
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        return Result(ok=False, error=f"{type(exc).__name__}: {exc}")
    res.latency = time.perf_counter() - start
    res.output_tokens = len(res.output_ids)
    res.ok = res.output_tokens == output_len
    if not res.ok:
        res.error = f"{res.output_tokens} of {output_len} tokens"
    return res


async def replay(url: str, model: str, turns: list[Turn], output_len: int) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=512, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        start = time.perf_counter()
        sessions: dict[int, list[Turn]] = {}
        opens = []
        for turn in turns:
            (sessions.setdefault(turn.session, []) if turn.session >= 0 else opens).append(turn)

        async def at(turn: Turn) -> Result:
            await asyncio.sleep(max(0.0, start + turn.after_s - time.perf_counter()))
            return await one_request(client, url, model, turn.prompt, output_len)

        async def session(chain: list[Turn]) -> list[Result]:
            out = [await at(chain[0])]
            for turn in chain[1:]:
                await asyncio.sleep(turn.after_s)
                out.append(await one_request(client, url, model, turn.prompt, output_len))
            return out

        results = list(await asyncio.gather(*(at(t) for t in opens)))
        for chain_results in await asyncio.gather(*(session(c) for c in sessions.values())):
            results += chain_results
        return results, time.perf_counter() - start


def summary(results: list[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok]), "itl_s": percentiles([x for r in ok for x in r.itls]),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_s, "wall_s": wall_s,
    }


def router_decisions(url: str) -> dict[str, float]:
    """The router's decision-time histogram and predicted cached tokens, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("splitserve_router_route_decision_seconds_sum",
                            "splitserve_router_route_decision_seconds_count",
                            "splitserve_router_predicted_cached_tokens_total")):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def run_deployment(cfg: PrefixBenchConfig, engines: int, kv_tokens: int, routing: str,
                   loads: dict[str, list[Turn]]) -> dict[str, Any]:
    from splitserve.launcher.up import Deployment, UpConfig, free_port

    engine_args = f"--max-total-tokens {kv_tokens} {cfg.engine_args}".strip()
    deployment = Deployment(UpConfig(model=cfg.model, device=cfg.device, port=free_port(), prefill=0, decode=0,
                                     unified=engines, engine_args=engine_args, router_args=f"--routing {routing}"))
    out: dict[str, Any] = {}
    try:
        url = deployment.start()
        for name, turns in loads.items():
            for u, _ in deployment.procs:
                if u != url:
                    httpx.post(f"{u}/internal/flush_cache", timeout=30,
                               headers={"X-Splitserve-Key": deployment.key})
            results, wall = asyncio.run(replay(url, cfg.model, turns, cfg.output_len))
            out[name] = summary(results, wall)
            logger.info("%s %s x%d: %s", name, routing, engines, json.dumps(out[name]["hit_rate"]))
        out["router"] = router_decisions(url)
    finally:
        deployment.stop()
    return out


def decision_latency(backends: int, pages: int, prompt_tokens: int = 2176, page_size: int = 16,
                     samples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The router's choice timed in process: an index of `backends` x `pages` cached pages (each backend holds
    prefixes of its own and a few shared ones), prompts of `prompt_tokens` that hit one, several or none."""
    from prometheus_client import CollectorRegistry

    from splitserve.router.backend_pool import Backend
    from splitserve.router.cache_routing import CacheAwareRouting, RoutePlan
    from splitserve.router.kv_events import KVEventsPoller
    from splitserve.router.prefix_index import PrefixIndex
    from splitserve.router.prompt_pages import prompt_page_hashes

    rng = random.Random(seed)
    index = PrefixIndex()
    urls = [f"http://b{i}" for i in range(backends)]
    per_prompt = prompt_tokens // page_size
    prompts: list[list[int]] = []
    for b, url in enumerate(urls):
        stored: list[int] = []
        while len(stored) < pages:  # whole prompts' pages, as an engine's cache holds them
            ids = [rng.randrange(3, 32000) for _ in range(prompt_tokens)]
            if b < 4 and len(prompts) < 64:
                prompts.append(ids)
            stored += prompt_page_hashes(ids, page_size)
        index.apply_events(url, {"epoch": "e", "seq": 1, "page_size": page_size, "hash_version": 1,
                                 "reset": True, "events": [["stored", "device", stored[:pages]]]})
    for shared in prompts[:8]:  # a few prefixes held everywhere
        for url in urls:
            index.sent(url, prompt_page_hashes(shared, page_size))
    poller = KVEventsPoller(index, None, lambda: urls, "", 1.0)  # type: ignore[arg-type]
    poller.page_size = dict.fromkeys(urls, page_size)
    routing = CacheAwareRouting(index, poller, max_load_tokens=1 << 30, registry=CollectorRegistry())
    candidates = [Backend(url, "unified", healthy=True) for url in urls]
    times = []
    for i in range(samples):
        ids = (rng.choice(prompts) if i % 2 else [rng.randrange(3, 32000) for _ in range(per_prompt * page_size)])
        ids = [*ids[: prompt_tokens - 64], *(rng.randrange(3, 32000) for _ in range(64))]
        start = time.perf_counter()
        plan = RoutePlan(routing, ids)  # hashing the prompt is part of the decision
        plan.choose(candidates)
        times.append(time.perf_counter() - start)
        plan.take_release()()
    times.sort()
    return {"backends": backends, "pages_per_backend": pages, "prompt_tokens": prompt_tokens,
            "p50_s": times[len(times) // 2], "p99_s": times[int(len(times) * 0.99)], "samples": samples}


def run(cfg: PrefixBenchConfig) -> dict[str, Any]:
    if cfg.decision_only:
        return {"config": dataclasses.asdict(cfg), "decision": decision_latency(cfg.decision_backends,
                                                                              cfg.decision_pages, seed=cfg.seed)}
    if cfg.shape:
        import tempfile
        from pathlib import Path

        from splitserve.engine.checkpoints.model_shapes import write_shape_folder

        folder = write_shape_folder(cfg.shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{cfg.shape}-")))
        cfg = dataclasses.replace(cfg, model=str(folder), engine_args=f"--load-format dummy {cfg.engine_args}")
    loads = {"shared": shared_load(cfg, fresh=False), "fresh": shared_load(cfg, fresh=True),
             "multiturn": multiturn_load(cfg)}
    loads = {name: loads[name] for name in cfg.loads}
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
    report["cache-aware"] = run_deployment(cfg, cfg.engines, cfg.kv_tokens, "cache-aware", loads)
    report["least-loaded"] = run_deployment(cfg, cfg.engines, cfg.kv_tokens, "least-loaded", loads)
    if "shared" in loads:
        report["one-cache"] = run_deployment(cfg, 1, cfg.kv_tokens * cfg.engines, "cache-aware",
                                             {"shared": loads["shared"]})
    return report


def print_report(report: dict[str, Any]) -> None:
    d = report.get("decision")
    if d:
        print(f"decision: {d['backends']} backends x {d['pages_per_backend']} cached pages, {d['prompt_tokens']}-token "
              f"prompts, hashing included: p50 {d['p50_s'] * 1e6:.0f} us, p99 {d['p99_s'] * 1e6:.0f} us "
              f"({d['samples']} decisions)")
        if "cache-aware" not in report:
            return
    for load in report["config"]["loads"]:
        for routing in ("cache-aware", "least-loaded", "one-cache"):
            r = report.get(routing, {}).get(load)
            if r is None:
                continue
            print(f"{load:>9} {routing:>11}: hit rate {r['hit_rate']:.3f} | "
                  f"TTFT p50 {r['ttft_s']['p50'] * 1e3:7.1f} ms "
                  f"p99 {r['ttft_s']['p99'] * 1e3:7.1f} ms | ITL p50 {r['itl_s']['p50'] * 1e3:6.2f} ms "
                  f"p99 {r['itl_s']['p99'] * 1e3:6.2f} ms | {r['output_tokens_per_s']:7.1f} tok/s | "
                  f"{r['failed']}/{r['requests']} failed")
    ca, rr, one = report["cache-aware"], report["least-loaded"], report.get("one-cache", {})
    if "shared" in ca and "shared" in one:
        print(f"shared: cache-aware hit rate / one cache's: {ca['shared']['hit_rate'] / one['shared']['hit_rate']:.3f}"
              f"; least-loaded's / one cache's: {rr['shared']['hit_rate'] / one['shared']['hit_rate']:.3f}")
        print(f"shared: TTFT p50 least-loaded / cache-aware: "
              f"{rr['shared']['ttft_s']['p50'] / ca['shared']['ttft_s']['p50']:.2f}")
    if "fresh" in ca:
        print(f"fresh: throughput cache-aware / least-loaded: "
              f"{ca['fresh']['output_tokens_per_s'] / rr['fresh']['output_tokens_per_s']:.3f}")
    if "multiturn" in ca:
        print(f"multiturn: hit rate cache-aware {ca['multiturn']['hit_rate']:.3f}, "
              f"least-loaded {rr['multiturn']['hit_rate']:.3f}")
    decisions = ca.get("router", {})
    count = decisions.get("splitserve_router_route_decision_seconds_count", 0)
    if count:
        mean = decisions["splitserve_router_route_decision_seconds_sum"] / count
        print(f"router: {count:.0f} cache-aware decisions, mean {mean * 1e6:.0f} us")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench --profile prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, PrefixBenchConfig, "SPLITSERVE_BENCH")
    cfg = config_from_args(PrefixBenchConfig, parser.parse_args(argv), "SPLITSERVE_BENCH")
    report = run(cfg)
    print_report(report)
    if cfg.output:
        with open(cfg.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0

"""`splitserve bench --profile structured`: decode tokens/s with and without a JSON schema.

The same prompts run through one bare engine twice, at the same concurrency and temperature:
unconstrained, and under a JSON schema (a fixed-size array of small integers, so both runs have
about as many output tokens). Both go through the full sampling backend, so the ratio is the cost
of the grammar alone: filling each row's bitmask on the host and applying it to the logits.
"""

from __future__ import annotations

import json
import logging
import time

from splitserve.engine.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)

ITEMS = 24  # array length: each item is 1 to 3 digits and a ", "
REPEATS = 3  # runs of each, alternated (a shared machine's load drifts); the median counts


def numbers_schema(items: int) -> GrammarSpec:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": items, "maxItems": items}
    return GrammarSpec("json_schema", json.dumps(schema))


def _timed(engine, prompts: list[list[int]], params) -> dict:
    from splitserve.engine.offline import generate_tokens

    start = time.perf_counter()
    outs = generate_tokens(engine, prompts, params, timeout=3600)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def _median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def run_structured_benchmark(cfg) -> dict:
    """cfg: a BenchConfig (model, device, concurrency, input_len, seed, max_running_requests)."""
    from splitserve.bench.workload import random_prompts
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=cfg.model, device=cfg.device, max_running_requests=cfg.max_running_requests,
                                 disable_prefix_cache=True))
    engine.start()
    try:
        vocab = min(250, engine.model_cfg.vocab_size)
        prompts = random_prompts(cfg.concurrency, cfg.input_len, cfg.seed, vocab)
        spec = numbers_schema(ITEMS)
        engine.grammar.compile(spec)  # the compiler's start and this compile are not part of the runs
        schema = SamplingParams(max_new_tokens=ITEMS * 6, temperature=1.0, seed=cfg.seed, grammar=spec)
        _timed(engine, prompts[:2], schema)  # warm-up
        free_len = max(1, _timed(engine, prompts, schema)["output_tokens"] // len(prompts))
        free = SamplingParams(max_new_tokens=free_len, temperature=1.0, seed=cfg.seed, ignore_eos=True)
        _timed(engine, prompts[:2], free)
        runs: dict[str, list[dict]] = {"json_schema": [], "unconstrained": []}
        for _ in range(REPEATS):
            runs["unconstrained"].append(_timed(engine, prompts, free))
            runs["json_schema"].append(_timed(engine, prompts, schema))
        constrained, unconstrained = (_median(runs[k]) for k in ("json_schema", "unconstrained"))
    finally:
        engine.stop()
    return {"model": cfg.model, "device": str(engine.runner.device), "vocab_size": engine.model_cfg.vocab_size,
            "concurrency": cfg.concurrency, "input_len": cfg.input_len, "unconstrained": unconstrained,
            "json_schema": constrained, "ratio": constrained["tokens_per_s"] / unconstrained["tokens_per_s"],
            "runs": runs}


def print_structured_report(r: dict) -> None:
    logger.info("structured outputs on %s (%s, vocab %d), %d requests at once, %d-token prompts",
                r["model"], r["device"], r["vocab_size"], r["concurrency"], r["input_len"])
    for name in ("unconstrained", "json_schema"):
        m = r[name]
        logger.info("  %-13s %6d output tokens in %6.2f s: %8.1f tokens/s", name, m["output_tokens"], m["seconds"],
                    m["tokens_per_s"])
    logger.info("  json_schema / unconstrained tokens/s: %.3f", r["ratio"])

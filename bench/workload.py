"""What the engine benchmarks run: seeded random prompts, and one batch of them through the bare engine."""

from __future__ import annotations

import statistics
import time

import torch


def random_prompts(n: int, length: int, seed: int, vocab: int = 250) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=gen).tolist()


def run_engine_batch(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Submits `prompts` at once and times prefill (to the last first token) and decode steps."""
    from splitserve.engine.offline import generate_tokens
    from splitserve.engine.sampling_params import SamplingParams

    first_times: list[float] = []

    def note_first_token(out) -> None:
        if out.token_ids and out.completion_tokens == 1:
            first_times.append(time.perf_counter())

    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    steps_before = engine.steps
    start = time.perf_counter()
    generate_tokens(engine, prompts, params, timeout=3600, observe=note_first_token)
    end = time.perf_counter()
    prefill_end = max(first_times)
    decode_steps = max(1, output_len - 1)
    return {"batch": len(prompts), "prefill_s": prefill_end - start, "decode_s": end - prefill_end,
            "ttft_p50_s": statistics.median(first_times) - start,
            "decode_step_s": (end - prefill_end) / decode_steps, "steps": engine.steps - steps_before,
            "output_tokens_per_s": len(prompts) * output_len / (end - start)}

"""How close a quantized engine's model is to its reference: mean KL per token, teacher-forced top-1 and greedy
agreement on fixed random-id prompts, each prompt through the paths a request takes (two prompt chunks, then a
decode step). `bench --profile fp8` reports it for a model shape; the FP8 tests hold checkpoints to it."""

from __future__ import annotations

import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk


def prompt_logits(runner: ModelRunner, kv: KVCache, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt (two chunks then a decode step: the paths a request takes)."""
    req = Request("r", list(prompt[:-1]), SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    out = []
    try:
        for start, length in ((0, 5), (5, len(prompt) - 6), (len(prompt) - 1, 1)):
            if start == len(prompt) - 1:
                req.output_ids.append(prompt[-1])
            assert kv.grow(req, start + length)
            batch = build_forward_batch([ScheduledChunk(req, start, length, True)], kv.page_table, kv.page_size,
                                        runner.device)
            batch.logits_index = torch.arange(length)
            out.append(runner.model(batch, runner.kv_pool))
            req.kv_len = start + length
    finally:
        kv.release(req, cache_prefix=False)
    return torch.cat(out)


def fixed_prompts(vocab: int) -> list[list[int]]:
    """Four prompts of 24-57 ids below 256 (every model here has them), the same in every run."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, min(vocab, 256), (n,), generator=gen).tolist() for n in (24, 31, 40, 57)]


@torch.inference_mode()
def greedy(runner: ModelRunner, kv: KVCache, prompt: list[int], steps: int) -> list[int]:
    req = Request("g", list(prompt), SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    tokens: list[int] = []
    try:
        start, length = 0, len(prompt)
        for _ in range(steps):
            assert kv.grow(req, start + length)
            batch = build_forward_batch([ScheduledChunk(req, start, length, True)], kv.page_table, kv.page_size,
                                        runner.device)
            tokens.append(int(runner.model(batch, runner.kv_pool)[-1].argmax()))
            req.output_ids.append(tokens[-1])
            req.kv_len = start = start + length
            length = 1
    finally:
        kv.release(req, cache_prefix=False)
    return tokens


@torch.inference_mode()
def accuracy(reference: tuple[ModelRunner, KVCache], quantized: tuple[ModelRunner, KVCache], vocab: int,
             steps: int = 16) -> dict[str, float]:
    """Mean KL per token, teacher-forced top-1 agreement and greedy agreement of `quantized` against `reference`."""
    kls, top1, matched, total = [], [], 0, 0
    for prompt in fixed_prompts(vocab):
        want, got = prompt_logits(*reference, prompt), prompt_logits(*quantized, prompt)
        p = torch.log_softmax(want.double(), -1)
        kls.append((p.exp() * (p - torch.log_softmax(got.double(), -1))).sum(-1))
        top1.append((want.argmax(-1) == got.argmax(-1)).double())
        a, b = greedy(*reference, prompt, steps), greedy(*quantized, prompt, steps)
        matched += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), steps)
        total += steps
    return {"mean_kl": float(torch.cat(kls).mean()), "top1": float(torch.cat(top1).mean()),
            "greedy": matched / total}

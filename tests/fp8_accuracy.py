"""Accuracy of a quantized model against its reference on the CPU: mean KL per token, teacher-forced top-1 and
greedy agreement on fixed random-id prompts (the FP8 weights' and the FP8 KV cache's tests share them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.config import EngineConfig
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


def smollm2_pair(**candidate: Any) -> tuple[tuple[ModelRunner, KVCache], tuple[ModelRunner, KVCache], int]:
    """SmolLM2-135M-Instruct (the GGUF file a package ships) on the CPU in float32, and the same with the engine
    config's `candidate` fields (quantization, KV dtype), each with its KV cache; and the vocabulary size. Skips
    the test where the file is not installed."""
    from splitserve.engine.checkpoints.model_names import ModelNotFoundError, smollm2_file

    try:
        path = smollm2_file()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    cfg = ModelConfig.from_checkpoint(path)
    ref_cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
                           max_running_requests=4)
    pair = []
    for engine_cfg in (ref_cfg, dataclasses.replace(ref_cfg, **candidate)):
        runner = ModelRunner(engine_cfg, path, cfg)
        pair.append((runner, KVCache(runner.kv_shape.num_pages, 4, 4, 1024, runner.device)))
    return pair[0], pair[1], cfg.vocab_size

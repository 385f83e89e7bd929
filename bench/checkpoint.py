"""`splitserve bench --profile checkpoint --model smollm2`: a real checkpoint (a folder, a GGUF
file or a built-in name) generating greedily in the bare engine and in transformers `generate`, on
the same chat prompts and in one run: output tokens/s of each, their ratio, and how many answers
are identical token for token.

Both produce exactly `output_len` tokens per prompt (EOS ignored), so the work is the same; at a
batch above one, transformers pads the prompts on the left with an attention mask. Each side runs
`repeats` times, interleaved, and its median counts.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from splitserve.engine.checkpoints.gguf import find_gguf_file
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.", "Give me three tips for sleeping better.",
    "What is 12 times 12?", "Name a famous painting by Leonardo da Vinci.", "Why is the sky blue?",
]


def chat_prompts(engine: Engine, count: int) -> list[list[int]]:
    """`count` prompts: the questions in turn, each rendered with the model's chat template."""
    tok = engine.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
            for i in range(count)]


def load_transformers(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The same checkpoint in transformers (a GGUF file through its `gguf_file` loader)."""
    from transformers import AutoModelForCausalLM

    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def transformers_generate(model: Any, prompts: list[list[int]], output_len: int, pad_id: int,
                          device: torch.device) -> tuple[float, list[list[int]]]:
    """Seconds and new tokens of one greedy `generate` over the prompts, left-padded."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                         min_new_tokens=output_len, pad_token_id=pad_id, eos_token_id=None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out[:, width:].tolist()


def engine_generate(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Seconds and tokens of the prompts submitted together to the engine."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    tokens = generate_tokens(engine, prompts, params, timeout=3600)
    return time.perf_counter() - start, tokens


def run_checkpoint_benchmark(model: str, device: str, batches: list[int], output_len: int,
                             repeats: int = 3) -> dict[str, Any]:
    engine = Engine(EngineConfig(model=model, device=device, max_running_requests=max(batches),
                                 disable_prefix_cache=True))
    engine.start()
    try:
        hf = load_transformers(engine.model_folder, engine.runner.dtype, engine.runner.device)
        pad_id = next(iter(engine.eos_token_ids), 0)
        warm = chat_prompts(engine, 1)
        engine_generate(engine, warm, 4)
        transformers_generate(hf, warm, 4, pad_id, engine.runner.device)
        rows = []
        for batch in batches:
            prompts = chat_prompts(engine, batch)
            # Interleaved runs, median of each side: a machine whose load drifts slows both alike.
            ours_times, hf_times = [], []
            for _ in range(repeats):
                seconds, ours = engine_generate(engine, prompts, output_len)
                ours_times.append(seconds)
                seconds, theirs = transformers_generate(hf, prompts, output_len, pad_id, engine.runner.device)
                hf_times.append(seconds)
            ours_s, hf_s = statistics.median(ours_times), statistics.median(hf_times)
            tokens = batch * output_len
            row = {"batch": batch, "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": tokens,
                   "engine_s": ours_s, "transformers_s": hf_s, "engine_tokens_per_s": tokens / ours_s,
                   "transformers_tokens_per_s": tokens / hf_s, "engine_over_transformers": hf_s / ours_s,
                   "identical_answers": sum(a == b for a, b in zip(ours, theirs, strict=True))}
            rows.append(row)
            logger.info("batch %d: engine %.1f tok/s, transformers %.1f tok/s (%.2fx), %d/%d answers identical",
                        batch, row["engine_tokens_per_s"], row["transformers_tokens_per_s"],
                        row["engine_over_transformers"], row["identical_answers"], batch)
    finally:
        engine.stop()
    import transformers

    return {"model": model, "checkpoint": str(engine.model_folder), "device": str(engine.runner.device),
            "dtype": str(engine.runner.dtype), "output_len": output_len, "repeats": repeats,
            "threads": torch.get_num_threads(),
            "transformers_version": transformers.__version__, "rows": rows}


def print_checkpoint_report(report: dict[str, Any]) -> None:
    lines = [f"{report['model']} on {report['device']} ({report['dtype']}, {report['threads']} threads), "
             f"{report['output_len']} greedy tokens per chat prompt, median of {report['repeats']} interleaved runs, "
             f"transformers {report['transformers_version']}",
             "batch | engine tok/s | transformers tok/s | engine / transformers | identical answers"]
    for r in report["rows"]:
        lines.append(f"{r['batch']:>5} | {r['engine_tokens_per_s']:12.1f} | {r['transformers_tokens_per_s']:18.1f} | "
                     f"{r['engine_over_transformers']:21.2f} | {r['identical_answers']}/{r['batch']}")
    for line in lines:
        print(line)  # the report is the command's output

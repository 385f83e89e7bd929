"""SmolLM2 and its quantized twin on the CPU for the FP8 accuracy tests; the measures are bench/accuracy.py's."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.runner.model_runner import ModelRunner


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

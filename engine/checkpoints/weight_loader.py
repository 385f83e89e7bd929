"""Loads a checkpoint's weights into a model, with progress: the safetensors shards of a Hugging
Face folder, or the tensors of a GGUF file (dequantized)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from splitserve.engine.checkpoints.gguf import find_gguf_file, open_gguf
from splitserve.engine.layers.linear import WeightShapeError
from splitserve.engine.quantization.kv_fp8 import KV_SCALE_NAME

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes or does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embeddings.position_ids")
# An FP8 checkpoint's KV-cache scales (ModelOpt's k_proj.k_scale, compressed-tensors' self_attn.k_scale): no
# model weight; the KV pool takes them (--kv-cache-dtype fp8_e4m3: engine/quantization/kv_fp8.py).
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


class CheckpointError(ValueError):
    """The checkpoint is missing tensors, has unexpected ones, or has none at all."""


def safetensors_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    return files


class ParamTarget:
    """A load target for one plain parameter (a bias, a class embedding) of a module without `load`."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        if tuple(self.param.shape) != tuple(tensor.shape):
            raise WeightShapeError(f"{name}: expected shape {tuple(self.param.shape)}, "
                                   f"checkpoint has {tuple(tensor.shape)}")
        self.param.data.copy_(tensor)


def _copy_into(module: nn.Module, name: str, tensor: torch.Tensor, shard: int) -> None:
    loader = getattr(module, "load", None)
    if loader is not None:
        loader(name, tensor, shard)
        return
    param = module.weight
    if tuple(param.shape) != tuple(tensor.shape):
        raise WeightShapeError(f"{name}: expected shape {tuple(param.shape)}, checkpoint has {tuple(tensor.shape)}")
    param.data.copy_(tensor)


def safetensors_tensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's shards, logging progress after each shard."""
    files = safetensors_files(folder)
    total_bytes = sum(f.stat().st_size for f in files)
    done_bytes, started = 0, time.monotonic()
    for index, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, reader.get_tensor(name)
        done_bytes += path.stat().st_size
        elapsed = time.monotonic() - started
        logger.info("loaded weights %d/%d files, %.0f%% (%.1f GB/s)", index, len(files),
                    100 * done_bytes / max(total_bytes, 1), done_bytes / max(elapsed, 1e-9) / 1e9)


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight in a checkpoint folder or GGUF file."""
    gguf_file = find_gguf_file(path)
    return open_gguf(gguf_file).tensors() if gguf_file is not None else safetensors_tensors(path)


def load_weights(model: nn.Module, path: str | Path, tied_lm_head: bool) -> dict[str, torch.Tensor]:
    """Copies every tensor the model needs from the checkpoint; raises naming what is missing or extra.
    Returns the checkpoint's KV-cache scales (name -> tensor; none in most checkpoints) for the KV pool."""
    targets: dict[str, tuple[nn.Module, int]] = model.weight_targets()  # type: ignore[operator]
    # Multimodal checkpoints come in several layouts: the model maps each name to the one it targets.
    canonical = getattr(model, "checkpoint_name", lambda n: n)
    skips = getattr(model, "skips_checkpoint_tensor", lambda n: False)  # an image side alone: the text's tensors
    remaining = set(targets)
    kv_scales: dict[str, torch.Tensor] = {}
    for stored, tensor in checkpoint_tensors(path):
        name = canonical(stored)
        if name.endswith(IGNORED_SUFFIXES) or (tied_lm_head and name == "lm_head.weight") or skips(name):
            continue
        if name.endswith(KV_SCALE_SUFFIXES) and name not in targets:
            if KV_SCALE_NAME.search(name):  # the KV pool's; other attention (a vision tower's) keeps no KV cache
                kv_scales[name] = tensor
            continue
        if name not in targets:
            if name.endswith((".weight_scale", ".input_scale")):
                raise CheckpointError(f"{path}: FP8 scale {name!r}, but its config names no FP8 quantization for "
                                      "that layer (quantization_config in config.json, or hf_quant_config.json)")
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (wrong architecture?)")
        module, shard = targets[name]
        _copy_into(module, name, tensor, shard)
        remaining.discard(name)
    if remaining:
        missing = sorted(remaining)
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s): {shown}")
    return kv_scales

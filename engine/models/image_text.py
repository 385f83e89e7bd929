"""What a multimodal model (LLaVA, Qwen-VL) shares: a Llama-family text model that `layers`, `embed_tokens`,
`forward` and `logits` are, image-side modules whose every parameter loads whole (not tensor-parallel
sharded), and checkpoint names brought to its own by the class's `LAYOUT_RENAMES` (prefix, replacement).

Built with `image_side_only` (an encode engine: it only turns images into rows), the model holds the image side alone:
no text layers, embeddings or LM head in memory, and the checkpoint's text tensors are skipped on load."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from splitserve.engine.checkpoints.weight_loader import ParamTarget
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.runner.forward_batch import ForwardBatch


class ImageTextModel(nn.Module):
    """A text model plus image-side modules; subclasses set `language_model`, `LAYOUT_RENAMES` and
    `image_modules()`."""

    LAYOUT_RENAMES: ClassVar[tuple[tuple[str, str], ...]] = ()
    language_model: LlamaForCausalLM | None  # None: the image side alone (image_side_only)

    def image_modules(self) -> dict[str, nn.Module]:
        """The image side's modules by their checkpoint prefix."""
        raise NotImplementedError

    @property
    def text_model(self) -> LlamaForCausalLM:
        if self.language_model is None:
            raise RuntimeError("this model was built with its image side alone (an encode engine): it runs no text")
        return self.language_model

    @property
    def layers(self) -> nn.ModuleList:
        return self.text_model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.text_model.embed_tokens

    def forward(self, batch: ForwardBatch, kv: KVPool, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.text_model(batch, kv, input_embeds)

    def logits(self, batch: ForwardBatch, kv: KVPool, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.text_model.logits(batch, kv, input_embeds)

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        for old, new in cls.LAYOUT_RENAMES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """A text-side tensor of the checkpoint, when the model holds the image side alone (`name` renamed)."""
        return self.language_model is None and not name.startswith(tuple(f"{p}." for p in self.image_modules()))

    def weight_targets(self) -> dict[str, tuple[nn.Module, int]]:
        targets = self.language_model.weight_targets() if self.language_model is not None else {}
        for prefix, module in self.image_modules().items():
            for name, param in module.named_parameters():
                targets[f"{prefix}.{name}"] = (ParamTarget(param), 0)  # type: ignore[assignment]
        return targets

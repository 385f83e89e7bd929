"""A checkpoint's tokenizer and chat template: `tokenizer.json` and `tokenizer_config.json` of a
Hugging Face folder, or the metadata of a GGUF file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from splitserve.engine.checkpoints.gguf import find_gguf_file, open_gguf
from splitserve.engine.checkpoints.gguf_tokenizer import gguf_tokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not render with it."""


class TextTokenizer:
    """Encodes prompts, decodes outputs and renders chat messages for one checkpoint."""

    def __init__(self, path: str | Path | None = None, parts: dict[str, Any] | None = None) -> None:
        """From a checkpoint (`path`), or from another tokenizer's `parts()` (a router's copy of an engine's)."""
        if parts is not None:
            tokenizer, bos, eos, template = (Tokenizer.from_str(parts["tokenizer_json"]), parts["bos_token"],
                                             parts["eos_token"], parts["chat_template"])
        elif (gguf_file := find_gguf_file(path)) is not None:
            gguf = gguf_tokenizer(open_gguf(gguf_file))
            tokenizer, bos, eos, template = gguf.tokenizer, gguf.bos_token, gguf.eos_token, gguf.chat_template
        else:
            tokenizer, bos, eos, template = folder_tokenizer(Path(path))
        self.tokenizer = tokenizer
        self.bos_token = bos
        self.eos_token = eos
        self.chat_template = template
        self._template: jinja2.Template | None = None
        self._decoded_ids: dict[bool, bytearray] = {}

    def parts(self) -> dict[str, Any]:
        """Everything that makes this tokenizer, as JSON values; `digest` names them."""
        parts = {"tokenizer_json": self.tokenizer.to_str(), "bos_token": self.bos_token, "eos_token": self.eos_token,
                 "chat_template": self.chat_template}
        return {**parts, "digest": hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tokenizer.token_to_id(text)

    def token_str(self, token_id: int) -> str:
        """The vocabulary entry of a token (unique, unlike its decoded text), as logprobs show it."""
        return self.tokenizer.id_to_token(token_id) or f"<id:{token_id}>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoded_ids(self, skip_special_tokens: bool = True) -> bytearray:
        """1 for each id `decode` keeps, 0 for one it drops before decoding (not in the vocabulary, or a
        special token when they are skipped); ids past the end are dropped too. Built once per setting."""
        flags = self._decoded_ids.get(skip_special_tokens)
        if flags is None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
            flags = bytearray(max(vocab.values(), default=-1) + 1)
            for token, tid in vocab.items():
                flags[tid] = 0 if skip_special_tokens and token in special else 1
            self._decoded_ids[skip_special_tokens] = flags
        return flags

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each sequence, in one call into the tokenizer."""
        return self.tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         tools=tools)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def folder_tokenizer(folder: Path) -> tuple[Tokenizer, str | None, str | None, str | None]:
    """(tokenizer, BOS text, EOS text, chat template) of a Hugging Face checkpoint folder."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in model folder {folder}")
    cfg_path = folder / "tokenizer_config.json"
    cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (folder / "chat_template.jinja").is_file():  # where transformers 5 saves it
        template = (folder / "chat_template.jinja").read_text()
    return Tokenizer.from_file(str(path)), _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")), \
        template


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # AddedToken serialised as a dict
        return token.get("content")
    return token


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)

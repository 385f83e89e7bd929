"""The router's view of a prompt: its token ids, made with the engines' own tokenizer and chat template
(fetched from an engine's `/internal/tokenizer`, so both sides tokenize alike), and the hashes of its full
pages (`engine/page_hash.py`), which the prefix index looks up. Imports no torch."""

from __future__ import annotations

import logging
from typing import Any

from splitserve.api.chat_prompt import chat_prompt_text
from splitserve.api.openai_protocol import ApiError, parse_chat, parse_completion
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.page_hash import page_hashes

logger = logging.getLogger(__name__)


class PromptTokenizer:
    """An engine's tokenizer, as the router holds it (one per tokenizer digest its engines report)."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.digest: str = parts["digest"]
        self.tool_format: str = parts["tool_format"]
        # What an engine compares with its own before it takes the router's ids: the tool-call format shapes a
        # chat's prompt too (api/server.py `prompt_digest`).
        self.prompt_digest = f"{self.digest}/{self.tool_format}"
        self.tokenizer = TextTokenizer(parts=parts)

    def prompt_ids(self, path: str, body: Any) -> list[int] | None:
        """The prompt's token ids as the engine will make them, or None where the router cannot tell
        (several prompts, images, or a request the engine will refuse: it answers that itself)."""
        vocab = self.tokenizer.vocab_size
        try:
            if path.endswith("/chat/completions"):
                gen, messages = parse_chat(body, str(body.get("model", "")), vocab, default_max_tokens=256)
                text = chat_prompt_text(self.tokenizer, messages, gen.tools, self.tool_format)
                return self.tokenizer.encode(text, add_special_tokens=False)
            gen = parse_completion(body, str(body.get("model", "")), vocab)
        except (ApiError, ValueError, TypeError, AttributeError):
            return None
        if len(gen.prompts) != 1:
            return None
        prompt = gen.prompts[0]
        return self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)


def prompt_page_hashes(ids: list[int], page_size: int) -> list[int]:
    """The hashes of the prompt's full pages that an engine could reuse (its last token always runs)."""
    return page_hashes(ids, page_size, max_pages=(len(ids) - 1) // page_size)
